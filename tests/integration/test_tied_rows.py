"""A tied embedding's gradient, added row by row (overlap/tied_rows.py's note): the weights
plain PyTorch trains, whichever way backward reaches the weight, and no full-size gradient
in backward beyond the head's."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import outcore

VOCAB, DIM, PAD = 96, 16, 3


class TiedLM(nn.Module):
    def __init__(self, padding_idx: int | None = None, inplace: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, padding_idx=padding_idx)
        self.mid = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.inplace = inplace

    def forward(self, idx: torch.Tensor, head: bool = True) -> torch.Tensor:
        h = self.emb(idx)
        if self.inplace:  # a model that changes the embedding's output in place
            h.mul_(2)
        h = torch.tanh(self.mid(h))
        out = self.head(h) if head else h
        return out.float().logsumexp(-1).mean()


def _batches(steps: int, accumulate: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    # few distinct tokens, so most repeat (and PAD is among them)
    return [[torch.randint(0, 8, (2, 12), generator=gen) for _ in range(accumulate)]
            for _ in range(steps)]


def _train(model: nn.Module, step, backward, batches, head: bool, device) -> list[float]:
    losses = []
    for micro in batches:
        for idx in micro:
            loss = model(idx.to(device), head)
            backward(loss)
            losses.append(loss.item())
        step()
    return losses


@pytest.mark.parametrize("padding_idx,inplace,head,accumulate", [
    (None, False, True, 1),
    (PAD, False, True, 2),
    (None, True, True, 1),
    (PAD, False, False, 1),  # backward never reaches the head: the rows alone
])
def test_the_weights_plain_torch_trains(padding_idx, inplace, head, accumulate) -> None:
    batches = _batches(3, accumulate)
    torch.manual_seed(0)
    ref = TiedLM(padding_idx, inplace)
    torch.manual_seed(0)
    model = TiedLM(padding_idx, inplace)
    cfg = {"dtype": "fp32", "gradient_accumulation_steps": accumulate,
           "optimizer": {"type": "sgd", "lr": 0.5}}
    with outcore.initialize(model, cfg) as engine:
        assert engine.hooks.tied_rows.modules, "the tied embedding was not taken"
        ref.to(engine.device)
        opt = torch.optim.SGD(ref.parameters(), lr=0.5, foreach=False)

        def ref_step() -> None:
            opt.step()
            opt.zero_grad()

        want = _train(ref, ref_step, lambda loss: (loss / accumulate).backward(), batches, head,
                      engine.device)
        got = _train(engine, engine.step, engine.backward, batches, head, engine.device)
        assert got == want
        with engine.gathered_parameters():
            for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
                assert torch.equal(a.detach(), b.detach()), name
            if padding_idx is not None:  # its row gets no gradient, as in torch
                assert torch.equal(model.emb.weight[PAD], ref.emb.weight[PAD])


class _FullSize(TorchDispatchMode):
    """The new tensors of the tied weight's shape (or its transpose) that ops make: views and
    in-place results, whose returns alias an input, are not new."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: set[int] = set()

    @property
    def made(self) -> int:
        return len(self.storages)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and tuple(t.shape) in ((VOCAB, DIM), (DIM, VOCAB)):
                self.storages.add(t.untyped_storage().data_ptr())
        return out


def test_backward_makes_no_full_gradient_beyond_the_heads() -> None:
    idx = _batches(1, 1)[0][0]
    torch.manual_seed(0)
    plain = TiedLM()
    loss = plain(idx)
    with _FullSize() as seen:
        loss.backward()
    assert seen.made >= 2  # torch: the head's, the embedding's and (here) their sum
    torch.manual_seed(0)
    with outcore.initialize(TiedLM(), {"dtype": "fp32"}) as engine:
        loss = engine(idx.to(engine.device))
        with _FullSize() as seen:
            engine.backward(loss)
        assert seen.made == 1  # the head's, into which the rows were added


def test_autograd_grad_gets_torchs_gradient() -> None:
    idx = _batches(1, 1)[0][0]
    torch.manual_seed(0)
    ref = TiedLM(PAD)
    (want,) = torch.autograd.grad(ref(idx), ref.emb.weight)
    torch.manual_seed(0)
    model = TiedLM(PAD)
    with outcore.initialize(model, {"dtype": "fp32"}) as engine:
        (got,) = torch.autograd.grad(engine(idx.to(engine.device)), model.emb.weight)
        assert torch.equal(got.cpu(), want)


def test_a_hook_on_the_weight_sees_the_whole_gradient() -> None:
    mask = torch.zeros(VOCAB, 1)
    mask[4:] = 1  # the first rows frozen, as when training only added tokens
    batches = _batches(2, 1)
    torch.manual_seed(0)
    ref = TiedLM()
    ref.emb.weight.register_hook(lambda g: g * mask)
    torch.manual_seed(0)
    model = TiedLM()
    with outcore.initialize(model, {"dtype": "fp32", "optimizer": {"type": "sgd", "lr": 0.5}}
                            ) as engine:
        model.emb.weight.register_hook(lambda g: g * mask.to(g.device))
        opt = torch.optim.SGD(ref.parameters(), lr=0.5, foreach=False)

        def ref_step() -> None:
            opt.step()
            opt.zero_grad()

        want = _train(ref, ref_step, lambda loss: loss.backward(), batches, True, "cpu")
        got = _train(engine, engine.step, engine.backward, batches, True, engine.device)
        assert got == want
        with engine.gathered_parameters():
            assert torch.equal(model.emb.weight.detach().cpu(), ref.emb.weight.detach())


def test_a_loss_kept_after_close_keeps_no_engine_state() -> None:
    torch.manual_seed(0)
    model = TiedLM()
    engine = outcore.initialize(model, {"dtype": "fp32"})
    runtime = weakref.ref(engine.rt)
    loss = engine(_batches(1, 1)[0][0].to(engine.device))
    engine.close()
    del engine
    gc.collect()
    assert runtime() is None  # the loss's graph holds the tied rows' state weakly
    loss.backward()  # a plain backward now: torch's own gradient, into the plain model
    assert model.emb.weight.grad is not None


def _one_step_weights(change, after_forward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The tied weight after one SGD step, plain and through outcore, with ``change(model)``
    applied after ``initialize`` (before the forward, or between it and backward)."""
    idx = _batches(1, 1)[0][0]
    torch.manual_seed(0)
    ref = TiedLM()
    change(ref)
    ref(idx).backward()
    with torch.no_grad():
        want = ref.emb.weight - 0.5 * ref.emb.weight.grad
    torch.manual_seed(0)
    model = TiedLM()
    with outcore.initialize(model, {"dtype": "fp32", "optimizer": {"type": "sgd", "lr": 0.5}}
                            ) as engine:
        if not after_forward:
            change(model)
        loss = engine(idx.to(engine.device))
        if after_forward:
            change(model)
        engine.backward(loss)
        engine.step()
        with engine.gathered_parameters():
            got = model.emb.weight.detach().cpu().clone()
    return got, want


def test_a_hook_added_between_forward_and_backward_sees_the_whole_gradient() -> None:
    mask = torch.zeros(VOCAB, 1)
    mask[4:] = 1

    def hook(m: nn.Module) -> None:
        m.emb.weight.register_hook(lambda g: g * mask.to(g.device))

    got, want = _one_step_weights(hook, after_forward=True)
    assert torch.equal(got, want)


def test_scale_grad_by_freq_set_after_initialize_is_honoured() -> None:
    def by_freq(m: nn.Module) -> None:
        m.emb.scale_grad_by_freq = True

    got, want = _one_step_weights(by_freq, after_forward=False)
    assert torch.equal(got, want)
