"""Which kind of call a torch function is, for a parameter it touches (surface.py's note).

[Note: telling reads from writes]
Every torch call on a sharded parameter is sorted once, by the function: metadata (answered
by the placeholder), a read, a write (in-place: a name ending in one underscore, an in-place
operator, ``__setitem__``, ``nn.init``'s fills), ``.data`` get or set, ``repr``, or a call
that would change the parameter's storage or shape in place (refused). Whether a write can
run on each rank's own slice alone comes from the ATen operator of the same name: overwrites
(``copy_``, ``fill_``, the ``nn.init`` fills) and operators tagged pointwise or seeded-random
touch each element from that element alone, so a rank can apply them to its slice.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from enum import Enum
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
from torch import nn

from outcore.errors import ParamAccessError
from outcore.zero import registry
from outcore.zero.state import ParamState
from outcore.zero.wrappers import dcp_hint

if TYPE_CHECKING:
    from outcore.zero.param import ShardedParam


class Kind(Enum):
    META = "meta"
    READ = "read"
    WRITE = "write"
    DATA_GET = "data_get"
    DATA_SET = "data_set"
    REPR = "repr"
    REFUSED = "refused"  # changes the parameter's storage or shape in place


Args: TypeAlias = tuple[Any, ...]
"""A torch call's positional arguments, as ``__torch_function__`` receives them."""
Kwargs: TypeAlias = dict[str, Any]
"""A torch call's keyword arguments."""

# torch's stubs declare ``Tensor.data`` a plain Tensor attribute; it is a getset descriptor
DATA_GET: Callable[[torch.Tensor], torch.Tensor] = (
    torch.Tensor.data.__get__)  # type: ignore[attr-defined]  # see above
DATA_SET: Callable[[torch.Tensor, torch.Tensor], None] = (
    torch.Tensor.data.__set__)  # type: ignore[attr-defined]  # see above
GRAD_GET: Callable[[torch.Tensor], torch.Tensor | None] = (
    torch.Tensor.grad.__get__)  # type: ignore[union-attr]  # a getset descriptor
GRAD_SET: Callable[[torch.Tensor, torch.Tensor | None], None] = (
    torch.Tensor.grad.__set__)  # type: ignore[union-attr]  # a getset descriptor
SETITEM = torch.Tensor.__setitem__
DETACH = torch.Tensor.detach
# calls that use only metadata, beyond registry.METADATA_CALLS; *_like and new_* allocate a
# new tensor without reading the parameter's values
_MORE_META = frozenset(
    [getattr(torch.Tensor, n) for n in (
        "data_ptr", "untyped_storage", "storage", "stride", "storage_offset", "is_contiguous",
        "_is_view", "is_pinned", "is_shared", "is_signed", "is_inference", "__len__",
        "retain_grad", "new_empty", "new_zeros", "new_ones", "new_full", "new_tensor",
        "new_empty_strided", "__dir__") if hasattr(torch.Tensor, n)]
    + [getattr(torch.Tensor, n).__get__ for n in (
        "itemsize", "nbytes", "is_cpu", "is_mkldnn", "is_nested", "output_nr", "_version",
        "_base", "is_xpu", "is_mps") if hasattr(torch.Tensor, n)]
    + [torch._has_compatible_shallow_copy_type, torch.empty_like, torch.zeros_like,
       torch.ones_like, torch.full_like, torch.rand_like, torch.randn_like, torch.randint_like]
)
_REPR = frozenset([torch.Tensor.__repr__, torch.Tensor.__format__])
_REFUSED = frozenset(getattr(torch.Tensor, n) for n in (
    "set_", "resize_", "resize_as_", "detach_", "share_memory_", "as_strided_", "t_",
    "transpose_", "squeeze_", "unsqueeze_", "swapdims_", "swapaxes_"))
_INPLACE_DUNDERS = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
    "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
    "__imatmul__"})
TO, CPU, CUDA = torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda
_KINDS: dict[Any, Kind] = {}


def _classify(func: Any) -> Kind:
    hashable = getattr(type(func), "__hash__", None) is not None  # else no set can hold it
    if hashable and (func in registry.METADATA_CALLS or func in _MORE_META):
        return Kind.META
    if func == DATA_GET:  # method-wrappers are made anew on each access: compare, not `is`
        return Kind.DATA_GET
    if func == DATA_SET:
        return Kind.DATA_SET
    if hashable and func in _REPR:
        return Kind.REPR
    if hashable and func in _REFUSED:
        return Kind.REFUSED
    name = getattr(func, "__name__", "")
    if name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("__")):
        return Kind.WRITE
    return Kind.READ


def kind_of(func: Any) -> Kind:
    try:
        return _KINDS[func]
    except KeyError:
        kind = _KINDS[func] = _classify(func)
        return kind
    except TypeError:  # an unhashable callable
        return _classify(func)


_POINTWISE: dict[str, bool] = {}


def local_write(func: Any) -> bool:
    """Whether a write can run on each rank's own slice alone: it overwrites what it touches,
    or it is pointwise (each element from that element alone)."""
    if func in registry.OVERWRITE_CALLS or func is SETITEM or func == DATA_SET:
        return True
    name = getattr(func, "__name__", "")
    if name not in _POINTWISE:
        op = getattr(torch.ops.aten, name, None)
        tags = set()
        if op is not None:
            for overload in op.overloads():
                tags.update(getattr(op, overload).tags)
        _POINTWISE[name] = bool(tags & {torch.Tag.pointwise, torch.Tag.nondeterministic_seeded})
    return _POINTWISE[name]


_PARAMETER_NEW = nn.Parameter.__new__.__code__


def called_from(code: CodeType, depth: int = 8) -> bool:
    """Whether a frame running ``code`` is among the ``depth`` callers of our caller's caller:
    the torch function that started a call, seen through dispatch, a view's or a user's
    torch function mode, and the ``.data`` setter."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


ALLOCATING = frozenset(("empty_like", "zeros_like", "ones_like", "full_like", "rand_like",
                        "randn_like", "randint_like", "new_empty", "new_empty_strided",
                        "new_zeros", "new_ones", "new_full"))
"""aten calls that make a new tensor from an argument's geometry alone: ``*_like`` and
``new_*`` on a view of a sharded parameter (``torch.zeros_like(p.data)``) reach its dispatch,
where the view has no bytes to give, and need none (``allocate_like``)."""


def allocate_like(func: Any, args: Args, kwargs: Kwargs, view: type) -> Any:
    """``func`` (one of ``ALLOCATING``) with each ``view`` among ``args`` replaced by an empty
    tensor of its size, strides, dtype and device: what it would make from the view."""
    return func(*[torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device=a.device)
                  if isinstance(a, torch.Tensor) and type(a) is view else a for a in args],
                **kwargs)


def refuse_new_parameter(func: Any, args: Args) -> None:
    """Refuse ``nn.Parameter(p)`` of a sharded parameter or a view of one, seen as the
    ``detach`` that ``Parameter.__new__`` calls on a tensor subclass.

    In torch the new parameter shares the old one's storage; a sharded parameter has no
    storage to share (its values are spread over shards), and a copy would be a parameter
    the engine neither fetches nor trains. ``weight_norm`` (the parametrization) makes one
    this way and then removes the original from its module, so the layer would silently
    stop training; without this, torch's own check fails with a message about
    ``__torch_dispatch__``. (A parametrization that registers the same tensor again, as
    ``spectral_norm`` does, makes no new parameter and trains as in torch.)"""
    if func != DETACH or not called_from(_PARAMETER_NEW):
        return
    source = getattr(args[0], "source", args[0])  # a view's parameter
    sp = registry.managed(source)
    if sp is not None and sp.state is ParamState.DROPPED:
        return  # its read says it has no values, and how to keep them
    name = sp.label() if sp is not None else "of the model"
    building = sp is not None and sp.rt.engine is None  # under outcore.init, no engine yet
    raise ParamAccessError(
        f"torch.nn.Parameter(...) of parameter {name}, which outcore shards: a new parameter "
        "made from it would not share its values (it has no single storage) and the engine "
        "would neither fetch nor train it. weight_norm makes one this way: "
        + ("build a model that applies it outside outcore.init (outcore.initialize shards "
           "it after)" if building else "apply it before outcore.initialize, or after "
           "engine.close()")
        + ". For a copy of the values, pass p.detach().clone().")


_MODULE_APPLY = nn.Module._apply.__code__


def refuse_grad_assignment(func: Any, args: Args) -> None:
    """Refuse ``p.grad = g`` (a gradient written by hand) on a sharded parameter: outcore's
    update reads the gradients ``engine.backward`` reduced into its shards, never ``p.grad``,
    so the step went on without it and said nothing. ``p.grad = None`` stays a no-op."""
    if func != GRAD_SET or len(args) < 2 or args[1] is None:  # method-wrappers: compare
        return
    sp = registry.managed(args[0])
    if sp is not None:
        raise ParamAccessError(
            f"assigning parameter {sp.label()}.grad: outcore's optimizer updates from the "
            "gradients engine.backward(loss) reduces into its shards, never from p.grad; "
            "put what should reach the gradient into the loss" + dcp_hint())


def refuse_grad_of_gathered(func: Any, args: Args, kwargs: Kwargs) -> None:
    """Refuse ``torch.autograd.grad(..., inputs=[p])`` for a parameter that is not the tensor
    the model computes with (gathered per use, or cast to a 16-bit compute dtype): the forward
    used a copy, so ``p`` is not in the graph and torch's answer was "appears to not have been
    used in the graph". A parameter whose fp32 values are the tensor itself (``is_live``: one
    rank, in memory, fp32) is in the graph, and gets torch's own gradient."""
    if func is not torch.autograd.grad:
        return
    for sp in _sharded_inputs(args[1] if len(args) > 1 else kwargs.get("inputs", ())):
        if not is_live(sp):
            raise ParamAccessError(
                f"torch.autograd.grad with respect to parameter {sp.label()}: outcore computes "
                "with a copy of it (gathered, or in the compute dtype), not the parameter "
                "itself, so it is not in the graph; take the gradient with engine.backward "
                "(it reaches the optimizer), or with respect to activations")


def refuse_backward_into_params(func: Any, kwargs: Kwargs) -> None:
    """Refuse ``loss.backward(inputs=[p])`` for a sharded parameter ``p``. It never reached the
    engine's backward: with ``p`` on NVMe or in a 16-bit compute dtype the forward used a copy,
    so ``p`` got no gradient and the step trained nothing, without a word. Where ``p`` is the
    tensor the model computes with, the engine's gradient hook refused it as a plain
    ``loss.backward()``; at more ranks the inputs were refused as a read. Gradients with
    respect to activations (``inputs=[x]``) stay PyTorch's."""
    if func is not torch.autograd.backward:
        return
    sharded = _sharded_inputs(kwargs.get("inputs") or ())
    if sharded:
        raise ParamAccessError(
            f"backward(inputs=[...]) with parameter {sharded[0].label()} among the inputs: outcore "
            "trains a model through engine.backward(loss), which computes the gradients of "
            "every trainable parameter and hands them to its optimizer; to train only some, "
            "set requires_grad=False on the others. Gradients with respect to activations "
            "(inputs that are not parameters) work as in PyTorch")


def _sharded_inputs(inputs: object) -> list[ShardedParam]:
    """The sharded parameters among an autograd call's ``inputs`` (a tensor or a sequence)."""
    seq = inputs if isinstance(inputs, (list, tuple)) else (inputs,)
    return [sp for t in seq if isinstance(t, torch.Tensor)
            and (sp := registry.managed(t)) is not None]


def refuse_meta_move(func: Any, args: Args, kwargs: Kwargs) -> None:
    """Refuse ``model.to("meta")`` of a sharded parameter: torch's ``Module._apply`` cannot
    give a CPU tensor meta data in place, so it puts a new ``nn.Parameter`` without values in
    the module, and the engine went on training the old one while every read and forward of
    the model failed. Seen at ``fn(p)``, before torch replaces anything."""
    if func is not TO or not args:
        return
    try:
        device = torch._C._nn._parse_to(*args[1:], **kwargs)[0]
    except (TypeError, RuntimeError):
        return  # torch's own call will say what is wrong
    if device is None or device.type != "meta" or not called_from(_MODULE_APPLY):
        return
    sp = registry.managed(args[0])
    if sp is None or sp.state is ParamState.DROPPED:
        return
    raise ParamAccessError(
        f"model.to('meta') on parameter {sp.label()}: torch would replace it with a new "
        "parameter that holds no values, and outcore trains the one it sharded; do it after "
        "engine.close() (or build on the meta device under outcore.init). No parameter was moved")


def layout_only(func: Any, args: Args, kwargs: Kwargs) -> bool:
    """Whether ``func`` is ``model.to(memory_format=...)``'s call on a sharded parameter (torch's
    ``Module._apply``) that changes nothing but the memory layout: outcore keeps its
    parameters' layout (the forward computes with contiguous full tensors gathered from
    flat shards), so the parameter itself is the answer and the values stay. At more ranks
    the conversion was refused as a read from one rank, naming ``gathered_parameters``."""
    if func is not TO or len(args) < 1 or registry.managed(args[0]) is None:
        return False
    try:
        device, dtype, _, fmt = torch._C._nn._parse_to(*args[1:], **kwargs)
    except (TypeError, RuntimeError):
        return False  # torch's own call will say what is wrong
    obj = args[0]
    return (fmt not in (None, torch.preserve_format) and dtype in (None, obj.dtype)
            and already_on(obj, device) and called_from(_MODULE_APPLY))


def already_on(t: torch.Tensor, device: torch.device | None) -> bool:
    """Whether a move of ``t`` to ``device`` (None: none asked; no index: the current one)
    would leave it where it is."""
    return device is None or (device.type == t.device.type
                              and device.index in (None, t.device.index))


def refuse_replacing_conversion(func: Any, args: Args) -> None:
    """Refuse a module conversion (``model.half()``, ``.to(...)``, ``.cpu()``) of a sharded
    parameter while torch's ``torch.__future__`` flags make conversions replace parameters.

    With ``set_overwrite_module_params_on_conversion(True)`` torch's ``Module._apply`` puts
    a new ``nn.Parameter`` holding ``fn(p)`` in the module instead of assigning ``p.data``
    (and ``set_swap_module_params_on_conversion(True)`` swaps the two tensors' contents).
    The engine goes on fetching and training the parameter it sharded while the model
    computes with the new one, so training would silently stop changing the model. Seen at
    ``fn(p)``, before torch replaces anything; the flags are module globals, read first so
    the frame walk runs only while one is set."""
    future = torch.__future__
    flag = ("set_overwrite_module_params_on_conversion"
            if future.get_overwrite_module_params_on_conversion() else
            "set_swap_module_params_on_conversion"
            if future.get_swap_module_params_on_conversion() else None)
    if flag is None:
        return
    sp = registry.managed(args[0]) if args else None
    if sp is None or sp.state is ParamState.DROPPED or not called_from(_MODULE_APPLY):
        return  # a dropped parameter's read says it has no values, and how to keep them
    advice = ("outcore.initialize takes the model as it is; set dtype in the config to choose "
              "outcore's dtype" if sp.rt.engine is None else "convert before "
              "outcore.initialize or after engine.close() (to another dtype only then: set "
              "dtype in the config to choose outcore's)")
    raise ParamAccessError(
        f"converting the model (model.half(), .float(), .to(...), .cpu()) with "
        f"torch.__future__.{flag}(True): torch would replace parameter {sp.label()}, which "
        "outcore shards, with a new tensor that the engine neither fetches nor trains, so "
        f"training would silently stop changing the model. Call torch.__future__.{flag}"
        f"(False) while outcore holds the model; {advice}. No parameter was converted")


def storage_refusal(name: str, label: str) -> str:
    """Why ``name`` (a call that changes a tensor's storage or shape in place) may not run on
    parameter ``label``; said as ``model.share_memory()`` when that is the call made (torch's
    ``Module._apply`` calls ``share_memory_`` on every parameter)."""
    if name == "share_memory_" and called_from(_MODULE_APPLY):
        return (f"model.share_memory(): outcore keeps parameter {label} in shards that it moves "
                "between memory and disk, which other processes cannot share; to train in "
                "several processes, start them with torchrun: each rank holds its own shards")
    return (f"{name} on parameter {label}: it would change the storage or shape outcore keeps "
            "the parameter in; do it to a copy (p.detach())")


def dtype_refusal(label: str, given: torch.dtype, dtype: torch.dtype, building: bool) -> str:
    """Why a parameter's ``.data`` may not become a ``given`` tensor: outcore computes it in
    ``dtype`` (``building``: under ``outcore.init``, where it holds fp32 values until
    ``outcore.initialize`` casts them). Said as the call the user made when it is a module
    conversion (``model.half()``, ``.float()``, ``.to(dtype)``: torch's ``Module._apply``
    assigns ``.data``), since the user never wrote ``.data`` there."""
    if not called_from(_MODULE_APPLY):
        return (f"assigning a {given} tensor to parameter {label}.data: outcore computes it in "
                f"{dtype} (the config's dtype); assign a {dtype} tensor, or copy_() values of "
                "any dtype into it")
    said = f"converting the model to {given} (model.half(), .float(), .double(), .to(dtype)): "
    if building:
        return (said + f"parameter {label} was built under outcore.init, which keeps fp32 "
                "values until outcore.initialize casts them to the config's dtype: set dtype "
                "in the config instead; no parameter was converted")
    return (said + f"outcore computes parameter {label} in {dtype}, the config's dtype, and "
            "keeps an fp32 master for training. Set dtype in the config, or convert before "
            "outcore.initialize or after engine.close(); no parameter was converted")


def shape_refusal(label: str, given: list[int], shape: list[int], building: bool) -> str:
    """Why a parameter's ``.data`` may not become a tensor of another shape, with the way
    that works where the parameter is: ``building`` (under ``outcore.init``, no engine yet)
    the shards were cut as the model was built, so "before outcore.initialize" is no way
    out there (a user's ``resize_token_embeddings`` got that advice)."""
    said = (f"assigning a tensor of shape {given} to parameter {label}.data (shape {shape}): "
            "outcore shards it by its shape")
    if building:
        return (said + "; outcore.init cut its shards as the model was built, so its shape "
                "cannot change now. To resize it (resize_token_embeddings), build the model "
                "without outcore.init, resize it, then pass it to outcore.initialize; or set "
                "the new size in the model's config (e.g. vocab_size) before building it "
                "under outcore.init")
    return (said + "; copy_() values of the same shape, or change shapes "
            "(resize_token_embeddings) before outcore.initialize or after engine.close()")


def is_live(sp: ShardedParam) -> bool:
    """Whether ``.data`` is where the exact values live (one rank, fp32 shards in memory
    shown without a copy): then every call, writes included, is plain PyTorch's."""
    return (sp.state is ParamState.GATHERED and sp.group is not None and sp.group.zero_copy
            and sp.compute_shard is sp.master_shard)
