"""The update arithmetic on the compute thread between its operations, against the same work
in a second thread that waits half its time (as the update thread waits for the disk).

Compute: N bf16 2048 x 2048 matmuls on torch's 2 intra-op threads. Work: K Adam-like passes
over 64 MiB fp32 buffers. Printed per round: the compute alone, the passes alone on 2
threads, the two together with the passes in a thread (1 intra-op thread, sleeping after each
pass for as long as it ran), and the passes run on the main thread after every third matmul.

    .venv/bin/python interleave.py
"""
from __future__ import annotations

import threading
import time

import torch

N, K = 60, 40
a = torch.randn(2048, 2048).bfloat16()
b = torch.randn(2048, 2048).bfloat16()
x, y, z = (torch.randn(16 << 20) for _ in range(3))
for _ in range(5):
    torch.mm(a, b)


def one() -> None:
    x.mul_(0.999).add_(y, alpha=0.001)
    z.copy_(x)


def comp() -> float:
    t0 = time.perf_counter()
    for _ in range(N):
        torch.mm(a, b)
    return time.perf_counter() - t0


def worker(out: dict) -> None:
    torch.set_num_threads(1)
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(K):
        s = time.perf_counter()
        one()
        time.sleep(time.perf_counter() - s)
    out["wall"], out["cpu"] = time.perf_counter() - t0, time.thread_time() - c0


for r in range(3):
    alone = comp()
    t0 = time.perf_counter()
    for _ in range(K):
        one()
    passes = time.perf_counter() - t0
    o: dict = {}
    th = threading.Thread(target=worker, args=(o,))
    th.start()
    th.join()
    o = {}
    t0 = time.perf_counter()
    th = threading.Thread(target=worker, args=(o,))
    th.start()
    comp()
    th.join()
    span = time.perf_counter() - t0
    t0, k = time.perf_counter(), 0
    for i in range(N):
        torch.mm(a, b)
        if i % 3 == 2 and k < K:
            one()
            k += 1
    while k < K:
        one()
        k += 1
    inter = time.perf_counter() - t0
    print(f"round {r + 1}: compute alone {alone:.2f}; passes alone on 2 threads {passes:.2f}; "
          f"thread worker cpu {o['cpu']:.2f}, both done {span:.2f}; interleaved in main "
          f"{inter:.2f} (sum alone {alone + passes:.2f})")
