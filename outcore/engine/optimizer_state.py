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
those copies are ``StateCopy`` tensors, which compute as tensors and refuse in-place writes
in words naming the assignment that works. A parameter the engine has not updated yet has
no state (``p in state`` is False, ``state[p]`` is empty), as in torch.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any, SupportsIndex

import torch

from outcore.errors import ParamAccessError
from outcore.zero.calls import Kind, kind_of
from outcore.zero.registry import managed

if TYPE_CHECKING:
    from outcore.engine.torch_optimizer import TorchOptimizer
    from outcore.zero.param import ShardedParam

_WRITES = (Kind.WRITE, Kind.REFUSED, Kind.DATA_SET)


class StateCopy(torch.Tensor):
    """A copy of one optimizer-state tensor: it computes as a tensor (results are plain
    tensors) and refuses in-place writes, which would be lost (see the note)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Iterable[type], args: tuple = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if kind_of(func) in _WRITES:
            target = kwargs.get("out", args[0] if args else None)
            if isinstance(target, StateCopy):
                name = getattr(func, "__name__", str(func))
                raise ParamAccessError(
                    f"{name} on a copy of optimizer state: outcore keeps the moments in its "
                    "shards, so the write would be lost; assign the new value instead "
                    "(opt.state[p]['exp_avg'] = torch.zeros_like(opt.state[p]['exp_avg'])), "
                    "or load a state dict")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __reduce_ex__(self, proto: SupportsIndex) -> Any:
        """Saved (``torch.save``) as the plain tensor it copies."""
        return self.as_subclass(torch.Tensor).__reduce_ex__(proto)


class ParamOptimizerState(MutableMapping[str, torch.Tensor]):
    """One parameter's ``state`` entry: its step and moments, read from and written to its
    shards (see the note)."""

    def __init__(self, facade: TorchOptimizer, sp: ShardedParam | None) -> None:
        self._facade, self._sp = facade, sp  # None: a parameter it does not update

    def _read(self) -> dict[str, torch.Tensor]:
        from outcore.engine.torch_optimizer import moments_of

        if self._sp is None:
            return {}
        sharded = self._facade._engine.sharded_optimizer
        sharded.wait()
        moments = moments_of(sharded, self._sp)
        if moments is None:
            return {}
        step = torch.tensor(float(sharded.step_of(self._sp)))
        return {k: v.as_subclass(StateCopy) for k, v in {"step": step, **moments}.items()}

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._read()[key]

    def __setitem__(self, key: str, value: Any) -> None:
        from outcore.engine.torch_optimizer import load_moments

        entry = self._read()
        if self._sp is None:
            raise ParamAccessError("optimizer state of a parameter this optimizer does not "
                                   "update (frozen, or not in its parameter groups)")
        if not entry:
            raise ParamAccessError(
                f"optimizer state of parameter {self._sp.label()} before its first update: "
                "outcore makes it at that update; set it after a step, or load a state dict")
        if key not in entry:
            raise ParamAccessError(f"optimizer state of parameter {self._sp.label()} has no "
                                   f"{key!r}; it has {sorted(entry)}")
        entry[key] = torch.as_tensor(value).detach()
        if key == "step" and float(entry[key]) < 1:
            raise ParamAccessError(f"optimizer state of parameter {self._sp.label()}: step "
                                   f"{float(entry[key]):g}; outcore counts a parameter's state "
                                   "from its first update, so the step is 1 or more")
        sharded = self._facade._engine.sharded_optimizer
        sharded.take_back_tentative()  # they came from the moments this replaces: step() redoes
        load_moments(sharded, self._sp, entry, saved_world=self._facade._engine.rt.world_size)

    def __delitem__(self, key: str) -> None:
        name = self._sp.label() if self._sp is not None else ""
        raise ParamAccessError(f"del on the optimizer state of parameter {name}: "
                               "outcore keeps every moment an update needs; assign new values "
                               "instead")

    def __iter__(self) -> Iterator[str]:
        return iter(self._read())

    def __len__(self) -> int:
        return len(self._read())

    def __repr__(self) -> str:
        return repr(self._read())


class OptimizerState(Mapping[torch.Tensor, ParamOptimizerState]):
    """``engine.optimizer.state``: parameter -> its state entry (see the note)."""

    def __init__(self, facade: TorchOptimizer) -> None:
        self._facade = facade

    def _shard(self, param: object) -> ShardedParam | None:
        sp = managed(param) if isinstance(param, torch.Tensor) else None
        members = self._facade._engine.sharded_optimizer.state
        return sp if sp is not None and sp in members else None

    def __getitem__(self, param: torch.Tensor) -> ParamOptimizerState:
        """Any parameter's entry, empty where it has no state (torch's ``defaultdict``)."""
        return ParamOptimizerState(self._facade, self._shard(param))

    def __contains__(self, param: object) -> bool:
        sp = self._shard(param)
        return sp is not None and self._facade._engine.sharded_optimizer.step_of(sp) > 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        sharded = self._facade._engine.sharded_optimizer
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
            out[copy.deepcopy(param, memo)] = {k: v.as_subclass(torch.Tensor)
                                               for k, v in self[param].items()}
        return out

    def __reduce_ex__(self, proto: SupportsIndex) -> Any:
        """Pickled as that copy (``torch.save`` of the optimizer object)."""
        return (_plain_state, ([(p, dict(self[p])) for p in self],))


def _plain_state(items: list[tuple[torch.Tensor, dict]]) -> defaultdict[torch.Tensor, dict]:
    out: defaultdict[torch.Tensor, dict] = defaultdict(dict)
    out.update(items)
    return out
