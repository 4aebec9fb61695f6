"""A loop that calls a model's parts itself, ``model.head(model.body(x))``, or keeps its modules
in a container with no forward (hooks.py's [Note: a submodule called on its own])."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from tests.common import assert_states_close, on_ranks

WIDTH, BATCH, STEPS = 256, 8, 3  # layers above zero.persistence_threshold_bytes: released


class Parts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(WIDTH, WIDTH)
        self.body = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
        self.head = nn.Linear(WIDTH, 1)


def _loss(model: Parts, x: torch.Tensor) -> torch.Tensor:
    # body is a container without parameters of its own: each of its layers opens its call
    return model.head(model.body(torch.tanh(model.emb(x)))).pow(2).mean()


def _batch() -> torch.Tensor:
    return torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(5)) * 0.1


def _torch() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Parts()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(STEPS):
        opt.zero_grad()
        _loss(model, _batch()).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _outcore(offload: str, swap: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Parts()
    engine = outcore.initialize(model, {"dtype": "fp32", "optimizer": {"type": "sgd", "lr": 0.5},
                                        "offload": {"params": offload, "optimizer": offload,
                                                    "nvme_path": swap}})
    rank, world = engine.rank, engine.world_size
    x = _batch()[rank * BATCH // world:(rank + 1) * BATCH // world].to(engine.device)
    for _ in range(STEPS):
        engine.backward(_loss(model, x))
        engine.step()
    engine.close(keep_values=True)
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(("world", "offload"), [(1, "nvme"), (2, "none"), (2, "nvme")])
def test_a_loop_calling_the_models_parts_trains_as_torch(tmp_path: Path, world: int,
                                                        offload: str) -> None:
    """Backward crashed in torch: "setStorage: ... out of bounds for storage of size 0"."""
    assert_states_close(on_ranks(world, _outcore, offload, str(tmp_path)), _torch())


INTERRUPTED = """
import sys, torch, outcore
torch.manual_seed(0)
parts = torch.nn.ModuleDict({"a": torch.nn.Linear(256, 256), "b": torch.nn.Linear(256, 1)})
engine = outcore.initialize(parts, {"dtype": "fp32", "offload": {
    "params": "nvme", "optimizer": "nvme", "nvme_path": sys.argv[1]}})
armed = [True]
def interrupt(module, args):
    if armed[0]:
        armed[0] = False
        raise KeyboardInterrupt
parts["b"].register_forward_pre_hook(interrupt)
x = torch.randn(4, 256)
try:
    parts["b"](torch.tanh(parts["a"](x)))
except KeyboardInterrupt:
    print("interrupted", flush=True)
for _ in range(2):  # a container with no forward: its parts called by the loop
    engine.backward(parts["b"](torch.tanh(parts["a"](x))).pow(2).mean())
    assert engine.step()
engine.close()
print("done", flush=True)
"""


def test_an_interrupt_inside_a_called_part_and_training_goes_on(tmp_path: Path) -> None:
    script = tmp_path / "parts.py"
    script.write_text(textwrap.dedent(INTERRUPTED))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "swap")],
                          cwd=Path(__file__).resolve().parents[2], timeout=120,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.split() == ["interrupted", "done"], proc.stdout + proc.stderr
