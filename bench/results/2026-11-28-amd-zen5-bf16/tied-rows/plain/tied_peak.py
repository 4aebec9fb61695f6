import torch, sys, threading, time
MIB = 1 << 20
import os
PAGE = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f: return int(f.read().split()[1]) * PAGE
w = torch.nn.Parameter(torch.randn(32000, 1024, dtype=torch.bfloat16))
ids = torch.randint(0, 32000, (1, 128))
mode = sys.argv[1]
peak = [0]; stop = False
def samp():
    while not stop:
        peak[0] = max(peak[0], rss()); time.sleep(0.0005)
x = torch.randn(1, 128, 1024, dtype=torch.bfloat16, requires_grad=True)
grads = []
def hk(p):
    grads.append(p.grad); p.grad = None
w.register_post_accumulate_grad_hook(hk)
base = rss(); th = threading.Thread(target=samp); th.start(); time.sleep(0.01)
h = torch.nn.functional.embedding(ids, w, sparse=mode.endswith("sparse")) + x
if mode.startswith("tied"):
    logits = torch.nn.functional.linear(h, w) if "lin" in mode else h @ w.t()
else:
    logits = h @ w.detach().t()
loss = logits.float().sum()
fwd = rss()
try:
    loss.backward()
finally:
    stop = True
stop = True; th.join()
print(mode, "fwd over base", (fwd - base) // MIB, "peak over base", (peak[0] - base) // MIB, "after", (rss() - base) // MIB)
