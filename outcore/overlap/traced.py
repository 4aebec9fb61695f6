"""``torch.jit.trace`` and ``torch.func`` transforms over a model whose parameters move.

[Note: what a tracer or a transform cannot take from outcore]
outcore's fetches run outside any tracer (zero/untraced.py's note), so ``torch.export``
records the model's computation alone and works: its program takes the parameters as inputs
and reads them when it runs. Two things still cannot work where parameters are gathered per
use (more than one rank, or parameters kept on NVMe, or in host memory for a GPU):

* ``torch.jit.trace`` keeps the parameter tensors themselves in the traced module, which
  runs without outcore's hooks: it would read the empty placeholder of a released parameter
  (its own sanity check failed so), and at more ranks a graph made there would hold this
  rank's gathers. Where the parameters stay in place (one rank, resident) it is plain
  PyTorch's trace, sharing the live parameters as a traced module does.
* ``torch.func.grad``, ``vjp``, ``jacrev``, ``hessian`` and ``jvp`` run autograd inside a
  transform that refuses saved-tensor hooks, which is how backward refetches a released
  parameter (hooks.py's [Note: three hooks, three jobs]); without them the saved parameter
  would be an empty placeholder by then. ``vmap`` alone keeps no state across the forward
  and runs as usual.
Both are refused when the forward begins, before anything is fetched, naming the ways out:
a plain copy of the model, or a configuration whose parameters stay in place. So is a forward
inside ``torch.autograd.graph.disable_saved_tensors_hooks`` (a library's guard), which
raised the guard's own message, saying nothing of why outcore needs the hooks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch._C._functorch import TransformType, get_interpreter_stack

from outcore.errors import ParamAccessError

if TYPE_CHECKING:
    from outcore.overlap.hooks import Hooks

_COPY = ("trace a plain copy of the model instead: copy.deepcopy(model) (at more ranks "
         "inside `with engine.gathered_parameters():`, on every rank), or the model itself "
         "after engine.close()")


def refuse_untraceable(hooks: Hooks) -> None:
    """Refuse a jit trace or a differentiating ``torch.func`` transform of a forward that
    gathers parameters per use (see the note); where none is gathered, a transform waits
    for the step's last updates first, so the forward needs no saved-tensor hooks."""
    if hooks.active:  # checked when the outermost module call begins
        return
    tracing = torch._C._get_tracing_state() is not None
    transform = _differentiating()
    unhooked = not torch._C._autograd._saved_tensors_hooks_is_enabled()  # type: ignore[attr-defined]
    if not tracing and transform is None and not unhooked:  # every training step: 3 C calls
        return
    if not hooks.schedule.movable:
        if transform is not None and hooks.rt.plan.defers_updates:
            hooks.schedule.await_updates()
        return
    where = (f"{hooks.rt.world_size} ranks, each holding a shard" if hooks.rt.world_size > 1
             else "one rank, parameters offloaded by offload.params")
    if tracing:
        raise ParamAccessError(
            f"torch.jit.trace of a model whose parameters outcore gathers per use ({where}): "
            "the traced module would keep the parameters themselves and run without "
            f"outcore's fetches; {_COPY}. torch.export.export(model, ...) works on the "
            "model at one rank")
    if transform is None:  # torch.autograd.graph.disable_saved_tensors_hooks(message)
        raise ParamAccessError(
            f"a forward inside torch.autograd.graph.disable_saved_tensors_hooks, of a model "
            f"whose parameters outcore gathers per use ({where}): outcore's backward fetches a "
            "released parameter again through saved-tensor hooks. Run the forward outside "
            "that block, or where the parameters stay in place (one rank, offload.params "
            "'none', or 'cpu' on a CPU device)")
    raise ParamAccessError(
        f"torch.func.{transform} over a model whose parameters outcore gathers per use "
        f"({where}): autograd inside torch's transforms cannot fetch a released parameter "
        "again (they refuse the saved-tensor hooks outcore's backward fetches through); run "
        "it where the parameters stay in place (one rank, "
        "offload.params 'none', or 'cpu' on a CPU device), or on a plain copy: "
        "copy.deepcopy(model) (at more ranks inside `with engine.gathered_parameters():`), "
        "or the model after engine.close()")


def _differentiating() -> str | None:
    """The name of the active ``torch.func`` transform that runs autograd, if any."""
    if torch._C._functorch.peek_interpreter_stack() is None:
        return None
    kinds = {i.key() for i in get_interpreter_stack() or ()}
    if TransformType.Grad in kinds:
        return "grad (or vjp, jacrev, hessian)"
    return "jvp (or jacfwd)" if TransformType.Jvp in kinds else None
