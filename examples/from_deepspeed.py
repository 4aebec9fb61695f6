"""An existing DeepSpeed ZeRO-3 / ZeRO-Infinity config, used by outcore unchanged.

``deepspeed_config.json`` beside this script is the kind of file Hugging Face users keep for
DeepSpeed: ZeRO stage 3, parameters and optimizer state offloaded to NVMe, and ``"auto"``
wherever the Trainer should decide. outcore reads it wherever it takes a config:

* ``OutcoreTrainer(..., outcore_config="deepspeed_config.json")`` (the default mode here):
  every ``"auto"`` takes the ``TrainingArguments`` value, as in transformers' DeepSpeed
  integration: learning rate, betas, epsilon, weight decay, accumulation, clipping,
  precision, and the ``WarmupLR`` scheduler's warm-up;
* ``outcore.initialize(model, cfg)`` in a plain loop (``--loop``), with
  ``cfg = outcore.Config.from_deepspeed(path)``: outside the Trainer nothing gives the
  ``"auto"`` values, so they keep outcore's defaults unless you set them, as done below.

Keys with no meaning in outcore (pinning, bucket sizes, ``sub_group_size`` ...) are listed in
one warning, each with the reason. The deepspeed package is not needed::

    python examples/from_deepspeed.py                         # OutcoreTrainer, ~30M Llama
    python examples/from_deepspeed.py --loop                  # a plain loop, same config
    python examples/from_deepspeed.py --config my_ds.json     # your own file
    torchrun --nproc_per_node 2 examples/from_deepspeed.py --tiny
    python examples/from_deepspeed.py --tiny                  # seconds: what CI runs

The config's ``nvme_path`` is ``./nvme-swap`` (relative to where you run it); point it at
your NVMe mount. Rank 0 prints, last, one machine-readable line: ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import outcore

HERE = Path(__file__).resolve().parent


def make_dataset(n: int, seq: int, vocab: int, seed: int = 0) -> list[dict]:
    """``n`` sequences that count up from a random start, modulo ``vocab``: easy to learn."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, vocab, (n, 1), generator=gen)
    ids = (starts + torch.arange(seq)) % vocab
    return [{"input_ids": x, "labels": x} for x in ids]


def build_model(cfg: outcore.Config | None, tiny: bool) -> torch.nn.Module:
    """A random Llama from its config (nothing downloaded); sharded as it is created when
    ``cfg`` is given, else plain (``initialize`` or the Trainer shards it)."""
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    useful = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, vocab_size=8192)
    config = LlamaConfig(max_position_embeddings=256, **(small if tiny else useful))
    torch.manual_seed(0)                          # the same seed on every rank
    if cfg is None:
        return LlamaForCausalLM(config)
    with outcore.init(cfg):
        return LlamaForCausalLM(config)


def train_with_trainer(args: argparse.Namespace) -> dict:
    """OutcoreTrainer with the DeepSpeed file: the Trainer fills in every "auto"."""
    from transformers import TrainingArguments

    from outcore.hf import OutcoreTrainer

    training_args = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=4 if args.tiny else 8,   # -> train_micro_batch_size_per_gpu
        gradient_accumulation_steps=2,                       # -> gradient_accumulation_steps
        learning_rate=1e-2 if args.tiny else 1e-3,           # -> optimizer lr, warmup_max_lr
        warmup_steps=4 if args.tiny else 20,                 # -> warmup_num_steps
        weight_decay=0.01,                                   # -> optimizer weight_decay
        max_grad_norm=1.0,                                   # -> gradient_clipping
        logging_steps=max(1, args.steps // 20),
        save_strategy="no",
        report_to=[],
        disable_tqdm=args.tiny,
        seed=0,
        use_cpu=not torch.cuda.is_available(),   # torchrun data parallelism on a CPU machine
    )
    # With the deepspeed package installed, TrainingArguments(deepspeed=path) works as well.
    # The Trainer shards this small model; one too large to build whole goes under
    # `with outcore.init(path):`, which places the shards where the file says.
    model = build_model(None, args.tiny)
    trainer = OutcoreTrainer(
        model=model, args=training_args,
        train_dataset=make_dataset(64 if args.tiny else 4096, 16 if args.tiny else 128,
                                   model.config.vocab_size),
        outcore_config=args.config,               # the DeepSpeed file, as it is
    )
    trainer.train()
    trainer.save_model(str(Path(args.out) / "final"))
    history = trainer.state.log_history
    trainer.close()
    return {"world_size": training_args.world_size, "rank": training_args.process_index,
            "losses": [h["loss"] for h in history if "loss" in h],
            "learning_rates": [h["learning_rate"] for h in history if "learning_rate" in h]}


def train_with_loop(args: argparse.Namespace) -> dict:
    """A plain loop: the same file through Config.from_deepspeed, "auto"s filled in here."""
    cfg = outcore.Config.from_deepspeed(args.config).with_overrides({
        "optimizer": {"lr": 1e-2 if args.tiny else 1e-3, "weight_decay": 0.01},
        "gradient_clipping": 1.0,
    })
    model = build_model(cfg, args.tiny)
    engine = outcore.initialize(model, cfg)       # or outcore.initialize(model, path)
    data = make_dataset(64 if args.tiny else 4096, 16 if args.tiny else 128,
                        model.config.vocab_size, seed=engine.rank)   # each rank its own data
    batch = 4 if args.tiny else 8
    losses = []
    for step in range(args.steps):
        chunk = data[(step * batch) % len(data):][:batch]
        ids = torch.stack([d["input_ids"] for d in chunk]).to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    result = {"world_size": engine.world_size, "rank": engine.rank, "losses": losses,
              "learning_rates": [g["lr"] for g in engine.optimizer.param_groups]}
    engine.close()
    return result


def parse_args() -> argparse.Namespace:
    """Sizes for a useful run by default; ``--tiny`` (or OUTCORE_EXAMPLE_TINY=1) for CI."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true",
                   default=os.environ.get("OUTCORE_EXAMPLE_TINY") == "1",
                   help="a small model and few steps: runs in seconds on a 2-core CPU")
    p.add_argument("--config", default=str(HERE / "deepspeed_config.json"),
                   help="a DeepSpeed config file (default: the one beside this script)")
    p.add_argument("--loop", action="store_true", help="a plain loop instead of the Trainer")
    p.add_argument("--out", default="outcore-from-deepspeed", help="output folder")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 100)")
    args = p.parse_args()
    args.steps = args.steps or (20 if args.tiny else 100)
    return args


def main() -> None:
    args = parse_args()
    # The file is read, not changed: only its swap folders are created if missing.
    zero = json.loads(Path(args.config).read_text())["zero_optimization"]
    for key in ("offload_param", "offload_optimizer"):
        if zero.get(key, {}).get("device") == "nvme":
            os.makedirs(zero[key]["nvme_path"], exist_ok=True)

    result = train_with_loop(args) if args.loop else train_with_trainer(args)
    if result.pop("rank") == 0:
        losses = result.pop("losses")
        head = max(1, len(losses) // 5)
        print("RESULT " + json.dumps({
            "example": "from_deepspeed", "mode": "loop" if args.loop else "trainer",
            "first_loss": sum(losses[:head]) / head, "last_loss": sum(losses[-head:]) / head,
            **result,
        }), flush=True)


if __name__ == "__main__":
    main()
