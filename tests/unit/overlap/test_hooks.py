"""The hooks that make a model need no changes (hooks.py's [Note: three hooks, three jobs]),
through a small engine with its parameters on NVMe (so groups really gather and release): the
runtime's ``Phase`` is IDLE between calls, FORWARD inside a forward and BACKWARD inside
``engine.backward``; a module's group is gathered while it runs and released after; a
parameter read outside its module is fetched on the spot and held until the forward ends;
backward re-fetches what it needs and releases it; a copied or pickled model carries inert
hooks; ``close()`` removes every hook."""

from __future__ import annotations

import copy
import io
import pickle
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from outcore.engine.core import Engine
from outcore.overlap.hooks import Hooks, inert_copy
from outcore.runtime.phase import Phase
from outcore.zero.state import GroupState

Look = Callable[[str, torch.Tensor], None]


class Net(nn.Module):
    """fc1 -> (read gate's weight outside gate) -> fc2; ``look`` sees the hidden state."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.gate = nn.Linear(16, 16)  # never called: its weight is read by this module
        self.fc2 = nn.Linear(16, 4)
        self.look: Look | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        if self.look is not None:
            self.look("between", h)
        h = h + 0.1 * (h @ self.gate.weight.T)
        return self.fc2(h)


def _engine(swap: Path, persist: int = 0) -> tuple[Net, Engine]:
    torch.manual_seed(0)
    model = Net()
    cfg = outcore.Config(dtype="fp32", optimizer={"type": "sgd", "lr": 0.1},
                         zero={"persistence_threshold_bytes": persist, "prefetch_bytes": 0},
                         offload={"params": "nvme", "nvme_path": str(swap),
                                  "host_buffer_bytes": 1 << 20})
    return model, outcore.initialize(model, cfg)


@pytest.fixture
def net(tmp_path: Path) -> Iterator[tuple[Net, Engine]]:
    model, engine = _engine(tmp_path)
    yield model, engine
    engine.close()


def _states(model: Net, engine: Engine) -> dict[str, GroupState]:
    return {name: engine.hooks.module_groups[getattr(model, name)][0].state
            for name in ("fc1", "gate", "fc2")}


X = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))


def test_phase_moves_idle_forward_idle_backward_idle(net: tuple[Net, Engine]) -> None:
    model, engine = net
    seen: list[tuple[str, Phase]] = []

    def look(where: str, h: torch.Tensor) -> None:
        seen.append((where, engine.rt.phase))
        h.register_hook(lambda g: seen.append(("grad", engine.rt.phase)))

    model.look = look
    assert engine.rt.phase is Phase.IDLE
    y = engine(X)
    assert seen == [("between", Phase.FORWARD)]
    assert engine.rt.phase is Phase.IDLE
    engine.backward(y.pow(2).mean())
    assert seen[1:] == [("grad", Phase.BACKWARD)]
    assert engine.rt.phase is Phase.IDLE


def test_a_modules_group_is_gathered_while_it_runs_and_released_after(
        net: tuple[Net, Engine]) -> None:
    model, engine = net
    S, U = GroupState.SHARDED, GroupState.UNSHARDED
    seen: list[tuple[str, dict[str, GroupState]]] = []

    def note(where: str) -> None:
        seen.append((where, _states(model, engine)))

    model.look = lambda where, h: note(where)
    model.fc1.register_forward_hook(lambda m, a, o: note("fc1 ran"))
    model.fc2.register_forward_pre_hook(lambda m, a: note("in fc2"))
    assert _states(model, engine) == {"fc1": S, "gate": S, "fc2": S}
    engine(X)
    assert seen == [
        # outcore's post-hook (registered first) already released fc1
        ("fc1 ran", {"fc1": S, "gate": S, "fc2": S}),
        ("between", {"fc1": S, "gate": S, "fc2": S}),
        # gate's weight was read outside gate: fetched on the spot, held for the forward
        ("in fc2", {"fc1": S, "gate": U, "fc2": U}),
    ]
    assert _states(model, engine) == {"fc1": S, "gate": S, "fc2": S}


def test_backward_fetches_what_it_needs_and_releases_everything(
        net: tuple[Net, Engine]) -> None:
    model, engine = net
    torch.manual_seed(0)
    ref = Net()  # the same weights, plain
    seen: list[dict[str, GroupState]] = []

    def look(where: str, h: torch.Tensor) -> None:
        h.register_hook(lambda g: seen.append(_states(model, engine)))

    model.look = look
    engine.backward(engine(X).pow(2).mean())
    # h's gradient needs gate's and fc2's weights: the saved-tensor hooks fetched them
    assert len(seen) == 1 and seen[0]["gate"] is GroupState.UNSHARDED
    assert engine.rt.phase is Phase.IDLE
    assert set(_states(model, engine).values()) == {GroupState.SHARDED}
    assert engine.step()
    # every gradient reached its shard: the step is plain SGD's
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref(X).pow(2).mean().backward()
    opt.step()
    model.look = None
    torch.testing.assert_close(engine(X).cpu(), ref(X))


def test_a_forward_that_raises_returns_to_idle_with_groups_released(
        net: tuple[Net, Engine]) -> None:
    model, engine = net

    def boom(where: str, h: torch.Tensor) -> None:
        raise KeyError("user code failed")

    model.look = boom
    with pytest.raises(KeyError):
        engine(X)
    assert engine.rt.phase is Phase.IDLE
    assert set(_states(model, engine).values()) == {GroupState.SHARDED}
    model.look = None
    assert torch.isfinite(engine(X)).all()  # the next forward is a clean one


def test_a_forward_whose_setup_raises_returns_to_idle(
        net: tuple[Net, Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    model, engine = net

    def fails() -> None:
        raise OSError("a read of the last iteration's prefetch failed")

    monkeypatch.setattr(engine.schedule, "begin_forward", fails)
    with pytest.raises(OSError):
        engine(X)
    monkeypatch.undo()
    assert engine.rt.phase is Phase.IDLE
    assert not engine.hooks.active and engine.hooks.frames == []
    # the next call, through the engine or the model itself, is a whole forward again
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no hook raising inside torch's always-call hooks
        assert torch.equal(model(X), engine(X))
    assert engine.rt.phase is Phase.IDLE


def test_persistent_groups_stay_gathered_after_their_module(tmp_path: Path) -> None:
    model, engine = _engine(tmp_path, persist=1 << 20)
    try:
        assert all(g.persistent for g in engine.groups)
        engine(X)
        assert engine.rt.phase is Phase.IDLE
        assert _states(model, engine)["fc1"] is GroupState.UNSHARDED
    finally:
        engine.close()


def test_a_deep_copied_model_carries_inert_hooks(net: tuple[Net, Engine]) -> None:
    model, engine = net
    want = engine(X).detach()
    twin = copy.deepcopy(model)
    owners = [h.__self__ for h in twin.fc1._forward_pre_hooks.values()]
    assert owners and all(isinstance(o, Hooks) and o.inert for o in owners)
    assert engine.hooks.inert is False  # the original's still work
    seen: list[Phase] = []
    twin.look = lambda where, h: seen.append(engine.rt.phase)
    # a plain copy on the device the engine shows its parameters on, as torch's copy would be
    x = X.to(engine.device)
    got = twin(x)
    assert torch.equal(got, want)
    assert seen == [Phase.IDLE]  # the copy's call is not an engine forward
    assert set(_states(model, engine).values()) == {GroupState.SHARDED}
    assert type(twin.fc1.weight) is nn.Parameter  # a plain model
    twin.look = None
    twin(x).pow(2).mean().backward()  # trains on its own: no gradient reaches the engine
    assert twin.fc1.weight.grad is not None
    assert not any(g.has_pending_grads for g in engine.groups)


def test_a_pickled_model_carries_inert_hooks(net: tuple[Net, Engine]) -> None:
    model, engine = net
    want = engine(X).detach()
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    owners = [h.__self__ for h in loaded.fc2._forward_pre_hooks.values()]
    assert owners and all(isinstance(o, Hooks) and o.inert for o in owners)
    assert torch.equal(loaded(X.to(engine.device)), want)
    assert engine.rt.phase is Phase.IDLE
    revived = pickle.loads(pickle.dumps(engine.hooks))
    assert type(revived) is Hooks and revived.inert


def test_inert_hooks_do_nothing() -> None:
    hooks = inert_copy(Hooks)
    assert hooks.inert
    module = nn.Linear(2, 2)
    assert hooks._pre_forward(module, ()) is None  # would need module_groups otherwise
    assert hooks._post_forward(module, (), None) is None


def test_close_removes_every_hook(tmp_path: Path) -> None:
    model, engine = _engine(tmp_path)
    counts = {n: len(getattr(model, n)._forward_pre_hooks) for n in ("fc1", "gate", "fc2")}
    assert counts == {"fc1": 1, "gate": 1, "fc2": 1}  # every module with parameters
    assert model._forward_pre_hooks  # the root's entry hook (entry.py)
    engine.close()
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks, m
    assert engine.rt.phase is Phase.IDLE
    assert torch.isfinite(model(X)).all()  # a plain model again
