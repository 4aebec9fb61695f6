"""The presets' loss: the same mean cross-entropy as ``F.cross_entropy`` in fp32, without
full-size fp32 logits kept for backward (models.py's [Note: the loss without full-size fp32
logits])."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from outcore.app import models
from outcore.app.models import GPT, GPTConfig, chunked_cross_entropy, loss_chunk_rows

VOCAB, TOKENS = 1000, 96


def _saved_bytes(fn) -> tuple[torch.Tensor, int]:
    """``fn()``'s result and the bytes autograd keeps for its backward (each tensor once)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_cross_entropy_in_fp32_loss_and_gradient(monkeypatch, dtype) -> None:
    monkeypatch.setattr(models, "LOSS_CHUNK_BYTES", 4 * VOCAB * 10)  # 10 rows: 10 chunks
    torch.manual_seed(0)
    base = torch.randn(TOKENS, VOCAB)
    targets = torch.randint(0, VOCAB, (TOKENS,))
    targets[::7] = -100  # ignored positions leave the mean, as in F.cross_entropy
    whole_logits = base.to(dtype).requires_grad_()
    whole = F.cross_entropy(whole_logits.float(), targets)
    whole.backward()
    logits = base.to(dtype).requires_grad_()
    loss = chunked_cross_entropy(logits, targets)
    loss.backward()
    assert loss.item() == pytest.approx(whole.item(), rel=1e-6)
    assert logits.grad is not None and whole_logits.grad is not None
    assert torch.allclose(logits.grad.float(), whole_logits.grad.float(), rtol=1e-5, atol=1e-8)
    with torch.no_grad():  # evaluation: no graph, the same value
        assert chunked_cross_entropy(base.to(dtype), targets).item() == pytest.approx(
            whole.item(), rel=1e-6)


def test_keeps_the_16_bit_logits_not_fp32_ones_for_backward(monkeypatch) -> None:
    monkeypatch.setattr(models, "LOSS_CHUNK_BYTES", 4 * VOCAB * 16)
    logits = torch.randn(TOKENS, VOCAB).bfloat16().requires_grad_()
    targets = torch.randint(0, VOCAB, (TOKENS,))
    _, whole = _saved_bytes(lambda: F.cross_entropy(logits.float(), targets))
    _, chunked = _saved_bytes(lambda: chunked_cross_entropy(logits, targets))
    fp32_logits = TOKENS * VOCAB * 4
    assert whole >= fp32_logits  # the log-softmax, in fp32, kept whole
    # the bf16 logits, the targets and the mean's count: half the fp32 size, and a few bytes
    assert chunked <= fp32_logits // 2 + TOKENS * 8 + 64


def test_the_preset_trains_the_same_as_before(monkeypatch) -> None:
    # the GPT's loss is the chunked one; a step with it equals one with the loss in one piece
    cfg = GPTConfig(layers=1, hidden=32, heads=2, vocab=VOCAB, seq_len=48)
    monkeypatch.setattr(models, "LOSS_CHUNK_BYTES", 4 * VOCAB * 8)
    torch.manual_seed(0)
    model = GPT(cfg)
    idx = torch.randint(0, VOCAB, (2, 48))
    loss = model(idx, idx.roll(-1, 1))
    loss.backward()
    chunked = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    whole = F.cross_entropy(model(idx).reshape(-1, VOCAB).float(), idx.roll(-1, 1).reshape(-1))
    assert loss.item() == pytest.approx(whole.item(), rel=1e-6)
    whole.backward()
    for a, b in zip(chunked, model.parameters(), strict=True):
        assert torch.allclose(a, b.grad, rtol=1e-5, atol=1e-7)


def test_the_preset_keeps_no_full_size_fp32_logits_for_backward(monkeypatch) -> None:
    cfg = GPTConfig(layers=1, hidden=32, heads=2, vocab=VOCAB, seq_len=48)
    monkeypatch.setattr(models, "LOSS_CHUNK_BYTES", 4 * VOCAB * 8)
    model = GPT(cfg).to(torch.bfloat16)
    idx = torch.randint(0, VOCAB, (2, 48))
    kept: list[tuple[torch.dtype, int]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append((t.dtype, t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(idx, idx.roll(-1, 1))
    # nothing fp32 beyond one chunk of 8 rows (before: the log-softmax of all 96 rows)
    assert max((n for dtype, n in kept if dtype == torch.float32), default=0) <= 8 * VOCAB
    loss.backward()


def test_an_accelerator_takes_larger_chunks_than_the_host() -> None:
    # 8 x 2048 tokens of a 32,000-word vocabulary: 126 chunks of 16 MiB cost an H100's step
    # more host time than its compute (bench/gpu/2026-11-27-h100); there a chunk is 256 MiB
    shape = (8 * 2048, 32_000)
    host = torch.empty(1, shape[1], dtype=torch.bfloat16).expand(shape)  # no 1 GB allocated
    device = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    assert loss_chunk_rows(host) == models.LOSS_CHUNK_BYTES // (4 * shape[1]) == 131
    assert loss_chunk_rows(device) == models.DEVICE_LOSS_CHUNK_BYTES // (4 * shape[1]) == 2097
    assert -(-shape[0] // loss_chunk_rows(device)) == 8
    # a vocabulary wider than the budget still takes a row at a time
    assert loss_chunk_rows(torch.empty(4, (64 << 20) + 1, device="meta")) == 1
