"""Which update a backward submits first: the tied embedding's or the last block's."""

import torch
from torch import nn

import outcore
from outcore.optim.optimizer import ShardedOptimizer


class M(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(1000, 64)
        self.blocks = nn.ModuleList([nn.Linear(64, 64) for _ in range(4)])
        self.head = nn.Linear(64, 1000, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for b in self.blocks:
            x = torch.tanh(b(x))
        return nn.functional.cross_entropy(self.head(x).view(-1, 1000), ids.view(-1))


order: list[list[str]] = []
orig = ShardedOptimizer.submit


def sub(self, sps, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202 - a lab script
    order.append([sp.name for sp in sps])
    return orig(self, sps, *a, **k)


ShardedOptimizer.submit = sub
torch.manual_seed(0)
m = M()
cfg = {"dtype": "fp32", "optimizer": {"type": "adamw", "lr": 1e-2}, "gradient_clipping": 0,
       "offload": {"params": "nvme", "optimizer": "nvme", "nvme_path": "/tmp/exp/swap"}}
e = outcore.initialize(m, cfg)
ids = torch.randint(0, 1000, (2, 16))
for _ in range(2):
    order.clear()
    loss = e(ids)
    e.backward(loss)
    e.step()
    print(float(loss), order)
e.close()
