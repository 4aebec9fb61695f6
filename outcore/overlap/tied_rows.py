"""A tied embedding's gradient as the rows its tokens touch, added where autograd would sum
two full-size gradients.

[Note: a tied embedding's gradient, row by row]
A weight that the embedding and the output head share (GPT-2's, and ``tie_word_embeddings``
in Hugging Face models) gets two gradients in backward, and autograd sums them in a buffer
of its own before the weight's hooks see the result: the head's, full-size, from the start
of backward; at its end the embedding's, full-size too (``embedding_dense_backward`` fills a
zero tensor, though only the rows of the batch's tokens are nonzero); then the two summed
out of place. So three vocabulary x hidden matrices are alive at once at the end of
backward: 62.5 MiB each on gpt-335m in bf16, where they made the step's peak RSS at 128
tokens (bench/results, 'tied embedding rows'), and 1 GiB each for a 256k x 2048 vocabulary.

So the embedding's output passes through ``_Rows``. Inside the engine's backward its
backward computes only the rows the tokens touch, with the same aten kernel on a table of
the distinct ids (so each row is summed in torch's order, bit for bit), keeps them, and
returns no gradient for the weight: autograd then neither fills the zero tensor nor sums,
and hands the weight's hook the head's gradient alone, into which the hook adds the kept
rows in place before the group's reduction (``add_kept``); a backward that never reached
the head adds them to zeros at its end (``flush``). The result is torch's sum exactly.
Outside the engine's backward (``torch.autograd.grad``, another engine's backward through
this model, the refused ``loss.backward()``) it returns torch's own full gradient.

Only where the saving is sure and nothing else can tell: a module whose type is exactly
``nn.Embedding`` (a subclass may change the output after the lookup) with no ``max_norm``
(which writes the weight in forward), ``scale_grad_by_freq`` or ``sparse``, whose weight is
tied, trained, and carries no hook of the user's (``weight.register_hook`` would otherwise
see the head's part alone: masking the gradient of some rows is a common use; checked at
the forward and again in backward, for a hook added between them). The flags are checked at
each call, since they can be set after ``initialize``. Two limits: a hook put on the weight's
gradient accumulator node itself (``torch.autograd.graph.get_gradient_edge(weight).node``,
as DeepSpeed does) is not seen, and sees the head's part alone; and a
``torch.autograd.grad`` through the embedding from inside the engine's own backward (a
custom function's backward calling it) would have its rows kept for the weight instead of
returned. An untied embedding is left to torch: its one gradient is full-size either way.
The output is a copy (a custom function that returned its input would return a view, which
an in-place change in the model would refuse), one activation-sized copy per forward.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch._C import DisableTorchFunctionSubclass

from outcore.zero.registry import managed

if TYPE_CHECKING:
    from outcore.zero.param import ShardedParam


class TiedRows:
    """The tied embeddings of one engine's model and, per backward, the rows kept for them."""

    def __init__(self, modules: Iterable[nn.Module], tied: set[int],
                 in_backward: Callable[[], bool]) -> None:
        self.modules: dict[nn.Module, ShardedParam] = {}
        for m in modules:
            if type(m) is not nn.Embedding:  # (and a parametrized weight is not computed)
                continue
            sp = managed(m._parameters.get("weight"))
            if sp is not None and sp.group is not None and sp.group.index in tied:
                self.modules[m] = sp
        self._in_backward = in_backward
        self._kept: dict[ShardedParam, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def wrap(self, module: nn.Module, args: tuple[object, ...], output: object) -> object:
        """The module's output, passed through ``_Rows`` where the note says so."""
        sp = self.modules.get(module)
        if (sp is None or not isinstance(output, torch.Tensor) or not output.requires_grad
                or type(output.grad_fn).__name__ != "EmbeddingBackward0"
                or not args or not isinstance(args[0], torch.Tensor)):
            return output
        assert isinstance(module, nn.Embedding)
        if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
            return output  # checked at each call: a user may set them after initialize
        pad = -1 if module.padding_idx is None else module.padding_idx
        # the parameter as autograd sees it (its edge is the gradient accumulator the head's
        # use shares), not as outcore's access rules dress it: nothing here reads its values
        with torch._C.DisableTorchFunctionSubclass():
            weight = module.weight
            if _has_hooks(weight) or not sp.trainable:  # the user's hook must see the sum
                return output
            # weakly: a loss kept after engine.close() must not keep the engine's state alive
            where = (weakref.ref(self), weakref.ref(sp), module.num_embeddings, pad)
            return _Rows.apply(  # type: ignore[no-untyped-call]  # torch leaves it untyped
                output.detach(), weight, args[0], where)

    def keep(self, sp: ShardedParam, ids: torch.Tensor, rows: torch.Tensor) -> None:
        self._kept.setdefault(sp, []).append((ids, rows))

    def add_kept(self, sp: ShardedParam) -> None:
        """Add the rows kept for ``sp`` in this backward into its gradient (its hook runs this
        before the group's reduction)."""
        kept = self._kept.pop(sp, None)
        if kept is None:
            return
        grad = sp.param.grad
        if grad is None:  # the head was not in this backward: the rows over zeros, as torch
            rows = kept[0][1]
            grad = torch.zeros(sp.param.shape, dtype=rows.dtype, device=rows.device)
            with DisableTorchFunctionSubclass():  # as autograd sets it: not a user's write
                sp.param.grad = grad
        for ids, rows in kept:
            # the ids are distinct: one add per element, as in torch's sum; index_put_, unlike
            # index_add_, also runs where torch is told to be deterministic on a GPU
            grad.index_put_((ids,), rows, accumulate=True)

    def flush(self) -> None:
        """At the end of a backward, rows no hook took (the head was not in it): the weight's
        gradient is those rows over zeros, as torch's would be."""
        for sp in list(self._kept):
            self.add_kept(sp)

    def clear(self) -> None:
        self._kept.clear()


class _Rows(torch.autograd.Function):
    """The embedding's output, whose backward keeps its rows (see the note)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor,
                where: tuple[weakref.ref[TiedRows], weakref.ref[ShardedParam], int, int]
                ) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.where = where
        return out.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor | None, None, None]:
        (ids,) = ctx.saved_tensors
        rows_ref, sp_ref, num_weights, pad = ctx.where
        rows_of, sp = rows_ref(), sp_ref()
        grad = grad.reshape(-1, grad.shape[-1])
        ids = ids.reshape(-1)
        if (rows_of is None or sp is None or not rows_of._in_backward()
                or _has_hooks(sp.param)):  # a hook of the user's added after the forward
            full = torch.ops.aten.embedding_dense_backward(grad, ids, num_weights, pad, False)
            return None, full, None, None
        distinct, inverse = torch.unique(ids, return_inverse=True)
        rows = torch.ops.aten.embedding_dense_backward(grad, inverse, distinct.numel(), -1, False)
        if pad >= 0:  # the padding row gets no gradient, as in torch (no sync with a device)
            rows.masked_fill_((distinct == pad).unsqueeze(1), 0)
        rows_of.keep(sp, distinct, rows)
        return None, None, None, None


def _has_hooks(weight: torch.Tensor) -> bool:
    """Whether the user registered a hook on the weight (``weight.register_hook``)."""
    with torch._C.DisableTorchFunctionSubclass():
        return bool(weight._backward_hooks)
