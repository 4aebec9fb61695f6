"""Which of a model's repeated blocks keep their activations, recompute them or move them.

``outcore train``'s ``checkpoint_activations`` and ``offload_activations`` settings, applied
to a preset or a Hugging Face model with ``outcore.checkpoint_activations`` and
``outcore.offload_activations``: the blocks are found by the model's own description of its
layers, and how many to checkpoint follows the memory estimate.
"""

from __future__ import annotations

import math
import re
import warnings

import torch
import torch.nn as nn

from outcore.app.models import Block, GPTConfig, shape_of
from outcore.config.schema import CommConfig
from outcore.device.accel import Accelerator, default_device
from outcore.device.machine import gpu_description
from outcore.errors import ConfigError
from outcore.guard.memory import available_memory
from outcore.memory.activations import checkpoint_activations, offload_activations
from outcore.runtime.bootstrap import join_world
from outcore.runtime.comm import Comm
from outcore.sizing.estimate import MemoryEstimate, memory_estimate, shape_from_hf_config
from outcore.units import format_bytes

__all__ = ["ACTIVATION_PLACES", "CHECKPOINT_MODES", "checkpoint_blocks", "checkpoint_mode",
           "offload_blocks", "repeated_blocks"]


ACTIVATIONS_SHARE = 1 / 8
"""``--checkpoint-activations auto`` checkpoints blocks where activations would pass this
share of the compute device's memory (on a CPU, the host memory this process may still use)."""


CHECKPOINT_MODES = "auto, on, off, or a number of blocks"
"""What ``checkpoint_activations`` takes, as its errors name it."""


def _is_checkpoint_mode(mode: object) -> bool:
    return mode in ("auto", "on", "off") or (type(mode) is int and mode >= 0)


def checkpoint_mode(value: object) -> str | int:
    """A ``checkpoint_activations`` setting as a config file or the command line gives it:
    "auto", "on", "off" or a number of blocks, where YAML's unquoted on / off (booleans) and a
    string of digits count as those; anything else raises ``ConfigError`` naming the value."""
    if isinstance(value, bool):
        value = "on" if value else "off"
    elif isinstance(value, str) and re.fullmatch(r"[0-9]+", value):
        value = int(value)
    if not _is_checkpoint_mode(value):
        raise ConfigError(f"got {value!r}; allowed: {CHECKPOINT_MODES}")
    assert isinstance(value, (str, int))  # what _is_checkpoint_mode lets through
    return value


def checkpoint_blocks(model: nn.Module, mode: str | int, batch: int, seq: int) -> int:
    """Checkpoint the model's repeated blocks as ``mode`` says; return how many.

    ``mode`` is ``"off"``, ``"on"`` (every block), ``"auto"`` (as few blocks as bring the
    activations under ``ACTIVATIONS_SHARE`` of the memory, none where they are already), or a
    number of blocks; a part of them is always the model's first blocks.

    [Note: when the job checkpoints activations]
    Without checkpointing, backward keeps every block's intermediate tensors: for a 30B
    Llama at 256 tokens that took 2.4 GiB of a 5.1 GiB peak, where the frozen base itself is
    read from disk (measured: bench/results, 'LoRA at 13B and 30B'). With it, each block keeps
    its input and recomputes the rest in backward, where its parameters are gathered anyway,
    so the disk reads no more, the loss is the same, and compute grows by about one forward
    (that run's step: 123 s against 78 s on 2 cores, at 2.7 GiB). So ``auto`` checkpoints
    only where the estimate of the activations (sizing/estimate.py, no checkpointing) passes
    ``ACTIVATIONS_SHARE`` of the compute device's memory (on a CPU, what the process may still
    use): the 30B run on a 24 GiB host, not the 13B one (2.3 GB). And only as many blocks as
    bring the estimate under that share, since each one checkpointed costs its forward again:
    recomputing every block of a GPT on a GPU cost a third more compute where a few blocks
    would have fitted (bench/gpu/2026-11-27-h100-b).
    * Which blocks: the first ones. Backward reaches them last, when the later blocks'
      activations are freed, so recomputing one adds nothing to the peak; a checkpointed last
      block would be recomputed first, beside everything still held.
    * Every rank takes the same count, the largest any rank's estimate asks for: recomputing
      a block gathers its parameters, a collective, and each rank's free memory differs.
    * The blocks are ``repeated_blocks``: a Hugging Face model's ``_no_split_modules`` (its
      decoder layers) or a preset's ``Block``; one nested in another counts as part of it
      (Mamba lists its layer and the mixer inside it).
    """
    if mode == "off":
        return 0
    if not _is_checkpoint_mode(mode):  # strict: a Python caller's True is not "on"
        raise ConfigError(f"checkpoint_activations: got {mode!r}; allowed: {CHECKPOINT_MODES}")
    blocks = repeated_blocks(model)
    slip = None  # (said once, by rank 0, not by every rank of the job)
    if not blocks and mode != "auto" and mode != 0:
        slip = ("the model has no repeated blocks (a Hugging Face model's _no_split_modules, a "
                "preset's blocks); none is checkpointed")
    elif isinstance(mode, int) and mode > len(blocks):  # (a config written for a deeper model)
        slip = f"{mode} blocks asked for, the model has {len(blocks)}; all are checkpointed"
    if slip is not None and _world().rank == 0:
        warnings.warn(f"checkpoint_activations: {slip}", stacklevel=2)
    count = len(blocks) if mode == "on" else (
        _agreed(_blocks_needed(model, batch, seq, len(blocks))) if mode == "auto"
        else min(int(mode), len(blocks)))
    _check_fits(model, batch, seq, len(blocks))
    if count == 0:
        return 0
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", False):
        config.use_cache = False  # a cache would be filled twice (activations.py's note)
    chosen = {id(b) for b in blocks[:count]}
    return checkpoint_activations(model, lambda _, m: id(m) in chosen, offload="cpu")


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks in order: a Hugging Face model's ``_no_split_modules`` (its
    decoder layers) or a preset's ``Block``; one nested in another counts as part of it."""
    names: set[str] = set()
    for m in model.modules():  # a PEFT wrapper: the wrapped model says
        names |= set(getattr(m, "_no_split_modules", None) or ())
    blocks: dict[str, nn.Module] = {}
    for name, m in model.named_modules():  # parents come before their children
        if ((type(m).__name__ in names or isinstance(m, Block))
                and not any(p == "" or name.startswith(p + ".") for p in blocks)):
            blocks[name] = m
    return list(blocks.values())


ACTIVATION_PLACES = ("off", "cpu", "nvme")
"""What ``offload_blocks`` (``outcore train --offload-activations``) takes."""


def offload_blocks(model: nn.Module, to: str) -> int:
    """Keep every repeated block's saved tensors at ``to`` ("cpu", "nvme"; "off": in memory)
    with ``offload_activations``, the model's own swap file for "nvme"; return how many."""
    if to not in ACTIVATION_PLACES:
        raise ConfigError(f"offload_activations: got {to!r}; allowed: "
                          + ", ".join(ACTIVATION_PLACES))
    if to == "off" or (to == "cpu" and default_device().type == "cpu"):
        return 0  # a CPU device's activations are in host memory already
    chosen = {id(b) for b in repeated_blocks(model)}
    return offload_activations(model, lambda _, m: id(m) in chosen,
                               to="cpu" if to == "cpu" else "nvme")


def _world() -> Comm:
    """The job's ranks. A job of several ranks joins its process group here if nothing has
    yet (as the engine would), so that no rank decides alone."""
    return join_world(Accelerator.detect().backend, CommConfig().timeout_s)


def _agreed(count: int) -> int:
    """The largest ``count`` of any rank."""
    return int(_world().all_reduce_max(torch.tensor([count]))[0])


def _blocks_needed(model: nn.Module, batch: int, seq: int, blocks: int) -> int:
    """The fewest of ``blocks`` to checkpoint for the estimated activations to fit
    ``ACTIVATIONS_SHARE`` of the memory (all of them where even that does not)."""
    estimate = _activation_estimate(model, batch, seq)
    budget = ACTIVATIONS_SHARE * _device_memory()
    if estimate is None or estimate.activations_full <= budget:
        return 0
    layers = estimate.shape.layers
    kept = _checkpoints_here(estimate) / layers  # a checkpointed block keeps its input
    saved = _per_block(estimate, batch, seq)[1] - kept
    if saved <= 0:
        return blocks
    needed = math.ceil((estimate.activations_full - budget) / saved)
    return min(blocks, math.ceil(needed * blocks / layers))


def _check_fits(model: nn.Module, batch: int, seq: int, blocks: int) -> None:
    """Refuse a batch whose activations exceed the memory even with every block
    checkpointed: it ran until the kernel killed the process for memory (with its swap file
    left) or torch failed to allocate, in a traceback.

    [Note: refuse on a lower bound]
    The estimate's per-block activations hold the attention scores, 5·a·s²·b bytes, that a
    fused attention kernel (torch's SDPA, which Llama, GPT-2 and our presets use) never keeps:
    an upper bound, right for choosing how many blocks to checkpoint, wrong for refusing. At
    32,768 tokens a tiny Llama was refused at "86 GB" and trained in 0.82 GiB. The refusal
    counts a block as 34·s·b·h bytes, the checkpoints and the logits, so it refuses only
    what cannot train whichever attention kernel runs. On a GPU the checkpoints wait in host
    memory (``checkpoint_blocks`` keeps them there), so they do not count against the GPU's."""
    estimate = _activation_estimate(model, batch, seq)
    if estimate is None or not blocks:
        return
    block = 34 * seq * batch * estimate.shape.hidden
    least = _checkpoints_here(estimate) + block + _per_block(estimate, batch, seq)[0]
    memory = _device_memory()
    too_big = least > memory
    # every rank refuses where one does: the others would wait in initialize() until the
    # process group's timeout (each rank's free memory differs)
    if not _world().any_failed(too_big):
        return
    room = ((f"and the GPU has {format_bytes(memory)}" if default_device().type == "cuda"
             else f"and {format_bytes(memory)} of host memory is free") if too_big
            else "more than another rank's memory holds (its error says how much)")
    raise ConfigError(f"--batch {batch} x --seq {seq}: the activations need at least "
                      f"{format_bytes(least)} even with every block checkpointed, {room}; "
                      "give a smaller --batch or --seq")


def _checkpoints_here(estimate: MemoryEstimate) -> float:
    """The checkpointed blocks' inputs in the memory activations live in: none on a GPU,
    where they wait in host memory (``checkpoint_activations(offload="cpu")``)."""
    return 0.0 if default_device().type == "cuda" else estimate.activation_checkpoints


def _per_block(estimate: MemoryEstimate, batch: int, seq: int) -> tuple[float, float]:
    """(the logits' bytes, one block's activations) of the estimate without checkpointing."""
    logits = 4 * batch * seq * estimate.shape.vocab
    return logits, (estimate.activations_full - logits) / estimate.shape.layers


def _device_memory() -> int:
    """Bytes of memory activations live in: the GPU's where one computes, else what this
    process may still use of the host's (its cgroup's room included)."""
    device = default_device()
    gpu = gpu_description(device) if device.type == "cuda" else None
    return int(gpu["memory_bytes"]) if gpu else available_memory().bytes


def _activation_estimate(model: nn.Module, batch: int, seq: int) -> MemoryEstimate | None:
    """sizing/estimate.py's activations of ``model`` without checkpointing, or None for a
    model the estimate cannot read (it is then left as it is)."""
    config = getattr(model, "config", None)
    try:
        if isinstance(config, GPTConfig):
            shape = shape_of(config)
        else:
            shape = shape_from_hf_config(config.to_dict())  # type: ignore[union-attr]
        return memory_estimate(shape, batch=batch, seq_len=seq, checkpointing=False)
    except (AttributeError, ConfigError, KeyError, TypeError):
        return None
