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
buffer budget). Every ignored key is reported in one warning, with the reason. Older spellings
DeepSpeed still reads keep their meaning: ``cpu_offload`` (the optimizer on the CPU),
``cpu_offload_params``, a ``bfloat16`` section, and the un-prefixed ``prefetch_bucket_size``
and ``param_persistence_threshold`` of DeepSpeed's own config model.

[Note: what "auto" means]
Recipes written for Hugging Face's DeepSpeed integration say ``"auto"`` where the Trainer
knows the value. Under ``OutcoreTrainer`` (``Auto(trainer=True)``) the keys the Trainer owns
(batch sizes, accumulation, clipping, the optimizer's numbers, the precision flags) come from
``TrainingArguments``, and the persistence threshold is derived from the model's hidden size
as transformers derives it (``10 h`` elements). The prefetch bucket is not: transformers'
``0.9 h^2`` elements sizes DeepSpeed's bucket of single parameters, which is smaller than one
``h x h`` projection, while outcore's budget counts whole modules' gathered bytes, so a
budget that small would prefetch no weight matrix at all; outcore's default
``zero.prefetch_bytes`` stays. Outside the Trainer nothing gives those values: an ``"auto"``
precision means outcore's ``dtype: auto``, and every other ``"auto"`` keeps outcore's default
for that key, listed in the one warning.
"""

from __future__ import annotations

import difflib
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import torch.distributed as dist

from outcore.config.deepspeed_keys import FP16_KEYS, OFFLOAD_KEYS, OPTIMIZER_KEYS, ZERO_KEYS
from outcore.config.mappings import Placement
from outcore.errors import ConfigError

# key -> why it has no meaning in outcore
_IGNORED = {
    "train_batch_size": "batch sizes belong to the data loader",
    "train_micro_batch_size_per_gpu": "batch sizes belong to the data loader",
    "steps_per_print": "outcore does not print from the engine",
    "wall_clock_breakdown": "use engine.schedule_stats()",
    "zero_allow_untested_optimizer": "outcore runs its own sharded Adam(W)/SGD",
    "stage3_max_live_parameters": "zero.prefetch_bytes bounds gathered bytes",
    "stage3_max_reuse_distance": "zero.prefetch_bytes bounds gathered bytes",
    "max_live_parameters": "zero.prefetch_bytes bounds gathered bytes",
    "max_reuse_distance": "zero.prefetch_bytes bounds gathered bytes",
    "sub_group_size": "sub-groups are sized from offload.host_buffer_bytes",
    "overlap_comm": "communication always overlaps",
    "contiguous_gradients": "gradient shards are always contiguous",
    "reduce_bucket_size": "gradients are reduce-scattered per module",
    "reduce_scatter": "gradients are always reduce-scattered",
    "allgather_bucket_size": "parameters are all-gathered per module",
    "stage3_gather_16bit_weights_on_model_save": "save_model and outcore.consolidate gather",
    "stage3_gather_fp16_weights_on_model_save": "save_model and outcore.consolidate gather",
    "gather_16bit_weights_on_model_save": "save_model and outcore.consolidate gather",
    "round_robin_gradients": "not applicable",
    "pin_memory": "host buffers are pinned whenever a CUDA device needs it",
    "cpu_offload_use_pin_memory": "host buffers are pinned whenever a CUDA device needs it",
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
    "torch_adam": "outcore always runs torch's own kernels",
    "fused": "outcore picks torch's fused kernel where the device has one",
    "scheduler": "a loop of your own builds it with outcore.deepspeed_scheduler("
                 "engine.optimizer, config) and steps it when engine.step() returns True "
                 "(OutcoreTrainer reads it itself)",
    "amp": "precision comes from the bf16 / fp16 sections or outcore's dtype",
}
# keys whose "auto" the Trainer fills (transformers' DeepSpeed integration does the same)
_TRAINER_AUTO = {"train_batch_size", "train_micro_batch_size_per_gpu",
                 "gradient_accumulation_steps", "gradient_clipping", "optimizer.params.lr",
                 "optimizer.params.betas", "optimizer.params.eps",
                 "optimizer.params.weight_decay", "bf16.enabled", "fp16.enabled",
                 "bfloat16.enabled"}
_BUCKETS = {"stage3_prefetch_bucket_size": 0.9, "prefetch_bucket_size": 0.9,
            "stage3_param_persistence_threshold": 10, "param_persistence_threshold": 10}


_DEEPSPEED_ONLY = ("zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size",
                   "fp16", "bf16", "bfloat16", "aio", "steps_per_print", "scheduler",
                   "wall_clock_breakdown", "zero_allow_untested_optimizer", "amp")


# outcore's top-level keys that a DeepSpeed config does not have (schema.Config's fields but
# optimizer, gradient_accumulation_steps, gradient_clipping and seed, which DeepSpeed files
# carry too, ignored by DeepSpeed; a unit test keeps them so)
OUTCORE_ONLY = ("dtype", "offload", "zero", "loss_scale", "comm", "track_grad_norm")


def is_deepspeed(mapping: dict[str, Any]) -> bool:
    """Whether a config mapping is DeepSpeed's rather than outcore's (it has a key only
    DeepSpeed configs have, or an optimizer with a ``params`` section). One with keys of both
    kinds is refused: read as either, the other kind's keys would be dropped (an outcore
    config with ``steps_per_print`` lost its ``offload`` and ``dtype`` to a warning)."""
    optimizer = mapping.get("optimizer")
    theirs = [k for k in _DEEPSPEED_ONLY if k in mapping]
    if isinstance(optimizer, dict) and "params" in optimizer:
        theirs.append("optimizer.params")
    ours = [k for k in OUTCORE_ONLY if k in mapping]
    if theirs and ours:
        raise ConfigError(f"the config mixes DeepSpeed's keys ({', '.join(theirs)}) with "
                          f"outcore's ({', '.join(ours)}); write it in one of the two forms "
                          "(docs/configuration.md)")
    return bool(theirs)


@dataclass(frozen=True)
class Auto:
    """Where ``"auto"`` values come from (see [Note: what "auto" means])."""

    trainer: bool = False
    """Under ``OutcoreTrainer``: the Trainer's arguments give the keys it owns."""
    hidden_size: int | None = None
    """The model's hidden size, for the bucket sizes (None: outcore's defaults)."""


class _Reader:
    """Walks one DeepSpeed dict, collecting outcore keys and the reasons keys are ignored."""

    def __init__(self, auto: Auto) -> None:
        self.auto = auto
        self.ignored: list[str] = []

    def ignore(self, path: str, key: str) -> None:
        self.ignored.append(f"{path}: {_IGNORED.get(key, 'no outcore equivalent')}")

    def is_auto(self, path: str, value: Any) -> bool:
        """Whether ``value`` is "auto"; lists it where nothing fills it in."""
        if value != "auto":
            return False
        if not (self.auto.trainer and path in _TRAINER_AUTO):
            where = "the Trainer does not fill it" if self.auto.trainer else "outside the Trainer"
            self.ignored.append(f"{path}: \"auto\" {where}; the default stays")
        return True

    def number(self, path: str, value: Any, kind: type = float) -> Any:
        return number(path, value, kind)


def number(path: str, value: Any, kind: type = float) -> Any:
    """``value`` of the DeepSpeed key at ``path`` as a number (JSON may hold "1e-4")."""
    try:
        return kind(float(value)) if kind is int else kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"DeepSpeed config {path}: expected a number or \"auto\", got "
                          f"{value!r}") from None


_OBJECTS = ("optimizer", "zero_optimization", "aio")
"""Sections read here that are JSON objects in DeepSpeed's schema (the precision sections are
checked by _enabled_precisions, with the form they take); null means absent, as there."""


def _need_object(path: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {value!r}")


def translate(ds: dict[str, Any], auto: Auto | None = None) -> tuple[dict[str, Any], list[str]]:
    """Return (outcore config dict, ignored keys with reasons) for a DeepSpeed config dict."""
    if not isinstance(ds, dict):
        raise ConfigError(f"a DeepSpeed config is a JSON object, got {type(ds).__name__}")
    r = _Reader(auto or Auto())
    out: dict[str, Any] = {}
    enabled = _enabled_precisions(ds, r)
    for key, value in ds.items():
        if key in _OBJECTS:
            if value is None:
                continue
            _need_object(key, value)
        if key in _PRECISIONS:
            if key == "fp16" and enabled.get("fp16") in (True, "auto"):
                out["loss_scale"] = _loss_scale(value, r)
        elif key == "optimizer":
            out["optimizer"] = _optimizer(value, r)
        elif key == "gradient_accumulation_steps":
            if not r.is_auto(key, value):
                out[key] = r.number(key, value, int)
        elif key == "gradient_clipping":
            if not r.is_auto(key, value):
                out[key] = r.number(key, value)
        elif key == "zero_optimization":
            _zero(value, out, r)
        elif key == "aio":
            _aio(value, out, r)
        elif key == "scheduler" and r.auto.trainer:
            continue  # the Trainer builds it (hf/schedule.py)
        elif key in _BATCH and not r.auto.trainer:
            continue  # _accumulation
        elif value == "auto" and (key not in _IGNORED or r.auto.trainer and key in _TRAINER_AUTO):
            r.is_auto(key, value)
        else:
            r.ignore(key, key)
    if not r.auto.trainer:  # the Trainer checks them against its arguments (hf/args.py)
        _accumulation(ds, out, r)
    dtype = _dtype(enabled, r.auto)
    if dtype is not None:
        out["dtype"] = dtype
    return out, r.ignored


_BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu")


def _world_size() -> int:
    """The ranks of the job: the process group's where one is joined (``mp.spawn``), else
    torchrun's ``WORLD_SIZE`` (the config is read before outcore joins)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _accumulation(ds: dict[str, Any], out: dict[str, Any], r: _Reader) -> None:
    """DeepSpeed's batch sizes: ``train_batch_size`` = micro batch x accumulation x ranks.
    Where the file gives the first two and no accumulation, DeepSpeed derives it, and so does
    this (``_world_size``); three that disagree DeepSpeed refuses, and so does this. A file
    with the total and the micro batch alone had trained with no accumulation, a quarter of
    its batch per update, with one line of warning."""
    given = {k: ds[k] for k in _BATCH if ds.get(k) not in (None, "auto")}
    total, micro = (r.number(k, given[k], int) if k in given else None for k in _BATCH)
    world, gas = _world_size(), out.get("gradient_accumulation_steps")
    if total is not None and micro is not None:
        whole, rest = divmod(total, micro * world * (gas or 1))
        if gas is None and not rest and whole >= 1:
            out["gradient_accumulation_steps"] = gas = whole
            r.ignored.append(f"train_batch_size: gives gradient_accumulation_steps {gas} "
                             f"({total} / micro batch {micro} / {world} rank(s)); the micro "
                             "batch is the data loader's")
            return
        if rest or whole != 1:
            raise ConfigError(
                f"train_batch_size {total} is not train_micro_batch_size_per_gpu {micro} x "
                f"gradient_accumulation_steps {gas or 'a whole number'} x {world} rank(s), as "
                "DeepSpeed requires; fix one of them (or leave train_batch_size out)")
    for key in (k for k in _BATCH if k in ds):
        r.ignore(key, key)


_PRECISIONS = ("bf16", "bfloat16", "fp16")


def names_precision(ds: dict[str, Any]) -> bool:
    """Whether ``ds`` itself says the precision (a section's ``enabled`` true or false); the
    ``fp32`` of a file with no section on, and an ``"auto"``, are defaults, not its word."""
    return any(isinstance(ds.get(key), dict) and ds[key].get("enabled", False) != "auto"
               for key in _PRECISIONS)


def _enabled_precisions(ds: dict[str, Any], r: _Reader) -> dict[str, Any]:
    """``enabled`` of the precision sections present: True, False or "auto" (the legacy
    ``bfloat16`` section counts as ``bf16``)."""
    out: dict[str, Any] = {}
    for key in _PRECISIONS:
        if key not in ds:
            continue
        section = ds[key]
        value = section.get("enabled", False) if isinstance(section, dict) else None
        if not (isinstance(value, bool) or value == "auto"):
            raise ConfigError(f"DeepSpeed config '{key}': expected {{\"enabled\": true, false "
                              f"or \"auto\"}}, got {section!r}")
        name = "bf16" if key == "bfloat16" else key
        if out.get(name) is not True:
            out[name] = value
        for sub in section:
            if sub != "enabled" and key != "fp16":
                r.ignore(f"{key}.{sub}", sub)
    return out


def _dtype(enabled: dict[str, Any], auto: Auto) -> str | None:
    """bf16 or fp16 where enabled; where either says "auto", outcore's ``auto`` (or, under
    the Trainer, nothing: its bf16/fp16 flags decide); fp32 where neither is on."""
    if enabled.get("bf16") is True and enabled.get("fp16") is True:
        raise ConfigError("DeepSpeed config enables both 'bf16' and 'fp16'; enable one")
    for name in ("bf16", "fp16"):
        if enabled.get(name) is True:
            return name
    if "auto" in enabled.values():
        return None if auto.trainer else "auto"
    return None if auto.trainer and not enabled else "fp32"


def read(source: dict[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """A DeepSpeed config as a dict, from a dict or a JSON file."""
    if isinstance(source, dict):
        return source
    try:
        return json.loads(Path(source).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"cannot read DeepSpeed config {source}: {err}") from None


def translate_and_warn(source: dict[str, Any], stacklevel: int = 2,
                       auto: Auto | None = None) -> dict[str, Any]:
    """``translate``'s outcore keys; the DeepSpeed keys it ignores, with the reason for each,
    in one warning."""
    data, ignored = translate(source, auto)
    warn_ignored(ignored, stacklevel + 1)
    return data


def warn_ignored(ignored: list[str], stacklevel: int = 2) -> None:
    """One warning listing the DeepSpeed keys ``translate`` ignored or read otherwise."""
    if ignored:
        warnings.warn("DeepSpeed keys ignored by outcore, or read otherwise:\n  "
                      + "\n  ".join(ignored), stacklevel=stacklevel + 1)


def nvme_named(out: dict[str, Any]) -> dict[str, Any]:
    """``out`` (``translate``'s) if each NVMe tier it places has a folder; else refused in the
    words of the user's file (``Config`` named ``offload.nvme_path``, a key it does not have).
    Not for ``outcore train``, which gives such a tier ``--nvme-path`` or ``OUT/swap``."""
    off = out.get("offload", {})
    for key, name in (("params", "offload_param"), ("optimizer", "offload_optimizer")):
        if off.get(key) == "nvme" and not off.get("nvme_path"):
            raise ConfigError(f"zero_optimization.{name}.device is 'nvme' but no nvme_path "
                              "names a folder for its swap files")
    return out


def _loss_scale(fp16: dict[str, Any], r: _Reader) -> dict[str, Any]:
    out: dict[str, Any] = {}
    names = {"initial_scale_power": ("initial_scale_power", int),
             "loss_scale_window": ("growth_interval", int), "min_loss_scale": ("min_scale", float)}
    for key, value in fp16.items():
        path = f"fp16.{key}"
        if key in names and not r.is_auto(path, value):
            name, kind = names[key]
            out[name] = r.number(path, value, kind)
        elif key == "loss_scale" and value in (0, 0.0):
            continue  # 0 is DeepSpeed's "dynamic", which is what outcore does
        elif key not in names and key != "enabled":
            _check_spelling(path, key, FP16_KEYS)
            r.ignore(path, key)
    return out


_ADAM = ("adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam")


def _optimizer(opt: dict[str, Any], r: _Reader) -> dict[str, Any]:
    kind = str(opt.get("type", "")).lower()
    params = dict(opt.get("params", {}))
    if kind in _ADAM:
        # DeepSpeed's Adam types are AdamW unless adam_w_mode is false; type AdamW always is
        w_mode = params.pop("adam_w_mode", True) if kind != "adamw" else True
        params.pop("adam_w_mode", None)
        out: dict[str, Any] = {"type": "adamw" if w_mode else "adam"}
        keys = ("lr", "betas", "eps", "weight_decay")
        for flag, refused in (("amsgrad", True), ("bias_correction", False)):
            if params.pop(flag, not refused) == refused:
                raise ConfigError(f"optimizer.params.{flag}={refused}: not supported; outcore "
                                  f"runs torch's Adam(W) with {flag}={not refused}")
    elif kind == "sgd":
        out = {"type": "sgd"}
        keys = ("lr", "momentum", "weight_decay", "nesterov")
    else:
        raise ConfigError(f"optimizer.type: {opt.get('type')!r} is not supported; use AdamW, "
                          "Adam or SGD")
    for key, value in params.items():
        path = f"optimizer.params.{key}"
        if key not in keys:
            _check_spelling(path, key, OPTIMIZER_KEYS)
            r.ignore(path, key)
        elif not r.is_auto(path, value):
            out[key] = [r.number(path, v) for v in value] if key == "betas" else (
                value if key == "nesterov" else r.number(path, value))
    for key in opt:
        if key not in ("type", "params"):
            r.ignore(f"optimizer.{key}", key)
    return out


def _check_spelling(path: str, key: str, known: frozenset[str]) -> None:
    """A key DeepSpeed does not know but one it does is close to: a typo, refused as DeepSpeed
    refuses it (it became "no outcore equivalent", and the section it meant was dropped). A
    key close to none stays a warning: a later DeepSpeed may have it."""
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
    if key not in known and close:
        raise ConfigError(f"{path}: DeepSpeed has no key {key!r}; did you mean {close[0]!r}?")


def _same_folder(path: str) -> str:
    return os.path.normpath(os.path.expanduser(path))


def _placement(section: dict[str, Any], name: str, out: dict[str, Any], r: _Reader) -> int:
    """Map offload_param / offload_optimizer; return its buffer pool size in bytes."""
    dev = section.get("device", "none")
    if dev not in get_args(Placement):
        raise ConfigError(f"zero_optimization.offload_{name}.device: {dev!r}; "
                          f"allowed: {', '.join(get_args(Placement))}")
    off = out.setdefault("offload", {})
    off["params" if name == "param" else "optimizer"] = dev
    path = f"zero_optimization.offload_{name}"
    if section.get("nvme_path") and dev == "nvme":  # one swap folder: if two, the optimizer's
        folder, other = str(section["nvme_path"]), off.get("nvme_path")  # (the larger state)
        if other is not None and _same_folder(other) != _same_folder(folder):
            kept, dropped = (folder, other) if name == "optimizer" else (other, folder)
            r.ignored.append(f"zero_optimization.offload_param.nvme_path: outcore keeps "
                             f"parameters and optimizer state in one swap folder, the "
                             f"optimizer's {kept}; {dropped} is not used")
        if other is None or name == "optimizer":
            off["nvme_path"] = folder
    for key in section:
        _check_spelling(f"{path}.{key}", key, OFFLOAD_KEYS)
        if key not in ("device", "nvme_path", "buffer_count", "buffer_size"):
            r.ignore(f"{path}.{key}", key)
    count, size = (section.get(k, 0) for k in ("buffer_count", "buffer_size"))
    if r.is_auto(f"{path}.buffer_count", count) or r.is_auto(f"{path}.buffer_size", size):
        return 0
    elem = 2 if name == "param" else 4
    return r.number(f"{path}.buffer_count", count, int) * r.number(
        f"{path}.buffer_size", size, int) * elem


def _zero(z: dict[str, Any], out: dict[str, Any], r: _Reader) -> None:
    if z.get("stage", 3) not in (3, "3"):
        raise ConfigError(f"zero_optimization.stage: {z.get('stage')}; outcore is ZeRO stage 3")
    pools = [0]
    zero: dict[str, Any] = {}
    for key, value in z.items():
        path = f"zero_optimization.{key}"
        if key == "stage":
            continue
        if key in ("offload_param", "offload_optimizer"):
            if value is not None:  # null: no offload, as DeepSpeed reads it
                _need_object(path, value)
                pools.append(_placement(value, key.removeprefix("offload_"), out, r))
        elif key in ("cpu_offload", "cpu_offload_params"):  # DeepSpeed's older spellings
            if value is True:
                target = "optimizer" if key == "cpu_offload" else "params"
                out.setdefault("offload", {}).setdefault(target, "cpu")
        elif key in _BUCKETS:
            name = "prefetch_bytes" if "prefetch" in key else "persistence_threshold_bytes"
            if value == "auto":
                h = r.auto.hidden_size
                if r.auto.trainer and h and "prefetch" not in key:
                    zero[name] = int(_BUCKETS[key] * h) * 2
                elif not (r.auto.trainer and "prefetch" in key):  # see [Note: what "auto"
                    r.is_auto(path, value)  # means]: outcore's prefetch default stays
            else:
                zero[name] = r.number(path, value, int) * 2
        else:
            _check_spelling(path, key, ZERO_KEYS)
            r.ignore(path, key)
    if max(pools) > 0:
        out.setdefault("offload", {})["host_buffer_bytes"] = max(pools)
    if zero:
        out["zero"] = zero


def _aio(aio: dict[str, Any], out: dict[str, Any], r: _Reader) -> None:
    off = out.setdefault("offload", {})
    for key, value in aio.items():
        path = f"aio.{key}"
        if key == "block_size" and not r.is_auto(path, value):
            off["io_block_bytes"] = -(-r.number(path, value, int) // 4096) * 4096
        elif key == "thread_count" and not r.is_auto(path, value):
            off["io_threads"] = r.number(path, value, int)
        elif key not in ("block_size", "thread_count"):
            r.ignore(path, key)
