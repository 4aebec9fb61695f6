"""``loss.backward()`` on a model outcore trains is refused in words, and leaves nothing behind:
the training that follows with ``engine.backward`` equals a run that never made the call
(overlap/hooks.py's [Note: loss.backward() is refused])."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from outcore.device.accel import default_device
from outcore.zero.state import GroupState
from tests.distributed import run_world


def _batch(step: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(step)).to(default_device())


def _train(tmp: str, offload: str, plain_backward_at: int | None,
           checkpointed: bool = False) -> dict:
    """Four steps of engine.backward and step(); at ``plain_backward_at`` a forward whose loss
    goes to ``loss.backward()`` first. Returns the losses, the errors and the weights."""
    rank = int(os.environ.get("RANK", "0"))
    (Path(tmp) / f"rank{rank}").mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                          nn.Linear(32, 4))
    if checkpointed:
        # the last block too: its recomputation comes before any gradient
        outcore.checkpoint_activations(model, lambda name, module: name in ("2", "4"))
    engine = outcore.initialize(model, {
        "dtype": "fp32", "gradient_accumulation_steps": 2,
        "zero": {"persistence_threshold_bytes": 0},  # every layer is fetched and released
        "offload": {"params": offload, "optimizer": offload,
                    "nvme_path": str(Path(tmp) / f"rank{rank}")}})
    losses, errors = [], []
    for step in range(4):
        if step == plain_backward_at:
            states = [g.state for g in engine.groups]
            try:
                model(_batch(100 + step)).pow(2).mean().backward()
            except outcore.OutcoreError as e:
                errors.append(str(e))
            errors.append([p.grad for p in model.parameters()] == [None] * 6)
            # nothing left gathered that was not before
            errors.append({i for i, g in enumerate(engine.groups) if g.state is not states[i]
                           and g.state is not GroupState.SHARDED} == set())
        for micro in range(2):
            loss = engine(_batch(10 * step + micro)).pow(2).mean()
            engine.backward(loss)
            losses.append(loss.item())
        assert engine.step()
    with engine.gathered_parameters():
        weights = [p.detach().clone().cpu() for p in model.parameters()]
    engine.close()
    return {"losses": losses, "errors": errors, "weights": weights}


def _same_training(got: dict, ref: dict) -> None:
    assert got["losses"] == ref["losses"]  # bit for bit: nothing of the refused backward stays
    for a, b in zip(got["weights"], ref["weights"], strict=True):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))  # across processes: numpy


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_loss_backward_is_refused_and_leaves_nothing(tmp_path: Path, offload: str,
                                                     checkpointed: bool) -> None:
    ref = _train(str(tmp_path / "ref"), offload, None, checkpointed)
    got = _train(str(tmp_path / "got"), offload, 0, checkpointed)  # before any step
    message, no_grads, as_before = got["errors"]
    assert message.startswith("loss.backward() on a model outcore trains: call "
                              "engine.backward(loss) instead")
    assert no_grads and as_before
    _same_training(got, ref)


def test_loss_backward_is_refused_on_every_rank(tmp_path: Path) -> None:
    """Each rank refuses at its first gradient, before any reduction: no rank waits in a
    collective the others never join, and training goes on as if nothing happened."""
    ref = run_world(_train, 2, str(tmp_path / "ref"), "nvme", None)
    got = run_world(_train, 2, str(tmp_path / "got"), "nvme", 2)
    for mine, theirs in zip(got, ref, strict=True):
        assert "call engine.backward(loss)" in mine["errors"][0]
        _same_training(mine, theirs)


def _gan(engines: bool) -> list[float]:
    """Two models trained against each other: the generator's loss runs through the
    discriminator, whose gradients from it are dropped by its zero_grad(). ``engines``:
    both under outcore (each engine.backward), else plain torch."""
    def mk(seed: int, d_in: int, d_out: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(d_in, 32), nn.Tanh(), nn.Linear(32, d_out))

    gen, disc = mk(1, 8, 16), mk(2, 16, 1)
    cfg = {"dtype": "fp32", "optimizer": {"type": "sgd", "lr": 0.05}}
    if engines:
        eg, ed = outcore.initialize(gen, cfg), outcore.initialize(disc, cfg)
        opt_g, opt_d = eg.optimizer, ed.optimizer
    else:
        opt_g, opt_d = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (gen, disc))
    z, real = torch.randn(4, 8, generator=torch.Generator().manual_seed(3)), torch.randn(4, 16)
    losses = []
    for _ in range(3):
        d_loss = disc(real).mean() - disc(gen(z).detach()).mean()
        ed.backward(d_loss) if engines else d_loss.backward()
        opt_d.step()
        opt_d.zero_grad()
        g_loss = -disc(gen(z)).mean()
        eg.backward(g_loss) if engines else g_loss.backward()
        opt_g.step()
        opt_g.zero_grad()
        opt_d.zero_grad()  # drops what the generator's loss left on the discriminator
        losses += [d_loss.item(), g_loss.item()]
    if engines:
        eg.close()
        ed.close()
    return losses


def test_a_backward_of_another_engine_through_the_model_is_not_refused() -> None:
    """A GAN: the generator's engine.backward runs through the discriminator's model, whose
    engine did not start it; that is not a plain loss.backward(), and trains as plain torch."""
    torch.testing.assert_close(_gan(engines=True), _gan(engines=False), rtol=1e-5, atol=1e-6)
