"""Built-in GPT presets in plain PyTorch, and a loader for local Hugging Face model folders.

The presets exist so that ``outcore train`` has something to train on every machine without a
download, and so that tests and benchmarks name models by size instead of re-declaring them.
Nothing in this file knows about outcore's sharding or tiers: the engine wraps these modules
unchanged, which is the point (the paper's "ease-inspired implementation").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from outcore.errors import ConfigError
from outcore.sizing.estimate import ModelShape

__all__ = ["GPT", "GPTConfig", "PRESETS", "build_model", "chunked_cross_entropy",
           "hf_has_weights", "is_hf_folder", "load_hf_model", "load_hf_tokenizer",
           "loss_chunk_rows", "num_params", "preset_shape", "resolve_config"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT-2-style decoder."""

    layers: int
    """Number of transformer blocks."""
    hidden: int
    """Width of the residual stream; must be divisible by ``heads``."""
    heads: int
    """Attention heads per block."""
    vocab: int
    """Token vocabulary size (256 for the byte-level presets)."""
    seq_len: int
    """Longest sequence the learned position embedding covers."""
    mlp_ratio: int = 4
    """MLP inner width as a multiple of ``hidden``."""
    tie_embeddings: bool = True
    """Output head reuses the token embedding matrix (GPT-2 does; saves vocab*hidden params)."""
    dropout: float = 0.0
    """Dropout on attention and residual outputs; 0 keeps steps deterministic for resume tests."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "vocab", "seq_len", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ConfigError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ConfigError(
                f"GPTConfig.hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


# [Note: choosing the presets]
# tiny: ~1.7M params, for tests; a step takes milliseconds.
# small: the default job's model. `outcore train` with no arguments must finish ~300 steps with
#   NVMe offload in well under 10 minutes on a 2-core CPU and visibly learn byte-level Python.
#   At the job's default batch (8 x 256 tokens) 6 x 384 came too close to that limit on a
#   CPU shared with other jobs, so small is 4 x 384 (7.3M params), and its loss still falls
#   visibly in 300 steps (measured: bench/RESULTS.md, '`outcore train`, the default job').
# gpt-125m / gpt-335m / gpt-1.3b / gpt-3b: GPT-2 / GPT-3 shaped models for benchmarks and the
#   scale demo; 32000-token vocabularies (Llama-sized) so the head is not the whole model.
# gpt-6b: GPT-3 6.7B's width with 30 layers: 6.2B parameters, 99 GB of mixed-precision model
#   states, more than an 80 GB GPU holds, while fp32 states and gradients on the host (16
#   bytes per parameter) still fit a 128 GiB machine (bench/gpu.py).
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(layers=2, hidden=256, heads=4, vocab=256, seq_len=128),
    "small": GPTConfig(layers=4, hidden=384, heads=6, vocab=256, seq_len=256),
    "gpt-125m": GPTConfig(layers=12, hidden=768, heads=12, vocab=50304, seq_len=1024),
    "gpt-335m": GPTConfig(layers=24, hidden=1024, heads=16, vocab=32000, seq_len=1024),
    "gpt-1.3b": GPTConfig(layers=24, hidden=2048, heads=16, vocab=32000, seq_len=2048),
    "gpt-3b": GPTConfig(layers=40, hidden=2560, heads=20, vocab=32000, seq_len=2048),
    "gpt-6b": GPTConfig(layers=30, hidden=4096, heads=32, vocab=32000, seq_len=2048),
}


def num_params(cfg: GPTConfig) -> int:
    """Parameter count of ``GPT(cfg)`` without building it (huge models do not fit in memory)."""
    h, inner = cfg.hidden, cfg.hidden * cfg.mlp_ratio
    per_block = (
        2 * h                      # ln_1
        + h * 3 * h + 3 * h        # qkv
        + h * h + h                # attention output projection
        + 2 * h                    # ln_2
        + h * inner + inner        # mlp up
        + inner * h + h            # mlp down
    )
    total = cfg.vocab * h + cfg.seq_len * h + cfg.layers * per_block + 2 * h
    if not cfg.tie_embeddings:
        total += cfg.vocab * h
    return total


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention; the kernel is torch's fused scaled-dot-product attention."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward block with GELU."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.hidden, cfg.mlp_ratio * cfg.hidden)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.hidden, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block (GPT-2 layout)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2-style decoder: token + learned position embeddings, pre-LN blocks, tied head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            # [Note: the tied head] One Parameter, two modules: the engine must treat it as
            # one shard that is used twice (once by tok_emb, once by lm_head) per step.
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2: residual projections are scaled so the residual stream's variance does not
        # grow with depth (two residual adds per block).
        resid_std = 0.02 / math.sqrt(2 * cfg.layers)
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
                nn.init.normal_(p, mean=0.0, std=resid_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(batch, seq, vocab)``, or the mean cross-entropy loss if ``targets`` given."""
        t = idx.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len "
                             f"{self.config.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return chunked_cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


LOSS_CHUNK_BYTES = 16 << 20
"""fp32 logits the loss holds at a time in host memory (``chunked_cross_entropy``)."""

DEVICE_LOSS_CHUNK_BYTES = 256 << 20
"""fp32 logits the loss holds at a time on an accelerator (``chunked_cross_entropy``)."""


def _summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets, reduction="sum")


def loss_chunk_rows(logits: torch.Tensor) -> int:
    """Rows of ``(tokens, vocab)`` logits that ``chunked_cross_entropy`` takes at a time:
    ``LOSS_CHUNK_BYTES`` of fp32 rows in host memory, ``DEVICE_LOSS_CHUNK_BYTES`` elsewhere."""
    budget = LOSS_CHUNK_BYTES if logits.device.type == "cpu" else DEVICE_LOSS_CHUNK_BYTES
    return max(1, budget // (4 * logits.shape[-1]))


def chunked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of ``(tokens, vocab)`` logits, in fp32, a few rows at a time.

    [Note: the loss without full-size fp32 logits]
    The loss is computed in fp32 for accuracy, and done in one piece that costs three
    fp32 tensors the size of the logits: the cast, the log-softmax that autograd keeps, and
    its gradient. With a 32,000-word vocabulary that is 250 MiB each at 2,048 tokens, more
    than the layers a step keeps in memory with everything on NVMe. Here each chunk of
    ``LOSS_CHUNK_BYTES`` of fp32 rows is cast, reduced and dropped under activation
    checkpointing, so backward recomputes one chunk's log-softmax at a time and only the
    16-bit logits are kept. The chunks' sums over the count of counted targets (ignore
    index -100, as ``F.cross_entropy``) give the same mean, up to the order of the sum.

    On an accelerator a chunk is larger (``DEVICE_LOSS_CHUNK_BYTES``, ``loss_chunk_rows``):
    each chunk costs kernel launches and a checkpoint's Python on the host in forward and
    again in backward, and 16 MiB chunks are 126 of them at 8 x 2048 tokens of a 32,000-word
    vocabulary. On an H100 that took gpt-1.3b's step with no offload from 0.274 to 0.315 s
    and the forward of its offloaded step from 0.10 to 0.21 s (bench/gpu/2026-11-27-h100);
    256 MiB chunks (8 there) gave 0.278 and 0.12 s. Three such chunks are little beside the
    device's memory.
    """
    rows = loss_chunk_rows(logits)
    if logits.shape[0] <= rows:
        return F.cross_entropy(logits.float(), targets)
    keep = torch.is_grad_enabled() and logits.requires_grad  # else nothing is kept anyway
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    for lc, tc in zip(logits.split(rows), targets.split(rows), strict=True):
        part = (checkpoint(_summed_cross_entropy, lc, tc, use_reentrant=False) if keep
                else _summed_cross_entropy(lc, tc))
        total = total + part
    return total / (targets != -100).sum()


def resolve_config(name_or_config: str | GPTConfig) -> GPTConfig:
    """A preset's config by name (or the config itself), with a ConfigError listing presets."""
    if isinstance(name_or_config, GPTConfig):
        return name_or_config
    try:
        return PRESETS[name_or_config]
    except KeyError:
        raise ConfigError(f"model: {_not_a_model(name_or_config)}") from None


def preset_shape(name: str) -> ModelShape:
    """Preset ``name`` as the estimator's ``ModelShape`` (for ``outcore estimate --model``);
    ConfigError listing the presets if there is none by that name."""
    if name not in PRESETS:
        raise ConfigError(_not_a_model(name, "folder or its config.json"))
    return shape_of(PRESETS[name], name)


def _not_a_model(name: str, give: str = "folder") -> str:
    """Why ``name`` names no model: a path that is not a model folder is told as a path (a
    typo in a folder name should not read as an unknown preset), anything else lists presets."""
    path = Path(name).expanduser()
    if path.is_file():
        return f"{name} is a file; give the Hugging Face model folder that holds config.json"
    if path.is_dir():
        return f"{name} is a folder with no config.json (not a Hugging Face model folder)"
    if "/" in name or "\\" in name or name.startswith((".", "~")):
        return f"{name}: no such folder"
    return (f"unknown preset {name!r}; choose one of {', '.join(PRESETS)} or give a local "
            f"Hugging Face model {give}")


def shape_of(cfg: GPTConfig, name: str = "") -> ModelShape:
    """A GPT config as the estimator's ``ModelShape``."""
    return ModelShape(layers=cfg.layers, hidden=cfg.hidden, heads=cfg.heads, vocab=cfg.vocab,
                      seq_len=cfg.seq_len, ffn=cfg.mlp_ratio * cfg.hidden,
                      tie_embeddings=cfg.tie_embeddings, name=name)


def build_model(name_or_config: str | GPTConfig) -> GPT:
    """Build a preset GPT; call inside ``outcore.init(cfg)`` to shard it as it is created."""
    return GPT(resolve_config(name_or_config))


def is_hf_folder(path: str | Path) -> bool:
    """Whether ``path`` is a local folder holding a Hugging Face ``config.json``."""
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file()


def load_hf_model(path: str | Path) -> nn.Module:
    """A randomly initialised causal LM from a local Hugging Face folder's ``config.json``: the
    architecture only (no download, no weights; loading weights is outcore.init's job)."""
    hf_config = load_hf_config(path)  # checks that transformers is installed
    from transformers import AutoModelForCausalLM
    try:
        return AutoModelForCausalLM.from_config(hf_config)
    except ValueError as e:  # an architecture transformers has no causal LM class for
        raise ConfigError(f"model: {path} is not a causal language model transformers can "
                          f"build: {str(e).splitlines()[0]}") from None


def load_hf_config(path: str | Path) -> Any:
    """The folder's ``transformers`` config; one it cannot read is a one-line ConfigError."""
    p = Path(path)
    if not is_hf_folder(p):
        raise ConfigError(f"model: {p} is not a folder with a Hugging Face config.json")
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ConfigError(f"model: {p} is a Hugging Face model folder, which needs the "
                          "'transformers' package: pip install transformers") from None
    try:
        return AutoConfig.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # a user's file: transformers' validation raises many kinds
        why = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        raise ConfigError(f"model: transformers cannot read {p / 'config.json'}: "
                          f"{why[:300] or type(e).__name__}") from None


def hf_has_weights(path: str | Path) -> bool:
    """Whether a Hugging Face folder holds safetensors weights (so training is fine-tuning)."""
    p = Path(path)
    return any(p.glob("*.safetensors"))


def load_hf_tokenizer(path: str | Path) -> Any | None:
    """The folder's own tokenizer if it ships one (and transformers can read it), else None."""
    p = Path(path)
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json",
                                          "vocab.json", "tokenizer.model")):
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
