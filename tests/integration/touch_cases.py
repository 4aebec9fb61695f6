"""What users do with a model, in every lifecycle state, on outcore's model and a plain copy.

``python -m tests.integration.touch_cases OFFLOAD WORLD START OUT`` runs the cases from index
START on and appends one JSON line per finished case to OUT (rank 0 writes): a process that
crashes loses only the case it was running, which tests/integration/test_model_touch.py then
reports as crashed, and starts again after it. Each case builds a fresh model and engine,
brings it and its plain-PyTorch twin into a lifecycle state, runs one action on both and
compares: the action's result (values, or the same exception), then a probe (a forward, one more
training step where an engine runs, every parameter's value).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import pickle
import signal
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from outcore.device.accel import default_device

HP = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
CLIP = 1.0  # clipping keeps every update after backward (no updates during it)
STATES = ("fresh", "mid_step", "trained", "failed", "failed_backward", "second", "reopened",
          "gathered", "closed")


@dataclass
class Action:
    fn: Callable[[nn.Module, Any], Any]
    reads: bool = False  # reads values: at W > 1 refused outside gathered_parameters
    kind: str = "read"


def _no_grad(fn: Callable) -> Callable:
    def run(m: nn.Module, c: Any) -> Any:
        with torch.no_grad():
            return fn(m, c)
    return run


def _seeded(fn: Callable) -> Callable:
    def run(m: nn.Module, c: Any) -> Any:
        torch.manual_seed(5)
        return fn(m, c)
    return run


def _eval_call(m: nn.Module, c: Any) -> Any:
    m.eval()
    try:
        with torch.no_grad():
            return m(c.x)
    finally:
        m.train()


def _inference(m: nn.Module, c: Any) -> Any:
    with torch.inference_mode():
        return m(c.x).clone()


def _penalty_step(m: nn.Module, c: Any) -> Any:
    """A loss with a weight penalty computed outside the forward (gradients must reach it)."""
    return c.train_step(m, penalty=True)


def _saved_and_loaded(m: nn.Module) -> nn.Module:
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _other_state(m: nn.Module, c: Any) -> Any:
    torch.manual_seed(7)
    other = _model()
    return m.load_state_dict(other.state_dict())


ACTIONS: dict[str, Action] = {
    # reads
    "sum": Action(lambda m, c: m[0].weight.sum(), reads=True),
    "detach_cpu": Action(lambda m, c: m[0].weight.detach().cpu(), reads=True),
    "tolist": Action(lambda m, c: m[2].bias.tolist(), reads=True),
    "item": Action(lambda m, c: m[2].bias[3].item(), reads=True),
    "allclose": Action(lambda m, c: torch.allclose(m[0].weight, c.ref_w0, atol=1e-5),
                       reads=True),
    "state_dict": Action(lambda m, c: {k: v.clone() for k, v in m.state_dict().items()},
                         reads=True),
    "norms_no_grad": Action(_no_grad(lambda m, c: torch.stack([p.norm() for p in
                                                                 m.parameters()])), reads=True),
    "data_norm": Action(lambda m, c: m[0].weight.data.norm(), reads=True),
    "repr": Action(lambda m, c: repr(m[2].bias), reads=True),
    "pickle": Action(lambda m, c: pickle.loads(pickle.dumps(m[2].bias)), reads=True),
    "deepcopy_call": Action(lambda m, c: copy.deepcopy(m)(c.x), reads=True),
    "torch_save_model": Action(lambda m, c: _saved_and_loaded(m)(c.x), reads=True),
    "p2v": Action(lambda m, c: nn.utils.parameters_to_vector(m.parameters()), reads=True),
    "penalty_step": Action(_penalty_step, reads=True, kind="train"),
    # calls
    "call_train": Action(lambda m, c: m(c.x), kind="call"),
    "call_eval_no_grad": Action(_eval_call, kind="call"),
    "call_inference_mode": Action(_inference, kind="call"),
    "to_same_device": Action(lambda m, c: m.to(c.x.device)(c.x), kind="call"),
    # writes
    "fill_no_grad": Action(_no_grad(lambda m, c: m[0].weight.fill_(0.5)), kind="write"),
    "copy_no_grad": Action(_no_grad(lambda m, c: m[2].weight.copy_(c.const)), kind="write"),
    "init_normal": Action(_seeded(lambda m, c: nn.init.normal_(m[2].weight, std=0.1)),
                          kind="write"),
    "init_kaiming": Action(_seeded(lambda m, c: nn.init.kaiming_uniform_(
        m[0].weight, a=math.sqrt(5))), kind="write"),
    "data_assign": Action(lambda m, c: setattr(m[2].bias, "data", c.data), kind="write"),
    "data_fill": Action(lambda m, c: m[0].weight.data.fill_(0.125), kind="write"),
    "data_row_zero": Action(lambda m, c: m[0].weight.data[3].zero_(), kind="write"),
    "setitem_no_grad": Action(_no_grad(lambda m, c: m[0].weight.__setitem__(
        (1, slice(0, 5)), 2.0)), kind="write"),
    "mul_no_grad": Action(_no_grad(lambda m, c: m[0].weight.mul_(0.5)), kind="write"),
    "add_tensor_no_grad": Action(_no_grad(lambda m, c: m[0].weight.add_(c.ones)),
                                 kind="write"),
    "load_state_dict": Action(_other_state, kind="write"),
    "leaf_inplace_grad": Action(lambda m, c: m[0].weight.fill_(1.0), kind="write"),
    "zero_grad": Action(lambda m, c: m.zero_grad(), kind="write"),
    "half": Action(lambda m, c: m.half(), kind="write"),
    # a parametrization makes nn.Parameter(p): refused while the engine holds the model
    "weight_norm": Action(lambda m, c: nn.utils.parametrizations.weight_norm(m[2]),
                          kind="write"),
}


def expect(state: str, action: str, world: int) -> str | None:
    """What the outcore side must do: "same" (as plain PyTorch), "refused" (outcore's
    ParamAccessError), "text" (a descriptive repr), or None (not a meaningful case)."""
    if action == "weight_norm":  # calls.py's refuse_new_parameter; once closed, the model
        return "refused" if state != "closed" else None  # is torch's (and so is its optimizer)
    if state == "closed":
        return "same"
    if action == "half":  # the engine computes in the config's dtype
        return None if state == "gathered" else "refused"
    if state == "gathered" and ACTIONS[action].kind == "train":
        return "refused"  # a step inside gathered_parameters(modify=True) would be undone
    if world > 1 and ACTIONS[action].reads and state != "gathered":
        return "text" if action == "repr" else "refused"
    return "same"


def cases(world: int) -> list[tuple[str, str, str]]:
    out = []
    for state in STATES:
        for action in ACTIONS:
            want = expect(state, action, world)
            if want is not None:
                out.append((state, action, want))
    return out


# -- the two models ----------------------------------------------------------------------------
def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))


PLACEMENTS = {  # offload names beyond "none"/"cpu"/"nvme" (params and optimizer together)
    # masters in memory: the params' copies are cast from them (storage.py's CastShard)
    "nvme-params": {"params": "nvme", "optimizer": "none"},
}


class Pair:
    """outcore's model with its engine, and a plain copy with torch's AdamW, in step."""

    def __init__(self, offload: str, swap: str) -> None:
        import outcore

        self.outcore = outcore
        torch.manual_seed(0)
        # built where the engine computes, as a GPU user moves a model before handing it over,
        # so close() hands it back there and plain calls after it take the same inputs
        self.model = _model().to(default_device())
        self.ref = copy.deepcopy(self.model)
        self.cfg = {"dtype": "fp32", "gradient_clipping": CLIP,
                    "optimizer": {"type": "adamw", **HP},
                    "offload": {**PLACEMENTS.get(offload, {"params": offload,
                                                           "optimizer": offload}),
                                "nvme_path": swap,
                                "host_buffer_bytes": 4 << 20, "io_block_bytes": 1 << 20,
                                "io_threads": 1}}
        self.engine = outcore.initialize(self.model, self.cfg)
        self.opt = torch.optim.AdamW(self.ref.parameters(), **HP)
        self.plain_opt: torch.optim.Optimizer | None = None  # the model's, once handed back
        g = torch.Generator().manual_seed(1)
        dev = self.engine.device
        self.x = torch.randn(4, 64, generator=g).to(dev)
        self.const = torch.randn(8, 64, generator=g).to(dev)
        self.ones = torch.ones(64, 64, device=dev)

    @property
    def ref_w0(self) -> torch.Tensor:
        return self.ref[0].weight.detach().clone()

    @property
    def data(self) -> torch.Tensor:
        return torch.full((8,), 0.25, device=self.x.device)

    def train_step(self, m: nn.Module, penalty: bool = False) -> float:
        """One step of the side ``m`` is: the engine's while it runs, else torch's."""
        def loss_of(model: nn.Module) -> torch.Tensor:
            loss = model(self.x).pow(2).mean()
            return loss + 1e-2 * model[0].weight.pow(2).sum() if penalty else loss

        if m is self.model and not self.engine.closed:
            loss = loss_of(m)
            self.engine.backward(loss)
            self.engine.step()
            return loss.item()
        opt = self.opt if m is self.ref else self._plain_opt()
        loss = loss_of(m)
        loss.backward()
        nn.utils.clip_grad_norm_(m.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        return loss.item()

    def _plain_opt(self) -> torch.optim.Optimizer:
        if self.plain_opt is None:
            self.plain_opt = torch.optim.AdamW(self.model.parameters(), **HP)
        return self.plain_opt

    def both_steps(self) -> None:
        self.train_step(self.model)
        self.train_step(self.ref)

    def values(self) -> dict[str, torch.Tensor]:
        """Every parameter's value on the outcore side (a collective while the engine runs)."""
        if self.engine.closed:
            return {n: p.detach().clone() for n, p in self.model.named_parameters()}
        with self.engine.gathered_parameters():
            return {n: p.data.clone() for n, p in self.model.named_parameters()}


@contextlib.contextmanager
def enter(state: str, pair: Pair):
    """Bring both sides into ``state``; the action runs inside the context."""
    if state == "mid_step":  # backward done, step not yet
        pair.engine.backward(pair.model(pair.x).pow(2).mean())
        pair.ref(pair.x).pow(2).mean().backward()
    elif state in ("trained", "failed", "failed_backward", "second", "reopened", "gathered",
                   "closed"):
        pair.both_steps()
        if state == "trained":
            pair.both_steps()
    if state == "failed":  # an exception in the middle of a forward
        def boom(module: nn.Module, args: tuple) -> None:
            raise ValueError("boom")
        handle = pair.model[2].register_forward_pre_hook(boom)
        with contextlib.suppress(ValueError):
            pair.model(pair.x)
        handle.remove()
    if state == "failed_backward":  # an exception in the middle of a backward, both sides
        def boom(grad: torch.Tensor) -> None:
            raise ValueError("boom")
        for side in (pair.model, pair.ref):
            out = side(pair.x)
            out.register_hook(boom)
            with contextlib.suppress(ValueError):
                if side is pair.model:
                    pair.engine.backward(out.pow(2).mean())
                else:
                    out.pow(2).mean().backward()
    if state == "second":  # a second engine takes the model; its optimizer starts fresh
        pair.engine = pair.outcore.initialize(pair.model, pair.cfg)
        pair.opt = torch.optim.AdamW(pair.ref.parameters(), **HP)
    if state in ("closed", "reopened"):
        pair.engine.close()
        pair.opt = torch.optim.AdamW(pair.ref.parameters(), **HP)
    if state == "reopened":
        pair.engine = pair.outcore.initialize(pair.model, pair.cfg)
    if state == "gathered":
        with pair.engine.gathered_parameters(modify=True):
            yield
        return
    yield


# -- comparing ---------------------------------------------------------------------------------
def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().float().cpu()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, nn.Module):
        return {n: _plain(p) for n, p in value.named_parameters()}
    return value


def differ(a: Any, b: Any, path: str = "", tol: float = 1e-5) -> str | None:
    """Where ``a`` and ``b`` differ beyond fp32 noise (``tol``, absolute), or None."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape:
            return f"{path}: shape {list(a.shape)} vs {list(b.shape)}"
        if not torch.allclose(a, b, rtol=10 * tol, atol=tol):
            return f"{path}: max abs diff {float((a - b).abs().max()):.3g}"
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{path}: keys {sorted(a)} vs {sorted(b)}"
        return next((d for k in a if (d := differ(a[k], b[k], f"{path}.{k}", tol))), None)
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: length {len(a)} vs {len(b)}"
        return next((d for i, (x, y) in enumerate(zip(a, b, strict=True))
                     if (d := differ(x, y, f"{path}[{i}]", tol))), None)
    if isinstance(a, float) and isinstance(b, float):
        return None if math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-5) else f"{path}: {a} vs {b}"
    if isinstance(a, str) and isinstance(b, str) and a.startswith("Parameter containing"):
        return differ(_numbers(a), _numbers(b), path)
    return None if a == b else f"{path}: {a!r} vs {b!r}"


def _numbers(text: str) -> list[float]:
    import re

    return [float(x) for x in re.findall(r"-?\d+\.\d+(?:e[-+]\d+)?", text)]


def run_case(state: str, action: str, want: str, offload: str, swap: str) -> dict:
    """One case: its verdict ("ok" or what went wrong) and the outcome on each side."""
    from outcore.errors import OutcoreError, ParamAccessError

    pair = Pair(offload, swap)
    act = ACTIONS[action]
    if os.environ.get("OUTCORE_TOUCH_CRASH") == f"{state}:{action}":  # the harness's own test
        os.kill(os.getpid(), signal.SIGSEGV)
    mine = theirs = None
    with enter(state, pair):
        keep = (lambda v: None) if act.kind == "write" else _plain  # the probe checks writes
        try:
            mine = ("value", keep(act.fn(pair.model, pair)))
        except Exception as e:  # noqa: BLE001 - compared below
            mine = ("error", type(e).__name__, str(e).splitlines()[0][:300],
                    isinstance(e, ParamAccessError), isinstance(e, OutcoreError))
        if mine[0] == "value" or not mine[3]:  # refused by outcore: plain skips it too
            try:
                theirs = ("value", keep(act.fn(pair.ref, pair)))
            except Exception as e:  # noqa: BLE001
                theirs = ("error", type(e).__name__, str(e).splitlines()[0][:300])
    verdict = _verdict(want, mine, theirs, pair, act.kind)
    if not pair.engine.closed:
        pair.engine.close(keep_values=False)
    return {"state": state, "action": action, "want": want, "verdict": verdict,
            "mine": str(mine)[:400], "theirs": str(theirs)[:400]}


def _verdict(want: str, mine: tuple, theirs: tuple | None, pair: Pair, kind: str) -> str:
    if want == "refused":
        if mine[0] != "error" or not mine[3]:
            return f"expected outcore's ParamAccessError, got {mine}"
    elif want == "text":
        if mine[0] != "value" or "gathered_parameters" not in str(mine[1]):
            return f"expected a repr naming gathered_parameters, got {mine}"
    else:
        if mine[0] == "error" and (theirs is None or theirs[0] != "error"
                                   or theirs[1] != mine[1]):
            return f"outcore raised {mine[1]}: {mine[2]} (plain: {theirs})"
        if mine[0] == "value" and theirs[0] == "error":
            return f"plain raised {theirs[1]} but outcore did not"
        if mine[0] == "value" and (d := differ(mine[1], theirs[1], "result")):
            return f"result differs from plain PyTorch: {d}"
    return _probe(pair, kind)


def _probe(pair: Pair, kind: str) -> str:
    """After the action: same forward, same values, and, after anything but a read, the same
    one step later, so a write that missed the fp32 masters shows up."""
    x = pair.x.to(pair.ref[0].weight.dtype)  # a plain model may have been cast (half)
    if (d := differ(_plain(pair.model(x)), _plain(pair.ref(x)), "forward")):
        return f"after the action: {d}"
    ref = {n: p.detach().clone() for n, p in pair.ref.named_parameters()}
    if (d := differ(pair.values(), ref, "params")):
        return f"after the action: {d}"
    if x.dtype != torch.float32 or kind == "read":
        return "ok"
    pair.both_steps()
    ref = {n: p.detach().clone() for n, p in pair.ref.named_parameters()}
    # Adam's first step moves a weight by lr·g/(|g| + eps): where g is near eps, fp32 noise in
    # it moves the weight by a part of lr (1e-2). A gradient of -1.5e-9 did so by 1.75e-4 on the
    # AMD Zen 5 kind, whose kernels sum in another order (on a GPU too); a missed write is off
    # by more than 1e-2
    tol = 1e-3
    if (d := differ(pair.values(), ref, "params", tol=tol)):
        return f"one step after the action: {d}"
    return "ok"


# -- the process -------------------------------------------------------------------------------
def run(offload: str, world: int, start: int, out: str, rank: int) -> None:
    torch.set_num_threads(1)
    swap = tempfile.mkdtemp(prefix=f"touch-{rank}-")
    todo = cases(world)
    for index in range(start, len(todo)):
        state, action, want = todo[index]
        try:
            row = run_case(state, action, want, offload, swap)
        except Exception:  # noqa: BLE001 - a failure of the harness itself, reported as such
            row = {"state": state, "action": action, "want": want,
                   "verdict": "harness error:\n" + traceback.format_exc()[-1500:]}
        row["index"] = index
        if rank == 0:
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")


def _rank_main(offload: str, world: int, start: int, out: str, rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1")
    run(offload, world, start, out, rank)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def main(argv: list[str]) -> None:
    offload, world, start, out = argv[0], int(argv[1]), int(argv[2]), argv[3]
    if world == 1:
        run(offload, 1, start, out, 0)
        return
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(offload, world, start, out, r, port))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    bad = [p.exitcode for p in procs if p.exitcode]
    sys.exit(bad[0] if bad else 0)


if __name__ == "__main__":
    main(sys.argv[1:])
