"""One outcore Config from ``TrainingArguments`` and ``outcore_config``, each owning its keys.

[Note: who decides what under the Trainer]
A user switching from ``Trainer`` keeps their ``TrainingArguments``: the learning rate, the
betas and epsilon, weight decay, gradient accumulation, clipping and the seed mean what they
mean there, so they come from there. ``outcore_config`` decides what the Trainer has no word
for: placement, budgets, I/O, and precision where ``bf16``/``fp16`` are not set. A key that
both set is one value given twice; if the two differ, one of them would be silently ignored,
so that is an error naming both places. Equal values pass, so a DeepSpeed config that repeats
the Trainer's numbers (as Hugging Face's DeepSpeed integration allows) works unchanged, and
its ``"auto"`` values mean "take it from the Trainer", as they do there.
"""

from __future__ import annotations

import os
from typing import Any

from outcore.config import Config, merge_mappings, read_mapping
from outcore.errors import ConfigError

# TrainingArguments.optim values whose update is torch's AdamW with decoupled weight decay
ADAMW_NAMES = ("adamw_torch", "adamw_torch_fused", "adamw_hf")

OutcoreConfigSource = Config | dict[str, Any] | str | os.PathLike[str] | None


def given_keys(source: OutcoreConfigSource) -> dict[str, Any]:
    """The outcore keys ``source`` sets explicitly, as a nested mapping (DeepSpeed configs
    translated, their ``"auto"`` values dropped)."""
    if source is None:
        return {}
    if isinstance(source, Config):
        return source.model_dump(exclude_unset=True)
    raw = dict(source) if isinstance(source, dict) else read_mapping(source)
    if "zero_optimization" in raw:
        from outcore.io.deepspeed_config import translate_and_warn

        return translate_and_warn(_without_auto(raw), stacklevel=3)
    return raw


def _without_auto(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_auto(v) for k, v in value.items() if v != "auto"}
    return value


def trainer_keys(args: Any) -> dict[str, tuple[str, Any]]:
    """outcore key -> (the TrainingArguments spelling, its value) for the keys the Trainer owns."""
    optim = str(getattr(args.optim, "value", args.optim))
    if optim not in ADAMW_NAMES:
        raise ConfigError(f"TrainingArguments.optim={optim!r} is not supported by "
                          f"OutcoreTrainer; use one of {', '.join(ADAMW_NAMES)} (outcore runs "
                          "torch's AdamW over its shards)")
    if args.optim_args:
        raise ConfigError(f"TrainingArguments.optim_args={args.optim_args!r} is not supported "
                          "by OutcoreTrainer; the AdamW keys are learning_rate, adam_beta1, "
                          "adam_beta2, adam_epsilon and weight_decay")
    keys = {
        "optimizer.type": (f"optim={optim!r}", "adamw"),
        "optimizer.lr": ("learning_rate", float(args.learning_rate)),
        "optimizer.betas": ("adam_beta1, adam_beta2", (float(args.adam_beta1),
                                                        float(args.adam_beta2))),
        "optimizer.eps": ("adam_epsilon", float(args.adam_epsilon)),
        "optimizer.weight_decay": ("weight_decay", float(args.weight_decay)),
        "gradient_accumulation_steps": ("gradient_accumulation_steps",
                                        int(args.gradient_accumulation_steps)),
        "gradient_clipping": ("max_grad_norm", float(args.max_grad_norm or 0.0)),
        "seed": ("seed", int(args.seed)),
    }
    if args.bf16 and args.fp16:
        raise ConfigError("TrainingArguments: bf16=True and fp16=True; choose one")
    if args.bf16 or args.fp16:
        keys["dtype"] = ("bf16=True" if args.bf16 else "fp16=True", "bf16" if args.bf16 else "fp16")
    return keys


def build_config(args: Any, source: OutcoreConfigSource) -> Config:
    """The engine's Config: ``source``'s keys plus the Trainer's, with clashes refused."""
    given = given_keys(source)
    owned = trainer_keys(args)
    clashes = []
    for key, (spelling, value) in owned.items():
        mine = _lookup(given, key)
        if mine is not _MISSING and _normal(mine) != _normal(value):
            shown = list(value) if isinstance(value, tuple) else value
            theirs = spelling if "=" in spelling else f"{spelling}={shown!r}"
            clashes.append(f"outcore_config {key}={mine!r} and TrainingArguments.{theirs}")
    if clashes:
        raise ConfigError("set in both outcore_config and TrainingArguments, with different "
                          "values: " + "; ".join(clashes) + ". Under OutcoreTrainer the "
                          "TrainingArguments give these; remove them from outcore_config")
    nested: dict[str, Any] = {}
    for key, (_, value) in owned.items():
        _assign(nested, key, list(value) if isinstance(value, tuple) else value)
    if "dtype" not in owned and _lookup(given, "dtype") is _MISSING:
        nested["dtype"] = "fp32"  # what Trainer trains in without bf16/fp16
    # The Trainer logs the gradient norm every logging step, so the engine computes it.
    nested["track_grad_norm"] = True
    base = source.model_dump() if isinstance(source, Config) else given
    return Config.from_dict(merge_mappings(base, nested))


_MISSING = object()


def _lookup(tree: dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _assign(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[last] = value


def _normal(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_normal(v) for v in value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    return float(value)

