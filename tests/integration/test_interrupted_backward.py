"""A ``KeyboardInterrupt`` in a backward with the optimizer on NVMe, caught by the user's loop:
the updates applied during it are named (stepping.py's [Note: a failed backward's applied
updates]), running the batch again completes the step as PyTorch's, and an interrupt while the
update thread starts stays an interrupt (pipeline.py's [Note: a Ctrl-C while the worker
starts])."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import outcore

ROOT = Path(__file__).resolve().parents[2]


class Interrupt(torch.autograd.Function):
    """Raises in backward when armed: between the last layer's gradient and the others'."""

    armed = False

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        if Interrupt.armed:
            Interrupt.armed = False
            raise KeyboardInterrupt
        return grad


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 4))
    model[3].register_forward_hook(lambda module, args, out: Interrupt.apply(out))
    return model


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


@pytest.mark.parametrize("params", ["nvme", "cpu"])
def test_an_interrupted_backward_names_its_updates_and_a_retry_completes_the_step(
        tmp_path: Path, params: str) -> None:
    """The updates applied before the interrupt stayed without a word. Now a warning names
    them, and the batch run again completes the step without updating them a second time."""
    model = _model()
    engine = outcore.initialize(model, {"dtype": "fp32", "optimizer": {"lr": 1e-2},
                                        "offload": {"params": params, "optimizer": "nvme",
                                                    "nvme_path": str(tmp_path)}})
    assert engine.overlaps_optimizer  # the case: updates applied during backward

    def last_layer() -> torch.Tensor:
        with engine.gathered_parameters([model[4].weight]):
            return model[4].weight.detach().cpu().clone()

    x, y = (t.to(engine.device) for t in _batch(0))
    engine.backward(nn.functional.mse_loss(model(x), y))
    assert engine.step()
    before = last_layer()
    Interrupt.armed = True
    with pytest.warns(UserWarning, match=r"updated 2 of 6 parameters \(4.weight, "
                      r"4.bias\).*Running the same batch again"), \
            pytest.raises(KeyboardInterrupt):
        engine.backward(nn.functional.mse_loss(model(x), y))
    interrupted = last_layer()
    assert not torch.equal(interrupted, before)  # applied, and it stays
    engine.zero_grad()  # then the same batch again, as the warning says
    engine.backward(nn.functional.mse_loss(model(x), y))
    assert engine.step() and engine.global_steps == 2
    assert torch.equal(last_layer(), interrupted)  # not updated twice in one step
    engine.close()


START = """
import sys, threading, time, torch, outcore
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
engine = outcore.initialize(model, {"dtype": "fp32", "offload": {
    "params": "nvme", "optimizer": "nvme", "nvme_path": sys.argv[1]}})
x = torch.randn(8, 8)
engine.backward(model(x).pow(2).mean()); engine.step()
start, armed = threading.Thread.start, [True]
def interrupted_start(self):  # the Ctrl-C lands in start()'s wait for the new thread
    if armed[0] and self.name == "outcore-optim":
        armed[0] = False
        def wait(timeout=None):
            raise KeyboardInterrupt
        def slow_boot(boot=self._bootstrap):  # the new thread runs a moment later
            time.sleep(0.3)
            boot()
        self._started.wait, self._bootstrap = wait, slow_boot
    return start(self)
threading.Thread.start = interrupted_start
try:
    engine.backward(model(x).pow(2).mean())
except KeyboardInterrupt:
    print("interrupted", flush=True)
threading.Thread.start = start
engine.zero_grad()
engine.backward(model(x).pow(2).mean())
assert engine.step()
engine.close()
print("done", flush=True)
"""


def test_an_interrupt_while_the_update_thread_starts_stays_an_interrupt(tmp_path: Path) -> None:
    """It was a ``RuntimeError`` ("cannot join thread before it is started") from the
    backward's clean-up, and the next ``step()`` waited forever."""
    script = tmp_path / "start.py"
    script.write_text(textwrap.dedent(START))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "swap")], cwd=ROOT,
                          timeout=120, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert proc.stdout.split() == ["interrupted", "done"], out


def test_a_step_right_after_an_interrupted_backward_says_nothing_was_stepped() -> None:
    """``step()`` returned False without a word, where PyTorch's steps the partial gradients."""
    model = _model()
    engine = outcore.initialize(model, {"dtype": "fp32"})
    x, y = (t.to(engine.device) for t in _batch(0))
    Interrupt.armed = True
    with pytest.raises(KeyboardInterrupt):
        engine.backward(nn.functional.mse_loss(model(x), y))
    with pytest.warns(UserWarning, match="step\\(\\) after a backward that raised"):
        assert not engine.step()
    engine.backward(nn.functional.mse_loss(model(x), y))
    assert engine.step()  # and a step after a completed backward says nothing
    engine.close()
