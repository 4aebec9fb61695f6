"""What a sharded parameter does when code touches it: every torch call, in every state.

[Note: a sharded parameter answers every call]
A parameter outcore shards keeps its identity but changes its class to a subclass of its own
(``dress``), whose ``__torch_function__`` sends every torch call on it here: ``p.sum()``,
``p.data``, ``p.copy_(t)``, ``nn.init.normal_(p)``, ``model.state_dict()``'s ``detach``,
``load_state_dict``'s ``copy_``, ``repr``. A kernel therefore never meets the zero-byte
placeholder of a released parameter (param.py's [Note: free the storage, keep the tensor]);
what a call means follows from the parameter's ``ParamState`` and the runtime's ``Phase``
(state.py):

* metadata (shape, dtype, device, ``requires_grad``, hooks, ``*_like``): answered as is;
* while its values are in ``.data`` (GATHERED in the engine's forward or backward; SHOWN by
  ``gathered_parameters``; BUILDING under ``outcore.init``; always, at one rank with the
  fp32 shards in memory): the call runs as in plain PyTorch;
* a read otherwise: at one rank the values are read from the shards into a new tensor and
  the call runs on it (under grad mode, gradients flow back to the parameter); at more ranks
  the values are spread over processes, and a read from one of them would be a collective
  the others never join, so it is refused with ``ParamAccessError`` naming
  ``engine.gathered_parameters()``;
* a write between steps goes to the shards: fp32 master and training-dtype copy, so the next
  forward, the next step and the next checkpoint see it. At more ranks each rank applies it
  to its own slice, which is exact for writes that overwrite what they touch (``copy_``,
  ``fill_``, ``nn.init``'s random fills with the same seed on every rank, ``load_state_dict``)
  and pointwise ones (``mul_``, ``clamp_``); others are refused. Writes inside the forward
  or backward are refused: the full tensor there is a temporary;
* a view (``p.data``, ``p[i]``, ``p.view(-1)``) is a ``ParamView``: it remembers how it was
  cut from its parameter, so writes through it (``p.data[pad].zero_()``) reach the shards
  and reads through it read the values, as above;
* after ``close()`` without kept values (DROPPED) reads are refused with the way to get the
  values, and a write of the whole parameter (``load_state_dict``) makes it plain again.

``p.detach()`` (and so ``state_dict()``) is a copy of the values, not a view: a state dict
must stay valid after the parameter is released again.

[Note: p.grad stays None, and says so]
Gradients live in the engine's shards: a parameter's full gradient never exists after its
module's backward, and with the optimizer state on NVMe it is applied and freed during
backward. So ``p.grad`` stays None, and code written for torch that reads it between a
backward and ``step()`` sees no gradient where torch would show one. Most such code is
``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``, which then clips nothing and
returns 0, silently. outcore cannot run that code on the shards (at more ranks each holds a
slice, and the overlapped updates have already used the gradients), so the first such read
per engine warns (``GradReadWarning``), pointed at the user's line, naming the config that
does the job: ``gradient_clipping`` (norm in ``engine.last_grad_norm``). Reads before the
first backward or after ``step()``, where torch shows None too, and the engine's own reads
(inside backward, or from the ``zero_grad`` it patches in) stay quiet, and so does
``model.to(...)``, whose ``Module._apply`` reads every gradient to move it along.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections import OrderedDict
from collections.abc import Iterable
from types import FrameType
from typing import Any, SupportsIndex, cast

import torch
from torch import nn

from outcore.errors import (
    ConfigError,
    GradReadWarning,
    OutcoreError,
    ParamAccessError,
    user_stacklevel,
)
from outcore.runtime.phase import Phase
from outcore.zero import access, registry
from outcore.zero.calls import (
    DATA_SET,
    DETACH,
    GRAD_GET,
    Args,
    Kind,
    Kwargs,
    is_live,
    kind_of,
    layout_only,
    refuse_backward_into_params,
    refuse_grad_assignment,
    refuse_grad_of_gathered,
    refuse_meta_move,
    refuse_new_parameter,
    refuse_replacing_conversion,
)
from outcore.zero.state import HAS_VALUES, USER_OWNED


# -- the parameter classes ------------------------------------------------------------------------
class ShardedParameter(nn.Parameter):
    """The class a sharded parameter wears (see the note); ``dress`` makes one per user class."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Iterable[type], args: Args = (),
                           kwargs: Kwargs | None = None) -> Any:
        return dispatch(func, args, kwargs or {})

    def set_(self, source: Any = None, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``p.set_(t)``, as ``p.data = t``: ``t``'s values go to the shards.

        [Note: set_ writes the values]
        torch's ``Tensor.set_`` never reaches ``__torch_function__``, so without this method it
        rebound the placeholder's storage unseen: the next forward used ``t`` and the step
        updated the shards, or the update was lost. ``register_parametrization`` calls it with
        its ``right_inverse`` (``orthogonal`` always does), so such a parametrization applied
        after ``initialize`` trained other weights than PyTorch's. A tensor of the parameter's
        shape and dtype is written as ``p.data = t`` writes it; any other form (a storage, a
        new shape) would change the parameter's storage, and is refused as ``resize_`` is."""
        if torch.is_grad_enabled() and self.requires_grad:  # torch's own rule for a leaf
            raise RuntimeError("a leaf Variable that requires grad is being used in an in-place "
                               "operation.")
        if isinstance(source, torch.Tensor) and not args and not kwargs:
            dispatch(DATA_SET, (self, source), {})
            return self
        given = () if source is None else (source,)
        return cast(torch.Tensor, dispatch(torch.Tensor.set_, (self, *given, *args), kwargs))

    def __reduce_ex__(self, proto: SupportsIndex) -> tuple[Any, ...]:
        """Pickled (``torch.save(model)``) as a plain parameter holding its values."""
        return (torch._utils._rebuild_parameter,
                (_value_for_copy(self), self.requires_grad, OrderedDict()))

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Parameter:
        if id(self) not in memo:
            sp = registry.managed(self)
            cls = sp.user_class if sp is not None else nn.Parameter
            memo[id(self)] = cls(_value_for_copy(self).clone(), self.requires_grad)
        return cast(nn.Parameter, memo[id(self)])  # copy's memo holds objects of any type


_CLASSES: dict[type[nn.Parameter], type[nn.Parameter]] = {nn.Parameter: ShardedParameter}
access.DRESSED.add(ShardedParameter)


def dress(param: nn.Parameter) -> type[nn.Parameter]:
    """Give ``param`` the sharded class for its own class; returns the class to restore."""
    cls = type(param)
    if cls in access.DRESSED:
        return next(c for c, d in _CLASSES.items() if d is cls)
    sub = _CLASSES.get(cls)
    try:
        if sub is None:
            meta: type[type] = type(cls)  # a class made at run time, by its own metaclass
            sub = meta(f"Sharded{cls.__name__}", (ShardedParameter, cls), {})
            _CLASSES[cls] = sub
            access.DRESSED.add(sub)
        param.__class__ = sub
    except TypeError as e:  # a parameter class with its own memory layout (__slots__)
        raise ConfigError(f"outcore cannot shard a parameter of class {cls.__module__}."
                          f"{cls.__name__}: {e}; outcore shards torch.nn.Parameter and its "
                          "plain Python subclasses") from None
    return cls


def undress(param: nn.Parameter, cls: type[nn.Parameter]) -> None:
    param.__class__ = cls


# -- dispatch -------------------------------------------------------------------------------------
def dispatch(func: Any, args: Args, kwargs: Kwargs) -> Any:
    """Run ``func`` as the states of the parameters it touches allow (see the note)."""
    kind = kind_of(func)
    if kind is Kind.META:
        refuse_grad_assignment(func, args)
        out = access.raw(func, args, kwargs)
        if out is None and func == GRAD_GET:  # method-wrappers: compare, not `is`
            _notice_grad_read(args[0])
        elif func is _POST_ACCUMULATE:
            _reduction_last(args[0])
        return out
    refuse_new_parameter(func, args)  # only a detach is looked at further
    refuse_replacing_conversion(func, args)  # only while torch.__future__ asks for it
    refuse_meta_move(func, args, kwargs)  # only a module's .to() looks further
    if layout_only(func, args, kwargs):  # model.to(memory_format=...): the layout is outcore's
        return args[0]
    refuse_grad_of_gathered(func, args, kwargs)  # only torch.autograd.grad looks further
    refuse_backward_into_params(func, kwargs)  # only torch.autograd.backward looks further
    touched = access.touched(args, kwargs)
    if not touched:
        return access.raw(func, args, kwargs)
    if kind is Kind.READ and kwargs.get("out") is None and all(_as_is(t) for t in touched):
        return access.raw(func, args, kwargs)  # the forward's path: values there, computing
    return access.handle(kind, func, args, kwargs, touched)


_MODULE_PY = os.path.join("torch", "nn", "modules", "module.py")
_POST_ACCUMULATE = torch.Tensor.register_post_accumulate_grad_hook
REDUCES = "_outcore_reduces"
"""The attribute that marks the engine's own post-accumulate hook on a parameter."""


def _reduction_last(param: torch.Tensor) -> None:
    """A post-accumulate hook registered on a parameter after ``initialize`` runs before the
    engine's own, as one registered before it does.

    [Note: hooks on a gradient run before its reduction]
    The engine's hook on each trainable parameter (overlap/hooks.py) reduces its group's
    gradients once the last of them arrives, and frees them. torch runs a parameter's
    post-accumulate hooks in the order they were registered, so a hook of the user's
    registered after ``initialize`` (a gradient logger; torch's optimizer-in-backward recipe)
    ran after that reduction: it saw ``p.grad`` for some parameters and None for the last one
    of each group, without a word, where one registered before ``initialize`` saw them all. So
    each registration moves the engine's hook back to the end."""
    hooks: dict[int, Any] = access.raw(getattr, (param, "_post_accumulate_grad_hooks"), {}) or {}
    for key, fn in list(hooks.items()):
        if getattr(fn, REDUCES, False):  # torch's C++ side walks the dict's insertion order,
            hooks[key] = hooks.pop(key)  # which OrderedDict.move_to_end does not change


def _notice_grad_read(param: torch.Tensor) -> None:
    """``param.grad`` was read and is None: warn once per engine where torch would show a
    gradient (see [Note: p.grad stays None, and says so])."""
    sp = registry.managed(param)
    if sp is None or not sp.trainable:
        return
    caller: FrameType | None = sys._getframe(1)
    while caller is not None and caller.f_code.co_filename == __file__:
        caller = caller.f_back
    if caller is not None and caller.f_code.co_name == "_unscale_grads_" and isinstance(
            caller.f_locals.get("self"), torch.amp.GradScaler):  # FSDP's ShardedGradScaler too
        raise OutcoreError(
            "torch.amp.GradScaler cannot unscale or check gradients under outcore, which keeps "
            f"them in its shards (p.grad of parameter {sp.label()} stays None); outcore scales "
            "the loss itself: set dtype: fp16 in the config (dynamic loss scaling, tuned by "
            "loss_scale; bf16 and fp32 need none), call engine.backward(loss) with the "
            "unscaled loss and engine.step(), and drop the GradScaler")
    rt = sp.rt
    if rt.phase is not Phase.IDLE or rt.grad_read_warned or not rt.gradients_held():
        return
    if caller is not None and caller.f_code.co_name == "_apply" and (
            caller.f_code.co_filename.endswith(_MODULE_PY)):
        return  # model.to(...) converting gradients along with parameters: no use of them
    rt.grad_read_warned = True
    warnings.warn(
        f"outcore: p.grad is None (read here for parameter {sp.label()}): outcore keeps "
        "gradients in the engine's shards, so code that reads p.grad between backward and "
        "step() sees none: torch.nn.utils.clip_grad_norm_ clips nothing and returns 0, and a "
        "torch optimizer the engine did not adopt steps nothing (use engine.optimizer, or pass "
        "yours as outcore.initialize(..., optimizer=opt)). To clip, set gradient_clipping in "
        "the config (OutcoreTrainer: max_grad_norm); the global norm is then "
        "engine.last_grad_norm (track_grad_norm: true gives it without clipping).",
        GradReadWarning, stacklevel=user_stacklevel())


def refuse_replacing_load(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                          local_metadata: dict[str, Any], *_: object) -> None:
    """A ``load_state_dict`` pre-hook on every module of an engine's model: refuse a load
    that would put new tensors in place of sharded parameters, before torch assigns any.

    ``load_state_dict(sd, assign=True)`` makes the state dict's tensors the module's
    parameters, and with ``torch.__future__.set_swap_module_params_on_conversion(True)``
    torch swaps each parameter's contents with its loaded copy; either way the engine would
    go on fetching and training what it sharded while the model computed with the new
    tensors. The module ``load_state_dict`` was called on runs its hook first and checks
    every parameter below it, so a refusal comes before any module was loaded."""
    assign = bool(local_metadata.get("assign_to_params_buffers"))
    swap = torch.__future__.get_swap_module_params_on_conversion()
    if not (assign or swap):
        return
    for name, p in module.named_parameters(remove_duplicate=False):
        sp = registry.managed(p)
        if sp is None or prefix + name not in state_dict:
            continue
        how = ("load_state_dict(..., assign=True) would put the state dict's tensor in place "
               "of" if assign else "load_state_dict with torch.__future__."
               "set_swap_module_params_on_conversion(True) would swap the state dict's tensor "
               "into")
        fix = " and ".join(
            ["load without assign=True"] * assign
            + ["call torch.__future__.set_swap_module_params_on_conversion(False) first"] * swap)
        raise ParamAccessError(
            f"{how} parameter {sp.label()}, which outcore shards: the "
            "engine would neither fetch nor train it, so training would silently stop "
            f"changing the model. Instead {fix}: the values are then copied into the shards "
            "(the fp32 master and the compute copy), from any dtype. Nothing of this model "
            "was loaded"
            + ("" if not prefix else f" (modules ahead of {prefix[:-1]!r} in the one "
               "load_state_dict was called on may have been)"))


def _as_is(t: access.Touch) -> bool:
    """Whether a read of ``t`` may run on the tensor as it is."""
    sp = t.sp
    if sp is None:
        return True
    if t.chain or sp.state not in HAS_VALUES:
        return False
    return sp.state in USER_OWNED or sp.rt.phase is not Phase.IDLE or is_live(sp)


def _value_for_copy(t: torch.Tensor) -> torch.Tensor:
    """The values of a parameter as a plain tensor (pickling, deepcopy)."""
    with torch.no_grad():
        return DETACH(t)
