"""Where surface.py's dispatch does more than run the call: reads from and writes to the
shards, views that remember their parameter, refusals. Each function here is entered from
``__torch_function__`` of a sharded parameter or a ``ParamView`` (surface.py's [Note: a
sharded parameter answers every call]) and ends in one call of the torch function on plain
tensors, or in a ``ParamAccessError``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple, SupportsIndex, TypeAlias, TypeVar, final

import torch
from torch import nn
from torch._C import DisableTorchFunctionSubclass

from outcore.errors import ParamAccessError
from outcore.runtime.phase import Phase
from outcore.zero import calls, finer, forward_writes, registry, shared_reads
from outcore.zero.calls import (
    CPU,
    CUDA,
    DATA_SET,
    DETACH,
    TO,
    Args,
    Kind,
    Kwargs,
    dtype_refusal,
    is_live,
    kind_of,
    local_write,
    refuse_new_parameter,
    shape_refusal,
    storage_refusal,
)
from outcore.zero.state import HAS_VALUES, USER_OWNED, ParamState
from outcore.zero.wrappers import unengined_read, wrapped_read

if TYPE_CHECKING:
    from outcore.zero.param import ShardedParam

DRESSED: set[type[nn.Parameter]] = set()
"""The sharded parameter classes (surface.py's ``dress`` adds them)."""

Chain: TypeAlias = tuple[tuple[Any, Args, Kwargs, int | None], ...]  # see ParamView
_R = TypeVar("_R")


def raw(func: Callable[..., _R], args: Args, kwargs: Kwargs) -> _R:
    """Run ``func`` on the tensors as torch keeps them, past every dispatch of ours."""
    with DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def raw_data(param: torch.Tensor) -> torch.Tensor:
    """``param.data`` as torch keeps it (outcore's own use)."""
    with DisableTorchFunctionSubclass():
        return param.data


@final  # Touch tells a view from a parameter by ``type(obj) is ParamView``
class ParamView(torch.Tensor):
    """A view of a sharded parameter that holds no bytes, only how it was cut from it.

    ``source``: the parameter; ``chain``: the view calls from it, each ``(func, rest of the
    arguments, kwargs, index of the output or None)``; ``detached``: it came through
    ``.data``, so writes through it are not autograd's business (as with ``.data``)."""

    source: nn.Parameter
    chain: Chain
    detached: bool

    @staticmethod
    def __new__(cls, source: nn.Parameter, chain: Chain, detached: bool,
                geometry: torch.Tensor) -> ParamView:
        view = torch.Tensor._make_wrapper_subclass(
            cls, geometry.size(), strides=geometry.stride(),
            storage_offset=geometry.storage_offset(), dtype=geometry.dtype,
            device=source.device, requires_grad=False)
        view.source, view.chain, view.detached = source, chain, detached
        return view

    @classmethod
    def __torch_function__(cls, func: Any, types: Iterable[type], args: Args = (),
                           kwargs: Kwargs | None = None) -> Any:
        kwargs = kwargs or {}
        kind = kind_of(func)
        if kind is Kind.META:
            return raw(func, args, kwargs)
        refuse_new_parameter(func, args)
        return handle(kind, func, args, kwargs, touched(args, kwargs))

    @classmethod  # torch's stub makes Tensor's default a plain method, hence the ignore
    def __torch_dispatch__(cls, func: Any, types: Iterable[type],  # type: ignore[override]
                           args: Args = (), kwargs: Kwargs | None = None) -> Any:
        if func.overloadpacket.__name__ in calls.ALLOCATING:  # zeros_like(p.data), new_full
            return calls.allocate_like(func, args, kwargs or {}, ParamView)
        raise ParamAccessError(
            f"{func} reached a view of a sharded parameter below torch's Python layer; wrap "
            "the code in engine.gathered_parameters() to give it the full tensor")

    def __reduce_ex__(self, proto: SupportsIndex) -> str | tuple[Any, ...]:
        with torch.no_grad():  # the ignore: torch leaves Tensor.__reduce_ex__ unannotated
            return DETACH(self).__reduce_ex__(proto)  # type: ignore[no-untyped-call, no-any-return]


class Touch(NamedTuple):
    """A sharded parameter or view among a call's arguments: its ShardedParam (None once
    handed back) and the view calls from the parameter (``()`` for the parameter)."""

    obj: nn.Parameter | ParamView
    sp: ShardedParam | None
    chain: Chain

    @property
    def param(self) -> nn.Parameter:
        return self.obj.source if type(self.obj) is ParamView else self.obj

    @property
    def detached(self) -> bool:
        return type(self.obj) is ParamView and self.obj.detached


def touched(args: Args, kwargs: Kwargs) -> list[Touch]:
    """The sharded parameters and views among ``args`` and ``kwargs`` (and lists of them)."""
    out: list[Touch] = []
    for a in (*args, *kwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            cls = type(t)
            if cls in DRESSED:
                sp = registry.managed(t)
                if sp is not None:
                    out.append(Touch(t, sp, ()))
            elif cls is ParamView:
                out.append(Touch(t, registry.managed(t.source), t.chain))
    return out


# -- entry ------------------------------------------------------------------------------------
def handle(kind: Kind, func: Any, args: Args, kwargs: Kwargs, found: list[Touch]) -> Any:
    """The slow path of ``surface.dispatch``: decide by kind and state."""
    if not found:
        return raw(func, args, kwargs)
    if kind is Kind.DATA_GET:
        return _data_get(found[0])
    if kind is Kind.DATA_SET:
        return _data_set(args[0], args[1], found)
    if kind is Kind.REPR:
        return _repr(func, args, kwargs, found)
    target = _target(kind, args, kwargs)
    mine = next((t for t in found if t.obj is target), None) if target is not None else None
    if kind is Kind.REFUSED and mine is not None:
        if mine.sp is not None and (mine.sp.state not in USER_OWNED or mine.chain):
            raise ParamAccessError(storage_refusal(_name(func), mine.sp.label()))
        return _run(func, args, kwargs, {id(mine.obj): _resolve(mine)})
    if mine is not None:
        return _write(func, args, kwargs, mine, [t for t in found if t is not mine])
    return _read(func, args, kwargs, found)


def _target(kind: Kind, args: Args, kwargs: Kwargs) -> object:
    out = kwargs.get("out")
    if isinstance(out, torch.Tensor):
        return out
    if kind not in (Kind.WRITE, Kind.REFUSED):
        return None
    keyed = (kwargs[key] for key in ("tensor", "input", "self") if key in kwargs)
    return args[0] if args else next(keyed, None)


def _run(func: Any, args: Args, kwargs: Kwargs, values: dict[int, torch.Tensor]) -> Any:
    """``func`` with each touched object replaced by its value (keyed by ``id``)."""
    def sub(a: Any) -> Any:
        if isinstance(a, (list, tuple)) and any(id(x) in values for x in a):
            return type(a)(values.get(id(x), x) for x in a)
        return values.get(id(a), a)

    return raw(func, tuple(sub(a) for a in args), {k: sub(v) for k, v in kwargs.items()})


def _name(func: Any) -> str:
    return getattr(func, "__name__", repr(func))


def _resolve(t: Touch) -> torch.Tensor:
    """The plain tensor ``t`` stands for, where it holds its values in place."""
    return apply_chain(raw_data(t.param), t.chain)


def _values_of(found: list[Touch]) -> dict[int, torch.Tensor]:
    """The values each touched object stands for, keyed by ``id`` (for ``_run``)."""
    return {id(t.obj): _value(t)[0] for t in found}


def _geometry(sp: ShardedParam, chain: Chain) -> torch.Tensor:
    """A meta tensor with the shape, strides and offset of ``chain`` cut from ``sp``."""
    return apply_chain(torch.empty(sp.shape, dtype=sp.dtype, device="meta"), chain)


def apply_chain(base: torch.Tensor, chain: Chain) -> torch.Tensor:
    for func, rest, kw, index in chain:
        base = raw(func, (base, *rest), kw)
        if index is not None:
            base = base[index]
    return base


# -- reads ------------------------------------------------------------------------------------
def _read(func: Any, args: Args, kwargs: Kwargs, found: list[Touch]) -> Any:
    first = args[0] if args else None
    if len(found) == 1 and found[0].obj is first and found[0].sp is not None:
        same = _same_object(func, found[0], args, kwargs)
        if same is not None:
            return same
        if func is not DETACH:
            view = _view(func, args, kwargs, found[0])
            if view is not None:
                return view
    if (view := shared_reads.kept(func, found)) is not None:  # shared_reads.py's note
        return finer.noted(func, found, view)
    values, borrowed = {}, []
    for t in found:
        values[id(t.obj)], fresh = _value(t)
        borrowed += [] if fresh else [values[id(t.obj)]]
    out = _own(_run(func, args, kwargs, values), borrowed)
    return shared_reads.keep(func, found, finer.noted(func, found, out))


def _value(t: Touch) -> tuple[torch.Tensor, bool]:
    """(the values ``t`` stands for, whether that tensor is new, owned by nobody else)."""
    sp = t.sp
    if sp is None:
        return _resolve(t), False
    check_readable(sp)
    if sp.state is ParamState.FETCHING:
        assert sp.group is not None  # only a group's fetch makes a parameter FETCHING
        sp.group.wait_unshard()  # one rank: finishing the reads is local
    copy = sp.state is ParamState.GATHERED and sp.group is not None and sp.group.zero_copy
    if copy and sp.rt.phase is Phase.IDLE:  # updates write it in place (build.py's note)
        sp.check_values()
    # a full tensor gathered before this backward's updates ran (a carried head) is stale
    # until step() refreshes it: outside a forward, read the updated shards instead
    stale = (not copy and sp.rt.phase is Phase.IDLE and sp.rt.updated_in_backward())
    if sp.state in HAS_VALUES and not stale and not (copy and sp.rt.is_tentative(sp)):
        base, fresh = raw_data(sp.param), False
    else:  # (a tentative update shows in the copy: read_value reads the master as it was)
        base, fresh = sp.read_value(), True
    param = t.param
    if not t.chain and not t.detached and torch.is_grad_enabled() and param.requires_grad:
        tmp = (base if fresh else base.clone()).detach().requires_grad_()
        _route_grad(tmp, param)
        return tmp, True
    return apply_chain(base, t.chain), fresh


def _own(out: Any, borrowed: list[torch.Tensor]) -> Any:
    """Copy results that alias a parameter's full tensor: it may be released after."""
    if not borrowed:
        return out
    keys = {b.untyped_storage()._cdata for b in borrowed}
    if isinstance(out, torch.Tensor) and out.untyped_storage()._cdata in keys:
        return out.clone()
    if isinstance(out, (tuple, list)):
        return type(out)(_own(o, borrowed) for o in out)
    return out


def _route_grad(tmp: torch.Tensor, param: nn.Parameter) -> None:
    """Gradients reaching ``tmp`` (a read outside the forward, e.g. a penalty term) go to
    ``param.grad``, where the engine's backward reduces them as any other."""
    def hook(t: torch.Tensor) -> None:
        g, t.grad = t.grad, None
        assert g is not None  # the hook runs once the gradient has been accumulated
        with DisableTorchFunctionSubclass():
            param.grad = g if param.grad is None else param.grad + g

    tmp.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]  # in torch


def readable(sp: ShardedParam) -> bool:
    """Whether this process alone can read ``sp``'s values now. At more ranks only what the
    user holds is read between steps, whatever happens to be gathered (a small group kept
    for the next forward): the rule must not depend on a parameter's size."""
    if sp.state is ParamState.DROPPED:
        return False
    return sp.rt.world_size == 1 or sp.state in USER_OWNED or (
        sp.state in HAS_VALUES and sp.rt.phase is not Phase.IDLE)


def check_readable(sp: ShardedParam) -> None:
    """Raise outcore's error where a read cannot be served from this process alone."""
    if sp.state is ParamState.DROPPED:
        raise ParamAccessError(dropped_message(sp))
    if not readable(sp):
        raise ParamAccessError(wrapped_read(sp.label()) or unengined_read(sp) or (
            f"reading parameter {sp.label()} outside the forward at world size "
            f"{sp.rt.world_size}: its values are spread over the ranks, and gathering them is "
            "a collective every rank must join; read it inside `with "
            "engine.gathered_parameters([p]):` (or outcore.gathered_parameters(model)) on every "
            "rank, or save with engine.save_checkpoint / OutcoreTrainer.save_model"))


def dropped_message(sp: ShardedParam) -> str:
    return (f"parameter {sp.label()} has no values: its engine closed without keeping them "
            "(close(keep_values=False), an error, or a model too large for memory); keep them "
            "with engine.close(keep_values=True), or save before closing "
            "(engine.save_checkpoint + outcore.consolidate) and load them back with "
            "model.load_state_dict(...) or outcore.load_pretrained(model, folder)")


def _same_object(func: Any, t: Touch, args: Args, kwargs: Kwargs) -> torch.Tensor | None:
    """``t.obj`` itself for a move to the device and dtype it already has (``model.to``)."""
    obj, rest = t.obj, args[1:]
    if func is TO:
        if kwargs.get("copy"):
            return None
        try:
            device, dtype, _, fmt = torch._C._nn._parse_to(*rest, **kwargs)
        except (TypeError, RuntimeError):
            return None
        if fmt not in (None, torch.preserve_format):
            return None
    elif func is CPU:
        device, dtype = torch.device("cpu"), None
    elif func is CUDA:
        index = rest[0] if rest else kwargs.get("device")
        device = (torch.device("cuda", torch.cuda.current_device()) if index is None
                  else torch.device("cuda", index) if isinstance(index, int)
                  else torch.device(index))
        dtype = None
    else:
        return None
    return obj if calls.already_on(obj, device) and dtype in (None, obj.dtype) else None


def _view(func: Any, args: Args, kwargs: Kwargs, t: Touch) -> object:
    """A ``ParamView`` (or several) if ``func`` returns views of ``t``; else None. Found by
    running ``func`` on a meta tensor of ``t``'s geometry and seeing what shares its storage."""
    assert t.sp is not None  # _read asks only for a parameter outcore still manages
    meta = _geometry(t.sp, t.chain)
    try:
        out = raw(func, (meta, *args[1:]), kwargs)
    except Exception:  # noqa: BLE001 - not runnable on meta: read the values instead
        return None
    if out is meta:
        return t.obj
    key = meta.untyped_storage()._cdata
    def shares(o: object) -> bool:
        return isinstance(o, torch.Tensor) and o.untyped_storage()._cdata == key

    rest = args[1:]
    if shares(out):
        return ParamView(t.param, (*t.chain, (func, rest, kwargs, None)), t.detached, out)
    if isinstance(out, (tuple, list)) and out and all(shares(o) for o in out):
        return type(out)(ParamView(t.param, (*t.chain, (func, rest, kwargs, i)), t.detached, o)
                         for i, o in enumerate(out))
    return None


def _data_get(t: Touch) -> torch.Tensor:
    sp = t.sp
    if sp is None or (not t.chain and sp.state in HAS_VALUES and (
            sp.state in USER_OWNED or sp.rt.phase is not Phase.IDLE or is_live(sp))):
        return forward_writes.data(sp, t.obj) if sp is not None else _resolve(t).detach()
    if sp.state is ParamState.DROPPED:
        raise ParamAccessError(dropped_message(sp))
    return ParamView(t.param, t.chain, True, _geometry(sp, t.chain))


def _repr(func: Any, args: Args, kwargs: Kwargs, found: list[Touch]) -> Any:
    t = found[0]
    sp = t.sp
    if sp is not None and not readable(sp):
        what = ("values dropped when its engine closed" if sp.state is ParamState.DROPPED else
                f"sharded over {sp.rt.world_size} ranks; read it inside "
                "engine.gathered_parameters()")
        text = f"tensor(<{sp.label()}: {list(t.obj.shape)} {t.obj.dtype}, {what}>)"
        return text if func is torch.Tensor.__repr__ else format(text, *args[1:])
    return _read(func, args, kwargs, found)


# -- writes -----------------------------------------------------------------------------------
def _write(func: Any, args: Args, kwargs: Kwargs, t: Touch, others: list[Touch]) -> Any:
    """An in-place call on ``t`` (see surface.py's note for what each state does)."""
    sp = t.sp
    if sp is not None and sp.rt.phase is not Phase.IDLE:
        sp.rt.drop_abandoned()  # a forward left by a KeyboardInterrupt (overlap/abandoned.py)
    if sp is not None and sp.rt.trial_load:  # a load's trial: nothing written (its refusals
        return t.obj  # would refuse the load itself on every rank alike; load_agreement.py)
    if sp is None or is_live(sp) and sp.rt.phase is Phase.IDLE:
        return _in_place(func, args, kwargs, t, others)
    if sp.state in USER_OWNED:
        if sp.state is ParamState.SHOWN and not sp.shown_modify:
            raise ParamAccessError(
                f"writing parameter {sp.label()} inside gathered_parameters(modify=False): the "
                "write would be discarded on exit; pass modify=True")
        return _in_place(func, args, kwargs, t, others)
    _check_writable(sp, func)
    if sp.state is ParamState.DROPPED:
        return _revive(func, args, kwargs, t, others)
    if (not t.detached and torch.is_grad_enabled() and t.param.requires_grad
            and getattr(func, "__module__", None) != "torch.nn.init"):  # those run in no_grad
        raise RuntimeError(  # what torch says for the same call on a plain parameter
            ("a view of a leaf Variable" if t.chain else "a leaf Variable")
            + " that requires grad is being used in an in-place operation.")
    world = sp.rt.world_size
    if world > 1 and (others or not local_write(func)):
        raise ParamAccessError(
            f"{_name(func)} on parameter {sp.label()} at world size {world} needs values held "
            "by other ranks; do it inside `with engine.gathered_parameters([p], modify=True):` "
            "on every rank (writes that overwrite or are pointwise, like copy_, fill_, "
            "nn.init's random fills or mul_, work as they are)")
    if finer.unchanged(sp, finer.source_of(func, args, t.chain)):  # a read written back
        return t.obj
    if not t.chain and func in registry.OVERWRITE_CALLS:  # nothing old survives the call
        full = torch.empty(sp.shape, dtype=torch.float32, device=sp.rt.device)
    elif world > 1:
        full = sp.local_values()
    else:
        full = sp.read_value(exact=True)
    values = _values_of(others)
    values[id(t.obj)] = apply_chain(full, t.chain)
    with torch.no_grad():
        _run(func, args, kwargs, values)
    sp.overwrite(sp.layout.cut(full, torch.float32))
    return t.obj


def _in_place(func: Any, args: Args, kwargs: Kwargs, t: Touch, others: list[Touch]) -> Any:
    """Run the write where ``t``'s values live in place: on the parameter itself (so
    autograd's rules apply as in plain PyTorch), or on the tensor a view stands for."""
    values = _values_of(others)
    if t.chain or t.detached or t.sp is None:
        values[id(t.obj)] = _resolve(t)
    _run(func, args, kwargs, values)
    return t.obj


def _check_writable(sp: ShardedParam, func: Any) -> None:
    if sp.rt.phase is not Phase.IDLE:
        raise ParamAccessError(
            f"{_name(func)} writes parameter {sp.label()} inside the engine's "
            f"{sp.rt.phase.value}: its full tensor there is a temporary gathered for compute; "
            "write it between steps (outcore sends it to the shards), or inside "
            "engine.gathered_parameters([p], modify=True)")


def _revive(func: Any, args: Args, kwargs: Kwargs, t: Touch, others: list[Touch]) -> Any:
    """A write of every element of a DROPPED parameter (``load_state_dict`` after close)
    makes it a plain parameter again; anything less has nothing to write into."""
    sp = t.sp
    assert sp is not None  # _write found it DROPPED
    if t.chain or func not in registry.OVERWRITE_CALLS:
        raise ParamAccessError(dropped_message(sp))
    values = _values_of(others)
    full = torch.empty(sp.shape, dtype=sp.user_dtype, device=sp.rt.device)
    values[id(t.obj)] = full
    with torch.no_grad():
        _run(func, args, kwargs, values)
    sp.hand_back(full)
    return t.obj


def _data_set(obj: torch.Tensor, value: object, found: list[Touch]) -> None:
    """``p.data = value``: the values go to the shards; the shape and dtype stay."""
    t = next((f for f in found if f.obj is obj), None)
    if t is None:  # plain.data = a sharded parameter: give it the values, not the placeholder
        src = next(f for f in found if f.obj is value)
        return raw(DATA_SET, (obj, _value(src)[0].detach()), {})
    sp = t.sp
    if value is obj or (type(value) is ParamView and value.source is t.param and not value.chain):
        return None  # Module._apply after a move to where it already is
    if t.chain and sp is not None and sp.state not in USER_OWNED:
        raise ParamAccessError(
            f"assigning .data of a view of parameter {sp.label()}: the view holds no bytes of "
            "its own to rebind (outcore keeps the parameter sharded); assign to a copy "
            "(view.clone()), or write the values with view.copy_(...)")
    if sp is None or t.chain or not isinstance(value, torch.Tensor) or sp.state in USER_OWNED:
        if sp is not None and sp.state is ParamState.SHOWN and not sp.shown_modify:
            raise ParamAccessError(f"assigning parameter {sp.label()}.data inside "
                                   "gathered_parameters(modify=False); pass modify=True")
        return raw(DATA_SET, (_resolve(t) if t.chain else obj, value), {})
    if type(value) in DRESSED or type(value) is ParamView:
        value = _value(touched((value,), {})[0])[0]
    _check_writable(sp, DATA_SET)
    if tuple(value.shape) != tuple(sp.shape):
        raise ParamAccessError(shape_refusal(sp.label(), list(value.shape), list(sp.shape),
                                             building=sp.rt.engine is None))
    if sp.state is ParamState.DROPPED:
        sp.hand_back(value)
        return None
    if value.dtype != t.obj.dtype:
        raise ParamAccessError(dtype_refusal(sp.label(), value.dtype, t.obj.dtype,
                                             building=sp.rt.engine is None))
    if not finer.unchanged(sp, value):  # (a read written back changes nothing: finer.py)
        sp.overwrite(sp.layout.cut(value.detach().to(sp.rt.device), torch.float32))
