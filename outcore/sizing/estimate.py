"""The ZeRO-Infinity paper's memory and bandwidth analysis, as pure functions.

Bytes per tier under each strategy and the largest model a machine can train (the efficiency
a tier's bandwidth allows is efficiency.py's). No torch here: it answers for models far too
large to build. These are estimates from the formulas below; ``engine.memory_report()``
tells what a run uses.

[Note: bytes per parameter]
Mixed-precision Adam keeps, per parameter: the 16-bit parameter (2 bytes) and gradient (2), and
the fp32 master copy, momentum and variance (4 + 4 + 4) = 16 bytes, ZeRO's "2 + 2 + K" with
K = 12 (Rajbhandari et al., ZeRO, 2020, sec. 3.1). ZeRO-Infinity's own count (sec. 3) adds an
fp32 copy of the gradient inside the optimizer state, 20 bytes; ``StateBytes(fp32_grads=4)``
(``--fp32-grads``) uses that accounting. So a 1T-parameter model has 16 TB of model states.

[Note: activation memory]
* Checkpointed (the default): one checkpoint, the block's input, per ``checkpoint_every``
  blocks: 2·b·s·h bytes each in 16 bits (ZeRO-Infinity sec. 3).
* Not checkpointed: s·b·h·(34 + 5·a·s/h) bytes per block (Korthikanti et al., "Reducing
  Activation Recomputation in Large Transformer Models", 2022, eq. 1 without tensor
  parallelism: 16-bit activations plus 1-byte dropout masks). The 5·a·s²·b term is the
  attention score matrix, which fused attention kernels do not keep: an upper bound there.
* The output logits, 4·b·s·V bytes (fp32 for the loss), live at the end of the forward pass;
  they matter for small models with large vocabularies and count as activation working memory.
b = micro-batch per device, s = sequence length, h = hidden, a = heads, V = vocabulary.

[Note: working memory]
Offloading moves the model states out of the device, but two things must still fit there at
once (ZeRO-Infinity sec. 3):
* Model-state working memory (MSWM): the 16-bit parameters and gradients of the largest single
  operator, 4 bytes per parameter of max(h·ffn, attention projection, V·h); the 4h² MLP linear
  in the paper. Memory-centric tiling by a factor t splits the linear operators into t tiles;
  the embedding is not tiled. The prefetch budget (config ``zero.prefetch_bytes``) comes on top.
* Activation working memory (AWM): b·s·c·(16·h + 2·a·s) bytes to recompute the c blocks
  between two checkpoints, or the logits if larger.

[Note: where each strategy puts things]
Per device, for W devices (shards are 1/W of the model states, rounded up):
  strategy       device                            host                  nvme
  data_parallel  states + activations + AWM        -                     -
  zero3          states/W + MSWM + act. + AWM      -                     -
  zero3_cpu      MSWM + AWM                        states/W + ckpts      -
  zero3_nvme     MSWM + AWM                        ckpts                 states/W
Offloaded strategies keep activation checkpoints in host memory, as the paper does. Without
checkpointing the full activations stay on the device under every strategy.

[Note: usable fraction of each tier]
This is outcore's one model of how much of each tier training may use; ``max_model`` and
``Config.auto`` (placement.py) both apply it, and ``check_fits`` cautions above it.
* ``USABLE``: 90% of device memory, 80% of host memory and 95% of NVMe. The rest is lost to
  what is not training state: allocator fragmentation, the framework's context and kernel
  workspaces (device); the operating system, page cache, pinned staging buffers and data
  loading (host); the filesystem reserve and the swap files' alignment padding (NVMe).
  ``max_model`` counts every byte training needs (model states, activations, working memory)
  against these fractions of each capacity. Host memory and NVMe are given per node and
  shared by the node's devices. ``Overheads`` changes the fractions.
* ``STATES_SHARE``, for a planner that counts model states alone: ``Config.auto`` knows the
  parameter count, but not the batch, sequence length or layer shapes that activations and
  working memory depend on. It lets model states take three quarters of each tier's usable
  part and keeps the other quarter as a margin for what it cannot count: activations and their
  checkpoints (``checkpoint_activations`` may put these on any tier), gathered layers and the
  prefetch budget on the device, the host I/O buffers.
These fractions are rules of thumb, not measurements. The share is set so that model states get
60% of free host memory (0.8 x 3/4), the figure ``Config.auto`` was built and tested with; on a
CPU-only machine, where the device is host memory, that is all it plans with.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, astuple, dataclass, field
from pathlib import Path
from typing import Any

from outcore.errors import ConfigError
from outcore.units import format_count

__all__ = [
    "STATES_SHARE", "STRATEGIES", "TIERS", "USABLE", "MaxModel", "MemoryEstimate", "ModelShape",
    "Overheads", "StateBytes", "TierBytes", "max_model", "memory_estimate", "resolve_model",
    "shape_from_hf_config", "shape_from_params",
]

STRATEGIES = ("data_parallel", "zero3", "zero3_cpu", "zero3_nvme")
TIERS = ("device", "host", "nvme")
"""``Tier``'s values in its order (storage.py; a test pins that they agree), spelled out so
that this module imports no torch."""
_GATED_TYPES = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3",
                "olmo", "olmo2", "granite"}
_LEARNED_POSITION_TYPES = {"gpt2", "gpt_bigcode", "opt", "gpt_neo", "biogpt"}


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a decoder-only transformer that memory depends on."""

    layers: int
    hidden: int
    heads: int
    vocab: int = 50257
    """GPT-2's vocabulary unless the model says otherwise."""
    seq_len: int = 1024
    """Context length; the sequence length estimates use unless told another."""
    ffn: int | None = None
    """MLP inner width; ``4 * hidden`` if None."""
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention); ``heads`` if None."""
    gated_mlp: bool = False
    """Llama-style gated MLP: three ``hidden x ffn`` matrices, RMSNorm, no biases."""
    tie_embeddings: bool = True
    learned_positions: bool = True
    """GPT-2-style position embedding table of ``seq_len x hidden``."""
    params_given: int | None = None
    """A parameter count the user gave (``--params``); used instead of the computed count."""
    name: str = ""

    def __post_init__(self) -> None:
        for key in ("layers", "hidden", "heads", "vocab", "seq_len", "ffn", "kv_heads"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"model {key} must be a whole number >= 1, "
                                  f"got {value!r}")

    @property
    def ffn_width(self) -> int:
        return self.ffn if self.ffn is not None else 4 * self.hidden

    @property
    def params(self) -> int:
        """Parameter count: exact for GPT-2- and Llama-shaped models, close for similar ones."""
        if self.params_given is not None:
            return self.params_given
        h, f = self.hidden, self.ffn_width
        kv = (self.kv_heads or self.heads) * (h // self.heads)
        bias = not self.gated_mlp
        attn = 2 * h * h + 2 * h * kv + (2 * h + 2 * kv if bias else 0)
        mlp = (3 if self.gated_mlp else 2) * h * f + (f + h if bias else 0)
        norm = 2 * h if bias else h
        block = attn + mlp + 2 * norm
        embed = self.vocab * h * (1 if self.tie_embeddings else 2)
        positions = self.seq_len * h if self.learned_positions else 0
        return self.layers * block + embed + positions + norm

    def largest_operator(self, tiles: int = 1) -> int:
        """Parameters of the largest single operator, linear ones split into ``tiles``."""
        h = self.hidden
        kv = (self.kv_heads or self.heads) * (h // self.heads)
        linear = max(h * self.ffn_width, h * (h + 2 * kv) if not self.gated_mlp else h * h)
        positions = self.seq_len * h if self.learned_positions else 0
        return max(math.ceil(linear / tiles), self.vocab * h, positions)

    def describe(self) -> str:
        """One line for people: name, dimensions and parameter count."""
        name = f"{self.name}: " if self.name else ""
        return (f"{name}{self.layers} layers, hidden {self.hidden}, {self.heads} heads, "
                f"vocab {self.vocab}, context {self.seq_len}: "
                f"{format_count(self.params)} parameters")


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of the model states (see [Note: bytes per parameter])."""

    params: int = 2
    grads: int = 2
    master: int = 4
    momentum: int = 4
    variance: int = 4
    fp32_grads: int = 0
    """4 for the ZeRO-Infinity paper's accounting, which keeps an fp32 gradient copy."""

    @property
    def total(self) -> int:
        return sum(astuple(self))


@dataclass(frozen=True)
class Overheads:
    """Fractions of each tier usable for training (see [Note: usable fraction of each tier])."""

    device: float = 0.90
    host: float = 0.80
    nvme: float = 0.95

    def states_only(self) -> Overheads:
        """These fractions times ``STATES_SHARE``: what model states may take of each tier
        when nothing else is counted (``Config.auto``)."""
        return Overheads(*(f * STATES_SHARE for f in astuple(self)))


USABLE = Overheads()
"""The usable fraction of each tier; see [Note: usable fraction of each tier]."""
STATES_SHARE = 3 / 4
"""Of each tier's usable part, what a count of model states alone may fill; the rest is the
margin for activations, working memory and buffers (see [Note: usable fraction of each tier])."""


class JsonRecord:
    """A dataclass of results that ``outcore estimate --json`` prints as is."""

    def to_json(self) -> dict[str, Any]:
        """Plain ``dict``/``list``/number data for ``json.dumps``."""
        return asdict(self)  # type: ignore[call-overload]


@dataclass(frozen=True)
class TierBytes(JsonRecord):
    """Bytes one device needs in each tier, and what each tier holds."""

    device: int
    host: int
    nvme: int
    holds: dict[str, str] = field(default_factory=dict)
    """Part name -> tier: ``{"model_states": "nvme", ...}``."""


@dataclass(frozen=True)
class MemoryEstimate(JsonRecord):
    """Memory of one model and workload, overall and per strategy, per device."""

    shape: ModelShape
    batch: int
    seq_len: int
    devices: int
    bytes_per_param: int
    model_states: int
    """All model states of the whole model, unsharded."""
    activation_checkpoints: int
    activations_full: int
    """Activations of one device's micro-batch with no checkpointing."""
    mswm: int
    awm: int
    strategies: dict[str, TierBytes]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "params": self.shape.params}


def _activations(layers: float, hidden: float, heads: float, vocab: float, seq: float,
                 batch: float, every: int) -> tuple[float, float, float]:
    """(checkpoints, full activations, AWM) in bytes; see [Note: activation memory]."""
    logits = 4 * batch * seq * vocab
    checkpoints = 2 * batch * seq * hidden * math.ceil(layers / every)
    full = layers * seq * batch * hidden * (34 + 5 * heads * seq / hidden) + logits
    awm = max(batch * seq * every * (16 * hidden + 2 * heads * seq), logits)
    return checkpoints, full, awm


def _tiers(strategy: str, states: float, devices: int, mswm: float, act: float,
           awm: float, checkpointing: bool) -> tuple[float, float, float, dict[str, str]]:
    """(device, host, nvme, holds) for one strategy; see [Note: where each strategy puts things]."""
    shard = math.ceil(states / devices)
    act_tier = "host" if checkpointing and strategy in ("zero3_cpu", "zero3_nvme") else "device"
    place = {"data_parallel": "device", "zero3": "device", "zero3_cpu": "host",
             "zero3_nvme": "nvme"}[strategy]
    held = states if strategy == "data_parallel" else shard
    need = {"device": awm + (0 if strategy == "data_parallel" else mswm), "host": 0.0, "nvme": 0.0}
    need[place] += held
    need[act_tier] += act
    holds = {"model_states": place, "activations": act_tier, "working_memory": "device"}
    return need["device"], need["host"], need["nvme"], holds


def memory_estimate(shape: ModelShape, *, batch: int = 1, seq_len: int | None = None,
                    devices: int = 1, state_bytes: StateBytes | None = None,
                    checkpointing: bool = True, checkpoint_every: int = 1,
                    tiles: int = 1) -> MemoryEstimate:
    """Bytes per device in each tier under every strategy, for ``batch`` sequences per device.

    ``checkpoint_every`` is the paper's c (blocks between activation checkpoints) and ``tiles``
    the memory-centric tiling factor; see the notes at the top of this module.
    """
    for name, value in (("batch", batch), ("devices", devices),
                        ("checkpoint_every", checkpoint_every), ("tiles", tiles)):
        if value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")
    sb = state_bytes or StateBytes()
    seq = seq_len or shape.seq_len
    states = shape.params * sb.total
    ckpt, full, awm = _activations(shape.layers, shape.hidden, shape.heads, shape.vocab, seq,
                                   batch, checkpoint_every)
    mswm = 4 * shape.largest_operator(tiles)
    act, awm = (ckpt, awm) if checkpointing else (full, 0)
    strategies = {}
    for s in STRATEGIES:
        d, h, n, holds = _tiers(s, states, devices, mswm, act, awm, checkpointing)
        strategies[s] = TierBytes(int(d), int(h), int(n), holds)
    return MemoryEstimate(shape, batch, seq, devices, sb.total, states, int(ckpt), int(full),
                          mswm, int(awm), strategies)


# [Note: GPT shape from a parameter count]
# Given only N, assume a GPT-3-like aspect ratio, hidden = 128 x layers (GPT-3 175B: 96 x 12288;
# 13B: 40 x 5120), and 12·layers·hidden² = N, with 128-wide heads, GPT-2's vocabulary and the
# given context. Activations and working memory depend on this guess; model states do not.
def _gpt_dims(params: float) -> tuple[float, float, float]:
    layers = max(1.0, (params / (12 * 128.0**2)) ** (1 / 3))
    hidden = max(64.0, math.sqrt(params / (12 * layers)))
    return layers, hidden, max(1.0, hidden / 128)


def shape_from_params(params: int, *, seq_len: int = 1024, vocab: int = 50257) -> ModelShape:
    """A GPT shape for a bare parameter count (see [Note: GPT shape from a parameter count])."""
    if params < 1:
        raise ConfigError(f"params must be >= 1, got {params}")
    layers, hidden, _ = _gpt_dims(params)
    width = max(64, int(round(hidden / 64)) * 64)
    return ModelShape(layers=int(round(layers)), hidden=width, heads=max(1, width // 128),
                      vocab=vocab, seq_len=seq_len, params_given=params, name="GPT-shaped")


def shape_from_hf_config(config: dict[str, Any] | str | Path) -> ModelShape:
    """The shape in a Hugging Face ``config.json`` (a dict, the file, or the model folder)."""
    name = "config.json"
    if not isinstance(config, dict):
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        name = str(path)
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read {path} as a JSON config: {e}") from None
        if not isinstance(config, dict):
            raise ConfigError(f"{path} does not hold a JSON object")

    def pick(*keys: str, default: Any = None) -> Any:
        for key in keys:
            if config.get(key) is not None:
                return config[key]
        if default is None:
            raise ConfigError(f"{name} has none of the keys {', '.join(keys)}")
        return default

    kind = str(config.get("model_type", ""))
    act = str(pick("hidden_act", "activation_function", default=""))
    heads = pick("n_head", "num_attention_heads")
    return ModelShape(
        layers=pick("n_layer", "num_hidden_layers"),
        hidden=pick("n_embd", "hidden_size"), heads=heads,
        vocab=pick("vocab_size"),
        seq_len=pick("n_positions", "max_position_embeddings", default=1024),
        ffn=config.get("intermediate_size") or config.get("n_inner"),
        kv_heads=config.get("num_key_value_heads") or heads,
        gated_mlp=kind in _GATED_TYPES or act in ("silu", "swiglu", "swish"),
        tie_embeddings=bool(config.get("tie_word_embeddings", True)),
        learned_positions=kind in _LEARNED_POSITION_TYPES or (not kind and "n_positions" in config),
        name=kind or name)


def resolve_model(spec: str, preset: Callable[[str], ModelShape] | None = None) -> ModelShape:
    """A ``config.json`` path, a Hugging Face model folder, or a name that ``preset`` maps to a
    shape (model presets belong to the application, which passes its lookup; none here)."""
    path = Path(spec)
    if path.is_file() or (path.is_dir() and (path / "config.json").is_file()):
        return shape_from_hf_config(path)
    if path.is_dir() or spec.endswith(".json"):
        raise ConfigError(f"{spec} is neither a config.json nor a folder holding one")
    if preset is None:
        raise ConfigError(f"unknown model {spec!r}; give a config.json or a Hugging Face "
                          "model folder")
    return preset(spec)


@dataclass(frozen=True)
class MaxModel(JsonRecord):
    """The largest model each strategy can train on some hardware."""

    max_params: dict[str, int]
    limited_by: dict[str, str]
    """Strategy -> the tier that runs out first just above ``max_params``."""
    hardware: dict[str, int]
    assumptions: dict[str, Any]


def max_model(gpus: int, gpu_memory: int, host_memory: int, nvme: int, *, nodes: int = 1,
              batch: int = 1, seq_len: int = 1024, vocab: int = 50257,
              state_bytes: StateBytes | None = None, overheads: Overheads | None = None,
              tiles: int = 1) -> MaxModel:
    """The largest GPT-shaped model each strategy fits (host memory and NVMe per node).

    Binary search over the parameter count, with the shape from
    [Note: GPT shape from a parameter count] kept continuous so that the needs grow
    monotonically with the count.
    """
    if gpus < 1 or nodes < 1 or gpus % nodes:
        raise ConfigError(f"gpus ({gpus}) must be a positive multiple of nodes ({nodes})")
    for name, value in (("gpu_memory", gpu_memory), ("host_memory", host_memory), ("nvme", nvme)):
        if value < 0:
            raise ConfigError(f"{name} must be >= 0, got {value}")
    sb, oh = state_bytes or StateBytes(), overheads or USABLE
    per_node = gpus // nodes
    usable = {"device": gpu_memory * oh.device, "host": host_memory * oh.host / per_node,
              "nvme": nvme * oh.nvme / per_node}

    def overflow(strategy: str, params: float) -> list[str]:
        layers, hidden, heads = _gpt_dims(params)
        ckpt, _, awm = _activations(layers, hidden, heads, vocab, seq_len, batch, 1)
        linear = max(4 * hidden * hidden / tiles, vocab * hidden)
        need = _tiers(strategy, params * sb.total, gpus, 4 * linear, ckpt, awm, True)[:3]
        return [t for t, n in zip(TIERS, need, strict=True) if n > usable[t]]

    best, limits = {}, {}
    for s in STRATEGIES:
        lo, hi = 0, 1 << 20
        while not overflow(s, hi) and hi < 10**19:
            lo, hi = hi, hi * 2
        while hi - lo > max(1, lo // 10**6):
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if not overflow(s, mid) else (lo, mid)
        best[s] = lo
        limits[s] = (overflow(s, hi) or ["none"])[0]
    hardware = {"gpus": gpus, "nodes": nodes, "gpu_memory": gpu_memory,
                "host_memory_per_node": host_memory, "nvme_per_node": nvme}
    assumptions = {"bytes_per_param": sb.total, "batch_per_device": batch, "seq_len": seq_len,
                   "usable_fraction": asdict(oh), "tiles": tiles, "activation_checkpointing": True}
    return MaxModel(best, limits, hardware, assumptions)
