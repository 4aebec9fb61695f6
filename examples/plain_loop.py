"""A plain PyTorch training loop under outcore, with parameters and optimizer state on NVMe.

The model is an ordinary ``nn.Module`` and the loop is the usual forward / backward / step;
the only outcore lines are the config, ``outcore.initialize`` and ``engine.close()``.

Run it as one process, or as several ranks with torchrun (gloo on CPU, NCCL on GPU: outcore
picks the backend and joins the process group itself)::

    python examples/plain_loop.py
    torchrun --nproc_per_node 2 examples/plain_loop.py --nvme-path /mnt/nvme/swap
    python examples/plain_loop.py --tiny          # a few seconds: what CI runs

The task: a student MLP learns to imitate a fixed random "teacher" MLP, so the loss falls
visibly within a few dozen steps and no data set is needed. Rank 0 prints the loss as it
goes and, last, one machine-readable line: ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
from torch import nn

import outcore


class Block(nn.Module):
    """A pre-norm residual MLP block, as in a transformer."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Student(nn.Module):
    """A stack of residual blocks; ``forward`` returns the loss, so the engine does too."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        prediction = self.head(self.blocks(x))
        # outcore casts floating inputs to its compute dtype (maybe bf16): score in fp32
        return nn.functional.mse_loss(prediction.float(), target.float())


def teacher_batch(teacher: nn.Module, batch: int, width: int, seed: int) -> dict:
    """One batch of (input, teacher output). Each rank draws its own seed: data parallelism."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, width, generator=gen)
    with torch.no_grad():
        return {"x": x, "target": teacher(x)}


def parse_args() -> argparse.Namespace:
    """Sizes for a useful run by default; ``--tiny`` (or OUTCORE_EXAMPLE_TINY=1) for CI."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true",
                   default=os.environ.get("OUTCORE_EXAMPLE_TINY") == "1",
                   help="a small model and few steps: runs in seconds on a 2-core CPU")
    p.add_argument("--width", type=int, default=None, help="hidden width (default 768)")
    p.add_argument("--depth", type=int, default=None, help="number of blocks (default 8)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 200)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--nvme-path", default=None,
                   help="folder for the swap files (default: a folder under the system temp)")
    args = p.parse_args()
    args.width = args.width or (32 if args.tiny else 768)
    args.depth = args.depth or (2 if args.tiny else 8)
    args.steps = args.steps or (30 if args.tiny else 200)
    return args


def main() -> None:
    args = parse_args()
    # Every rank must agree on the folder; outcore makes its own subfolder per run inside it
    # and deletes it at the end, so a shared default folder is safe.
    nvme_path = args.nvme_path or os.path.join(tempfile.gettempdir(), "outcore-swap")
    os.makedirs(nvme_path, exist_ok=True)

    cfg = outcore.Config.from_dict({
        "dtype": "auto",                        # fastest dtype this device multiplies natively
        "optimizer": {"type": "adamw", "lr": 1e-3, "weight_decay": 0.0},
        "offload": {"params": "nvme", "optimizer": "nvme", "nvme_path": nvme_path},
        "gradient_clipping": 1.0,
    })

    torch.manual_seed(0)                        # the same seed on every rank: the same model
    teacher = nn.Sequential(nn.Linear(args.width, args.width), nn.Tanh(),
                            nn.Linear(args.width, args.width))
    model = Student(args.width, args.depth)     # a plain model: initialize() shards it
    engine = outcore.initialize(model, cfg)     # joins torchrun's process group, if any
    rank, world = engine.rank, engine.world_size
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"{n:,} parameters, {world} rank(s), dtype {engine.dtype}, "
              f"device {engine.device}, swap under {nvme_path}", flush=True)

    losses = []
    for step in range(args.steps):
        batch = teacher_batch(teacher, args.batch, args.width, seed=step * world + rank)
        batch = {k: v.to(engine.device) for k, v in batch.items()}   # CPU or this rank's GPU
        loss = engine(**batch)                  # the module's forward: here, the loss
        engine.backward(loss)                   # gradients are averaged over the ranks
        engine.step()
        losses.append(loss.item())              # this rank's loss on its own batch
        if rank == 0 and (step % max(1, args.steps // 10) == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.5f}", flush=True)

    report = engine.memory_report()             # bytes per tier, from outcore's accounting
    engine.close()                              # deletes the swap files; model is plain again
    if rank == 0:
        head = max(1, len(losses) // 5)
        print("RESULT " + json.dumps({
            "example": "plain_loop", "world_size": world, "steps": args.steps,
            "first_loss": sum(losses[:head]) / head, "last_loss": sum(losses[-head:]) / head,
            "bytes_nvme": report["nvme"],
        }), flush=True)


if __name__ == "__main__":
    main()
