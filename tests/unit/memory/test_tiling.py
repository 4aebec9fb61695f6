"""Memory-centric tiling: TiledLinear is nn.Linear's math, and cuts working memory to a tile.

Working memory is read from the engine's own ledger: with parameters and optimizer states in
host memory, the device tier holds nothing but gathered (unsharded) parameters, so the
ledger's device peak is the peak of gathered bytes over forward and backward.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import outcore
from outcore.memory.tiling import TiledLinear, tile_linears
from outcore.zero.registry import managed
from tests.distributed import run_world


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.parametrize(("shape", "splits", "bias"),
                         [((64, 48), (4, 3), True), ((37, 53), (3, 4), False),
                          ((16, 16), (1, 1), True), ((10, 7), (10, 7), True)])
def test_tiled_linear_equals_linear(shape: tuple[int, int], splits: tuple[int, int],
                                    bias: bool) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(*shape, bias=bias)
    tiled = TiledLinear.from_linear(lin, *splits)
    assert sum(p.numel() for p in tiled.parameters()) == sum(p.numel() for p in lin.parameters())
    x = torch.randn(3, 5, shape[0], requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y2 = lin(x), tiled(x2)
    assert _rel(y2, y) <= 1e-6
    y.square().sum().backward()
    y2.square().sum().backward()
    assert _rel(x2.grad, x.grad) <= 1e-6
    w_grad = torch.cat([torch.cat([t.weight.grad for t in row], 1) for row in tiled.tiles], 0)
    assert _rel(w_grad, lin.weight.grad) <= 1e-6
    if bias:
        b_grad = torch.cat([row[0].bias.grad for row in tiled.tiles])
        assert _rel(b_grad, lin.bias.grad) <= 1e-6
    # an nn.Linear state dict loads into a tiled layer
    fresh = TiledLinear(*shape, bias=bias, in_splits=splits[0], out_splits=splits[1])
    fresh.load_state_dict(lin.state_dict())
    assert torch.equal(fresh(x2), y2)


def test_init_draws_with_the_full_layer_fan_in() -> None:
    """Same distribution as nn.Linear: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with the *layer's*
    fan-in (a tile's own fan-in would give twice the bound here)."""
    torch.manual_seed(0)
    tiled = TiledLinear(1024, 512, in_splits=4, out_splits=2)
    bound = 1 / math.sqrt(1024)
    w = torch.cat([t.weight.reshape(-1) for row in tiled.tiles for t in row])
    b = torch.cat([row[0].bias for row in tiled.tiles])
    for values in (w, b):
        assert values.abs().max() <= bound
        assert values.abs().max() >= 0.98 * bound
        assert values.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.05)
    lin = nn.Linear(1024, 512)
    assert lin.weight.std().item() == pytest.approx(w.std().item(), rel=0.02)

    # built under outcore.init: tile by tile, the same numbers as plain construction
    cfg = outcore.Config(dtype="fp32")
    torch.manual_seed(0)
    with outcore.init(cfg):
        sharded = TiledLinear(1024, 512, in_splits=4, out_splits=2)
    assert all(managed(p) is not None for p in sharded.parameters())
    with outcore.gathered_parameters(sharded):
        for p, q in zip(sharded.parameters(), tiled.parameters(), strict=True):
            assert torch.equal(p.data.cpu(), q.data)


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(32, 4, batch_first=True)  # out_proj: a Linear subclass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mha(x, x, x, need_weights=False)[0]


def test_tile_linears_keeps_weights_and_skips_what_tiling_would_break() -> None:
    torch.manual_seed(0)
    shared = nn.Linear(32, 32)
    model = nn.ModuleDict({
        "up": nn.Linear(32, 128), "down": nn.Linear(128, 32), "small": nn.Linear(32, 4),
        "attn": Attn(), "a": shared, "b": shared,  # one module at two places
        "tied": nn.Linear(32, 128), "emb": nn.Embedding(128, 32),
    })
    model["tied"].weight = model["emb"].weight
    x = torch.randn(2, 5, 32)
    before = {k: model[k](x) for k in ("up", "a", "attn")}
    before["down"] = model["down"](before["up"])
    assert tile_linears(model, min_params=1000, in_splits=2, out_splits=4) == 3
    assert isinstance(model["up"], TiledLinear) and isinstance(model["down"], TiledLinear)
    assert model["a"] is model["b"] and isinstance(model["a"], TiledLinear)
    assert type(model["small"]) is nn.Linear  # below min_params
    assert type(model["tied"]) is nn.Linear  # weight shared with the embedding
    assert not isinstance(model["attn"].mha.out_proj, TiledLinear)
    for k, y in before.items():
        inp = model["up"](x) if k == "down" else x
        assert _rel(model[k](inp), y) <= 1e-6, k
    assert tile_linears(nn.Linear(64, 64), 1, 2, 2) == 0  # a root cannot be replaced


# -- working memory under the engine, and training parity --------------------------------------
IN, HID, OUT, BATCH = 16, 512, 8, 4


class Net(nn.Module):
    """Two small layers around one big one (HID x HID)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, HID)
        self.big = nn.Linear(HID, HID)
        self.out = nn.Linear(HID, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.out(F.gelu(self.big(F.gelu(self.inp(x))))), x[:, :OUT])


CFG = {"dtype": "fp32", "optimizer": {"lr": 1e-3, "eps": 1e-6},
       "zero": {"persistence_threshold_bytes": 0, "prefetch_bytes": 0},
       "offload": {"params": "cpu", "optimizer": "cpu"}}
STEPS = 3


def _train(engine: outcore.Engine, rank: int, world: int) -> tuple[list[float], int, int]:
    """Train; return mean losses, peak gathered bytes in forward (hooks), and over fwd+bwd."""
    forward_peak = 0

    def look(module: nn.Module, args: tuple) -> None:  # runs after outcore's fetch
        nonlocal forward_peak
        now = engine.memory_report()["by_kind"].get("device.unsharded", 0)
        forward_peak = max(forward_peak, now)

    handles = [m.register_forward_pre_hook(look) for m in engine.module.modules()]
    # one batch, every step: the loss then falls step by step (a check that training moves)
    x = torch.randn(BATCH * world, IN, generator=torch.Generator().manual_seed(3))
    x = x.to(engine.device)
    losses = []
    for _ in range(STEPS):
        loss = engine(x[rank * BATCH : (rank + 1) * BATCH])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
    for h in handles:
        h.remove()
    kinds = engine.memory_report()["by_kind"]
    assert {k for k in kinds if k.startswith("device.")} <= {"device.unsharded"}
    engine.close()
    return losses, forward_peak, kinds["peak.device"]


def _compare(splits: int) -> dict:
    cfg = outcore.Config.from_dict(CFG)
    out = {}
    torch.manual_seed(0)
    with outcore.init(cfg):
        untiled = Net()
    engine = outcore.initialize(untiled, cfg)
    rank, world, dev = engine.rank, engine.world_size, engine.device
    out["untiled"] = _train(engine, rank, world)

    torch.manual_seed(0)
    with outcore.init(cfg):
        model = Net()
    assert tile_linears(model, min_params=HID * HID, in_splits=splits, out_splits=splits) == 1
    assert all(managed(p) is not None for p in model.parameters())  # tiles sharded as cut
    out["tiled_sharded"] = _train(outcore.initialize(model, cfg), rank, world)

    torch.manual_seed(0)
    plain = Net()
    plain.big = TiledLinear.from_linear(plain.big, splits, splits)
    out["tiled_plain"] = _train(outcore.initialize(plain, cfg), rank, world)

    # plain PyTorch, untiled, on the whole batch
    torch.manual_seed(0)
    ref = Net().to(dev)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.0)
    x = torch.randn(BATCH * world, IN, generator=torch.Generator().manual_seed(3)).to(dev)
    ref_losses = []
    for _ in range(STEPS):
        parts = [ref(x[r * BATCH : (r + 1) * BATCH]) for r in range(world)]
        (sum(parts) / world).backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(sum(p.item() for p in parts) / world)
    out["reference"] = ref_losses
    return out


def test_tiling_cuts_gathered_working_memory_and_trains_like_linear(
        device: torch.device) -> None:
    # the smallest world that gathers: on the CPU one rank's host shards are the full
    # tensors (zero-copy), on CUDA they are copied to the device
    for r in run_world(_compare, 1 if device.type == "cuda" else 2, 4):
        ref = r["reference"]
        for name in ("untiled", "tiled_sharded", "tiled_plain"):
            losses = r[name][0]
            for a, b in zip(losses, ref, strict=True):
                assert abs(a - b) <= 1e-5 * abs(b), (name, losses, ref)
        assert ref[2] < ref[1] < ref[0]
        big = HID * HID * 4  # fp32 bytes of the big layer's weight
        small = max(IN * HID, HID * OUT) * 4 + 2 * HID * 4  # largest small layer, with biases
        _, fwd_untiled, peak_untiled = r["untiled"]
        assert peak_untiled >= big and fwd_untiled >= big
        for name in ("tiled_sharded", "tiled_plain"):
            _, fwd_tiled, peak_tiled = r[name]
            # one 1/16 tile at a time (two at most while backward hands over), never the layer
            assert fwd_tiled <= big // 16 + HID * 4 + small, (name, fwd_tiled)
            assert peak_tiled <= 2 * (big // 16 + HID * 4) + small, (name, peak_tiled)
            assert peak_tiled <= peak_untiled / 4, (peak_tiled, peak_untiled)
