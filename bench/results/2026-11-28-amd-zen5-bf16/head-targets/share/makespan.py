"""Compute and a fixed amount of intermittent CPU work in a second thread, together: how long
until both are done, with the worker at each scheduling policy.

The compute loop runs N bf16 matmuls on torch's intra-op threads (2); the worker runs K
passes over fp32 buffers with one intra-op thread, sleeping after each pass for as long as it
computed (half its time waiting, as a thread waiting for the disk). Printed per policy: the
compute's wall, the worker's wall, their makespan, against the compute alone and the worker
alone.

    python makespan.py [--n 60] [--k 40] [--rounds 2] [--worker-threads 2 --policies normal]

With ``--worker-threads 2`` the printed worker CPU is its own thread's only (``thread_time``),
not its OpenMP helper's.
"""
from __future__ import annotations

import argparse
import os
import threading
import time

import torch

SCHED_BATCH, SCHED_IDLE, SCHED_OTHER = 3, 5, 0


def set_policy(policy: str) -> None:
    if policy == "normal":
        return
    if policy.startswith("nice"):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), int(policy[4:]))
        return
    pol = {"batch": SCHED_BATCH, "idle": SCHED_IDLE}[policy]
    os.sched_setscheduler(threading.get_native_id(), pol, os.sched_param(0))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=60)
    ap.add_argument("--k", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--policies", default="normal,batch,nice10,idle")
    ap.add_argument("--worker-threads", type=int, default=1)
    args = ap.parse_args()
    a = torch.randn(2048, 2048).bfloat16()
    b = torch.randn(2048, 2048).bfloat16()
    x, y, z = (torch.randn(16 << 20) for _ in range(3))
    for _ in range(5):
        torch.mm(a, b)

    def work(policy: str, out: dict) -> None:
        torch.set_num_threads(args.worker_threads)
        set_policy(policy)
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(args.k):
            s = time.perf_counter()
            x.mul_(0.999).add_(y, alpha=0.001)
            z.copy_(x)
            time.sleep(time.perf_counter() - s)
        out["wall"], out["cpu"] = time.perf_counter() - t0, time.thread_time() - c0

    def comp() -> float:
        t0 = time.perf_counter()
        for _ in range(args.n):
            torch.mm(a, b)
        return time.perf_counter() - t0

    for r in range(args.rounds):
        alone_c = comp()
        o: dict = {}
        th = threading.Thread(target=work, args=("normal", o))
        th.start()
        th.join()
        print(f"round {r + 1}: compute alone {alone_c:.2f} s; worker alone {o['wall']:.2f} s "
              f"({o['cpu']:.2f} CPU-s)")
        for pol in args.policies.split(","):
            o = {}
            t0 = time.perf_counter()
            th = threading.Thread(target=work, args=(pol, o))
            th.start()
            c = comp()
            th.join()
            span = time.perf_counter() - t0
            print(f"  {pol:7} compute {c:.2f} s (+{c - alone_c:.2f}), worker {o['wall']:.2f} s "
                  f"({o['cpu']:.2f} CPU-s), both done {span:.2f} s")


if __name__ == "__main__":
    main()
