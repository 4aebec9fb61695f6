"""bench/train.py's worker side: one row, trained in this fresh process, printed as JSON.

Every row trains the same GPT preset on the same fixed random token batch in the compute dtype
the driver resolved (``--dtype``, default ``auto``), with AdamW and seed 0, and times its
steps with ``timed_steps``: medians after warm-up, bytes moved, CPU seconds of the process
(``getrusage``, all threads) and the CPU other processes took meanwhile. ``ds_contender.py``
imports ``timed_steps``, ``engine_step`` and ``make_batch`` from here so DeepSpeed's row is timed
the same way, and ``gpu.py`` builds its rows with ``outcore_engine`` and ``run_plain``. On a GPU
the batch is on the device, every timestamp follows a device synchronize, and the result
carries the device memory peaks.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLACEMENT = {  # row -> (offload.params, offload.optimizer, prefetch on)
    "none": ("none", "none", True),
    "cpu-p0": ("cpu", "none", False), "cpu": ("cpu", "none", True),
    "nvme-p0": ("nvme", "none", False), "nvme": ("nvme", "none", True),
    "nvme+opt-p0": ("nvme", "nvme", False), "nvme+opt": ("nvme", "nvme", True),
    "nvme+opt-reuse": ("nvme", "nvme", True), "nvme+opt-early": ("nvme", "nvme", True),
    "nvme+opt-return": ("nvme", "nvme", True), "nvme+opt-wait": ("nvme", "nvme", True),
    "nvme+opt-lean": ("nvme", "nvme", True), "nvme+opt-small": ("nvme", "nvme", True),
    "nvme+opt-act": ("nvme", "nvme", True), "nvme+opt-lean-act": ("nvme", "nvme", True),
    "nvme+opt-ckpt": ("nvme", "nvme", True), "nvme+opt-ckpt-p384": ("nvme", "nvme", True),
    "nvme+opt-ckpt-early": ("nvme", "nvme", True), "nvme+opt-ckpt-p512": ("nvme", "nvme", True),
    "nvme+opt-ckpt-p512-early": ("nvme", "nvme", True),
    "opt-cpu": ("none", "cpu", True), "cpu+opt": ("cpu", "cpu", True),
    "nvme+opt-cpu": ("nvme", "cpu", True),
}
# a row's own overrides, applied after --set (so --set cannot turn a row into another)
ROW_SET = {"nvme+opt-reuse": {"offload": {"reuse_freed_memory": True}},
           "nvme+opt-return": {"offload": {"reuse_freed_memory": False}},
           "nvme+opt-wait": {"zero": {"speculative_step": False}},
           "nvme+opt-early": {"zero": {"overlap_step_with_forward": True}},
           # the smallest footprint (docs/offload.md): memory given back, 64 MiB buffers
           "nvme+opt-lean": {"offload": {"reuse_freed_memory": False,
                                         "host_buffer_bytes": 64 << 20},
                             "zero": {"prefetch_bytes": 64 << 20}},
           # the small buffers of -lean, freed memory kept where the host has room (the default)
           "nvme+opt-small": {"offload": {"host_buffer_bytes": 64 << 20},
                              "zero": {"prefetch_bytes": 64 << 20}}}
ROW_SET["nvme+opt-lean-act"] = ROW_SET["nvme+opt-lean"]
# a small footprint at little cost in time: every block checkpointed (a block's activations
# are its input), memory given back, and (-p384) a prefetch budget that does not grow
ROW_SET["nvme+opt-ckpt"] = ROW_SET["nvme+opt-return"]
ROW_SET["nvme+opt-ckpt-p384"] = {"offload": {"reuse_freed_memory": False},
                                 "zero": {"prefetch_bytes": 384 << 20}}
# the same, the step's last updates run into the next forward (-early), a 512 MiB budget
ROW_SET["nvme+opt-ckpt-early"] = {"offload": {"reuse_freed_memory": False},
                                  "zero": {"overlap_step_with_forward": True}}
ROW_SET["nvme+opt-ckpt-p512"] = {"offload": {"reuse_freed_memory": False},
                                 "zero": {"prefetch_bytes": 512 << 20}}
ROW_SET["nvme+opt-ckpt-p512-early"] = {"offload": {"reuse_freed_memory": False},
                                       "zero": {"prefetch_bytes": 512 << 20,
                                                "overlap_step_with_forward": True}}
ROW_CHECKPOINT = {row: "on" for row in PLACEMENT if row.startswith("nvme+opt-ckpt")}
# rows whose blocks keep what they save for backward on NVMe (outcore.offload_activations)
ROW_ACTIVATIONS = {"nvme+opt-act": "nvme", "nvme+opt-lean-act": "nvme"}
HP = {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}


def _cpu_jiffies() -> tuple[int, int]:
    """(machine busy jiffies, this process's utime+stime jiffies over all its threads)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    with open("/proc/self/stat") as f:
        p = f.read().rsplit(")", 1)[1].split()
    return sum(v) - v[3] - v[4], int(p[11]) + int(p[12])


def _proc_io() -> tuple[int, int]:
    """(read_bytes, write_bytes) this process caused at the block layer."""
    vals = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            vals[k] = int(v)
    return vals["read_bytes"], vals["write_bytes"]


def timed_steps(step_fn, steps: int, warmup: int, counters=None, profile: str | None = None
                ) -> dict:
    """Run ``step_fn() -> (loss, t_fwd, t_bwd)`` ``steps`` times; medians after ``warmup``.

    ``counters()`` returns (bytes read, bytes written) of the store; sampled around the
    measured steps, as are /proc/self/io and the CPU other processes used meanwhile.
    With ``profile`` (a path), the measured steps run under cProfile and the stats go there.
    """
    import cProfile
    import resource

    prof = cProfile.Profile() if profile else None
    ru0 = None
    hz, ncpu = os.sysconf("SC_CLK_TCK"), os.cpu_count() or 1
    times, phases, losses, others = [], [], [], []
    io0 = store0 = None
    for i in range(steps):
        if i == warmup:
            io0, store0 = _proc_io(), counters() if counters else (0, 0)
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            if prof:
                prof.enable()
        b0, m0 = _cpu_jiffies()
        t0 = time.perf_counter()
        loss, t1, t2 = step_fn()
        t3 = time.perf_counter()
        b1, m1 = _cpu_jiffies()
        times.append(t3 - t0)
        phases.append((t1 - t0, t2 - t1, t3 - t2))
        losses.append(loss)
        others.append(max(0.0, ((b1 - b0) - (m1 - m0)) / hz / ((t3 - t0) * ncpu)))
        print(f"  step {i} loss {loss:.4f} {t3 - t0:.2f}s (fwd {t1 - t0:.2f} bwd {t2 - t1:.2f} "
              f"step {t3 - t2:.2f}) other_cpu {others[-1]:.2f}", file=sys.stderr, flush=True)
    if prof:
        prof.disable()
        prof.dump_stats(profile)
    n = steps - warmup
    io1, store1 = _proc_io(), counters() if counters else (0, 0)
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    med = statistics.median
    return {
        "step_s": med(times[warmup:]), "step_times_s": [round(t, 3) for t in times],
        "fwd_s": med(p[0] for p in phases[warmup:]), "bwd_s": med(p[1] for p in phases[warmup:]),
        "opt_s": med(p[2] for p in phases[warmup:]),
        "losses": [round(x, 5) for x in losses],
        "other_cpu": round(statistics.mean(others[warmup:]), 3),
        "proc_read_per_step": (io1[0] - io0[0]) / n, "proc_write_per_step": (io1[1] - io0[1]) / n,
        "store_read_per_step": (store1[0] - store0[0]) / n,
        "store_write_per_step": (store1[1] - store0[1]) / n,
        # CPU seconds of this process (all threads) and minor page faults, per measured step
        "user_s_per_step": (ru1.ru_utime - ru0.ru_utime) / n,
        "sys_s_per_step": (ru1.ru_stime - ru0.ru_stime) / n,
        "minflt_per_step": (ru1.ru_minflt - ru0.ru_minflt) / n,
    }


def make_batch(vocab: int, batch: int, seq: int, device=None):
    """A fixed random (inputs, targets) batch, drawn on the CPU, on ``device`` (default CPU)."""
    import torch

    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)


def now() -> float:
    """``perf_counter`` once the device has finished the work queued so far (CUDA runs
    asynchronously: a timestamp without this would time the launches)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def device_peaks() -> dict:
    """Peak device memory of this process so far (allocated by tensors, and reserved by the
    caching allocator); empty without CUDA."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    return {"peak_device_allocated": torch.cuda.max_memory_allocated(),
            "peak_device_reserved": torch.cuda.max_memory_reserved()}


def engine_step(engine, x, y):
    """One timed training step of an engine with the ``engine(x, y)`` / ``backward`` /
    ``step`` API (outcore's and DeepSpeed's): returns (loss, end of forward, end of backward)."""

    def step():
        loss = engine(x, y)
        t1 = now()
        engine.backward(loss)
        t2 = now()
        engine.step()
        out = float(loss.detach().float())
        now()  # the step's last kernels are part of it
        return out, t1, t2

    return step


def run_plain(spec: dict) -> dict:
    from outcore.app.models import num_params, resolve_config

    res = timed_steps(plain_step(spec), spec["steps"], spec["warmup"])
    res["params"] = num_params(resolve_config(spec["model"]))
    res.update(device_peaks())
    return res


def plain_step(spec: dict):
    """The plain PyTorch row's model, optimizer and fixed batch, as one timed-step function
    (``timed_steps``'s contract)."""
    import torch

    from outcore.app.models import build_model, resolve_config
    from outcore.device.accel import default_device
    from outcore.device.compute_dtype import DTYPES

    torch.manual_seed(0)
    device = default_device()
    model = build_model(spec["model"]).to(DTYPES[spec["dtype"]]).to(device)
    params = list(model.parameters())
    # plain-master keeps fp32 masters beside the bf16 model, as outcore does
    masters = [p.detach().float() for p in params] if spec["row"] == "plain-master" else None
    opt = torch.optim.AdamW(masters or params, lr=HP["lr"], betas=tuple(HP["betas"]),
                            eps=HP["eps"], weight_decay=HP["weight_decay"], fused=True)
    x, y = make_batch(resolve_config(spec["model"]).vocab, spec["batch"], spec["seq"], device)
    clip = spec["clip"]

    def step():
        loss = model(x, y)
        t1 = now()
        loss.backward()
        t2 = now()
        if masters:
            for m, p in zip(masters, params, strict=True):
                m.grad, p.grad = p.grad.float(), None
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(masters or params, clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if masters:
            with torch.no_grad():
                for m, p in zip(masters, params, strict=True):
                    p.copy_(m)
        out = float(loss.detach().float())
        now()
        return out, t1, t2

    return step


def outcore_engine(spec: dict):
    """The row's engine, built under ``outcore.init``; returns (engine, seconds it took)."""
    import torch

    import outcore
    from outcore.app.blocks import checkpoint_blocks, offload_blocks
    from outcore.app.models import build_model
    from outcore.config import merge_mappings

    params, optim, prefetch = PLACEMENT[spec["row"]]
    zero: dict = {"prefetch_bytes": spec["prefetch_bytes"] if prefetch else 0}
    if prefetch and spec["prefetch_bytes"] is None:
        zero = {}  # outcore's default budget
    cfg = outcore.Config.from_dict({
        "dtype": spec["dtype"], "seed": 0, "optimizer": {"type": "adamw", **HP},
        "offload": {"params": params, "optimizer": optim, "nvme_path": spec["nvme_path"]},
        "zero": zero, "gradient_clipping": spec["clip"],
    })
    cfg = cfg.with_overrides(merge_mappings(spec.get("outcore_set", {}),
                                            ROW_SET.get(spec["row"], {})))
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with outcore.init(cfg):
        model = build_model(spec["model"])
    if spec["row"] in ROW_ACTIVATIONS:  # before checkpointing, which replaces it on a block
        spec["offloaded_blocks"] = offload_blocks(model, ROW_ACTIVATIONS[spec["row"]])
    checkpoint = spec.get("checkpoint") or ROW_CHECKPOINT.get(spec["row"])
    if checkpoint:  # "on" (every block) or a number of blocks: no estimate asked
        spec["checkpointed_blocks"] = checkpoint_blocks(model, checkpoint, 1, 1)
    engine = outcore.initialize(model, cfg)
    return engine, now() - t0


def store_counters(engine):
    """() -> (bytes read, bytes written) of the engine's NVMe store (0, 0 without one)."""

    def counters():
        store = engine.rt._nvme  # only NVMe placements create the store
        return (store.bytes_read, store.bytes_written) if store is not None else (0, 0)

    return counters


def run_outcore(spec: dict) -> dict:
    from outcore.app.models import num_params, resolve_config
    from outcore.offload.storage import Tier

    engine, init_s = outcore_engine(spec)
    x, y = make_batch(resolve_config(spec["model"]).vocab, spec["batch"], spec["seq"],
                      engine.device)
    step = engine_step(engine, x, y)

    res = timed_steps(step, spec["steps"], spec["warmup"], store_counters(engine),
                      spec.get("profile"))
    report = engine.memory_report()
    res.update(init_s=round(init_s, 1), params=num_params(resolve_config(spec["model"])),
               memory_report={k: report[k] for k in (*(t.value for t in Tier), "rss")},
               schedule=engine.schedule_stats(), last_grad_norm=engine.last_grad_norm,
               **device_peaks())
    engine.close(keep_values=False)  # no hand-back: it would count in the peak RSS
    return res


def run_probe(spec: dict) -> dict:
    from outcore.sizing.probe import measure

    return measure(spec["nvme_path"], **spec.get("probe_kwargs", {})).to_json()


def worker(spec: dict) -> None:
    """Run one row in this process and print its ``RESULT`` line; ``compute_threads`` (when
    set) caps torch's intra-op threads, leaving the other cores to outcore's I/O threads."""
    import torch

    sys.path.insert(0, str(REPO))
    if spec.get("compute_threads"):
        torch.set_num_threads(spec["compute_threads"])
    kind = {"plain": run_plain, "plain-master": run_plain, "probe": run_probe}.get(
        spec["row"], run_outcore)
    res = kind(spec)
    res["torch_threads"] = torch.get_num_threads()
    print("RESULT " + json.dumps(res), flush=True)
