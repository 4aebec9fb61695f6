"""Memory-centric tiling: one huge linear operator as a grid of tiles fetched one at a time.

[Note: why tiles are submodules]
outcore gathers and releases parameters per module (hooks.py): a module's own parameters
form one group, all-gathered before it runs and released after. A layer's working memory is
therefore its whole weight, however the arithmetic inside it is arranged. ``TiledLinear``
turns that unit into a tile by making every tile a module of its own, so the existing hooks
fetch tile (o, i), run it, and release it before the next tile is fetched; the schedule
prefetches tiles like any other module, and in backward each tile's weight is re-fetched on
its own when autograd unpacks it. No special path in the engine is needed, and the gathered
bytes at any moment are one tile (plus what ``zero.prefetch_bytes`` allows ahead), not the
layer: the paper's memory-centric tiling, here a consequence of module granularity.

[Note: tiled init draws with the full layer's fan-in]
``nn.Linear`` draws its weight and bias from U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with the
layer's fan-in. A tile sees only ``in_features / in_splits`` inputs, so initializing it as
its own ``nn.Linear`` would widen the distribution by sqrt(in_splits). Tiles therefore use the
full layer's fan-in for the bound: a freshly built ``TiledLinear`` has the same distribution as
the ``nn.Linear`` it stands for (not the same numbers: the random stream is drawn tile by tile,
so that under ``outcore.init`` only one tile is ever materialized). To reproduce an existing
layer exactly, use ``TiledLinear.from_linear`` or ``tile_linears``, which copy weights.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from outcore.errors import ConfigError, ParamAccessError
from outcore.zero.gathered import gathered_parameters
from outcore.zero.param import ShardedParam
from outcore.zero.registry import managed, register


def split_sizes(n: int, parts: int) -> list[int]:
    """``n`` cut into ``parts`` near-equal sizes, larger ones first (as ``tensor_split``)."""
    if not 1 <= parts <= n:
        raise ConfigError(f"cannot split {n} features into {parts} tiles (need 1 <= splits "
                          f"<= {n})")
    base, extra = divmod(n, parts)
    return [base + (1 if k < extra else 0) for k in range(parts)]


def _starts(sizes: list[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


class LinearTile(nn.Module):
    """One tile of a ``TiledLinear``: ``y = x @ weight.T (+ bias)`` over a slice of inputs.

    ``fan_in`` is the *full* layer's fan-in, used by ``reset_parameters`` (see the note on
    tiled init).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fan_in: int,
                 requires_grad: bool = True) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.fan_in = fan_in
        self.weight = nn.Parameter(weight, requires_grad=requires_grad)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=requires_grad)

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.fan_in) if self.fan_in > 0 else 0.0
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, fan_in={self.fan_in}")


# make_tile(o, i, rows, cols, has_bias) -> LinearTile for output rows ``rows`` and inputs ``cols``
TileMaker = Callable[[int, int, slice, slice, bool], LinearTile]


class TiledLinear(nn.Module):
    """``nn.Linear(in_features, out_features, bias)`` as ``out_splits x in_splits`` tiles.

    Tile (o, i) is ``tiles[o][i]``, a module of its own (see [Note: why tiles are submodules]);
    output block o is the sum over i of tile (o, i) applied to input block i, and the output
    blocks are concatenated. Output block o's bias lives in tile (o, 0). Equal to the
    ``nn.Linear`` with the same weights up to float rounding of the partial sums.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 in_splits: int = 1, out_splits: int = 1, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()

        def random_tile(o: int, i: int, rows: slice, cols: slice, has_bias: bool) -> LinearTile:
            kw = {"device": device, "dtype": dtype}
            w = torch.empty(rows.stop - rows.start, cols.stop - cols.start, **kw)
            b = torch.empty(rows.stop - rows.start, **kw) if has_bias else None
            tile = LinearTile(w, b, fan_in=in_features)
            tile.reset_parameters()
            return tile

        self._build(in_features, out_features, bias, in_splits, out_splits, random_tile)

    def _build(self, in_features: int, out_features: int, bias: bool, in_splits: int,
               out_splits: int, make_tile: TileMaker) -> None:
        self.in_features, self.out_features = in_features, out_features
        self.in_sizes = split_sizes(in_features, in_splits)
        self.out_sizes = split_sizes(out_features, out_splits)
        rows = [slice(s, s + n) for s, n in zip(_starts(self.out_sizes), self.out_sizes,
                                                 strict=True)]
        cols = [slice(s, s + n) for s, n in zip(_starts(self.in_sizes), self.in_sizes,
                                                 strict=True)]
        # one tile at a time, so under outcore.init only one tile is ever whole in memory
        self.tiles = nn.ModuleList()
        for o, r in enumerate(rows):
            row = nn.ModuleList()
            self.tiles.append(row)
            for i, c in enumerate(cols):
                row.append(make_tile(o, i, r, c, bias and i == 0))
        self.register_load_state_dict_pre_hook(_split_linear_state)

    @classmethod
    def _assemble(cls, in_features: int, out_features: int, bias: bool, in_splits: int,
                  out_splits: int, make_tile: TileMaker) -> TiledLinear:
        """A TiledLinear whose tiles come from ``make_tile`` (no random init, no RNG drawn)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._build(in_features, out_features, bias, in_splits, out_splits, make_tile)
        return self

    @classmethod
    def from_linear(cls, linear: nn.Linear, in_splits: int, out_splits: int) -> TiledLinear:
        """The same layer as ``linear``, tiled, with exactly its weights (and requires_grad).

        ``linear`` may be a plain layer or one built under ``outcore.init`` (before
        ``outcore.initialize``); in the second case its weight is gathered once (a collective:
        every rank must call) and each tile is sharded as soon as it is cut, so only this one
        layer is ever whole in memory, never the model.
        """
        sp = managed(linear.weight)
        if sp is None:
            w = linear.weight.detach()
            b = None if linear.bias is None else linear.bias.detach()
            return cls._assemble(linear.in_features, linear.out_features, b is not None,
                                 in_splits, out_splits, _copying(w, b, linear))
        if sp.group is not None:
            raise ParamAccessError("tile layers before outcore.initialize: the engine has "
                                   "already built its parameter groups (layer weight "
                                   f"{sp.name or '?'})")
        params = [p for p in (linear.weight, linear.bias) if p is not None]
        with gathered_parameters(params):  # full fp32 values in .data, one layer
            w = linear.weight.data.to(sp.dtype)
            b = None if linear.bias is None else linear.bias.data.to(sp.dtype)
            copy = _copying(w, b, linear)

            def sharded_tile(o: int, i: int, rows: slice, cols: slice, has_bias: bool):
                tile = copy(o, i, rows, cols, has_bias)
                for p in tile.parameters():
                    if managed(p) is None:  # (inside an outcore.init context it already is)
                        register(p, ShardedParam(p, sp.rt))
                return tile

            return cls._assemble(linear.in_features, linear.out_features, b is not None,
                                 in_splits, out_splits, sharded_tile)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs = x.split(self.in_sizes, dim=-1) if len(self.in_sizes) > 1 else (x,)
        outs = []
        for row in self.tiles:
            y = row[0](xs[0])
            for tile, xi in zip(row[1:], xs[1:], strict=True):
                y = y + tile(xi)
            outs.append(y)
        return torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.tiles[0][0].bias is not None}, "
                f"in_splits={len(self.in_sizes)}, out_splits={len(self.out_sizes)}")


def _copying(w: torch.Tensor, b: torch.Tensor | None, linear: nn.Linear) -> TileMaker:
    """A tile maker that cuts tiles out of the full weight ``w`` and bias ``b``."""
    grad = linear.weight.requires_grad

    def copy(o: int, i: int, rows: slice, cols: slice, has_bias: bool) -> LinearTile:
        wt = w[rows, cols].clone(memory_format=torch.contiguous_format)
        bt = b[rows].clone() if has_bias and b is not None else None
        return LinearTile(wt, bt, fan_in=linear.in_features, requires_grad=grad)

    return copy


def _split_linear_state(module: nn.Module, state_dict: dict, prefix: str, *args: object) -> None:
    """Let a TiledLinear load an ``nn.Linear`` state dict (``weight``/``bias`` keys)."""
    assert isinstance(module, TiledLinear)
    w = state_dict.pop(prefix + "weight", None)
    b = state_dict.pop(prefix + "bias", None)
    if w is None:
        return
    for o, (r0, rn) in enumerate(zip(_starts(module.out_sizes), module.out_sizes, strict=True)):
        for i, (c0, cn) in enumerate(zip(_starts(module.in_sizes), module.in_sizes, strict=True)):
            key = f"{prefix}tiles.{o}.{i}."
            state_dict[key + "weight"] = w[r0 : r0 + rn, c0 : c0 + cn]
            if i == 0 and b is not None:
                state_dict[key + "bias"] = b[r0 : r0 + rn]


def tile_linears(model: nn.Module, min_params: int, in_splits: int, out_splits: int) -> int:
    """Replace every ``nn.Linear`` with at least ``min_params`` weights by a ``TiledLinear``
    holding exactly the same weights, in place; return how many layers were replaced.

    No model code changes: the layer is swapped in its parent(s) under the same name. Splits
    are capped at the layer's feature counts. Skipped, because tiling would break them:
    subclasses of ``nn.Linear`` (they may compute differently, e.g. attention's ``out_proj``)
    and layers whose weight or bias is shared with another module (tied weights). Works on a
    plain model and on one built under ``outcore.init``, before ``outcore.initialize``; for the
    latter every rank must call it (each layer is gathered, a collective).
    """
    owners: dict[int, set[int]] = defaultdict(set)
    places: dict[int, list[tuple[nn.Module, str]]] = defaultdict(list)
    for _, parent in model.named_modules(remove_duplicate=False):
        for p in parent._parameters.values():
            if p is not None:
                owners[id(p)].add(id(parent))
        for attr, child in parent._modules.items():
            if child is not None:
                places[id(child)].append((parent, attr))
    replaced = 0
    for m in list(model.modules()):
        if type(m) is not nn.Linear or m.weight.numel() < min_params:
            continue
        if not places[id(m)] or any(len(owners[id(p)]) > 1 for p in m.parameters()):
            continue  # the root itself, or tied to another module
        tiled = TiledLinear.from_linear(m, min(in_splits, m.in_features),
                                        min(out_splits, m.out_features))
        tiled.train(m.training)
        for parent, attr in places[id(m)]:
            setattr(parent, attr, tiled)
        replaced += 1
    return replaced
