"""Typed, validated configuration: the one place user input is checked.

[Note: validate at the edge]
Every key is validated here, once, when the config is built; the parts of outcore below
the engine take plain arguments and trust them. A bad key raises ``ConfigError`` (a
``ValueError``) whose message names the dotted key, the value given, and what is allowed.
Unknown keys are errors, not warnings: a misspelt ``gradient_cliping`` silently ignored is
a training run wasted.

[Note: one byte budget per tier]
Memory is governed by byte budgets, one per place memory is spent, never by counts of
parameters or overlapping knobs:
  * ``offload.host_buffer_bytes``: the pool of aligned host buffers every NVMe transfer
    goes through; a transfer waits when it is exhausted.
  * ``zero.prefetch_bytes``: full (gathered) parameters fetched ahead of use.
  * ``zero.persistence_threshold_bytes``: groups this small are gathered once per step
    and kept, since fetching them costs more in latency than they save in memory.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from outcore.config.deepspeed import is_deepspeed, nvme_named, read, translate_and_warn
from outcore.config.mappings import Dtype, Placement, merge_mappings, read_mapping
from outcore.errors import ConfigError

_MiB = 1 << 20


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    def __setattr__(self, name: str, value: Any) -> None:
        """Refused as outcore refuses a user's mistake (pydantic's ``ValidationError`` was no
        ``OutcoreError``, which docs/python.md promises for every one): a config is frozen."""
        raise ConfigError(f"a config is frozen: {type(self).__name__}.{name} cannot be set; "
                          "make another with cfg.with_overrides(...), nested as in a config "
                          "file (e.g. {'optimizer': {'lr': 1e-3}})")


class OptimizerConfig(_Section):
    """Hyper-parameters of the sharded optimizer; per-group overrides come from param groups."""

    type: Literal["adamw", "adam", "sgd", "adafactor"] = Field(
        "adamw", description="torch's AdamW, Adam (L2 weight decay) or SGD kernel, or "
        "transformers' Adafactor (state in memory), run over this rank's fp32 shards")
    lr: float = Field(1e-4, gt=0, allow_inf_nan=False, description="learning rate")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam(W) betas, each in [0, 1)")
    eps: float = Field(1e-8, gt=0, allow_inf_nan=False, description="Adam(W) epsilon")
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False,
                                description="decoupled weight decay (AdamW) or L2 (Adam, SGD)")
    momentum: float = Field(0.0, ge=0, lt=1, description="SGD momentum")
    nesterov: bool = Field(False, description="SGD Nesterov momentum")

    @model_validator(mode="after")
    def _check_betas(self) -> OptimizerConfig:
        for i, b in enumerate(self.betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"betas[{i}]={b} must be in [0, 1)")
        if self.nesterov and self.momentum == 0.0:
            raise ValueError("nesterov=true needs momentum > 0")
        return self


class OffloadConfig(_Section):
    """Where each kind of model state lives, and the host buffer budget for NVMe transfers."""

    params: Placement = Field("none", description="home tier of training-dtype parameter shards")
    optimizer: Placement = Field(
        "none", description="home tier of fp32 master shards, optimizer states and gradients"
    )
    nvme_path: str | None = Field(None, description="folder for swap files (needed for nvme)")
    host_buffer_bytes: int = Field(
        256 * _MiB, ge=4096, description="byte budget of aligned host buffers for NVMe I/O"
    )
    io_block_bytes: int = Field(
        8 * _MiB, ge=4096, description="size of one read/write request to the disk"
    )
    io_threads: int = Field(4, ge=1, le=64, description="I/O threads per rank")
    verify_swap: bool = Field(
        True, description="check every swap read against the xxh3 digest of what was written"
        " (about 0.2-0.4 CPU-seconds per 8 GB moved; docs/offload.md)")
    reuse_freed_memory: bool | None = Field(
        None, description="keep host memory freed by one step for the next (fewer page "
        "faults, higher RSS); default: where the optimizer state is in host memory, and "
        "elsewhere after the first step if the host has room for it (offload/host_memory.py)")

    @field_validator("nvme_path", mode="before")
    @classmethod
    def _folder(cls, value: Any) -> Any:
        """A path object as its text, ``~`` expanded as a shell would (the swap sweep after a
        killed run looked in a literal ``~`` folder and left the run's swap behind); a blank
        name refused (it made a folder named by spaces)."""
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if isinstance(value, str) and value and not value.strip():
            raise ValueError("a blank name: name a folder for swap files")
        return os.path.expanduser(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check_nvme(self) -> OffloadConfig:
        if "nvme" in (self.params, self.optimizer) and not self.nvme_path:
            raise ValueError("offload to nvme needs offload.nvme_path (a folder for swap files)")
        if self.io_block_bytes % 4096:
            raise ValueError(f"io_block_bytes={self.io_block_bytes} must be a multiple of 4096")
        return self


class ZeroConfig(_Section):
    """Sharding knobs, each a byte budget."""

    persistence_threshold_bytes: int = Field(
        64 * 1024, ge=0, description="groups of at most this many full bytes stay gathered"
    )
    prefetch_bytes: int = Field(
        128 * _MiB, ge=0, description="byte budget for parameters gathered ahead of use; "
        "left at this default it grows to the two largest layers, and to 5% of free memory "
        "where the parameters are on NVMe and most of the model trains"
    )
    overlap_optimizer: bool = Field(
        True, description="update parameters during backward when clipping and fp16 allow "
        "(with the state on NVMe they do: see speculative_step)"
    )
    speculative_step: bool = Field(
        True, description="with gradient clipping or fp16 and optimizer state on NVMe, update "
        "during backward as if no clipping were needed and nothing overflowed; redo the step "
        "when it clips, drop it when it overflows; the state on NVMe takes twice its space "
        "(optim/speculation.py)"
    )
    overlap_step_with_forward: bool = Field(
        False, description="with overlap_optimizer and optimizer state on NVMe (or in host "
        "memory beside a CUDA device), step() returns before the last updates finish; the "
        "next forward waits for each layer's own"
    )
    resident_copies: bool = Field(
        True, description="with one rank on a CPU, params and optimizer state on NVMe and a "
        "16-bit training dtype (in fp32 the masters are the training copies), "
        "the training copies of the groups that fit prefetch_bytes stay in host memory, "
        "updated in place, never written to or read from disk (zero/build.py); false "
        "streams every copy"
    )


class LossScaleConfig(_Section):
    """Dynamic loss scaling, used with fp16 only."""

    initial_scale_power: int = Field(16, ge=0, le=40, description="initial scale is 2**this")
    growth_interval: int = Field(1000, ge=1, description="good steps before the scale doubles")
    min_scale: float = Field(1.0, gt=0, description="the scale never drops below this")


class CommConfig(_Section):
    """Collective communication settings."""

    timeout_s: float = Field(600.0, gt=0, description="a collective waiting longer fails")


class Config(_Section):
    """The whole outcore configuration: ``Config(...)``, ``from_dict`` or ``from_file``."""

    dtype: Dtype = Field(
        "auto", description="compute dtype; auto: the fastest the device multiplies natively "
        "(bf16, else fp16 with loss scaling on a GPU, else fp32; device/compute_dtype.py). Master "
        "weights and optimizer states are always fp32")
    seed: int = Field(0, ge=0, le=2**63 - 1,
                      description="seed used by the training job for init and data")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    offload: OffloadConfig = Field(default_factory=OffloadConfig)
    zero: ZeroConfig = Field(default_factory=ZeroConfig)
    loss_scale: LossScaleConfig = Field(default_factory=LossScaleConfig)
    comm: CommConfig = Field(default_factory=CommConfig)
    gradient_accumulation_steps: int = Field(1, ge=1, description="micro-steps per optimizer step")
    gradient_clipping: float = Field(0.0, ge=0, allow_inf_nan=False,
                                     description="max global grad norm; 0 = off")
    track_grad_norm: bool = Field(
        False, description="compute the global gradient norm every step (engine.last_grad_norm)"
        " even without clipping; it reads every gradient once more")

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as err:
            raise ConfigError(_describe(err)) from None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        """Validate a plain dict (e.g. parsed JSON); unknown keys are errors."""
        if not isinstance(data, dict):
            kind = type(data).__name__
            raise ConfigError(f"config must be a mapping of keys to values, got {kind}")
        return cls(**data)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Config:
        """Read a JSON or YAML file (by suffix; other suffixes are tried as YAML)."""
        return cls.from_dict(read_mapping(path))

    @classmethod
    def load(cls, source: Config | dict[str, Any] | str | os.PathLike[str] | None) -> Config:
        """Accept what the public API accepts: a Config, a dict, a path, or None (defaults);
        a DeepSpeed config (dict or JSON file) is read with ``from_deepspeed``."""
        if source is None:
            return cls()
        if isinstance(source, Config):
            return source
        if not isinstance(source, dict | str | os.PathLike):
            raise ConfigError(f"config: expected an outcore.Config, a dict, the path of a JSON "
                              f"or YAML file, or None; got {type(source).__name__} {source!r}")
        data = source if isinstance(source, dict) else read_mapping(source)
        if is_deepspeed(data):  # a DeepSpeed config works wherever a config is taken
            return cls.from_dict(nvme_named(translate_and_warn(data, stacklevel=2)))
        return cls.from_dict(data) if isinstance(source, dict) else cls.from_file(source)

    @classmethod
    def from_deepspeed(cls, source: dict[str, Any] | str | os.PathLike[str]) -> Config:
        """Map a DeepSpeed ZeRO-3 config (dict or JSON path); warns once about ignored keys."""
        return cls.from_dict(nvme_named(translate_and_warn(read(source), stacklevel=2)))

    @classmethod
    def auto(cls, model_or_params: Any, base: Config | dict[str, Any] | None = None, *,
             world_size: int = 1, nvme_path: str | None = None, **measured: Any) -> Config:
        """Choose tiers and budgets for this machine (sizing/placement.py); prints the plan
        and why. See [Note: Config.auto is answered from above]."""
        if _auto_planner is None:  # pragma: no cover - outcore/__init__ registers it
            raise ConfigError("Config.auto needs outcore.sizing; import outcore first")
        return _auto_planner(model_or_params, base, world_size=world_size,
                             nvme_path=nvme_path, **measured)

    def with_overrides(self, overrides: dict[str, Any]) -> Config:
        """Deep-merge ``overrides`` into this config and validate the result."""
        return Config.from_dict(merge_mappings(self.model_dump(), overrides))

    def with_dtype(self, name: str) -> Config:
        """This config with ``dtype`` set to a resolved (concrete) name; no re-validation."""
        return self if self.dtype == name else self.model_copy(update={"dtype": name})

    @property
    def nvme_used(self) -> bool:
        return "nvme" in (self.offload.params, self.offload.optimizer)


def _describe(err: ValidationError) -> str:
    """One line per problem: the dotted key, what was given and what is allowed."""
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "config"
        given = e.get("input")
        if e["type"] == "extra_forbidden":
            parent = _section_for(e["loc"][:-1])
            allowed = ", ".join(sorted(parent.model_fields)) if parent else "see the README"
            lines.append(f"unknown config key '{key}'; allowed keys here: {allowed}")
        elif e["type"] == "literal_error":
            lines.append(f"{key}: got {given!r}; allowed: {e['ctx']['expected']}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            shown = "" if isinstance(given, dict) else f" (got {given!r})"
            lines.append(f"{key}: {msg}{shown}")
    return "; ".join(lines)


def _section_for(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] = Config
    for part in loc:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


AutoPlanner = Callable[..., Config]

_auto_planner: AutoPlanner | None = None


def answer_auto_with(planner: AutoPlanner) -> None:
    """[Note: Config.auto is answered from above]
    ``Config.auto`` is the public spelling of the sizing layer's ``auto_config``, but the
    config sits at the bottom of the layer order (docs/design.md) and sizing far above it:
    sizing reads the model, the machine and the execution plan. Rather than import upwards,
    the config keeps a slot that ``outcore.sizing.placement`` fills when it is imported, which
    ``import outcore`` always does before a user can reach ``Config``."""
    global _auto_planner
    _auto_planner = planner
