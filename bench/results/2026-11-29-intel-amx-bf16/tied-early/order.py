import os, torch, outcore
from torch import nn
from outcore.optim.optimizer import ShardedOptimizer
class M(nn.Module):
    def __init__(s):
        super().__init__()
        s.emb = nn.Embedding(1000, 64)
        s.blocks = nn.ModuleList([nn.Linear(64, 64) for _ in range(4)])
        s.head = nn.Linear(64, 1000, bias=False)
        s.head.weight = s.emb.weight
    def forward(s, ids):
        x = s.emb(ids)
        for b in s.blocks: x = torch.tanh(b(x))
        return nn.functional.cross_entropy(s.head(x).view(-1, 1000), ids.view(-1))
order = []
orig = ShardedOptimizer.submit
def sub(self, sps, *a, **k):
    order.append([sp.name if hasattr(sp, "name") else sp.shape for sp in sps]); return orig(self, sps, *a, **k)
ShardedOptimizer.submit = sub
torch.manual_seed(0)
m = M()
cfg = {"dtype": "fp32", "optimizer": {"type": "adamw", "lr": 1e-2}, "gradient_clipping": 0,
       "offload": {"params": "nvme", "optimizer": "nvme", "nvme_path": "/tmp/exp/swap"}}
e = outcore.initialize(m, cfg)
ids = torch.randint(0, 1000, (2, 16))
for _ in range(2):
    order.clear(); l = e(ids); e.backward(l); e.step(); print(float(l), order)
e.close()
