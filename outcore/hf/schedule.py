"""A DeepSpeed config's ``scheduler`` section under ``OutcoreTrainer``.

[Note: the recipe's schedule]
Under transformers' DeepSpeed integration a config with a ``scheduler`` section replaces the
Trainer's ``lr_scheduler_type``: DeepSpeed builds WarmupLR, WarmupDecayLR or WarmupCosineLR,
its ``"auto"`` values filled from ``TrainingArguments`` (the warm-up from 0 to
``learning_rate`` over ``get_warmup_steps``, the total from the run's step count), the keys
left out taking DeepSpeed's defaults. A recipe carried over to outcore expects the same
schedule: the curves are optim/deepspeed_schedule.py's, with those values. A number that the
section states and the Trainer states otherwise (the peak, the warm-up or total steps) is
refused, as transformers refuses it.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from outcore.errors import ConfigError
from outcore.optim.deepspeed_schedule import MISSING, SUPPORTED, DeepSpeedLR, build, outside

__all__ = ["SUPPORTED", "deepspeed_scheduler"]


def deepspeed_scheduler(spec: dict[str, Any], optimizer: torch.optim.Optimizer, args: Any,
                        num_training_steps: int) -> DeepSpeedLR:
    """DeepSpeed's scheduler ``spec`` over ``optimizer``, "auto" from ``args``."""
    if spec.get("type") not in SUPPORTED:
        raise ConfigError(f"DeepSpeed config scheduler.type: {spec.get('type')!r} is not "
                          f"supported under OutcoreTrainer; use one of {', '.join(SUPPORTED)}, "
                          "or drop the section and set TrainingArguments.lr_scheduler_type")
    theirs = {"warmup_num_steps": (max(1, args.get_warmup_steps(num_training_steps)),
                                   "warmup_steps"),
              "total_num_steps": (num_training_steps, "number of training steps"),
              # the peak is compared with learning_rate when the Trainer is made (hf/args.py)
              "warmup_max_lr": (float(args.learning_rate), None)}

    def fill(key: str, given: Any, default: Any) -> float | None:
        """"auto": the Trainer's value; else as outside it (optim/deepspeed_schedule.py's
        ``outside``: left out, DeepSpeed's default, as transformers fills only "auto"); a
        number that differs from the Trainer's is refused."""
        auto, name = theirs.get(key, (None, None))
        if given == "auto":
            return auto if auto is not None else cast("float | None", default)
        mine = outside(key, given, default)
        if given is not MISSING and name is not None and mine != auto:
            raise ConfigError(f"DeepSpeed config scheduler.params.{key}={given!r} and the "
                              f"Trainer's {name}={auto!r} differ; set one of them (\"auto\" "
                              "takes the Trainer's), as transformers' DeepSpeed integration "
                              "asks")
        return mine

    return build(spec, optimizer, fill)
