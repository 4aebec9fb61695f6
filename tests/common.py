"""Helpers the test modules share: the models that stand in for real ones, and the small
training loops and measurements several tests run. Kept here so no test module imports
another."""

from __future__ import annotations

import ctypes
import math
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import outcore
from outcore.offload.buffers import ALIGN, round_up
from outcore.offload.host_memory import libc

if TYPE_CHECKING:
    import transformers

REPO = Path(__file__).resolve().parents[1]
"""The repository's root."""


# -- the parity model: the awkward parts real models have (test_parity.py's docstring) ------
VOCAB, DIM, BATCH, SEQ = 64, 32, 2, 8


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Quirky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(2))
        self.shared = Block(DIM)  # run twice per forward
        self.optional = Block(DIM)  # skipped on odd steps
        self.gate = nn.Linear(DIM, DIM)  # never called: the parent reads its weight
        self.scale = nn.Parameter(torch.ones(DIM))  # owned by the root module
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied
        for name, p in self.named_parameters():
            if name.endswith("fc2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(6))
        nn.init.trunc_normal_(self.gate.weight, std=0.05)
        with torch.no_grad():
            self.emb.weight.mul_(0.5)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, use_optional: bool = True):
        h = self.emb(idx)
        for b in self.blocks:
            h = b(h)
        h = self.shared(self.shared(h))
        if use_optional:
            h = self.optional(h)
        h = h + 0.1 * torch.tanh(h @ self.gate.weight.T)
        logits = self.head(h * self.scale)
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def param_groups(model: nn.Module, decay: float) -> list[dict]:
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if p.dim() >= 2], "weight_decay": decay},
        {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]


def max_rel(a, b) -> float:
    """Norm-wise relative error ||a - b|| / ||b||.

    Sharded gradients are sums of per-rank partial sums, so they differ from the reference in
    the last bits; Adam divides a near-zero gradient element's rounding by sqrt(v) + eps and
    can turn it into a visible update of that one element. A norm-wise measure judges the
    whole tensor, which is what "equal weights" means here.
    """
    a, b = torch.as_tensor(a).cpu(), torch.as_tensor(b).cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


ADAMW = {"type": "adamw", "lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1}
BASE = {"dtype": "fp32", "optimizer": ADAMW, "zero": {"persistence_threshold_bytes": 0}}


# -- the checkpoint model and loop ----------------------------------------------------------
GLOBAL_BATCH = 4


class Buffered(Quirky):
    """Quirky with a float and an int buffer that every forward updates and the loss reads."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, DIM))
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))
        self.register_buffer("cache", torch.ones(3), persistent=False)

    def forward(self, idx, targets, use_optional=True):
        with torch.no_grad():
            self.shift.add_(0.01)
            self.count.add_(1)
        loss = super().forward(idx, targets, use_optional)
        return loss + self.shift.mean() + 1e-3 * self.count.float()


def checkpoint_engine(cfg: dict, seed: int, freeze: bool = False, cls: type = Buffered):
    config = outcore.Config.from_dict(cfg)
    torch.manual_seed(seed)
    with outcore.init(config):
        model = cls()
    if freeze:
        model.scale.requires_grad_(False)
    groups = param_groups(model, config.optimizer.weight_decay)
    return model, outcore.initialize(model, config, groups)


def checkpoint_batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    idx, tgt = (torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g) for _ in range(2))
    mine = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    return idx[mine], tgt[mine]


def square_loss_steps(engine, x: torch.Tensor, steps: int) -> list[float]:
    """``steps`` steps of the mean squared output on one fixed batch ``x`` (moved to the
    engine's device); the losses."""
    x, losses = x.to(engine.device), []
    for _ in range(steps):
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def ranks_mean(loss: torch.Tensor, world: int) -> float:
    """The mean over the ranks of each rank's ``loss`` (a collective at more ranks): the loss
    of the global batch, where each rank's is the mean over its part."""
    mean = loss.detach().float().clone()
    if world > 1:
        dist.all_reduce(mean)
    return mean.item() / world


def on_ranks(world: int, fn, *args) -> list:
    """``[fn(*args)]`` in this process at world size 1, else ``fn`` on each of ``world`` ranks
    (``run_world``)."""
    from tests.distributed import run_world

    return [fn(*args)] if world == 1 else run_world(fn, world, *args)


def assert_states_close(runs: list, want: dict[str, torch.Tensor], rtol: float = 1e-5,
                        atol: float = 1e-6) -> None:
    """Each run's state dict (as ``run_world`` hands it back) equals ``want``, key by key."""
    for got in runs:
        assert got.keys() == want.keys()
        for name, value in want.items():
            torch.testing.assert_close(torch.as_tensor(got[name]), value, rtol=rtol, atol=atol,
                                       msg=name)


def train_steps(engine, steps: range) -> list[float]:
    """Optimizer steps ``steps``; returns the global mean loss of each."""
    losses = []
    for step in steps:
        x, y = (t.to(engine.device) for t in checkpoint_batch(step, engine.rank, engine.world_size))
        loss = engine(x, y, step % 2 == 0)
        engine.backward(loss)
        engine.step()
        losses.append(ranks_mean(loss, engine.world_size))
    return losses


def weights_of(engine, model) -> dict[str, torch.Tensor]:
    with engine.gathered_parameters():
        return {n: p.data.clone() for n, p in model.named_parameters()}


# -- models whose execution path changes between steps (the schedule's tests) ----------------
DIVERGENT_DIM = 64  # one Linear(64, 64) group is 64*64*4 + 64*4 = 16640 bytes in fp32


class Path_(nn.Module):
    """Blocks run in an order chosen per step: the trace changes between steps."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, DIVERGENT_DIM)
        self.blocks = nn.ModuleList(nn.Linear(DIVERGENT_DIM, DIVERGENT_DIM) for _ in range(6))
        self.out = nn.Linear(DIVERGENT_DIM, 1)

    def forward(self, x: torch.Tensor, order: list[int]) -> torch.Tensor:
        h = self.inp(x)
        for i in order:
            h = h + torch.tanh(self.blocks[i](h))
        return F.mse_loss(self.out(h), x[:, :1])


class MoE(nn.Module):
    """Top-1 mixture of experts: which expert runs depends on the data."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, DIVERGENT_DIM)
        self.router = nn.Linear(DIVERGENT_DIM, 4)
        self.experts = nn.ModuleList(nn.Linear(DIVERGENT_DIM, DIVERGENT_DIM) for _ in range(4))
        self.out = nn.Linear(DIVERGENT_DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        gate = torch.softmax(self.router(h).mean(0), dim=-1)
        k = int(gate.argmax())
        h = h + gate[k] * torch.tanh(self.experts[k](h))
        return F.mse_loss(self.out(h), x[:, :1])


def run_divergent(model_name: str, prefetch: int, params: str, swap: str, steps: int) -> dict:
    cfg = outcore.Config.from_dict({
        "dtype": "fp32", "optimizer": {"lr": 1e-2},
        "zero": {"persistence_threshold_bytes": 0, "prefetch_bytes": prefetch},
        "offload": {"params": params, "nvme_path": swap, "host_buffer_bytes": 1 << 20},
    })
    torch.manual_seed(0)
    with outcore.init(cfg):
        model = Path_() if model_name == "path" else MoE()
    engine = outcore.initialize(model, cfg)
    rank = engine.rank
    gen = torch.Generator().manual_seed(3)
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            x = torch.randn(4 * engine.world_size, 8, generator=gen)
            x = (x[rank * 4 : (rank + 1) * 4] if model_name == "path" else x).to(engine.device)
            if model_name == "path":
                # the same order on every rank (ZeRO-3 needs that), a different one per step
                order = torch.randperm(6, generator=gen)[: 3 + step % 3].tolist()
                loss = engine(x, order)
            else:
                loss = engine(x)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    stats = engine.schedule_stats()
    engine.close()
    return {"losses": losses, "stats": stats,
            "warnings": [str(w.message) for w in caught if "prefetch_bytes" in str(w.message)]}


# -- measurements and fixtures ---------------------------------------------------------------
def resident_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s whole pages that are in memory right now (``mincore``)."""
    mincore = libc().mincore
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    start = t.data_ptr() - t.data_ptr() % ALIGN
    length = round_up(t.data_ptr() + t.nbytes - start)
    vec = ctypes.create_string_buffer(length // ALIGN)
    assert mincore(start, length, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw) * ALIGN


def char_tokenizer(folder):
    """A character-level Hugging Face tokenizer saved to ``folder`` (no download)."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz \n")}
    vocab["[UNK]"] = len(vocab)
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.save_pretrained(folder)
    return transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)


def save_tiny_llama(folder: Path, dtype: torch.dtype = torch.float32, seed: int = 1) -> Path:
    """A 2-layer Llama (about 109K parameters) saved as a Hugging Face folder: config.json and
    model.safetensors, in ``dtype``. Needs ``transformers``."""
    import transformers

    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )).to(dtype).save_pretrained(folder)
    return folder


def hf_steps(engine, ids: torch.Tensor, steps: int) -> list[float]:
    """``steps`` optimizer steps of a Hugging Face causal LM on one batch (its own labels);
    the losses."""
    losses = []
    for _ in range(steps):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


# -- tiny Hugging Face models and Trainer arguments (test_hf_trainer.py and others) ---------
LLAMA = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
LORA = "r=4,alpha=8,targets=q_proj,v_proj"
GPT2_LORA = "r=4,alpha=8,targets=c_attn"


def build(name: str, cfg: dict | None = None, lora: str | None = None) -> torch.nn.Module:
    """A random-init tiny model from its config (no download), under ``outcore.init`` when
    ``cfg`` is given, with LoRA adapters when ``lora`` is."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from outcore.hf import apply_lora

    def make() -> torch.nn.Module:
        if name == "gpt2":
            return GPT2LMHeadModel(GPT2Config(
                n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64, resid_pdrop=0.0,
                embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
        return LlamaForCausalLM(LlamaConfig(**LLAMA))

    torch.manual_seed(0)
    if cfg is None:
        model = make()
    else:
        with outcore.init(cfg):
            model = make()
    if lora is not None:
        torch.manual_seed(1)
        model = apply_lora(model, lora)
    return model


def dataset(n: int = 22) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    return [{"input_ids": x, "labels": x} for x in torch.randint(0, 128, (n, 16), generator=gen)]


def arguments(out: Path, **over) -> transformers.TrainingArguments:
    """Accumulation over 2 micro-batches (22 samples: the epoch's last accumulation has one),
    clipping on, a warm-up and decay schedule, weight decay."""
    import transformers
    kw = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
              max_grad_norm=0.5, learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=2,
              weight_decay=0.1, max_steps=8, logging_steps=1, save_strategy="no",
              report_to=[], seed=0, disable_tqdm=True)
    kw.update(over)
    return transformers.TrainingArguments(**kw)


def nvme(tmp: Path) -> dict:
    """Everything on NVMe, the swap in ``tmp / "swap"``."""
    return {"offload": {"params": "nvme", "optimizer": "nvme", "nvme_path": str(tmp / "swap")}}



# -- a transformer-like model for activation checkpointing and offloading --------------------
# It has the parts that make saving activations under ZeRO-3 tricky: a block owning a
# parameter directly (only the block's own hook fetches it), a block reading a child's weight
# outside the child, a root parameter passed into every block (a saved input in parameter
# storage), a keyword tensor input, and dropout (the recomputation must restore its RNG).
ACT_VOCAB, ACT_DIM, ACT_HEADS, ACT_BATCH, ACT_SEQ, ACT_LAYERS = 64, 32, 4, 2, 16, 3


class ActAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(ACT_DIM, 3 * ACT_DIM)
        self.proj = nn.Linear(ACT_DIM, ACT_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, ACT_HEADS, ACT_DIM // ACT_HEADS).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, ACT_DIM))


class ActBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(ACT_DIM), nn.LayerNorm(ACT_DIM)
        self.attn = ActAttention()
        self.fc1, self.fc2 = nn.Linear(ACT_DIM, 4 * ACT_DIM), nn.Linear(4 * ACT_DIM, ACT_DIM)
        self.gain = nn.Parameter(torch.ones(ACT_DIM))  # owned by the block itself
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor, scale: torch.Tensor, *, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        # reads a child's weight outside the child
        x = x + 0.05 * torch.tanh(x @ self.fc2.weight @ self.fc2.weight.T)
        h = self.fc2(self.drop(F.gelu(self.fc1(self.ln2(x)))))
        return x + h * self.gain * scale + bias


class ActNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(ACT_VOCAB, ACT_DIM)
        self.blocks = nn.ModuleList(ActBlock() for _ in range(ACT_LAYERS))
        self.scale = nn.Parameter(torch.full((ACT_DIM,), 0.9))  # passed into every block
        self.head = nn.Linear(ACT_DIM, ACT_VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        bias = torch.linspace(-0.01, 0.01, ACT_DIM, device=h.device)
        for b in self.blocks:
            h = b(h, self.scale, bias=bias)
        return F.cross_entropy(self.head(h).reshape(-1, ACT_VOCAB), idx.roll(-1, 1).reshape(-1))
