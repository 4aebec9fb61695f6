"""``engine.optimizer``: the engine's sharded optimizer as code written for ``torch.optim`` sees it.

[Note: torch's optimizer contract over shards]
Learning-rate schedulers, Hugging Face's Trainer and user loops talk to an optimizer through
a small contract: ``isinstance(opt, torch.optim.Optimizer)``, ``defaults`` with the
hyper-parameters, ``param_groups`` whose dicts hold ``"params"`` (the user's parameters) and
``"lr"`` & co., ``step()``, ``zero_grad()``, ``state_dict()`` / ``load_state_dict()`` and the
step hooks. ``TorchOptimizer`` is a real ``torch.optim.Optimizer`` built over the engine's own
param-group dicts (torch's constructor adopts the dicts it is given), so an edit of
``param_groups[i]["lr"]`` by any scheduler is what the next update of the shards uses.
``step()`` is ``engine.step()``. The state (moments, step counts) lives in the shards;
``state_dict()`` carries it in fp32, at one rank in torch's own layout (each moment in its
parameter's shape), at more as this rank's slices (``"outcore"`` records the world size and
rank), with indices counting every parameter of a group, frozen ones too, as torch's do.
``load_state_dict()`` takes slices back on the rank and world size that saved them, and
full-shape moments (a plain ``torch.optim`` state dict) at any world size.

[Note: the optimizer a user brought answers for the engine]
A user who passes a torch optimizer (``initialize(model, cfg, optimizer=opt)``) keeps calling
it: ``opt.zero_grad()``, ``opt.step()``, ``opt.state_dict()`` for a checkpoint. Its own
methods would find no ``p.grad`` (gradients live in the shards) and an empty state, so the
loop would not train and the checkpoint would hold no moments, without a word. While an
engine holds it, those methods (``STANDS_IN``) are instance attributes that call this facade
(``adopt``, after taking any state it holds into the shards); the class stays untouched,
and a torch scheduler bound to it, made before or after, sees it stepped (the facade marks
it, as the scheduler's own wrapper of ``step`` would).
``close()``, or a newer engine taking the model, puts back what was there (``step_aside``).
The moments stay the engine's: after ``close()`` the optimizer starts empty, as a new one
would.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from outcore.engine.optimizer_state import (
    OptimizerState,
    moments_of,
    prepared_moments,
    prepared_reset,
)
from outcore.errors import ConfigError, EngineClosedError
from outcore.optim.param_groups import TORCH_GROUP_KEYS, check_loaded_group

if TYPE_CHECKING:
    from outcore.engine.core import Engine
    from outcore.optim.optimizer import ShardedOptimizer
    from outcore.zero.param import ShardedParam


class TorchOptimizer(torch.optim.Optimizer):
    """The engine's optimizer with ``torch.optim.Optimizer``'s contract (see the note)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._built = False
        self.skipped = False  # the last step() changed nothing (fp16 overflow, or no boundary)
        super().__init__(engine.sharded_optimizer.param_groups, dict(engine.optimizer_defaults))
        self.state = OptimizerState(self)  # type: ignore[assignment]  # optimizer_state.py
        self._built = True

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """The engine's update (``engine.step()`` runs it through here); a ``closure`` is
        called first (it runs forward and backward), and its loss returned, as with torch
        optimizers."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.skipped = not self._engine._update()
        # what a scheduler bound to either checks (torch's lr_scheduler); the adopted
        # optimizer's step runs this one past the wrapper a scheduler put on it
        self._opt_called = True
        adopted = self._engine.adopted_optimizer  # param_groups.py's adopting note
        if adopted is not None:
            adopted._opt_called = True
        return loss

    def sharded(self) -> ShardedOptimizer:
        """The engine's sharded optimizer, its running updates finished (``state``'s reads)."""
        self._engine._check_open()
        self._engine.sharded_optimizer.wait()
        return self._engine.sharded_optimizer

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``engine.zero_grad()``: drop the gradients accumulated since the last step (the
        engine's shards). Refused between a boundary backward that already applied the updates
        (optimizer.py's [Note: updating during backward]) and ``step()``."""
        self._engine.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adopts the engine's group dicts while torch's constructor runs; refused after.
        (torch's own version is wrapped to import TorchDynamo, a second of start-up that
        these ready-made groups do not need.)"""
        if self._built:
            raise ConfigError("outcore builds its optimizer's parameter groups when the engine "
                              "is made; pass them as outcore.initialize(model, cfg, "
                              "param_groups=[...]) (to train parameters added later: "
                              "engine.close() and initialize again)")
        for key, value in self.defaults.items():
            param_group.setdefault(key, value)
        self.param_groups.append(param_group)

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's layout (see ``_state_dict``), between this optimizer's state-dict hooks as
        torch runs them: a post-hook may return the dict to give instead."""
        return hooked_state_dict(self, self._state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict`` (see ``_load_state_dict``) between this optimizer's load hooks
        as torch runs them: each pre-hook gets a shallow copy and may return another dict."""
        hooked_load(self, state_dict, self._load_state_dict)

    def _state_dict(self) -> dict[str, Any]:
        """torch's layout: ``state`` by parameter index (``step`` and each fp32 moment, in
        the parameter's shape at one rank, else this rank's slice), ``param_groups`` with
        indices for ``params`` (see the note)."""
        self._engine._check_open()  # closed, or handed over: its shards are gone or another's
        sharded = self._engine.sharded_optimizer
        sharded.wait()
        index, state, groups = 0, {}, []
        for group, members in zip(self.param_groups, sharded.members, strict=True):
            ids = []
            for sp in _slots(group, members):  # every parameter of the group, as torch's
                moments = None if sp is None else moments_of(sharded, sp)
                if sp is not None and moments is not None:
                    state[index] = {"step": torch.tensor(float(sharded.step_of(sp))), **moments}
                ids.append(index)
                index += 1
            groups.append({**TORCH_GROUP_KEYS.get(self._engine.cfg.optimizer.type, {}),
                           **{k: v for k, v in group.items() if k != "params"}, "params": ids})
        rt = self._engine.rt
        return {"state": state, "param_groups": groups,
                "outcore": {"world_size": rt.world_size, "rank": rt.rank}}

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Every entry is checked before any is written, so a refused load changes nothing;
        at more ranks a refusal on one is a refusal on all, as the ranks must stay alike."""
        self._engine._check_open()  # a closed engine's ranks agree on nothing any more
        try:
            writes, groups = self._prepared(state_dict)
            error: Exception | None = None
        except Exception as e:  # noqa: BLE001 - raised below, once every rank knows
            writes, groups, error = [], [], e
        # every rank reaches this, refused or not: no one waits alone
        self._engine.rt.comm.raise_together(error, ConfigError(
            "optimizer load_state_dict() was refused on another rank (its error says why); "
            "this rank loaded nothing either"))
        for write in writes:
            write()
        for mine, saved in zip(self.param_groups, groups, strict=True):
            mine.update({k: v for k, v in saved.items() if k != "params"})

    def _prepared(self, state_dict: dict[str, Any]
                  ) -> tuple[list[Callable[[], None]], list[dict[str, Any]]]:
        """What loading ``state_dict`` writes, every part of it checked; and its groups."""
        sharded = self._engine.sharded_optimizer
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(self.param_groups):
            raise ConfigError(f"optimizer state_dict has {len(groups or [])} param groups; "
                              f"this engine has {len(self.param_groups)}")
        # each saved group numbers all of its parameters (torch, outcore since frozen ones
        # count), or its trainable ones only (outcore before)
        slots = []
        for i, (mine, members, saved) in enumerate(zip(self.param_groups, sharded.members,
                                                        groups, strict=True)):
            every, n = _slots(mine, members), len(saved.get("params", []))
            if n not in (len(every), len(members)):
                raise ConfigError(f"optimizer state_dict's param group {i} holds {n} "
                                  f"parameters; this engine's holds {len(every)} "
                                  f"({len(members)} of them trainable)")
            slots.append(every if n == len(every) else list(members))
            check_loaded_group(i, saved)
        sharded.wait()
        # updates of a boundary backward came from the moments this replaces: tentative ones
        # are taken back for step() to redo; ones applied for good refuse it (as zero_grad())
        self._engine._reopen_boundary("optimizer load_state_dict()")
        origin = state_dict.get("outcore") or {}
        world = origin.get("world_size")
        if world == self._engine.rt.world_size > 1 and origin.get("rank") != self._engine.rt.rank:
            raise ConfigError(f"optimizer state_dict holds rank {origin.get('rank')}'s slices; "
                              f"this is rank {self._engine.rt.rank}: each rank loads the "
                              "state dict it saved (engine.save_checkpoint loads at any rank)")
        saved_state = state_dict.get("state", {})
        writes = []
        for group_slots, saved in zip(slots, groups, strict=True):
            for sp, key in zip(group_slots, saved["params"], strict=True):
                entry = saved_state.get(key)
                if sp is not None and entry:
                    writes.append(prepared_moments(sharded, sp, entry, saved_world=world))
                elif sp is not None:  # torch leaves it without state: so does outcore
                    writes.append(prepared_reset(sharded, sp))
        return writes, groups

    def __repr__(self) -> str:
        hp = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return f"{type(self).__name__}({self._engine.cfg.optimizer.type}, {hp})"

    def __reduce_ex__(self, proto: Any) -> Any:
        """Pickled or deep-copied, it is what torch's own copy of an optimizer is: a plain
        ``torch.optim`` optimizer of the engine's type with the same hyper-parameters and
        state, over copies of the parameters (``copy.deepcopy((model, opt))`` keeps the two
        together, as in torch). The engine and its shards stay behind."""
        engine = self._engine
        kind = engine.cfg.optimizer.type
        if kind not in _PLAIN:
            raise ConfigError(f"a copy of engine.optimizer ({kind}) would need outcore's "
                              f"{kind}, which runs only in an engine; save "
                              "engine.optimizer.state_dict() or a checkpoint instead")
        if engine.rt.world_size > 1:
            raise ConfigError("a copy of engine.optimizer at more than one rank: each rank "
                              "holds a slice of every moment; save a checkpoint "
                              "(engine.save_checkpoint) or each rank's state_dict() instead")
        sharded = self.sharded()  # open, its running updates finished
        if sharded.updated_this_round:
            raise ConfigError("a copy of engine.optimizer between a backward that already "
                              "applied its updates and step() would hold this step's moments "
                              "with the parameters before it; copy it after step()")
        return (_plain_optimizer, (kind, [dict(g) for g in self.param_groups], self.state))

    def __copy__(self) -> Any:
        raise ConfigError("a shallow copy of engine.optimizer would share the engine's "
                          "parameters and state with a plain optimizer; use copy.deepcopy "
                          "(with the model: copy.deepcopy((model, engine.optimizer)))")


_PLAIN = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}


def _plain_optimizer(kind: str, groups: list[dict[str, Any]], state: dict
                     ) -> torch.optim.Optimizer:
    """A copy of ``engine.optimizer`` (``TorchOptimizer.__reduce_ex__``), made plain. Its state
    goes in through torch's own ``load_state_dict``, which casts the moments to each copied
    parameter's dtype (bf16 ones with a bf16 model), as torch would have them."""
    opt = _PLAIN[kind](groups)
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    opt.load_state_dict({
        "state": {index[id(p)]: entry for p, entry in state.items()},
        "param_groups": [{**g, "params": [index[id(p)] for p in g["params"]]}
                         for g in opt.param_groups]})
    return opt


def _slots(group: dict[str, Any], members: list[ShardedParam]) -> list[ShardedParam | None]:
    """Each parameter of a torch group dict in its order: its shard if it trains (a member),
    None if frozen, so state indices count every parameter as torch's optimizers do."""
    by_param = {id(sp.param): sp for sp in members}
    return [by_param.get(id(p)) for p in group["params"]]


STANDS_IN = ("step", "zero_grad", "state_dict", "load_state_dict", "add_param_group")
_SAVED = "_outcore_saved_methods"  # what the adopted optimizer had as instance attributes


def adopt(adopted: torch.optim.Optimizer, facade: TorchOptimizer) -> None:
    """Load the state ``adopted`` holds (a loaded state dict) into the shards, then make its
    ``STANDS_IN`` methods call ``facade`` (see the note)."""
    step_aside(adopted)  # an engine that was not closed may still be standing in
    if adopted.state:
        facade.load_state_dict(adopted.state_dict())
        adopted.state.clear()  # the shards hold it now; a copy would go stale and take memory
    saved = {name: adopted.__dict__[name] for name in (*STANDS_IN, "state")
             if name in adopted.__dict__}
    ref = weakref.ref(facade)  # weakly, as everything reachable from the user's objects
    for name in STANDS_IN:
        setattr(adopted, name, types.MethodType(_calling(ref, name), adopted))
    adopted.state = facade.state  # type: ignore[assignment]  # optimizer_state.py's note
    setattr(adopted, _SAVED, saved)


def _facade_step(facade: TorchOptimizer, *args: Any, **kwargs: Any) -> Any:
    """The facade's ``step`` within the hooks registered on it (``engine.optimizer``'s), not
    the global ones: the wrapper torch puts on its class would run those a second time."""
    step = type(facade).step
    raw = getattr(step, "__wrapped__", step)
    return _hooked(facade, list(facade._optimizer_step_pre_hooks.values()),
                   list(facade._optimizer_step_post_hooks.values()),
                   lambda *a, **k: raw(facade, *a, **k), args, kwargs)


def _hooked(opt: torch.optim.Optimizer, pres: list[Callable[..., Any]],
            posts: list[Callable[..., Any]], run: Callable[..., Any],
            args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``run(*args, **kwargs)`` between step hooks as torch runs them: each given ``opt`` and
    the call's arguments (``opt`` first); a pre-hook may return new ones."""
    full = (opt, *args)
    for pre in pres:
        changed = pre(opt, full, kwargs)
        if changed is not None:
            full, kwargs = changed
    out = run(*full[1:], **kwargs)
    for post in posts:
        post(opt, full, kwargs)
    return out


def hooked_state_dict(opt: torch.optim.Optimizer,
                      run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``run()``'s state dict between ``opt``'s state-dict hooks, as torch's
    ``Optimizer.state_dict`` runs them."""
    for pre in list(opt._optimizer_state_dict_pre_hooks.values()):
        pre(opt)
    state_dict = run()
    for post in list(opt._optimizer_state_dict_post_hooks.values()):
        changed = post(opt, state_dict)
        state_dict = state_dict if changed is None else changed
    return state_dict


def hooked_load(opt: torch.optim.Optimizer, state_dict: dict[str, Any],
                run: Callable[[dict[str, Any]], None]) -> None:
    """``run(state_dict)`` between ``opt``'s load hooks, as torch's
    ``Optimizer.load_state_dict`` runs them (the pre-hooks get a shallow copy)."""
    if not isinstance(state_dict, dict):
        raise ConfigError(f"optimizer load_state_dict() takes the dict that state_dict() "
                          f"gives; got a {type(state_dict).__name__}")
    state_dict = state_dict.copy()
    for pre in list(opt._optimizer_load_state_dict_pre_hooks.values()):
        changed = pre(opt, state_dict)
        state_dict = state_dict if changed is None else changed
    run(state_dict)
    for post in list(opt._optimizer_load_state_dict_post_hooks.values()):
        post(opt)


def step_aside(adopted: torch.optim.Optimizer | None) -> None:
    """Give ``adopted`` back the methods it had before ``adopt``."""
    saved = None if adopted is None else adopted.__dict__.pop(_SAVED, None)
    if adopted is None or saved is None:
        return
    for name in (*STANDS_IN, "state"):
        adopted.__dict__.pop(name, None)
    adopted.__dict__.update(saved)


def _calling(ref: weakref.ref[TorchOptimizer], name: str) -> Callable[..., Any]:
    def call(this: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        facade = ref()
        if facade is None:
            raise EngineClosedError(f"{type(this).__name__}.{name}(): the outcore Engine that "
                                    "adopted this optimizer is gone")
        if name == "state_dict":  # the adopted optimizer's hooks around the facade's own
            return hooked_state_dict(this, lambda: facade.state_dict(*args, **kwargs))
        if name == "load_state_dict" and (args or "state_dict" in kwargs):
            given = args[0] if args else kwargs.pop("state_dict")
            return hooked_load(this, given,
                               lambda sd: facade.load_state_dict(sd, *args[1:], **kwargs))
        if name != "step":
            return getattr(facade, name)(*args, **kwargs)
        # step hooks run around it as torch runs them (Optimizer.profile_hook_step): torch's
        # global ones and the adopted optimizer's, in torch's order, each given the adopted
        # optimizer; inside them engine.optimizer's own, given it (the global ones once)
        pres = [*_global_optimizer_pre_hooks.values(), *this._optimizer_step_pre_hooks.values()]
        posts = [*this._optimizer_step_post_hooks.values(),
                 *_global_optimizer_post_hooks.values()]
        return _hooked(this, pres, posts, lambda *a, **k: _facade_step(facade, *a, **k), args,
                       kwargs)

    call.__name__ = call.__qualname__ = name
    if name == "step":  # torch's schedulers need not wrap it: the facade's step() marks
        call._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # `adopted` stepped
    return call
