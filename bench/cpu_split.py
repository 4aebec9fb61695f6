"""Where an offloaded step's CPU time goes, per thread and per function (issue 29's "measure
first").

Builds one bench/train.py row's engine in this process and runs its measured steps while
reading every thread's CPU time from ``/proc/self/task/<tid>/stat`` (user and system apart),
so the offload path's own work (I/O threads: reads, digests, copies; the optimizer's thread)
is told apart from the compute threads' (the main thread and torch's OpenMP pool). The main
thread also runs under cProfile; ``--io-profile`` profiles the I/O and optimizer threads too
(``threading.setprofile``, from the engine's build on; slower, for what they spend their
time on, not for timings).

    python bench/cpu_split.py --row nvme+opt --steps 5 --warmup 2
    python bench/cpu_split.py --row nvme+opt --seq 2048 --top 25
    python bench/cpu_split.py --row nvme+opt --set offload.verify_swap=false
    python bench/cpu_split.py --row nvme+opt --phases     # the disk's busy share per phase
    python bench/cpu_split.py --row nvme+opt --pipeline --no-cprofile   # the update pipeline

``--phases`` samples the disk's busy time every 50 ms and splits it by the step's phases
(forward, backward, the update tail in ``step()``). Busy means a request in flight, not the
disk at its full rate: a share under 100% is idle disk time, a share near 100% does not
prove saturation. ``--pipeline`` (bench/pipeline_trace.py) splits each phase by what the
optimizer's update pipeline did: waited for jobs, for reads or writes, or worked (the update,
casts, digests). The main thread's cProfile slows the hooks' Python; ``--no-cprofile`` turns it
off so the phases keep a bench/train.py step's proportions.

The peak RSS printed is over the measured steps only (``VmHWM`` reset before them). For
native profiles (page faults, libgomp's spinning, the JIT's kernels), ``--perf-ctl`` frames
the measured steps for ``perf``, which then records nothing of the build or the warm-up:

    mkfifo /tmp/ctl
    perf record -g --control fifo:/tmp/ctl -D -1 -o nvme.data -- \
        python bench/cpu_split.py --row nvme+opt --perf-ctl /tmp/ctl
    perf report -i nvme.data --no-children --sort dso -g none
"""

from __future__ import annotations

import argparse
import bisect
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train_worker  # noqa: E402
from lora_scale import disk_busy_ms  # noqa: E402
from train import parse_set  # noqa: E402

from outcore.config import merge_mappings  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def reset_peak_rss() -> None:
    """Start ``VmHWM`` (peak RSS) over from the current RSS (Linux, ``clear_refs`` 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes() -> int:
    """``VmHWM`` of this process: its peak RSS since the start or the last reset."""
    with open("/proc/self/status") as f:
        kib = next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:"))
    return kib * 1024


def thread_times() -> dict[int, tuple[float, float]]:
    """tid -> (user s, system s) of every thread of this process."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        out[int(tid)] = (int(fields[11]) / TICK, int(fields[12]) / TICK)
    return out


def disk_busy_s(path: Path) -> float:
    """Seconds the block device holding ``path`` has been busy (``io_ticks``; 0 where no
    block device answers: tmpfs, overlayfs): a disk kept busy the whole step runs at its
    floor whatever its speed that minute."""
    return disk_busy_ms(path) / 1000


class DiskSampler:
    """The disk's busy-seconds counter sampled every ``every`` seconds on a thread, for the
    busy share of any stretch of time afterwards."""

    def __init__(self, path: Path, every: float = 0.05) -> None:
        self.path, self.every, self.samples = path, every, [(time.perf_counter(),
                                                             disk_busy_s(path))]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="disk-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.samples.append((time.perf_counter(), disk_busy_s(self.path)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def busy(self, a: float, b: float) -> float:
        """Busy seconds between times ``a`` and ``b`` (from the samples around them)."""
        times = [t for t, _ in self.samples]
        i = max(bisect.bisect_right(times, a) - 1, 0)
        j = min(bisect.bisect_left(times, b), len(times) - 1)
        (t0, b0), (t1, b1) = self.samples[i], self.samples[j]
        return (b1 - b0) * (b - a) / (t1 - t0) if t1 > t0 else float("nan")


def thread_names() -> dict[int, str]:
    """tid -> a name for Python threads (numbers stripped, so pools fold into one line)."""
    names = {}
    for t in threading.enumerate():
        if t.native_id is not None:
            base = t.name.rstrip("0123456789-_ ") or t.name
            names[t.native_id] = "main" if t is threading.main_thread() else base
    return names


def process_times() -> tuple[float, float]:
    """(user s, system s) of the whole process, threads that have ended included."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


ENDED = "ended threads (the update pipeline's)"  # it retires after each step


def split(before: dict, after: dict, names: dict,
          process: tuple[tuple[float, float], tuple[float, float]] | None = None,
          ) -> dict[str, dict[str, float]]:
    """CPU per thread name over the window; with the process's totals at both ends
    (``process``), what threads that ended meanwhile used is its own row, so the rows add
    up to the process (the update pipeline retires its thread after each step)."""
    rows: dict[str, dict[str, float]] = {}
    for tid, (u1, s1) in after.items():
        u0, s0 = before.get(tid, (0.0, 0.0))
        name = names.get(tid, "native (torch's OpenMP pool and others)")
        row = rows.setdefault(name, {"user_s": 0.0, "sys_s": 0.0, "threads": 0})
        row["user_s"] += u1 - u0
        row["sys_s"] += s1 - s0
        row["threads"] += 1
    if process is not None:
        (pu0, ps0), (pu1, ps1) = process
        user = pu1 - pu0 - sum(r["user_s"] for r in rows.values())
        system = ps1 - ps0 - sum(r["sys_s"] for r in rows.values())
        if user + system > 2 / TICK:  # more than the clock's rounding
            rows[ENDED] = {"user_s": max(user, 0.0), "sys_s": max(system, 0.0), "threads": 0}
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row", default="nvme+opt", help="a bench/train.py outcore row")
    ap.add_argument("--model", default="gpt-335m")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--clip", type=float, default=0.0)
    ap.add_argument("--set", dest="outcore_set", type=parse_set, action="append", default=[])
    ap.add_argument("--nvme-path", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--top", type=int, default=20, help="functions listed per profile")
    ap.add_argument("--io-profile", action="store_true",
                    help="cProfile the background threads too (distorts timings)")
    ap.add_argument("--phases", action="store_true",
                    help="the disk's busy share per phase (forward, backward, step)")
    ap.add_argument("--pipeline", action="store_true",
                    help="the update pipeline's time per phase (bench/pipeline_trace.py)")
    ap.add_argument("--no-cprofile", action="store_true",
                    help="no cProfile of the main thread: it slows the hooks' Python, so the "
                    "phases' times are nearer a bench/train.py step without it")
    ap.add_argument("--out", type=Path, help="write the split as JSON here")
    ap.add_argument("--perf-ctl", type=Path, metavar="FIFO",
                    help="perf's control FIFO: 'enable' before the measured steps, 'disable' "
                    "after (perf record --control fifo:FIFO -D -1 -- python bench/cpu_split.py)")
    args = ap.parse_args(argv)

    import torch

    from outcore.app.models import resolve_config
    from outcore.device.compute_dtype import resolve

    dtype = resolve(args.dtype, torch.device("cpu")).name if args.dtype == "auto" \
        else args.dtype
    os.makedirs(args.nvme_path, exist_ok=True)  # as bench/train.py makes its swap root
    folder = tempfile.mkdtemp(prefix="cpu-split-", dir=args.nvme_path)
    sets: dict = {}
    for one in args.outcore_set:  # --set a.b=1 --set a.c=2 both apply
        sets = merge_mappings(sets, one)
    spec = {"row": args.row, "model": args.model, "nvme_path": folder, "clip": args.clip,
            "prefetch_bytes": None, "dtype": dtype, "outcore_set": sets}
    profiles: dict[int, cProfile.Profile] = {}
    if args.io_profile:  # threads start with the engine: their profiles cover the whole run
        def start(*_: object) -> None:
            prof = profiles.setdefault(threading.get_native_id(), cProfile.Profile())
            sys.setprofile(None)
            prof.enable()
        threading.setprofile(start)
    engine, _ = train_worker.outcore_engine(spec)
    x, y = train_worker.make_batch(resolve_config(args.model).vocab, args.batch, args.seq,
                                   engine.device)
    step = train_worker.engine_step(engine, x, y)
    trace = None
    if args.pipeline:
        from pipeline_trace import PipelineTrace

        trace = PipelineTrace(engine)
        trace.install()
    for _ in range(args.warmup):
        step()

    main_prof = cProfile.Profile()
    counters = train_worker.store_counters(engine)
    moved0 = counters()
    busy0 = disk_busy_s(Path(folder))
    reset_peak_rss()
    proc0 = process_times()
    before, t0, pb = thread_times(), time.perf_counter(), time.process_time()
    sampler = DiskSampler(Path(folder)) if args.phases or args.pipeline else None
    windows: list[tuple[str, float, float]] = []
    if trace is not None:
        trace.recording = True
    phases = {"forward": [0.0, 0.0], "backward": [0.0, 0.0], "step": [0.0, 0.0]}
    perf = open(args.perf_ctl, "w", buffering=1) if args.perf_ctl else None  # noqa: SIM115
    if perf is not None:
        perf.write("enable\n")
    if not args.no_cprofile:
        main_prof.enable()
    for _ in range(args.steps):
        start = train_worker.now()
        _, fwd_end, bwd_end = step()
        end = train_worker.now()
        if sampler is not None:
            for name, a, b in (("forward", start, fwd_end), ("backward", fwd_end, bwd_end),
                               ("step", bwd_end, end)):
                phases[name][0] += b - a
                phases[name][1] += sampler.busy(a, b)
                windows.append((name, a, b))
    main_prof.disable()
    if perf is not None:
        perf.write("disable\n")
        perf.close()
    if sampler is not None:
        sampler.stop()
    wall, cpu = time.perf_counter() - t0, time.process_time() - pb
    peak_rss = peak_rss_bytes()
    busy = disk_busy_s(Path(folder)) - busy0
    rows = split(before, thread_times(), thread_names(), (proc0, process_times()))
    read, written = (b - a for a, b in zip(moved0, counters(), strict=True))
    engine.close(keep_values=False)
    if os.path.isdir(folder) and not os.listdir(folder):
        os.rmdir(folder)

    moved_gb = (read + written) / 1e9
    print(f"{args.row}, {args.model}, {args.batch}x{args.seq} tokens, {dtype}, "
          f"{os.cpu_count()} cores, torch threads {torch.get_num_threads()}: "
          f"{args.steps} steps in {wall:.2f} s ({wall / args.steps:.3f} s/step), "
          f"process CPU {cpu:.2f} s ({cpu / wall:.2f} cores), "
          f"moved {moved_gb / args.steps:.2f} GB/step (read {read / 1e9 / args.steps:.2f}, "
          f"written {written / 1e9 / args.steps:.2f}), disk busy {busy / wall:.0%} of the time "
          f"({moved_gb / max(busy, 1e-9):.2f} GB/s while busy), "
          f"peak RSS over the measured steps {peak_rss / 2**30:.2f} GiB")
    if sampler is not None:
        print("  ".join(f"{name} {d / args.steps:.2f} s/step, disk busy {b / max(d, 1e-9):.0%}"
                        for name, (d, b) in phases.items()))
    pipe = None
    if trace is not None:
        pipe = trace.by_phase(windows)
        trace.uninstall()
        from pipeline_trace import KINDS

        print(f"{'pipeline, s/step':24}{'phase':9}" + "".join(f" {k[:13]:>13}" for k in KINDS))
        for name, row in pipe.items():
            print(f"{'':24}{name:9}" + "".join(f" {row[k] / args.steps:13.3f}" for k in KINDS))
        firsts = [trace.first_submit(a, b) for n, a, b in windows if n == "backward"]
        print("first submit after backward starts, s: "
              + ", ".join(f"{f:.3f}" if f is not None else "-" for f in firsts))
    print(f"{'thread':44} {'threads':>7} {'user s/step':>11} {'sys s/step':>10} {'share':>6}")
    for name, r in sorted(rows.items(), key=lambda kv: -(kv[1]["user_s"] + kv[1]["sys_s"])):
        tot = r["user_s"] + r["sys_s"]
        print(f"{name[:44]:44} {r['threads']:7d} {r['user_s'] / args.steps:11.3f} "
              f"{r['sys_s'] / args.steps:10.3f} {tot / max(cpu, 1e-9):6.1%}")

    def top(prof: cProfile.Profile, title: str) -> None:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(args.top)
        lines = buf.getvalue().splitlines()
        start = next((i for i, ln in enumerate(lines) if "ncalls" in ln), 0)
        print(f"\n{title} (tottime, {args.steps} steps)")
        print("\n".join(lines[start:start + args.top + 1]))

    if not args.no_cprofile:
        top(main_prof, "main thread")
    for tid, prof in profiles.items():
        top(prof, f"thread {tid} ({thread_names().get(tid, 'ended')}; build and warm-up "
                  "included)")
    if args.out:
        args.out.write_text(json.dumps({"row": args.row, "wall_s": wall, "cpu_s": cpu,
                                        "steps": args.steps, "moved_GB": moved_gb,
                                        "peak_rss_bytes": peak_rss,
                                        "read_GB": read / 1e9, "written_GB": written / 1e9,
                                        "disk_busy_s": busy,
                                        "phases": phases if sampler is not None else None,
                                        "pipeline": pipe,
                                        "threads": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
