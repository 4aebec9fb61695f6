"""Peak RSS in backward, above its start, for a 32000 x 1024 bf16 embedding and a linear head
over 128 tokens, plain torch: ``tied|untied|tied_sparse`` (``..._lin``: ``F.linear`` head)."""
import os
import sys
import threading
import time

import torch

MIB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


w = torch.nn.Parameter(torch.randn(32000, 1024, dtype=torch.bfloat16))
ids = torch.randint(0, 32000, (1, 128))
mode = sys.argv[1]
peak, stop = [0], [False]


def sample() -> None:
    while not stop[0]:
        peak[0] = max(peak[0], rss())
        time.sleep(0.0005)


x = torch.randn(1, 128, 1024, dtype=torch.bfloat16, requires_grad=True)
grads = []


def take(p: torch.Tensor) -> None:
    grads.append(p.grad)
    p.grad = None


w.register_post_accumulate_grad_hook(take)
base = rss()
th = threading.Thread(target=sample)
th.start()
time.sleep(0.01)
h = torch.nn.functional.embedding(ids, w, sparse=mode.endswith("sparse")) + x
head = w if mode.startswith("tied") else w.detach()
logits = torch.nn.functional.linear(h, head) if "lin" in mode else h @ head.t()
loss = logits.float().sum()
fwd = rss()
try:
    loss.backward()
finally:
    stop[0] = True
    th.join()
print(mode, "fwd over base", (fwd - base) // MIB, "peak over base", (peak[0] - base) // MIB,
      "after", (rss() - base) // MIB)
