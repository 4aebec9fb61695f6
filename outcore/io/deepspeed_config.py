"""``Config.from_deepspeed``: read a DeepSpeed ZeRO-3 config and keep what means something here.

[Note: one budget instead of several knobs]
DeepSpeed spreads memory control over ``stage3_prefetch_bucket_size``,
``stage3_max_live_parameters``, ``stage3_max_reuse_distance``, ``sub_group_size`` and the
offload ``buffer_count``/``buffer_size`` pairs. outcore has one byte budget per place memory is
spent, so the mapping is: the prefetch bucket (in elements, 16-bit) becomes
``zero.prefetch_bytes``; the persistence threshold (elements) becomes
``zero.persistence_threshold_bytes``; the larger of the param/optimizer offload buffer pools
(count x size elements, 16-bit for params and fp32 for the optimizer) becomes
``offload.host_buffer_bytes``; ``aio.block_size``/``thread_count`` become ``io_block_bytes``/
``io_threads``. Live-parameter and reuse-distance limits are ignored (the prefetch budget
already bounds gathered bytes), as is ``sub_group_size`` (sub-groups are sized from the host
buffer budget). Every ignored key is reported in one warning, with the reason.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, get_args

from outcore.config import Placement
from outcore.errors import ConfigError

# key -> why it has no meaning in outcore
_IGNORED = {
    "train_batch_size": "batch sizes belong to the data loader",
    "train_micro_batch_size_per_gpu": "batch sizes belong to the data loader",
    "steps_per_print": "outcore does not print from the engine",
    "wall_clock_breakdown": "use engine.schedule_stats()",
    "zero_allow_untested_optimizer": "outcore runs its own sharded AdamW/SGD",
    "stage3_max_live_parameters": "zero.prefetch_bytes bounds gathered bytes",
    "stage3_max_reuse_distance": "zero.prefetch_bytes bounds gathered bytes",
    "sub_group_size": "sub-groups are sized from offload.host_buffer_bytes",
    "overlap_comm": "communication always overlaps",
    "contiguous_gradients": "gradient shards are always contiguous",
    "reduce_bucket_size": "gradients are reduce-scattered per module",
    "reduce_scatter": "gradients are always reduce-scattered",
    "allgather_bucket_size": "parameters are all-gathered per module",
    "stage3_gather_16bit_weights_on_model_save": "use outcore.consolidate",
    "round_robin_gradients": "not applicable",
    "pin_memory": "host buffers are pinned whenever a CUDA device needs it",
    "max_in_cpu": "offload.params places every parameter shard",
    "fast_init": "not applicable",
    "ratio": "partial offload is not supported; use none | cpu | nvme",
    "queue_depth": "the I/O engine sizes its own queue",
    "single_submit": "not applicable",
    "overlap_events": "I/O always overlaps",
    "use_gds": "GPUDirect Storage is not supported",
    "loss_scale": "fp16 always uses dynamic loss scaling",
    "hysteresis": "fp16 halves the scale on every overflow",
    "consecutive_hysteresis": "fp16 halves the scale on every overflow",
}


def translate(ds: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Return (outcore config dict, ignored keys with reasons) for a DeepSpeed config dict."""
    out: dict[str, Any] = {}
    ignored: list[str] = []

    def ignore(path: str, key: str) -> None:
        ignored.append(f"{path}: {_IGNORED.get(key, 'no outcore equivalent')}")

    enabled = _enabled_precisions(ds)
    for key, value in ds.items():
        if key in ("bf16", "fp16"):
            if key == "fp16" and enabled[key] in (True, "auto"):
                out["loss_scale"] = _loss_scale(value, ignore)
        elif key == "optimizer":
            out["optimizer"] = _optimizer(value)
        elif key in ("gradient_accumulation_steps", "gradient_clipping"):
            out[key] = value
        elif key == "zero_optimization":
            _zero(value, out, ignore)
        elif key == "aio":
            _aio(value, out, ignore)
        else:
            ignore(key, key)
    out["dtype"] = _dtype(enabled)
    return out, ignored


def _enabled_precisions(ds: dict[str, Any]) -> dict[str, Any]:
    """``enabled`` of the ``bf16`` and ``fp16`` sections present: True, False or "auto"."""
    out = {}
    for key in ("bf16", "fp16"):
        if key not in ds:
            continue
        section = ds[key]
        value = section.get("enabled", False) if isinstance(section, dict) else None
        if not (isinstance(value, bool) or value == "auto"):
            raise ConfigError(f"DeepSpeed config '{key}': expected {{\"enabled\": true, false "
                              f"or \"auto\"}}, got {section!r}")
        out[key] = value
    return out


def _dtype(enabled: dict[str, Any]) -> str:
    """bf16 or fp16 where enabled; ``auto`` where either says ``"auto"`` (as Hugging Face's
    DeepSpeed configs do: outcore then picks per device); fp32 where neither is on."""
    if enabled.get("bf16") is True and enabled.get("fp16") is True:
        raise ConfigError("DeepSpeed config enables both 'bf16' and 'fp16'; enable one")
    for name in ("bf16", "fp16"):
        if enabled.get(name) is True:
            return name
    return "auto" if "auto" in enabled.values() else "fp32"


def from_deepspeed(source: dict[str, Any] | str | os.PathLike[str]):
    """Build an ``outcore.Config`` from a DeepSpeed config dict or JSON file."""
    from outcore.config import Config

    if not isinstance(source, dict):
        try:
            source = json.loads(Path(source).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"cannot read DeepSpeed config {source}: {err}") from None
    return Config.from_dict(translate_and_warn(source, stacklevel=3))


def translate_and_warn(source: dict[str, Any], stacklevel: int = 2) -> dict[str, Any]:
    """``translate``'s outcore keys; the DeepSpeed keys it ignores, with the reason for each,
    in one warning."""
    data, ignored = translate(source)
    if ignored:
        warnings.warn("DeepSpeed keys ignored by outcore:\n  " + "\n  ".join(ignored),
                      stacklevel=stacklevel + 1)
    return data


def _loss_scale(fp16: dict[str, Any], ignore) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in fp16.items():
        if key == "initial_scale_power":
            out["initial_scale_power"] = value
        elif key == "loss_scale_window":
            out["growth_interval"] = value
        elif key == "min_loss_scale":
            out["min_scale"] = value
        elif key != "enabled":
            ignore(f"fp16.{key}", key)
    return out


def _optimizer(opt: dict[str, Any]) -> dict[str, Any]:
    kind = str(opt.get("type", "")).lower()
    params = dict(opt.get("params", {}))
    if kind in ("adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam"):
        if kind in ("adam", "fusedadam", "cpuadam", "deepspeedcpuadam") and \
                not params.pop("adam_w_mode", True):
            raise ConfigError("optimizer: Adam with L2 weight decay (adam_w_mode=false) is not "
                              "supported; outcore's AdamW uses decoupled weight decay")
        out = {"type": "adamw"}
        keys = ("lr", "betas", "eps", "weight_decay")
    elif kind == "sgd":
        out = {"type": "sgd"}
        keys = ("lr", "momentum", "weight_decay", "nesterov")
    else:
        raise ConfigError(f"optimizer.type: {opt.get('type')!r} is not supported; use AdamW, "
                          "Adam or SGD")
    for key in keys:
        if key in params:
            out[key] = params[key]
    return out


def _placement(section: dict[str, Any], name: str, out: dict[str, Any], ignore) -> int:
    """Map offload_param / offload_optimizer; return its buffer pool size in bytes."""
    dev = section.get("device", "none")
    if dev not in get_args(Placement):
        raise ConfigError(f"zero_optimization.offload_{name}.device: {dev!r}; "
                          f"allowed: {', '.join(get_args(Placement))}")
    off = out.setdefault("offload", {})
    off["params" if name == "param" else "optimizer"] = dev
    if section.get("nvme_path"):
        off["nvme_path"] = section["nvme_path"]
    for key in section:
        if key not in ("device", "nvme_path", "buffer_count", "buffer_size"):
            ignore(f"zero_optimization.offload_{name}.{key}", key)
    elem = 2 if name == "param" else 4
    return int(section.get("buffer_count", 0)) * int(section.get("buffer_size", 0)) * elem


def _zero(z: dict[str, Any], out: dict[str, Any], ignore) -> None:
    if z.get("stage", 3) != 3:
        raise ConfigError(f"zero_optimization.stage: {z.get('stage')}; outcore is ZeRO stage 3")
    pools = [0]
    zero: dict[str, Any] = {}
    for key, value in z.items():
        if key == "stage":
            continue
        if key in ("offload_param", "offload_optimizer"):
            pools.append(_placement(value, key.removeprefix("offload_"), out, ignore))
        elif key == "stage3_prefetch_bucket_size":
            zero["prefetch_bytes"] = int(value) * 2
        elif key == "stage3_param_persistence_threshold":
            zero["persistence_threshold_bytes"] = int(value) * 2
        else:
            ignore(f"zero_optimization.{key}", key)
    if max(pools) > 0:
        out.setdefault("offload", {})["host_buffer_bytes"] = max(pools)
    if zero:
        out["zero"] = zero


def _aio(aio: dict[str, Any], out: dict[str, Any], ignore) -> None:
    off = out.setdefault("offload", {})
    for key, value in aio.items():
        if key == "block_size":
            off["io_block_bytes"] = -(-int(value) // 4096) * 4096
        elif key == "thread_count":
            off["io_threads"] = int(value)
        else:
            ignore(f"aio.{key}", key)
