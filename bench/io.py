"""outcore's NVMe I/O path against fio, sequential read and write, on the same folder.

Pairs every fio pass (O_DIRECT, libaio, several block sizes) with a pass of outcore's
``NvmeStore``/``AioEngine`` moving the same bytes, alternating which goes first, and prints
the median GB/s of each and the median ratio of the pairs. The target is >= 0.95x of fio
at its best block size.

    python bench/io.py [--path DIR] [--size 1GiB] [--rounds 5] [--bs 1M,4M,8M] [--iodepth 16]

Installs nothing: without ``fio`` it says how to install it and exits 1. Everything it
writes lives in private folders under ``--path`` and is deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from outcore.device.machine import describe  # noqa: E402
from outcore.offload.aio import DEFAULT_BLOCK_BYTES, DEFAULT_THREADS, AioEngine  # noqa: E402
from outcore.offload.buffers import ALIGN, BufferPool, aligned_empty  # noqa: E402
from outcore.offload.nvme import NvmeStore  # noqa: E402

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``"1GiB"``, ``"512M"``, ``"4096"`` -> bytes (binary units)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1] if t and t[-1] in UNITS else ""
    return int(float(t[: len(t) - len(unit)]) * UNITS[unit])


def fio_rate(path: Path, rw: str, size: int, bs: str, iodepth: int) -> float:
    """GB/s that fio reports for one sequential pass over ``path``."""
    cmd = [
        "fio", "--name=seq", f"--filename={path}", f"--size={size}", "--direct=1",
        "--ioengine=libaio", f"--rw={rw}", f"--bs={bs}", f"--iodepth={iodepth}",
        "--numjobs=1", "--output-format=json",
    ]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{") :])["jobs"][0]
    return job[rw]["bw_bytes"] / 1e9


def timed_rate(run: Callable[[], object], nbytes: int) -> float:
    start = time.perf_counter()
    run()
    return nbytes / (time.perf_counter() - start) / 1e9


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{json.dumps(describe())}; {mem:.0f} GiB RAM")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    repo = Path(__file__).resolve().parents[1]
    parser.add_argument("--path", type=Path, default=repo / "bench" / "out", help="folder")
    parser.add_argument("--size", type=parse_size, default=1 << 30, help="bytes per pass")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bs", default="1M,4M,8M", help="fio block sizes, comma-separated")
    parser.add_argument("--iodepth", type=int, default=16, help="fio queue depth")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS, help="outcore threads")
    parser.add_argument("--block-bytes", type=parse_size, default=DEFAULT_BLOCK_BYTES)
    parser.add_argument("--small-pages", action="store_true",
                        help="outcore's buffer from torch's allocator (4 KiB pages), as before "
                        "buffers.py's [Note: huge pages under I/O buffers]")
    args = parser.parse_args(argv)
    if shutil.which("fio") is None:
        print("fio is not installed; install it with:  apt-get install -y fio", file=sys.stderr)
        return 1
    size = args.size - args.size % ALIGN
    sizes = args.bs.split(",")
    args.path.mkdir(parents=True, exist_ok=True)
    print(f"machine: {machine()}; folder: {args.path}; {size / 2**30:.2f} GiB per pass")
    print(f"load average at start: {os.getloadavg()[0]:.2f} (other work skews both sides)")
    print(f"outcore: AioEngine(threads={args.threads}, block_bytes={args.block_bytes})")
    print(f"fio: direct=1 ioengine=libaio iodepth={args.iodepth} numjobs=1 bs={args.bs}")

    data = aligned_empty(size, huge_pages=not args.small_pages)
    print(f"outcore's buffer: {'4 KiB pages' if args.small_pages else 'huge pages (as training)'}")
    data.copy_(torch.randint(0, 256, (1 << 20,), dtype=torch.uint8).repeat(size >> 20 or 1)[:size])
    fio_dir = Path(tempfile.mkdtemp(prefix="outcore-bench-fio-", dir=args.path))
    fio_file = fio_dir / "seq.bin"
    # [Note: paired passes] Other work on a shared 2-core machine moves both tools' rates by
    # 2x within seconds. So every fio pass is paired with an outcore pass of the same bytes
    # right before or after it (the order alternates), and the ratio is the median of the
    # ratios of those pairs, which cancels the slow drift that medians of rates do not.
    pairs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    try:
        with (
            AioEngine(args.threads, args.block_bytes) as engine,
            NvmeStore(args.path, rank=0, engine=engine, pool=BufferPool(ALIGN, ALIGN)) as store,
        ):
            extent = store.allocate(size)
            print(f"outcore O_DIRECT: {store.direct}")
            moves = {"write": store.write, "read": store.read}

            kernel: dict[str, list[float]] = {"read": [], "write": []}

            def ours(rw: str) -> float:
                # kernel CPU time of the whole process (the I/O threads included) per GB moved
                before = resource.getrusage(resource.RUSAGE_SELF).ru_stime
                rate = timed_rate(lambda: moves[rw](extent, data).result(), size)
                after = resource.getrusage(resource.RUSAGE_SELF).ru_stime
                kernel[rw].append((after - before) / (size / 1e9))
                return rate

            step = 0
            for r in range(args.rounds):
                for rw in ("write", "read"):
                    cells = []
                    for bs in sizes:
                        step += 1
                        if step % 2:
                            f = fio_rate(fio_file, rw, size, bs, args.iodepth)
                            o = ours(rw)
                        else:
                            o = ours(rw)
                            f = fio_rate(fio_file, rw, size, bs, args.iodepth)
                        pairs.setdefault((rw, bs), []).append((f, o))
                        cells.append(f"{bs}: fio {f:.2f} outcore {o:.2f}")
                    print(f"round {r + 1} {rw:5}  " + "  ".join(cells), flush=True)
    finally:
        shutil.rmtree(fio_dir, ignore_errors=True)

    med = statistics.median
    print(f"\nmedians of {args.rounds} rounds, GB/s (10^9 bytes/s):\n")
    print("| direction | fio bs | fio | outcore (paired passes) | outcore/fio (paired) |")
    print("|---|---|---|---|---|")
    worst = float("inf")
    for rw in ("read", "write"):
        best_bs = max(sizes, key=lambda bs: med(f for f, _ in pairs[(rw, bs)]))
        for bs in sizes:
            got = pairs[(rw, bs)]
            ratio = med(o / f for f, o in got)
            if bs == best_bs:
                worst = min(worst, ratio)
            mark = " (fio's best)" if bs == best_bs else ""
            print(f"| {rw} | {bs}{mark} | {med(f for f, _ in got):.2f} | "
                  f"{med(o for _, o in got):.2f} | {ratio:.2f}x |")  # fmt: skip
    for rw in ("read", "write"):
        print(f"outcore {rw}: {med(kernel[rw]):.3f} s of kernel CPU time per GB (median)")
    print(f"\nworst ratio against fio's best block size: {worst:.2f}x (target >= 0.95x); "
          f"load average at end: {os.getloadavg()[0]:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
