"""Activations offloaded without recomputation (``outcore.offload_activations``): the same
gradients bit for bit, the activations gone from memory after forward, their bytes on disk
until backward and nothing left there after it.

The model is tests/common.py's ``ActNet``: a block owning a parameter directly, a child's weight
read outside the child, a root parameter passed into every block, a keyword tensor input.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from outcore.errors import ConfigError
from outcore.memory import saved_disk
from outcore.memory.activations import checkpoint_activations, offload_activations
from tests.common import ACT_BATCH as BATCH
from tests.common import ACT_LAYERS as LAYERS
from tests.common import ACT_SEQ as SEQ
from tests.common import ACT_VOCAB as VOCAB
from tests.common import ActBlock as Block
from tests.common import ActNet as Net
from tests.distributed import run_world


def _engine(params: str, swap: str, **zero: int) -> tuple[outcore.Engine, Net]:
    cfg = outcore.Config.from_dict({
        "dtype": "fp32", "optimizer": {"lr": 1e-2, "eps": 1e-6},
        "zero": {"persistence_threshold_bytes": 0, "overlap_optimizer": False, **zero},
        "offload": {"params": params, "nvme_path": swap},
    })
    torch.manual_seed(0)
    with outcore.init(cfg):
        model = Net()
    return outcore.initialize(model, cfg), model


def _train(params: str, swap: str, steps: int, offloaded: bool) -> dict:
    """Losses, gradients and the disk's counters of ``steps`` steps, with or without offload."""
    small, saved_disk.SMALL_BYTES = saved_disk.SMALL_BYTES, 0  # this model's are all small
    try:
        return _steps(params, swap, steps, offloaded)
    finally:
        saved_disk.SMALL_BYTES = small


def _steps(params: str, swap: str, steps: int, offloaded: bool) -> dict:
    engine, model = _engine(params, swap, prefetch_bytes=0)
    if offloaded:
        assert offload_activations(model, Block, "nvme", engine) == LAYERS
    gen = torch.Generator().manual_seed(1)
    losses, grads, disk = [], [], []
    for _ in range(steps):
        idx = torch.randint(0, VOCAB, (BATCH * engine.world_size, SEQ), generator=gen)
        mine = idx[engine.rank * BATCH : (engine.rank + 1) * BATCH].to(engine.device)
        store = engine.rt.nvme
        before = store.bytes_written
        loss = engine(mine)
        on_disk = engine.memory_report()["by_kind"].get("nvme.activations", 0)
        engine.backward(loss)
        gc.collect()
        disk.append((store.bytes_written - before, on_disk,
                     engine.memory_report()["by_kind"].get("nvme.activations", 0)))
        grads.append(torch.cat([sp.grad.reshape(-1) for sp in engine.params]))
        losses.append(loss.item())
        engine.step()
    engine.close()
    return {"losses": losses, "grads": grads, "disk": disk}


def _both(params: str, swap: str, steps: int) -> tuple[dict, dict]:
    return (_train(params, swap + "/a", steps, False), _train(params, swap + "/b", steps, True))


@pytest.mark.parametrize(("world", "params"), [(1, "nvme"), (2, "none")])
def test_offloaded_blocks_train_bit_for_bit_and_leave_nothing_on_disk(
        world: int, params: str, tmp_path: Path) -> None:
    for plain, offloaded in run_world(_both, world, params, str(tmp_path), 3):
        assert offloaded["losses"] == plain["losses"]
        for g, ref in zip(offloaded["grads"], plain["grads"], strict=True):
            assert torch.equal(torch.as_tensor(g), torch.as_tensor(ref))
        # each block's hidden state alone (BATCH x SEQ x 32 fp32) is 4 KiB: at least that
        # much per block reached the disk, and backward freed every extent
        for (written, held, left), (plain_written, _, _) in zip(
                offloaded["disk"], plain["disk"], strict=True):
            assert written - plain_written >= LAYERS * BATCH * SEQ * 32 * 4
            assert held >= LAYERS * BATCH * SEQ * 32 * 4
            assert left == 0


class _Twice(nn.Module):
    """Saves one intermediate for two operators, and views of one storage."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64, bias=False)
        self.a, self.b = nn.Parameter(torch.ones(64)), nn.Parameter(torch.ones(64))
        self.seen: weakref.ref[torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))  # saved by tanh's backward and by both products'
        self.seen = weakref.ref(h)
        left, right = h.split(32, dim=-1)  # views of h, saved by their product: h's entry
        return (h * self.a + h * self.b).sum() + (left * right).sum()


def _twice(cfg: outcore.Config, offloaded: bool) -> tuple[torch.Tensor, dict, bool, int]:
    """Loss, gradients, whether the intermediate outlived forward, bytes written in forward."""
    torch.manual_seed(0)
    with outcore.init(cfg):
        block = _Twice()
    engine = outcore.initialize(block, cfg)
    if offloaded:
        assert offload_activations(block, _Twice, "nvme", engine) == 1
    store = engine.rt.nvme
    before = store.bytes_written
    loss = engine(torch.randn(128, 64, generator=torch.Generator().manual_seed(1)))
    gc.collect()
    assert block.seen is not None
    alive = block.seen() is not None
    store.wait_idle()
    written = store.bytes_written - before
    engine.backward(loss)
    grads = {sp.name: sp.grad.clone() for sp in engine.params}
    engine.close()
    return loss.detach(), grads, alive, written


@pytest.mark.parametrize(("dtype", "where"), [("fp32", "none"), ("bf16", "nvme")])
def test_one_write_per_storage_and_the_activation_freed_after_forward(
        dtype: str, where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the block saves is in memory only as its bytes on disk: the intermediate itself is
    gone once forward returns (without offload the graph holds it); a tensor saved by several
    operators, or as views, is written once; weights stay where the engine keeps them
    (params and optimizer on NVMe in bf16: copies kept in memory, shown as they are)."""
    monkeypatch.setattr(saved_disk, "SMALL_BYTES", 0)
    cfg = outcore.Config.from_dict({
        "dtype": dtype, "zero": {"overlap_optimizer": False},
        "offload": {"params": where, "optimizer": where, "nvme_path": str(tmp_path)}})
    loss, grads, alive, written = _twice(cfg, offloaded=False)
    assert alive and written == 0
    loss2, grads2, alive2, written2 = _twice(cfg, offloaded=True)
    assert not alive2
    # the block's input (the caller's, saved by the linear layer) and h once: for tanh,
    # both products and its split views
    assert written2 == 2 * 128 * 64 * (4 if dtype == "fp32" else 2)
    assert torch.equal(loss2, loss)
    for name, g in grads.items():
        assert torch.equal(grads2[name], g), name


def test_small_tensors_stay_in_memory_and_no_grad_writes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, model = _engine("none", str(tmp_path))
    offload_activations(model, Block, "nvme", engine)
    store = engine.rt.nvme
    idx = torch.randint(0, VOCAB, (BATCH, SEQ))
    engine.backward(engine(idx))  # every saved tensor here is under SMALL_BYTES
    store.wait_idle()
    assert store.bytes_written == 0
    monkeypatch.setattr(saved_disk, "SMALL_BYTES", 0)  # now every one would go
    with torch.no_grad():
        engine(idx)
    store.wait_idle()
    assert store.bytes_written == 0
    engine.backward(engine(idx))
    store.wait_idle()
    assert store.bytes_written > 0
    engine.close()


def test_a_model_reused_by_a_second_engine(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Offloaded without naming an engine, the model's own runtime is used; after close() a
    second engine on the same model trains with its own swap file, as it came."""
    monkeypatch.setattr(saved_disk, "SMALL_BYTES", 0)
    engine, model = _engine("nvme", str(tmp_path))
    offload_activations(model, Block, "nvme")
    idx = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    engine.backward(engine(idx))
    engine.step()
    engine.close()
    cfg = outcore.Config.from_dict({"dtype": "fp32", "optimizer": {"lr": 1e-2, "eps": 1e-6},
                                    "zero": {"overlap_optimizer": False},
                                    "offload": {"params": "nvme", "nvme_path": str(tmp_path)}})
    second = outcore.initialize(model, cfg)
    torch.manual_seed(5)  # the blocks' dropout
    loss = second(idx)
    second.backward(loss)
    second.rt.nvme.wait_idle()
    assert second.rt.nvme.bytes_written > 0 and torch.isfinite(loss)
    offload_activations(model, Block, "none")
    torch.manual_seed(5)
    ref = second(idx)
    assert torch.equal(loss.detach(), ref.detach())  # no step between: the same weights
    second.close()


def test_to_none_gives_each_block_its_forward_back_and_checkpointing_replaces_it() -> None:
    model = Net()
    blocks = list(model.blocks)
    outer = blocks[0].forward  # a forward set on the instance before us (another library's)
    blocks[0].forward = outer
    assert offload_activations(model, Block, "cpu") == LAYERS
    assert not blocks[1].forward.recompute
    assert checkpoint_activations(model, lambda n, m: m is blocks[1]) == 1
    assert blocks[1].forward.recompute
    assert offload_activations(model, Block, "none") == LAYERS
    assert blocks[0].forward is outer
    assert all("forward" not in b.__dict__ for b in blocks[1:])
    with pytest.raises(ValueError, match="to must be"):
        offload_activations(model, Block, "disk")  # type: ignore[arg-type]


def test_nvme_needs_a_runtime_and_a_swap_folder() -> None:
    model = Net()
    offload_activations(model, Block, "nvme")
    with pytest.raises(ValueError, match="runtime"):
        model(torch.randint(0, VOCAB, (BATCH, SEQ)))
    cfg = outcore.Config.from_dict({"dtype": "fp32"})
    with outcore.init(cfg):
        model = Net()
    engine = outcore.initialize(model, cfg)
    with pytest.raises(ConfigError, match="nvme_path"):
        offload_activations(model, Block, "nvme", engine)
    engine.close()


def _gpt2(offloaded: bool, swap: str) -> tuple[list[float], int]:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    cfg = outcore.Config(dtype="fp32", optimizer={"lr": 1e-3, "eps": 1e-6},
                         offload={"params": "nvme", "optimizer": "nvme", "nvme_path": swap})
    torch.manual_seed(0)
    with outcore.init(cfg):
        model = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=128,
                                           n_positions=64, bos_token_id=0, eos_token_id=0))
    engine = outcore.initialize(model, cfg)
    if offloaded:
        assert offload_activations(model, GPT2Block, "nvme") == 3  # the runtime found alone
    ids = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(3):
        loss = engine(input_ids=ids, labels=ids).loss  # a KV cache is fine: nothing reruns
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    written = engine.rt.nvme.bytes_written
    engine.close()
    return losses, written


def test_hugging_face_gpt2_offloaded_by_block_class(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    monkeypatch.setattr(saved_disk, "SMALL_BYTES", 0)
    plain, plain_written = _gpt2(False, str(tmp_path / "a"))
    offloaded, written = _gpt2(True, str(tmp_path / "b"))
    assert offloaded == plain
    assert plain[-1] < plain[0]
    # at least each block's input (4 x 64 x 64 fp32) every step
    assert written >= plain_written + 3 * 3 * 4 * 64 * 64 * 4


def test_a_plain_model_keeps_its_weights_in_place(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A model outcore does not manage, offloaded into an engine's swap file: its parameters'
    views (the linear layer's weight) are never copied out, only activations are."""
    monkeypatch.setattr(saved_disk, "SMALL_BYTES", 0)
    cfg = outcore.Config.from_dict({"dtype": "fp32", "offload": {"nvme_path": str(tmp_path)}})
    engine = outcore.initialize(nn.Linear(4, 4), cfg)  # lends its runtime's swap file
    x = torch.randn(128, 64)
    grads = []
    for offloaded in (False, True):
        torch.manual_seed(0)
        block = _Twice()
        if offloaded:
            offload_activations(block, _Twice, "nvme", engine)
        store = engine.rt.nvme
        before = store.bytes_written
        block(x).backward()
        store.wait_idle()
        gc.collect()
        saved_disk.settle()  # extents are freed by a thread, never by a finalizer
        if offloaded:
            assert store.bytes_written - before == 2 * 128 * 64 * 4  # x and h
        assert store.bytes_allocated == 0
        grads.append([p.grad for p in block.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)
    engine.close()


_CYCLES = """
import gc, sys, tempfile, torch, outcore
from torch import nn
from outcore.memory import saved_disk
from outcore.memory.activations import offload_activations
saved_disk.SMALL_BYTES = 0
engine = outcore.initialize(nn.Linear(4, 4), outcore.Config.from_dict(
    {"dtype": "fp32", "offload": {"nvme_path": sys.argv[1]}}))
class Block(nn.Module):
    def __init__(self): super().__init__(); self.lin = nn.Linear(64, 64)
    def forward(self, x): return torch.tanh(self.lin(x))
m = nn.Sequential(Block(), Block())
offload_activations(m, Block, "nvme", engine)
x = torch.randn(64, 64)
gc.set_threshold(5)  # the collector runs often, inside the store's and the ledger's locks too
for _ in range(1000):
    out = m(x); out.keep = [out]; del out  # a graph only the cyclic collector frees
gc.collect(); saved_disk.settle()
print("done", engine.rt.nvme.bytes_allocated)
"""


def test_graphs_the_garbage_collector_frees_do_not_hang(tmp_path: Path) -> None:
    """An entry collected inside the store's or the ledger's lock queues its extent instead
    of taking that lock again (it hung the process), and its extent is freed all the same."""
    run = subprocess.run([sys.executable, "-c", _CYCLES, str(tmp_path)], capture_output=True,
                         text=True, timeout=240, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["done", "0"]


def test_a_loop_keeping_its_last_output_does_not_pile_up(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Forwards with no backward while the previous output is still held (an evaluation with
    gradients on): the saver forgets the dropped forwards' records, and their extents go."""
    monkeypatch.setattr(saved_disk, "SMALL_BYTES", 0)
    cfg = outcore.Config.from_dict({"dtype": "fp32", "offload": {"nvme_path": str(tmp_path)}})
    engine = outcore.initialize(nn.Linear(4, 4), cfg)
    model = nn.Sequential(_Twice(), _Twice())

    def forward(x: torch.Tensor) -> torch.Tensor:
        return model[1](model[0](x).expand(128, 64))

    offload_activations(model, _Twice, "nvme", engine)
    saver = model[0].forward.place.saver()
    x = torch.randn(128, 64)
    out = None
    for _ in range(300):
        out = forward(x)
    # bounded, not one per block call (600 here): the caller's input, saved by every forward,
    # keeps the first segment's entry alive, so the others go by the sweeps
    assert len(saver._gen.segments) <= 70
    assert len(saver._by_base) <= 70
    del out
    gc.collect()
    saved_disk.settle()
    assert engine.rt.nvme.bytes_allocated == 0
    engine.close()


class _Exp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.exp()  # saves its output


@pytest.mark.parametrize("n", [16, 512])  # 1 KiB stays in memory, 1 MiB goes to disk
def test_a_saved_tensor_changed_in_place_raises_as_in_torch(n: int, tmp_path: Path) -> None:
    cfg = outcore.Config.from_dict({"dtype": "fp32", "offload": {"nvme_path": str(tmp_path)}})
    engine = outcore.initialize(nn.Linear(4, 4), cfg)
    for offloaded in (False, True):
        block = _Exp()
        if offloaded:
            offload_activations(block, _Exp, "nvme", engine)
        x = torch.randn(n, n, requires_grad=True)
        y = block(x)
        y.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()
    engine.close()


def test_conjugate_and_negative_views_keep_their_values(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(saved_disk, "SMALL_BYTES", 0)
    cfg = outcore.Config.from_dict({"dtype": "fp32", "offload": {"nvme_path": str(tmp_path)}})
    engine = outcore.initialize(nn.Linear(4, 4), cfg)

    class Conj(nn.Module):
        def __init__(self, fn) -> None:  # noqa: ANN001
            super().__init__()
            self.fn = fn

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fn(x)

    fns = [lambda x: (torch.view_as_complex(x).conj() * torch.view_as_complex(x)).real.sum(),
           lambda x: (torch.view_as_complex(x)[:2].conj() * torch.view_as_complex(x)[:2])
           .real.sum(),
           lambda x: (torch.view_as_complex(x).conj().imag * x[..., 0]).sum()]
    for fn in fns:
        grads = []
        for offloaded in (False, True):
            block = Conj(fn)
            if offloaded:
                offload_activations(block, Conj, "nvme", engine)
            x = torch.randn(256, 64, 2, generator=torch.Generator().manual_seed(0),
                            requires_grad=True)
            block(x).backward()
            grads.append(x.grad)
        assert torch.equal(*grads)
    engine.close()


def test_a_closed_engine_or_a_wrong_object_is_refused(tmp_path: Path) -> None:
    cfg = outcore.Config.from_dict({"dtype": "fp32", "offload": {"nvme_path": str(tmp_path)}})
    engine = outcore.initialize(nn.Linear(4, 4), cfg)
    for to in ("nvme", "cpu"):
        with pytest.raises(TypeError, match="Engine or Runtime.*got Sequential"):
            offload_activations(Net(), Block, to, nn.Sequential())  # type: ignore[arg-type]
    engine.close()
    with pytest.raises(outcore.EngineClosedError, match="open engine"):
        offload_activations(Net(), Block, "nvme", engine)


class _Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.lin, self.gate = nn.LayerNorm(256), nn.Linear(256, 256), nn.Linear(256, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)  # sigmoid's output (2 KiB) stays in memory, saved by sigmoid itself
        return torch.tanh(self.lin(h)) * torch.sigmoid(self.gate(h))


def test_a_graph_dropped_without_backward_frees_its_extents(tmp_path: Path) -> None:
    """Forwards whose outputs are dropped unused: a small output kept in memory must not hold
    its graph (and with it every extent on disk) in a loop the collector cannot see."""
    cfg = outcore.Config.from_dict({"dtype": "fp32", "offload": {"nvme_path": str(tmp_path)}})
    engine = outcore.initialize(nn.Linear(4, 4), cfg)
    model = nn.Sequential(_Gated(), _Gated())
    offload_activations(model, _Gated, "nvme", engine)
    x = torch.randn(512, 256, requires_grad=True)
    store = engine.rt.nvme
    for _ in range(3):
        out = model(x)
        del out
    gc.collect()
    saved_disk.settle()
    assert store.bytes_written > 0
    assert store.bytes_allocated == 0
    out = model(x)
    engine.close()
    with pytest.raises(outcore.EngineClosedError, match="closed since forward"):
        out.sum().backward()
