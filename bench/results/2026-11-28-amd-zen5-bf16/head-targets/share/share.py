"""How much wall time does CPU work in a second thread cost a 2-thread bf16 compute loop?

The compute loop (torch's intra-op threads, 2 by default) runs N bf16 matmuls; a second
thread runs elementwise fp32 work with one intra-op thread (as outcore's update thread
does) for as long as the compute loop runs, releasing the GIL inside each op. Printed: the
loop's wall alone and beside the worker, the worker's CPU seconds over the loop, and the
ratio extra wall / worker CPU: 0.5 would mean the two cores are shared evenly, 1.0 that
each CPU-second of the worker costs the compute a full second (likely because the compute's
threads wait at each op's end for the one that lost its core; not measured apart). The
worker's CPU includes its last pass after the loop ends, which lowers the ratio a little.

    python share.py [--n 60] [--size 2048] [--work-mib 64] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import threading
import time

import torch


def compute(n: int, a: torch.Tensor, b: torch.Tensor) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        torch.mm(a, b)
    return time.perf_counter() - t0


def worker(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor, duty: float,
           stop: threading.Event, cpu: list[float]) -> None:
    """Adam-like passes over memory on one intra-op thread until ``stop``; with ``duty`` < 1
    it sleeps after each pass, as a thread waiting for the disk does."""
    torch.set_num_threads(1)
    c0 = time.thread_time()
    while not stop.is_set():
        t0 = time.perf_counter()
        x.mul_(0.999).add_(y, alpha=0.001)
        z.copy_(x)
        busy = time.perf_counter() - t0
        if duty < 1.0:
            time.sleep(busy * (1 - duty) / duty)
    cpu[0] = time.thread_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=60)
    ap.add_argument("--size", type=int, default=2048)
    ap.add_argument("--work-mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duty", type=float, default=1.0,
                    help="share of the time the worker computes (the rest it sleeps, as a "
                         "thread waiting for the disk does)")
    args = ap.parse_args()
    a = torch.randn(args.size, args.size).bfloat16()
    b = torch.randn(args.size, args.size).bfloat16()
    n_el = args.work_mib * 2**20 // 4
    x, y, z = (torch.randn(n_el) for _ in range(3))
    compute(5, a, b)  # warm
    print(f"torch threads {torch.get_num_threads()}, {os.cpu_count()} cores, "
          f"mm {args.size} bf16 x {args.n}, worker on {args.work_mib} MiB fp32, duty {args.duty}")
    for r in range(args.rounds):
        alone = compute(args.n, a, b)
        stop = threading.Event()
        cpu = [0.0]
        th = threading.Thread(target=worker, args=(x, y, z, args.duty, stop, cpu))
        th.start()
        time.sleep(0.05)
        beside = compute(args.n, a, b)
        stop.set()
        th.join()
        # the worker's CPU over the compute loop only, scaled by the loop's share of its life
        wcpu = cpu[0] * beside / (beside + 0.05)
        print(f"round {r + 1}: alone {alone:.2f} s, beside the worker {beside:.2f} s "
              f"(+{beside - alone:.2f}); worker CPU over the loop {wcpu:.2f} s; "
              f"extra wall / worker CPU {(beside - alone) / max(wcpu, 1e-9):.2f}")

if __name__ == "__main__":
    main()
