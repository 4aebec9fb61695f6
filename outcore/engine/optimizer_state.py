"""``engine.optimizer.state``: the moments in the shards, read and written as torch's ``state``.

[Note: optimizer.state over shards]
Code written for ``torch.optim`` reads ``opt.state[p]["exp_avg"]`` (to log a moment, to check
that a resume loaded one) and writes it (``opt.state[p]["exp_avg"] = torch.zeros_like(...)``
to reset a moment, as ReLoRA-style restarts do). The moments live in the shards, in host
memory or on NVMe, so ``state`` is a view: ``state[p]`` reads ``p``'s step and moments from
its shards when asked, in the layout ``state_dict()`` uses (the parameter's shape at one
rank, this rank's slice at more), and assigning a key writes it through to the shards, as a
``load_state_dict`` of that one entry would. An in-place write on what a read returned
(``state[p]["exp_avg"].zero_()``) would change only a copy, a write lost without a word; so
those copies are ``StateCopy`` tensors, which compute as tensors (new results are plain) and
refuse an in-place write, on themselves, on a view of them (``m[0]``, ``m.view(-1)``,
``m.data``: a view is a ``StateCopy`` too) or through ``out=`` and ``torch._foreach_*``, in
words naming the assignment that works. A parameter the engine has not
updated yet has no state (``p in state`` is False, ``state[p]`` is empty), as in torch.
Every access waits for the updates still running, so it sees what ``step()`` left.
"""

from __future__ import annotations

import copy
import math
import weakref
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any, SupportsIndex

import torch

from outcore.errors import ConfigError, EngineClosedError, ParamAccessError
from outcore.offload.storage import load_now
from outcore.zero.calls import Kind, kind_of
from outcore.zero.registry import managed

if TYPE_CHECKING:
    from outcore.engine.torch_optimizer import TorchOptimizer
    from outcore.optim.optimizer import ShardedOptimizer
    from outcore.zero.param import ShardedParam

_WRITES = (Kind.WRITE, Kind.REFUSED, Kind.DATA_SET)


_NUMPY = (torch.Tensor.numpy, torch.Tensor.__array__)


class StateCopy(torch.Tensor):
    """A copy of one optimizer-state tensor: it computes as a tensor (results are plain
    tensors) and refuses in-place writes, which would be lost (see the note)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Iterable[type], args: tuple = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        first = args[0] if args else None
        targets = [kwargs.get("out")]
        if kind_of(func) in _WRITES:  # an in-place method's target, or a foreach list's
            targets += list(first) if isinstance(first, (list, tuple)) else [first]
        if any(isinstance(t, StateCopy) for t in targets):
            name = getattr(func, "__name__", str(func))
            raise ParamAccessError(
                f"{name} on a copy of optimizer state: outcore keeps the moments in its "
                "shards, so the write would be lost; assign the new value instead "
                "(opt.state[p]['exp_avg'] = torch.zeros_like(opt.state[p]['exp_avg'])), "
                "or load a state dict")
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if (func in _NUMPY and isinstance(first, StateCopy)
                and out.ctypes.data == first.data_ptr()):  # np.asarray(m) too: it shares
            out.flags.writeable = False  # the copy's bytes, so a write there would be lost
            return out
        # a view of a copy (m[0], m.view(-1), m.T, m.data) is one too: a write through it
        # would be as lost as one on the copy
        if (isinstance(out, torch.Tensor) and isinstance(first, StateCopy)
                and out.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                and out.numel() > 0):
            return out.as_subclass(StateCopy)
        return out

    def __reduce_ex__(self, proto: SupportsIndex) -> Any:
        """Saved (``torch.save``) as the plain tensor it copies."""
        return self.as_subclass(torch.Tensor).__reduce_ex__(proto)

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        return self.as_subclass(torch.Tensor).clone()


class ParamOptimizerState(MutableMapping[str, torch.Tensor]):
    """One parameter's ``state`` entry: its step and moments, read from and written to its
    shards (see the note). Each read loads only what it asks for."""

    def __init__(self, facade: TorchOptimizer, sp: ShardedParam | None) -> None:
        self._ref, self._sp = weakref.ref(facade), sp  # None: a parameter it does not update

    @property
    def _facade(self) -> TorchOptimizer:
        return _alive(self._ref)

    def _keys(self) -> list[str]:
        sp, sharded = self._sp, self._facade.sharded()
        if sp is None or sharded.step_of(sp) == 0:
            return []
        factors = sharded.adafactor.factors_of(sp) if sharded.adafactor else {}
        return ["step", *sharded.state[sp].moments, *factors]

    def _read(self, kinds: list[str]) -> dict[str, torch.Tensor]:
        if not kinds:
            return {}
        assert self._sp is not None  # _keys() is empty without it
        sharded = self._facade.sharded()
        out = {"step": torch.tensor(float(sharded.step_of(self._sp)))} if "step" in kinds else {}
        out.update(moments_of(sharded, self._sp, [k for k in kinds if k != "step"]) or {})
        return {k: out[k].as_subclass(StateCopy) for k in kinds}

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys():
            raise KeyError(key)
        return self._read([key])[key]

    def __setitem__(self, key: str, value: Any) -> None:
        keys = self._keys()
        if self._sp is None:
            raise ParamAccessError("optimizer state of a parameter this optimizer does not "
                                   "update (frozen, or not in its parameter groups)")
        if not keys:
            raise ParamAccessError(
                f"optimizer state of parameter {self._sp.label()} before its first update: "
                "outcore makes it at that update; set it after a step, or load a state dict")
        if key not in keys:
            raise ParamAccessError(f"optimizer state of parameter {self._sp.label()} has no "
                                   f"{key!r}; it has {sorted(keys)}")
        step = _whole_step(value) if key == "step" else None
        if key == "step" and step is None:
            raise ParamAccessError(f"optimizer state of parameter {self._sp.label()}: step "
                                   f"{_shown(value)}; outcore counts a parameter's state from "
                                   "its first update, so the step is a whole number, 1 or more")
        new = torch.as_tensor(value).detach()
        engine, sp = self._facade._engine, self._sp
        sharded = engine.sharded_optimizer
        # updates applied during a boundary backward used the moments this replaces: refused
        # as zero_grad() is there; tentative ones are taken back, for step() to redo
        engine._reopen_boundary("an assignment to optimizer state")
        moments = sharded.state[sp].moments
        if step is not None:
            sharded.restore_step(sp, step)
        elif key in moments:  # only this moment is written: the others stay where they are
            checked = _checked_moment(sharded, sp, key, new, saved_world=engine.rt.world_size)
            moments[key].save(_as_shard(sharded, sp, checked)).result()
        else:  # an Adafactor factor (in memory): written with its partner
            assert sharded.adafactor is not None  # _keys() names factors only with it
            sharded.adafactor.load_factors(sp, {**sharded.adafactor.factors_of(sp), key: new})

    def __delitem__(self, key: str) -> None:
        name = self._sp.label() if self._sp is not None else ""
        raise ParamAccessError(f"del on the optimizer state of parameter {name}: "
                               "outcore keeps every moment an update needs; assign new values "
                               "instead")

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    def items(self) -> Any:  # one read of the shards, not one per key (Mapping's default)
        return self._read(self._keys()).items()

    def values(self) -> Any:
        return self._read(self._keys()).values()

    def __repr__(self) -> str:
        return repr(self._read(self._keys()))

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[str, torch.Tensor]:
        """A plain dict of plain tensors (a snapshot), as a copy of torch's entry is."""
        return {k: v.as_subclass(torch.Tensor) for k, v in self.items()}


class OptimizerState(Mapping[torch.Tensor, ParamOptimizerState]):
    """``engine.optimizer.state``: parameter -> its state entry (see the note)."""

    def __init__(self, facade: TorchOptimizer) -> None:
        # weakly: the optimizer a user brought holds this view, and a strong path from it to
        # the engine would keep the model and its swap files alive after both were dropped
        self._ref = weakref.ref(facade)

    @property
    def _facade(self) -> TorchOptimizer:
        return _alive(self._ref)

    def _shard(self, param: object) -> ShardedParam | None:
        sp = managed(param) if isinstance(param, torch.Tensor) else None
        members = self._facade.sharded().state
        return sp if sp is not None and sp in members else None

    def __getitem__(self, param: torch.Tensor) -> ParamOptimizerState:
        """Any parameter's entry, empty where it has no state (torch's ``defaultdict``)."""
        return ParamOptimizerState(self._facade, self._shard(param))

    def __setitem__(self, param: torch.Tensor, entry: Mapping[str, Any]) -> None:
        """``state[p] = {...}`` (as code that moves state between devices writes it): each
        key is assigned, as ``state[p][key] = value``."""
        target = self[param]
        for key, value in dict(entry).items():
            target[key] = value

    def __delitem__(self, param: torch.Tensor) -> None:
        """``del state[p]`` (torch's way to reset a parameter's moments): refused, as
        ``del state[p][key]`` is; outcore keeps what every update needs."""
        self[param].__delitem__("")  # raises ParamAccessError naming the parameter

    def __contains__(self, param: object) -> bool:
        sp = self._shard(param)
        return sp is not None and self._facade.sharded().step_of(sp) > 0

    def get(self, param: torch.Tensor, default: Any = None) -> Any:
        """torch's ``state.get(p)``: None (or ``default``) for a parameter with no state."""
        return self[param] if param in self else default  # noqa: SIM401 - this is get()

    def __iter__(self) -> Iterator[torch.Tensor]:
        sharded = self._facade.sharded()
        return iter([sp.param for members in sharded.members for sp in members
                     if sp.alive and sharded.step_of(sp) > 0])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"OptimizerState({len(self)} parameters with state, in the engine's shards)"

    def __deepcopy__(self, memo: dict[int, Any]) -> defaultdict[torch.Tensor, dict]:
        """A copy (``copy.deepcopy`` of the optimizer holding it) is torch's own: a plain
        ``defaultdict`` of plain tensors, keyed by the copies of the parameters."""
        out: defaultdict[torch.Tensor, dict] = defaultdict(dict)
        for param in self:
            out[copy.deepcopy(param, memo)] = copy.deepcopy(self[param])
        return out

    def __reduce_ex__(self, proto: SupportsIndex) -> Any:
        """Pickled as that copy (``torch.save`` of the optimizer object)."""
        return (_plain_state, ([(p, copy.deepcopy(self[p])) for p in self],))


def _alive(ref: weakref.ref[TorchOptimizer]) -> TorchOptimizer:
    facade = ref()
    if facade is None:
        raise EngineClosedError("optimizer state: the outcore Engine that held it is gone")
    return facade


def _plain_state(items: list[tuple[torch.Tensor, dict]]) -> defaultdict[torch.Tensor, dict]:
    out: defaultdict[torch.Tensor, dict] = defaultdict(dict)
    out.update(items)
    return out


def moments_of(opt: ShardedOptimizer, sp: ShardedParam,
               kinds: Collection[str] | None = None) -> dict[str, torch.Tensor] | None:
    """Copies of ``sp``'s moment shards (fp32, this rank's slice; only ``kinds`` if given),
    or None before its first update (torch keeps no state for a parameter until then)."""
    state = opt.state.get(sp)
    if state is None or state.step == 0:
        return None
    # at one rank a slice is the whole parameter (no padding): torch's own layout, which
    # torch's optimizers, and outcore at any world size, load as they are
    shape = sp.shape if opt.rt.world_size == 1 else (-1,)
    out = {k: load_now(stored, opt.rt.device).clone().view(shape)
           for k, stored in state.moments.items() if kinds is None or k in kinds}
    factors = opt.adafactor.factors_of(sp) if opt.adafactor else {}
    return {**out, **{k: v for k, v in factors.items() if kinds is None or k in kinds}}


def prepared_moments(opt: ShardedOptimizer, sp: ShardedParam, entry: dict,
                     saved_world: int | None) -> Callable[[], None]:
    """Check a torch-style state entry for ``sp`` and return what writes it: its step and
    moments (full-shape moments, any torch optimizer's, are cut into this rank's slice;
    slices, ``moments_of``, are taken as they are from a state dict of the same world size)
    and Adafactor's factors. Every entry of a state dict is checked before any is written,
    so a refused load changes nothing."""
    state = opt.state[sp]
    for kind in state.moments:
        if kind not in entry:
            raise ConfigError(f"optimizer state for {sp.label()} has no {kind!r} "
                              f"({sorted(entry)}); this engine's {opt.kind} needs it")
    # checked now, cut as each is written: holding every cut slice until all are checked
    # would hold a second copy of the whole state dict
    values = {kind: _checked_moment(opt, sp, kind, entry[kind], saved_world)
              for kind in state.moments}
    factors = opt.adafactor.checked_factors(sp, entry) if opt.adafactor is not None else []
    step = _checked_step(opt, sp, entry, state.step)

    def write() -> None:
        for target, value in factors:
            target.copy_(value)
        for kind, t in values.items():
            state.moments[kind].save(_as_shard(opt, sp, t)).result()
        state.step = step
    return write


def prepared_reset(opt: ShardedOptimizer, sp: ShardedParam) -> Callable[[], None]:
    """What loading a state dict that holds no state for ``sp`` writes: none, as torch's
    ``load_state_dict`` leaves a parameter it holds no entry for without state (its moments
    zero, its count from 0: a load of a fresh optimizer's state dict restarts them)."""
    state = opt.state[sp]

    def write() -> None:
        if state.step == 0:
            return  # nothing to take back
        for stored in state.moments.values():
            stored.save(torch.zeros(sp.shard_numel, dtype=torch.float32,
                                    device=opt.rt.device)).result()
        for target in (opt.adafactor.factors_of_live(sp) if opt.adafactor else []):
            target.zero_()
        state.step = 0
    return write


def _checked_step(opt: ShardedOptimizer, sp: ShardedParam, entry: dict, current: int) -> int:
    """The update count an entry holds: a whole number from 1 (outcore counts a parameter's
    state from its first update). Adam's and AdamW's entries always hold one, as torch's do;
    SGD's may not (torch's keeps none): then the count stays, from 1 where the entry brings a
    momentum buffer (the parameter has state now, which ``state_dict()`` must show)."""
    if "step" not in entry:
        if opt.kind in ("adam", "adamw"):
            raise ConfigError(f"optimizer state for {sp.label()} has moments but no 'step' "
                              f"({sorted(entry)}); {opt.kind}'s bias correction needs it")
        return max(current, 1)
    step = _whole_step(entry["step"])
    if step is None:
        raise ConfigError(f"optimizer state 'step' for {sp.label()} is {entry['step']!r}: "
                          "outcore counts a parameter's state from its first update, so the "
                          "step is a whole number from 1")
    return step


def _shown(value: Any) -> str:
    """A step as a message names it: ``tensor(0.)`` as 0."""
    try:
        return f"{float(torch.as_tensor(value).item()):g}"
    except (TypeError, ValueError, RuntimeError):
        return repr(value)


def _whole_step(value: Any) -> int | None:
    """``value`` (a number or a one-element tensor, as torch keeps it) as an update count: a
    whole number from 1; None for anything else."""
    try:
        number = float(torch.as_tensor(value).item()) if not isinstance(value, str) else None
    except (TypeError, ValueError, RuntimeError):
        return None
    if number is None or not math.isfinite(number) or number < 1 or number != int(number):
        return None
    return int(number)


def _as_shard(opt: ShardedOptimizer, sp: ShardedParam, t: torch.Tensor) -> torch.Tensor:
    """A checked moment as this rank's fp32 slice: cut from the parameter's shape, or the
    slice itself."""
    t = t.to(opt.rt.device, torch.float32)
    return sp.layout.cut(t, torch.float32) if tuple(t.shape) == tuple(sp.shape) else t.reshape(-1)


def _checked_moment(opt: ShardedOptimizer, sp: ShardedParam, kind: str, value: Any,
                    saved_world: int | None) -> torch.Tensor:
    """``value`` as a tensor, checked to be moment ``kind`` of ``sp``: real numbers in the
    parameter's shape (cut when written), or this rank's slice saved at the same world size."""
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ConfigError(f"optimizer state {kind!r} for {sp.label()} is not a tensor of "
                          f"numbers ({type(value).__name__}: {e})") from None
    if t.device.type == "meta" or t.is_complex():
        raise ConfigError(f"optimizer state {kind!r} for {sp.label()} is a "
                          f"{'meta' if t.device.type == 'meta' else str(t.dtype)} tensor, "
                          "not real numbers")
    if tuple(t.shape) == tuple(sp.shape) or (
            t.numel() == sp.shard_numel and saved_world == opt.rt.world_size):
        return t
    if saved_world is None:  # torch's own layout (or outcore's with its record dropped)
        raise ConfigError(
            f"optimizer state {kind!r} for {sp.label()} has shape {list(t.shape)}, not the "
            f"parameter's {list(sp.shape)}: the state dict does not belong to this model (a "
            "state dict that outcore saved as slices at more ranks needs its 'outcore' "
            "record, which a torch optimizer's own load_state_dict drops: load it with "
            "engine.optimizer.load_state_dict after outcore.initialize)")
    raise ConfigError(
        f"optimizer state {kind!r} for {sp.label()} has shape {list(t.shape)}: "
        f"neither the parameter's {list(sp.shape)} nor this rank's slice at this world size "
        f"({sp.shard_numel} elements at {opt.rt.world_size}; the state dict was saved at "
        f"{saved_world}); engine.save_checkpoint loads at any world size")
