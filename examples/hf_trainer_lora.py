"""LoRA fine-tuning with ``OutcoreTrainer``: the frozen base read in place, adapters trained.

Built under ``outcore.init(cfg, frozen=True, weights=base)``, every base parameter is read
from the folder's own ``*.safetensors`` files at every use, in the files' dtype (no copy on
disk, no fp32 master, gradient or optimizer state); only the LoRA adapters, added by PEFT
afterwards, carry those. ``trainer.save_model`` writes PEFT's
own adapter files, which ``PeftModel.from_pretrained`` loads over the original base.

The base is a local Hugging Face folder (``--base FOLDER``: its ``config.json`` and
``*.safetensors``). Without one, the script first writes a randomly initialised Llama to
``OUT/base`` as a stand-in for a downloaded model, so nothing is downloaded::

    python examples/hf_trainer_lora.py --base path/to/hf-folder --lora r=8,targets=q_proj,v_proj
    python examples/hf_trainer_lora.py                      # a stand-in ~30M Llama, 100 steps
    torchrun --nproc_per_node 2 examples/hf_trainer_lora.py --tiny
    python examples/hf_trainer_lora.py --tiny               # seconds: what CI runs

The data is synthetic (sequences that count up modulo the vocabulary); put your tokenized
data set in ``make_dataset``. At the end rank 0 loads the saved adapter with ``peft`` over
the base folder and checks it lowers the loss on fresh data. It prints, last, one
machine-readable line: ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
from peft import PeftModel
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    TrainingArguments,
)

import outcore
from outcore.hf import OutcoreTrainer, apply_lora


def make_dataset(n: int, seq: int, vocab: int, seed: int = 0) -> list[dict]:
    """``n`` sequences that count up from a random start, modulo ``vocab``: easy to learn."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, vocab, (n, 1), generator=gen)
    ids = (starts + torch.arange(seq)) % vocab
    return [{"input_ids": x, "labels": x} for x in ids]   # causal LMs shift labels themselves


def write_stand_in_base(folder: Path, tiny: bool) -> None:
    """A random Llama saved as a Hugging Face folder: what a download would give you."""
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    useful = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, vocab_size=8192)
    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=256, **(small if tiny else useful))
    LlamaForCausalLM(config).save_pretrained(folder)


def loss_on(model: torch.nn.Module, batch: torch.Tensor) -> float:
    """The model's mean next-token loss on ``batch``, without gradients."""
    with torch.no_grad():
        return model(input_ids=batch, labels=batch).loss.item()


def parse_args() -> argparse.Namespace:
    """Sizes for a useful run by default; ``--tiny`` (or OUTCORE_EXAMPLE_TINY=1) for CI."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true",
                   default=os.environ.get("OUTCORE_EXAMPLE_TINY") == "1",
                   help="a small model and few steps: runs in seconds on a 2-core CPU")
    p.add_argument("--base", default=None, help="a local Hugging Face model folder")
    p.add_argument("--lora", default="r=16,alpha=32,targets=all-linear",
                   help="PEFT's LoRA settings: r, alpha, dropout, targets (layer names)")
    p.add_argument("--out", default="outcore-hf-lora", help="output folder")
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
        "offload": {"params": "nvme", "optimizer": "cpu", "nvme_path": nvme_path},
    })
    # TrainingArguments first: under torchrun it joins the process group, so that the
    # stand-in base below is written once (main_process_first) and outcore uses that group.
    training_args = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=4 if args.tiny else 8,
        learning_rate=1e-2 if args.tiny else 1e-3,   # LoRA likes a larger rate than full tuning
        lr_scheduler_type="cosine",
        warmup_steps=2 if args.tiny else 10,
        max_grad_norm=1.0,
        logging_steps=max(1, args.steps // 20),
        save_strategy="no",          # or "steps": each checkpoint-N holds the adapter files
        report_to=[],
        disable_tqdm=args.tiny,
        seed=0,
        # transformers runs torchrun's ranks data-parallel on a CPU-only machine only when
        # told to use the CPU; without it every rank would train on the same batches
        use_cpu=not torch.cuda.is_available(),
    )
    base = Path(args.base or Path(args.out) / "base")
    if args.base is None:
        with training_args.main_process_first(desc="writing the stand-in base model"):
            if not (base / "config.json").exists():
                write_stand_in_base(base, args.tiny)

    torch.manual_seed(0)                          # the same seed on every rank (outcore checks)
    with outcore.init(cfg, frozen=True, weights=base):   # the base, read in place from its files
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base))
    torch.manual_seed(1)
    model = apply_lora(model, args.lora)          # or peft.get_peft_model(model, LoraConfig(...))
    vocab, seq = model.config.vocab_size, 16 if args.tiny else 128

    trainer = OutcoreTrainer(
        model=model,
        args=training_args,
        train_dataset=make_dataset(64 if args.tiny else 4096, seq, vocab),
        outcore_config=cfg,
    )
    trainer.train()
    adapter = Path(args.out) / "adapter"
    trainer.save_model(str(adapter))   # adapter_config.json + adapter_model.safetensors
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    trainer.close()

    if training_args.process_index == 0:
        # What a user of the adapter does: load the original base, put the adapter on it.
        fresh = torch.stack([d["input_ids"] for d in make_dataset(8, seq, vocab, seed=1)])
        plain = AutoModelForCausalLM.from_pretrained(base).eval()
        base_loss = loss_on(plain, fresh)
        tuned = PeftModel.from_pretrained(plain, adapter).eval()
        adapter_loss = loss_on(tuned, fresh)
        print(f"adapter in {adapter}; loss on fresh data: base {base_loss:.4f}, "
              f"base + adapter {adapter_loss:.4f}")
        head = max(1, len(losses) // 5)
        print("RESULT " + json.dumps({
            "example": "hf_trainer_lora", "world_size": training_args.world_size,
            "first_loss": sum(losses[:head]) / head, "last_loss": sum(losses[-head:]) / head,
            "base_loss": base_loss, "adapter_loss": adapter_loss,
            "saved": sorted(p.name for p in adapter.iterdir()),
        }), flush=True)


if __name__ == "__main__":
    main()
