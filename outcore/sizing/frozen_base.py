"""What LoRA over a frozen base read in place costs: ``outcore estimate --trainable N``.

[Note: pricing a base read in place]
A frozen base on NVMe is read from the model's own files (offload/file_shard.py), so it
costs outcore no disk and no host memory beyond what is in flight: the two largest layers
that the schedule keeps ahead (zero/build.py's [Note: a default budget that fits the model's
layers]), the reader's eight 4 MiB buffers, the working memory of the largest operator (its
output and its gradient), the activations backward keeps (``estimate.py``'s count, without
checkpointing) and the process itself (Python, torch and transformers: ~0.6 GB measured).
The adapters pay the full 16 bytes per parameter (fp32 master and Adam moments, 16-bit copy
and gradient). Each step reads the base twice, once in the forward and once when the
backward gathers each layer again, so the step cannot be faster than twice the base's bytes
over the disk's read rate: the floor the measured step is compared with
(bench/lora_scale.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from outcore.sizing.estimate import JsonRecord, ModelShape, StateBytes

READ_BUFFERS = 8 * (4 << 20)
"""The base reader's buffers (offload/source_file.py)."""
PROCESS = 600 << 20
"""Host memory of the process before any model: interpreter, torch, transformers, peft."""
PASSES = 2
"""Reads of the whole base per step: the forward's and the backward's."""


@dataclass(frozen=True)
class FrozenBaseEstimate(JsonRecord):
    """Disk, host memory and the step's floor for adapters over a base read in place."""

    base_params: int
    base_bytes: int
    """The base's bytes on disk, in its files' dtype (read, never written, by outcore)."""
    trainable: int
    adapter_state_bytes: int
    """What outcore stores for the adapters: its only disk use besides checkpoints."""
    host_bytes: int
    """Peak host memory for the base's layers in flight, read buffers and working memory."""
    read_per_step: int
    disk_read_GBps: float | None
    floor_s: float | None
    """``read_per_step`` over the disk's read rate; None without a rate."""


def frozen_base(shape: ModelShape, trainable: int, *, base_bytes: int | None = None,
                storage_bytes: int = 2, batch: int = 1, seq_len: int | None = None,
                activations: int = 0, disk_read_GBps: float | None = None
                ) -> FrozenBaseEstimate:
    """See [Note: pricing a base read in place]; ``base_bytes`` is the files' size where
    known (a Hugging Face folder), else ``storage_bytes`` per parameter."""
    base_params = shape.params  # adapters are added to the model, not cut out of it
    stored = base_bytes if base_bytes is not None else base_params * storage_bytes
    h, f = shape.hidden, shape.ffn_width
    layers = sorted([shape.vocab * h, shape.vocab * h, h * f, h * f], reverse=True)
    in_flight = sum(layers[:2]) * storage_bytes
    seq = seq_len or shape.seq_len
    working = 2 * batch * seq * max(shape.vocab, f) * 4  # the largest output and its gradient
    adapters = trainable * StateBytes().total
    read = PASSES * stored
    floor = read / (disk_read_GBps * 1e9) if disk_read_GBps else None
    return FrozenBaseEstimate(base_params, stored, trainable, adapters,
                              PROCESS + in_flight + READ_BUFFERS + working + activations
                              + adapters, read,
                              disk_read_GBps, floor)
