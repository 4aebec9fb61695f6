"""Two engines in one process whose backwards cross: a GAN's generator step backpropagates
through the discriminator (hooks.py's [Note: another engine's backward reaches this model])."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from tests.distributed import run_world

BATCH, STEPS = 8, 3


def _nets() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6))
    disc = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    return gen, disc


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 4, generator=g)


def _bce(logits: torch.Tensor, target: float) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(logits, torch.full_like(logits,
                                                                                  target))


def _plain() -> dict[str, torch.Tensor]:
    gen, disc = _nets()
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.5)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.5)
    for step in range(STEPS):
        real, z = _data(step)
        opt_d.zero_grad()
        (_bce(disc(real), 1.0) + _bce(disc(gen(z).detach()), 0.0)).backward()
        opt_d.step()
        opt_g.zero_grad()
        _bce(disc(gen(z)), 1.0).backward()  # leaves gradients in the discriminator too
        opt_g.step()
    return {f"{k}.{n}": p.detach().clone() for k, m in (("g", gen), ("d", disc))
            for n, p in m.named_parameters()}


def _engines(swap: str) -> dict[str, torch.Tensor]:
    gen, disc = _nets()
    where = "nvme" if swap else "none"
    cfgs = [{"dtype": "fp32", "optimizer": {"type": "sgd", "lr": 0.5},
             "offload": {"params": where, "optimizer": where,
                         "nvme_path": str(Path(swap or ".") / name)}} for name in "gd"]
    eng_g, eng_d = outcore.initialize(gen, cfgs[0]), outcore.initialize(disc, cfgs[1])
    rank, world = eng_g.rank, eng_g.world_size
    part = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    for step in range(STEPS):
        real, z = (t[part].to(eng_g.device) for t in _data(step))
        eng_d.zero_grad()  # drops what the generator's last backward left here
        eng_d.backward(_bce(disc(real), 1.0) + _bce(disc(gen(z).detach()), 0.0))
        eng_d.step()
        eng_g.zero_grad()
        eng_g.backward(_bce(disc(gen(z)), 1.0))
        eng_g.step()
    eng_g.close()
    eng_d.close()
    return {f"{k}.{n}": p.detach().cpu().clone() for k, m in (("g", gen), ("d", disc))
            for n, p in m.named_parameters()}


@pytest.mark.parametrize(("world", "offload"), [(1, "none"), (2, "none"), (2, "nvme")])
def test_a_gan_trains_as_pytorch(tmp_path: Path, world: int, offload: str) -> None:
    """At 2 ranks the discriminator's reductions started in the generator's backward were
    finished in its own next backward, after its zero_grad: they went into its next step
    (the losses 0.5 off PyTorch's in a probe's GAN)."""
    want = _plain()
    swap = str(tmp_path) if offload == "nvme" else ""
    results = [_engines(swap)] if world == 1 else run_world(_engines, world, swap)
    for got in results:
        for name, value in want.items():
            torch.testing.assert_close(torch.as_tensor(got[name]), value, rtol=1e-5,
                                       atol=1e-6, msg=name)
