"""Direct calls as engine calls (entry.py's [Note: direct calls are engine calls]): the entry
modules are the root and a PEFT model's base model; a call of one that is not already inside a
forward opens the forward context (once, closed also when the call raises) and casts its
inputs, a call inside one changes nothing; ``generate`` is wrapped to default
``synced_gpus=True`` only when asked (W > 1), the root's ``zero_grad`` also calls the
engine's, ``remove()`` undoes both, and a copied model's entry hooks are inert. Through an
engine: ``model(x)`` computes exactly ``engine(x)``, also in bf16 and for a PEFT-style
wrapper's inner model."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import outcore
from outcore.overlap.entry import EntryHooks, Inputs, drop_grads, entry_modules
from outcore.runtime.phase import Phase


class Recorder:
    """A fake forward context: counts how deep it is open and logs each enter and exit."""

    def __init__(self) -> None:
        self.depth = 0
        self.log: list[str] = []

    def inside(self) -> bool:
        return self.depth > 0

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        self.depth += 1
        self.log.append("enter")
        try:
            yield
        finally:
            self.depth -= 1
            self.log.append("exit")


class Outer(nn.Module):
    """Calls ``inner`` (itself an entry module) from its forward, like PEFT's wrapper."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.seen_depth: list[int] = []
        self.rec: Recorder | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.rec is not None
        self.seen_depth.append(self.rec.depth)
        return self.inner(x)

    def get_base_model(self) -> nn.Module:
        return self.inner


class WithGenerate(nn.Linear):
    def generate(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {"args": args, **kwargs}


def _hooks(modules: list[nn.Module], rec: Recorder, **kw: Any) -> EntryHooks:
    return EntryHooks(modules, rec.inside, rec.context, synced_generate=kw.pop("synced", False),
                      **kw)


# -- entry_modules --------------------------------------------------------------------------
def test_entry_modules_of_a_plain_model_is_the_root() -> None:
    root = nn.Linear(2, 2)
    assert entry_modules(root) == [root]


def test_entry_modules_of_a_peft_like_model_adds_its_base_model() -> None:
    outer = Outer()
    assert entry_modules(outer) == [outer, outer.inner]


def test_entry_modules_ignores_a_base_model_that_is_itself_or_not_a_module() -> None:
    class Self_(nn.Linear):
        def get_base_model(self) -> nn.Module:
            return self

    class NotModule(nn.Linear):
        def get_base_model(self) -> object:
            return "no"

    class Attribute(nn.Linear):
        get_base_model = None

    for cls in (Self_, NotModule, Attribute):
        m = cls(2, 2)
        assert entry_modules(m) == [m], cls


# -- EntryHooks on its own ------------------------------------------------------------------
def test_a_direct_call_opens_the_context_once_and_closes_it() -> None:
    rec = Recorder()
    outer = Outer()
    outer.rec = rec
    _hooks(entry_modules(outer), rec)
    outer(torch.zeros(1, 4))
    assert rec.log == ["enter", "exit"]
    assert outer.seen_depth == [1]  # the forward ran inside it
    outer.inner(torch.zeros(1, 4))  # the inner entry called alone opens its own
    assert rec.log == ["enter", "exit", "enter", "exit"]
    assert rec.depth == 0


def test_a_call_already_inside_a_forward_changes_nothing() -> None:
    rec = Recorder()
    root = nn.Linear(2, 2)
    _hooks([root], rec, cast=lambda inputs: pytest.fail("cast inside a forward"))
    with rec.context():
        root(torch.zeros(1, 2))
    assert rec.log == ["enter", "exit"]  # only the caller's own


def test_the_context_is_closed_when_the_call_raises() -> None:
    rec = Recorder()

    class Fails(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise KeyError("inside")

    root = Fails()
    _hooks([root], rec)
    with pytest.raises(KeyError):
        root(torch.zeros(1))
    assert rec.log == ["enter", "exit"] and rec.depth == 0


def test_the_opening_call_casts_its_inputs() -> None:
    rec = Recorder()
    got: list[tuple[torch.dtype, torch.dtype]] = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor, *, y: torch.Tensor) -> torch.Tensor:
            got.append((x.dtype, y.dtype))
            return x

    def to_half(inputs: Inputs) -> Inputs:
        args, kwargs = inputs
        return (tuple(a.half() for a in args), {k: v.half() for k, v in kwargs.items()})

    root = Probe()
    _hooks([root], rec, cast=to_half)
    root(torch.zeros(1), y=torch.ones(1))
    assert got == [(torch.float16, torch.float16)]


def test_generate_is_wrapped_to_sync_only_when_asked_and_remove_restores_it() -> None:
    rec = Recorder()
    plain = WithGenerate(2, 2)
    _hooks([plain], rec, synced=False)
    assert "generate" not in plain.__dict__
    assert "synced_gpus" not in plain.generate()

    m = WithGenerate(2, 2)
    hooks = _hooks([m], rec, synced=True)
    assert m.generate(1)["synced_gpus"] is True
    assert m.generate(1)["args"] == (1,)
    assert m.generate(synced_gpus=False)["synced_gpus"] is False  # an explicit value wins
    hooks.remove()
    assert "generate" not in m.__dict__
    assert "synced_gpus" not in m.generate()
    m(torch.zeros(1, 2))
    assert rec.log == []  # hooks removed too


def test_the_roots_zero_grad_also_calls_the_engines() -> None:
    rec = Recorder()
    calls: list[str] = []
    root = nn.Linear(2, 2)
    root(torch.ones(1, 2)).sum().backward()

    def engines(set_to_none: bool) -> None:  # as Engine.zero_grad: the shards, then p.grad
        calls.append(f"zero_grad({set_to_none})")
        drop_grads(root)

    hooks = _hooks([root], rec, on_zero_grad=engines)
    walks: list[int] = []
    torch_parameters = root.parameters
    root.parameters = lambda *a, **k: walks.append(1) or torch_parameters(*a, **k)
    root.zero_grad()
    assert calls == ["zero_grad(True)"] and root.weight.grad is None
    assert len(walks) == 1  # torch's own zero_grad walked them a second time, to no effect
    del root.parameters
    twin = copy.deepcopy(root)
    twin.zero_grad()
    assert calls == ["zero_grad(True)"]  # a copy has no engine
    hooks.remove()
    root.zero_grad()
    assert calls == ["zero_grad(True)"] and "zero_grad" not in root.__dict__


def test_a_copied_models_entry_hooks_are_inert() -> None:
    rec = Recorder()
    root = nn.Linear(2, 2)
    _hooks([root], rec)
    twin = copy.deepcopy(root)
    owners = [h.__self__ for h in twin._forward_pre_hooks.values()]
    assert owners and all(isinstance(o, EntryHooks) and o.inert for o in owners)
    twin(torch.zeros(1, 2))
    assert rec.log == []
    root(torch.zeros(1, 2))
    assert rec.log == ["enter", "exit"]


# -- through an engine ----------------------------------------------------------------------
class Net(nn.Module):
    """Reads ``gate``'s weight outside ``gate``: only a forward context fetches it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.gate = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 4)
        self.phases: list[Phase] = []
        self.rt: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rt is not None:
            self.phases.append(self.rt.phase)
        h = torch.tanh(self.fc1(x))
        return self.fc2(h + 0.1 * (h @ self.gate.weight.T))


class Wrapper(nn.Module):
    """A PEFT-style wrapper: ``get_base_model()`` is what generate() would call."""

    def __init__(self) -> None:
        super().__init__()
        self.base = Net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x)

    def get_base_model(self) -> nn.Module:
        return self.base


def _cfg(swap: Path, dtype: str = "fp32", accumulation: int = 1) -> outcore.Config:
    return outcore.Config(dtype=dtype, optimizer={"lr": 0.1},
                          gradient_accumulation_steps=accumulation,
                          zero={"persistence_threshold_bytes": 0, "prefetch_bytes": 0},
                          offload={"params": "nvme", "nvme_path": str(swap),
                                   "host_buffer_bytes": 1 << 20})


X = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_direct_call_equals_the_engine_call(tmp_path: Path, dtype: str) -> None:
    torch.manual_seed(0)
    model = Net()
    engine = outcore.initialize(model, _cfg(tmp_path, dtype))
    try:
        model.rt = engine.rt
        direct = model(X)  # fp32 input: the entry hook casts it, as engine(x) does
        via_engine = engine(X)
        assert direct.dtype == via_engine.dtype == engine.dtype
        assert torch.equal(direct, via_engine)
        assert model.phases == [Phase.FORWARD, Phase.FORWARD]
        assert engine.rt.phase is Phase.IDLE
    finally:
        engine.close()


def test_a_peft_like_base_model_called_directly_is_an_engine_call(tmp_path: Path) -> None:
    torch.manual_seed(0)
    wrapper = Wrapper()
    engine = outcore.initialize(wrapper, _cfg(tmp_path))
    try:
        wrapper.base.rt = engine.rt
        inner = wrapper.base(X)  # gate's weight is read outside gate: needs the context
        outer = engine(X)
        assert torch.equal(inner, outer)
        assert wrapper.base.phases == [Phase.FORWARD, Phase.FORWARD]
        assert engine.rt.phase is Phase.IDLE
    finally:
        engine.close()


def test_the_models_zero_grad_starts_the_engines_accumulation_over(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Net()
    engine = outcore.initialize(model, _cfg(tmp_path, accumulation=2))
    try:
        engine.backward(engine(X).pow(2).mean())
        assert engine.micro_steps == 1
        model.zero_grad()
        assert engine.micro_steps == 0
    finally:
        engine.close()
    assert "zero_grad" not in model.__dict__  # close() put torch's method back


def test_at_one_rank_generate_is_left_alone(tmp_path: Path) -> None:
    class Generates(Net):
        def generate(self, **kwargs: Any) -> dict[str, Any]:
            return kwargs

    model = Generates()
    engine = outcore.initialize(model, _cfg(tmp_path))
    try:
        assert engine.world_size == 1
        assert "generate" not in model.__dict__
        assert model.generate() == {}
    finally:
        engine.close()
