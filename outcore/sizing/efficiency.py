"""The paper's efficiency model (ZeRO-Infinity sec. 4): the share of peak compute a run keeps
for a given arithmetic intensity and bandwidth, and what a probed machine predicts per tier."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from outcore.errors import ConfigError
from outcore.sizing.estimate import JsonRecord


# [Note: arithmetic intensity]
# The paper's efficiency = ait·bw / (ait·bw + peak) (ZeRO-Infinity sec. 4) is compute time over
# compute plus transfer time when nothing overlaps; ait is flops per byte moved. Per device and
# step, with T = b·s tokens and P parameters, a step costs 2TP (forward) + 4TP (backward) + 2TP
# (recomputation under activation checkpointing) = 8TP flops. Then:
#   params + grads: 16-bit params read 3 times (forward, recompute, backward) and grads written
#     once: 8P bytes, so ait = T.
#   optimizer states: read and written once, 16 bytes each way in the paper's count: 32P bytes,
#     so ait = T/4 (outcore's 12-byte states plus a 16-bit grad read and param write give 28P,
#     ait = 2T/7; the paper's figure is kept, the conservative one).
#   activation checkpoints: one per c blocks, 2·T·h bytes written then read (4·T·h) against
#     c·8·T·12h² flops of those blocks, so ait = 24·h·c.
# "combined" charges both params/grads and optimizer traffic to one tier with no overlap,
# the floor; the overlap-centric design hides params/grads traffic behind compute, so a
# real run lies between combined and the smaller of the two.
def efficiency(ait: float, bandwidth_GBps: float, peak_TFLOPs: float) -> float:
    """The paper's efficiency for ``ait`` flops/byte over a link of ``bandwidth_GBps``."""
    moved = ait * bandwidth_GBps * 1e9
    return moved / (moved + peak_TFLOPs * 1e12) if moved > 0 else 0.0


def required_bandwidth(ait: float, peak_TFLOPs: float, target: float = 0.5) -> float:
    """GB/s a tier must deliver for ``target`` efficiency: the inverse of ``efficiency``."""
    if not 0 < target < 1:
        raise ConfigError(f"target efficiency must be in (0, 1), got {target}")
    return target * peak_TFLOPs * 1e12 / (ait * (1 - target)) / 1e9


@dataclass(frozen=True)
class Efficiency(JsonRecord):
    """Predicted efficiencies (0..1) of keeping each kind of data in one tier."""

    tokens_per_step: int
    bandwidth_GBps: float
    peak_TFLOPs: float
    params_grads: float
    optimizer_states: float
    combined: float
    activation_checkpoints: float | None = None


def predict_efficiency(tokens_per_step: int, bandwidth_GBps: float, peak_TFLOPs: float, *,
                       write_GBps: float | None = None, hidden: int | None = None,
                       checkpoint_every: int = 1) -> Efficiency:
    """Efficiency per data type for ``tokens_per_step`` tokens per device per step.

    ``bandwidth_GBps`` is the tier's read bandwidth; if ``write_GBps`` differs (a disk), each
    data type's traffic mix sets its effective bandwidth (params/grads 3 reads : 1 write,
    optimizer 1 : 1). See [Note: arithmetic intensity].
    """
    if tokens_per_step < 1 or bandwidth_GBps <= 0 or peak_TFLOPs <= 0:
        raise ConfigError("tokens per step, bandwidth and peak must be positive, got "
                          f"{tokens_per_step}, {bandwidth_GBps}, {peak_TFLOPs}")
    r, w = bandwidth_GBps, write_GBps or bandwidth_GBps
    pg_bw, opt_bw = 4 / (3 / r + 1 / w), 2 / (1 / r + 1 / w)
    t, peak = tokens_per_step, peak_TFLOPs * 1e12
    pg = efficiency(t, pg_bw, peak_TFLOPs)
    opt = efficiency(t / 4, opt_bw, peak_TFLOPs)
    combined = 1 / (1 + peak / (t * pg_bw * 1e9) + peak / (t / 4 * opt_bw * 1e9))
    ckpt = None if hidden is None else efficiency(24 * hidden * checkpoint_every, opt_bw,
                                                  peak_TFLOPs)
    return Efficiency(t, r, peak_TFLOPs, pg, opt, combined, ckpt)


_PROBE_KEYS = ("disk_read_GBps", "disk_write_GBps", "host_copy_GBps")


def efficiency_from_probe(probe: dict[str, Any], tokens_per_step: int, *,
                          devices_per_node: int = 1, hidden: int | None = None,
                          source: str = "probe") -> dict[str, Efficiency]:
    """Efficiency of the host and NVMe tiers from ``outcore probe --json`` measurements.

    The probe measures one machine; its devices share the disk and the memory bus, so each
    device gets ``1/devices_per_node`` of the bandwidth. The peak is the matmul rate of the
    dtype ``dtype: auto`` trains in there (``auto_dtype``; bf16 for probes that predate it).
    """
    auto = probe.get("auto_dtype", "bf16")
    if auto not in ("bf16", "fp16", "fp32"):
        raise ConfigError(f"{source}: auto_dtype is {auto!r}; expected bf16, fp16 or fp32")
    keys = (*_PROBE_KEYS, f"matmul_{auto}_TFLOPs")
    missing = [k for k in keys if not isinstance(probe.get(k), (int, float))]
    if missing:
        raise ConfigError(f"{source} lacks the numbers {', '.join(missing)}; "
                          "use the output of 'outcore probe --json'")
    share, peak = 1 / devices_per_node, float(probe[f"matmul_{auto}_TFLOPs"])
    return {
        "host": predict_efficiency(tokens_per_step, probe["host_copy_GBps"] * share, peak,
                                   hidden=hidden),
        "nvme": predict_efficiency(tokens_per_step, probe["disk_read_GBps"] * share, peak,
                                   write_GBps=probe["disk_write_GBps"] * share, hidden=hidden),
    }

