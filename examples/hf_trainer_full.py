"""Full fine-tuning of a Hugging Face causal LM with ``OutcoreTrainer``, states on NVMe.

``OutcoreTrainer`` is ``transformers.Trainer`` with one more keyword, ``outcore_config``:
``TrainingArguments`` keep deciding the learning rate, schedule, accumulation and saving, and
outcore decides where parameters, gradients and optimizer states live. Here both the
parameters and the optimizer state are on NVMe.

The model is a Llama built from a ``LlamaConfig`` with random weights, so nothing is
downloaded; ``--model FOLDER`` fine-tunes a local Hugging Face folder instead (its
``config.json`` and ``*.safetensors``), built under ``outcore.init(cfg, weights=FOLDER)``,
which computes no values and gives each rank's shards their slices of the files, so the model
never exists in full in memory::

    python examples/hf_trainer_full.py                       # ~30M-parameter Llama, 100 steps
    python examples/hf_trainer_full.py --model path/to/hf-folder --out run
    torchrun --nproc_per_node 2 examples/hf_trainer_full.py --tiny
    python examples/hf_trainer_full.py --tiny                # seconds: what CI runs

The data is synthetic (sequences that count up modulo the vocabulary), so the loss falls
quickly; put your tokenized data set in ``make_dataset``. At the end the model is saved as a
Hugging Face folder (``OUT/final``) and loaded back with ``from_pretrained``. Rank 0 prints,
last, one machine-readable line: ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    TrainingArguments,
)

import outcore
from outcore.hf import OutcoreTrainer


def make_dataset(n: int, seq: int, vocab: int, seed: int = 0) -> list[dict]:
    """``n`` sequences that count up from a random start, modulo ``vocab``: easy to learn."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, vocab, (n, 1), generator=gen)
    ids = (starts + torch.arange(seq)) % vocab
    return [{"input_ids": x, "labels": x} for x in ids]   # causal LMs shift labels themselves


def build_model(cfg: outcore.Config, args: argparse.Namespace) -> torch.nn.Module:
    """The model, sharded as it is created: a local folder's, or a random Llama."""
    torch.manual_seed(0)                          # the same seed on every rank
    if args.model:
        with outcore.init(cfg, weights=args.model):   # each rank reads its own slices
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model))
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    useful = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, vocab_size=8192)
    config = LlamaConfig(max_position_embeddings=256, **(small if args.tiny else useful))
    with outcore.init(cfg):
        return LlamaForCausalLM(config)


def parse_args() -> argparse.Namespace:
    """Sizes for a useful run by default; ``--tiny`` (or OUTCORE_EXAMPLE_TINY=1) for CI."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true",
                   default=os.environ.get("OUTCORE_EXAMPLE_TINY") == "1",
                   help="a small model and few steps: runs in seconds on a 2-core CPU")
    p.add_argument("--model", default=None, help="a local Hugging Face model folder")
    p.add_argument("--out", default="outcore-hf-full", help="output folder")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 100)")
    p.add_argument("--nvme-path", default=None,
                   help="folder for the swap files (default: a folder under the system temp)")
    args = p.parse_args()
    args.steps = args.steps or (20 if args.tiny else 100)
    return args


def main() -> None:
    args = parse_args()
    nvme_path = args.nvme_path or os.path.join(tempfile.gettempdir(), "outcore-swap")
    os.makedirs(nvme_path, exist_ok=True)
    cfg = outcore.Config.from_dict({
        "offload": {"params": "nvme", "optimizer": "nvme", "nvme_path": nvme_path},
    })
    model = build_model(cfg, args)
    vocab, seq = model.config.vocab_size, 16 if args.tiny else 128

    training_args = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=4 if args.tiny else 8,
        gradient_accumulation_steps=2,
        learning_rate=1e-2 if args.tiny else 1e-3,
        lr_scheduler_type="cosine",
        warmup_steps=2 if args.tiny else 10,
        weight_decay=0.01,
        max_grad_norm=1.0,
        logging_steps=max(1, args.steps // 20),
        save_strategy="no",          # or "steps": each checkpoint-N is a from_pretrained folder
        report_to=[],
        disable_tqdm=args.tiny,
        seed=0,
        # transformers runs torchrun's ranks data-parallel on a CPU-only machine only when
        # told to use the CPU; without it every rank would train on the same batches
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = OutcoreTrainer(
        model=model,
        args=training_args,
        train_dataset=make_dataset(64 if args.tiny else 4096, seq, vocab),
        outcore_config=cfg,          # a Config, a dict, a JSON/YAML path or a DeepSpeed config
    )
    trainer.train()
    final = Path(args.out) / "final"
    trainer.save_model(str(final))   # every rank calls it; written from the shards, streamed
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    trainer.close()                  # deletes the swap files, hands the trained model back

    if trainer.args.process_index == 0:
        # The saved folder is an ordinary Hugging Face model: check that it loads and has
        # learned to count (its loss on fresh sequences is far below a random model's).
        loaded = AutoModelForCausalLM.from_pretrained(final).eval()
        batch = torch.stack([d["input_ids"] for d in make_dataset(8, seq, vocab, seed=1)])
        with torch.no_grad():
            reloaded_loss = loaded(input_ids=batch, labels=batch).loss.item()
        print(f"saved to {final}; reloaded model's loss on fresh data: {reloaded_loss:.4f}")
        head = max(1, len(losses) // 5)
        print("RESULT " + json.dumps({
            "example": "hf_trainer_full", "world_size": trainer.args.world_size,
            "first_loss": sum(losses[:head]) / head, "last_loss": sum(losses[-head:]) / head,
            "reloaded_loss": reloaded_loss, "saved": sorted(p.name for p in final.iterdir()),
        }), flush=True)


if __name__ == "__main__":
    main()
