"""Build and train a model whose states do not fit in host memory, with everything on NVMe.

Under ``with outcore.init(cfg):`` each parameter is cut into this rank's shard and written to
its tier the moment its module creates it, so the full model never exists in memory, not even
while it is built. The default size, 1.3 billion parameters, has about 19 GB of model states
(14 bytes a parameter in bf16: the weights, fp32 masters and two fp32 AdamW moments), which
this script keeps in one swap file per rank while the process peaks at about 1.3 GB::

    python examples/larger_than_memory.py --nvme-path /mnt/nvme/swap      # needs ~20 GB free
    python examples/larger_than_memory.py --width 2048 --depth 4          # 135M parameters, ~2 GB
    python examples/larger_than_memory.py --tiny                          # seconds: what CI runs
    torchrun --nproc_per_node 2 examples/larger_than_memory.py --tiny     # sharded over 2 ranks

Before a large run, ``outcore estimate --params 1.3B`` says what each tier needs.
The task is synthetic (learn ``next = (7 * token + 3) mod vocab``), so the loss falls within a
few steps. Rank 0 prints, last, one machine-readable line: ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile

import torch
from torch import nn

import outcore


class Block(nn.Module):
    """A pre-norm residual MLP block (the bulk of a transformer's parameters)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class TokenModel(nn.Module):
    """Embedding, residual blocks, output head: a language model without attention."""

    def __init__(self, vocab: int, width: int, depth: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x)).float()
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def parameter_count(vocab: int, width: int, depth: int) -> int:
    """The model's size without building it: the numbers to check before committing a disk."""
    block = 2 * width + 4 * width * width + 4 * width + 4 * width * width + width
    return 2 * vocab * width + depth * block + 2 * width


def parse_args() -> argparse.Namespace:
    """Sizes for the real thing by default; ``--tiny`` (or OUTCORE_EXAMPLE_TINY=1) for CI."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true",
                   default=os.environ.get("OUTCORE_EXAMPLE_TINY") == "1",
                   help="a small model and few steps: runs in seconds on a 2-core CPU")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 256)")
    p.add_argument("--width", type=int, default=None, help="hidden width (default 4096)")
    p.add_argument("--depth", type=int, default=None, help="number of blocks (default 10)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 5)")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--nvme-path", default=None,
                   help="folder for the swap files, on a fast disk with room for the model "
                        "states (default: a folder under the system temp)")
    args = p.parse_args()
    args.vocab = args.vocab or (64 if args.tiny else 256)
    args.width = args.width or (32 if args.tiny else 4096)
    args.depth = args.depth or (2 if args.tiny else 10)
    args.steps = args.steps or (30 if args.tiny else 5)
    return args


def main() -> None:
    args = parse_args()
    nvme_path = args.nvme_path or os.path.join(tempfile.gettempdir(), "outcore-swap")
    os.makedirs(nvme_path, exist_ok=True)
    cfg = outcore.Config.from_dict({
        "optimizer": {"type": "adamw", "lr": 1e-3 if args.tiny else 3e-4},
        "offload": {"params": "nvme", "optimizer": "nvme", "nvme_path": nvme_path},
        # full layers read ahead of use: room for the next two of the largest (4*w*w, bf16)
        "zero": {"prefetch_bytes": max(128 << 20, 2 * 2 * 4 * args.width**2)},
    })

    n = parameter_count(args.vocab, args.width, args.depth)
    torch.manual_seed(0)                      # the same seed on every rank
    with outcore.init(cfg):                   # each parameter goes to NVMe as it is created
        model = TokenModel(args.vocab, args.width, args.depth)
    assert sum(p.numel() for p in model.parameters()) == n
    engine = outcore.initialize(model, cfg)   # the model is already sharded: nothing to copy
    rank, world = engine.rank, engine.world_size
    if rank == 0:
        print(f"{n:,} parameters built; process RSS "
              f"{engine.memory_report()['rss'] / 2**30:.2f} GiB; dtype {engine.dtype}; "
              f"{world} rank(s); swap under {nvme_path}", flush=True)

    losses = []
    gen = torch.Generator().manual_seed(1 + rank)   # each rank its own data
    for step in range(args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
        tokens = tokens.to(engine.device)           # CPU or this rank's GPU
        loss = engine(tokens=tokens, labels=(7 * tokens + 3) % args.vocab)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if rank == 0 and (step % max(1, args.steps // 10) == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {losses[-1]:.4f}", flush=True)

    report = engine.memory_report()
    if rank == 0:
        print(f"on NVMe: {report['nvme'] / 2**30:.2f} GiB of model states (this rank); "
              f"process RSS: {report['rss'] / 2**30:.2f} GiB", flush=True)
    # Handing the trained model back as plain PyTorch would need it all in memory, which is
    # the point of this example not to: checkpoint it instead (engine.save_checkpoint, then
    # `outcore consolidate`) and close without keeping the values.
    engine.close(keep_values=False)
    if rank == 0:
        head = max(1, len(losses) // 5)
        print("RESULT " + json.dumps({
            "example": "larger_than_memory", "world_size": world, "params": n,
            "first_loss": sum(losses[:head]) / head, "last_loss": sum(losses[-head:]) / head,
            "initial_loss_expected": math.log(args.vocab),
            "bytes_nvme": report["nvme"], "rss": report["rss"],
        }), flush=True)


if __name__ == "__main__":
    main()
