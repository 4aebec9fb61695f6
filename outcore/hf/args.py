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
from outcore.config.deepspeed import Auto, is_deepspeed, translate_and_warn
from outcore.errors import ConfigError

# TrainingArguments.optim values outcore runs over its shards, and the update each one is
OPTIM_NAMES = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw",
               "sgd": "sgd", "adafactor": "adafactor"}
_OPTIM_ARGS = {"momentum": float, "nesterov": lambda v: v.lower() in ("1", "true", "yes")}


def optimizer_type(optim: str) -> str:
    """outcore's optimizer type for a ``TrainingArguments.optim`` name, or a refusal that
    says what works and why the rest does not."""
    if optim in OPTIM_NAMES:
        return OPTIM_NAMES[optim]
    raise ConfigError(f"TrainingArguments.optim={optim!r} is not supported by OutcoreTrainer: "
                      "outcore runs Adam(W), SGD and Adafactor over its shards; use one of "
                      f"{', '.join(OPTIM_NAMES)}, or pass a torch Adam, AdamW or SGD or "
                      "transformers' Adafactor as optimizers=(optimizer, scheduler)")


def _optim_args(optim_args: str | None) -> dict[str, tuple[str, Any]]:
    """``TrainingArguments.optim_args`` ("momentum=0.9,nesterov=True" for SGD)."""
    keys: dict[str, tuple[str, Any]] = {}
    for item in filter(None, (optim_args or "").replace(" ", "").split(",")):
        name, _, value = item.partition("=")
        if name not in _OPTIM_ARGS:
            raise ConfigError(f"TrainingArguments.optim_args: {name!r} is not supported by "
                              f"OutcoreTrainer; it takes {', '.join(_OPTIM_ARGS)} (SGD); the "
                              "Adam(W) keys are learning_rate, adam_beta1/2, adam_epsilon and "
                              "weight_decay")
        keys[f"optimizer.{name}"] = (f"optim_args {name}", _OPTIM_ARGS[name](value))
    return keys


OutcoreConfigSource = Config | dict[str, Any] | str | os.PathLike[str] | None


def given_keys(source: OutcoreConfigSource, hidden_size: int | None = None) -> dict[str, Any]:
    """The outcore keys ``source`` sets explicitly, as a nested mapping (a DeepSpeed config
    translated, its ``"auto"`` values as the Trainer fills them: config/deepspeed.py's
    [Note: what "auto" means])."""
    if source is None:
        return {}
    if isinstance(source, Config):
        return source.model_dump(exclude_unset=True)
    raw = dict(source) if isinstance(source, dict) else read_mapping(source)
    if is_deepspeed(raw):
        return translate_and_warn(raw, stacklevel=3,
                                  auto=Auto(trainer=True, hidden_size=hidden_size))
    return raw


def hidden_size(model: Any) -> int | None:
    """The model's hidden size, where its config names one (for DeepSpeed's "auto" buckets)."""
    config = getattr(model, "config", None)
    for name in ("hidden_size", "n_embd", "d_model"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    sizes = getattr(config, "hidden_sizes", None)
    return max(sizes) if isinstance(sizes, (list, tuple)) and sizes else None


def trainer_keys(args: Any, optimizer_given: bool = False) -> dict[str, tuple[str, Any]]:
    """outcore key -> (the TrainingArguments spelling, its value) for the keys the Trainer owns.

    ``optimizer_given``: the config names its optimizer type (a DeepSpeed config's
    ``optimizer`` section), which then wins over ``optim``, as under transformers' DeepSpeed
    integration; its numbers still come from the Trainer."""
    keys: dict[str, tuple[str, Any]] = {}
    if not optimizer_given:
        optim = str(getattr(args.optim, "value", args.optim))
        keys["optimizer.type"] = (f"optim={optim!r}", optimizer_type(optim))
        keys.update(_optim_args(args.optim_args))
    keys.update({
        "optimizer.lr": ("learning_rate", float(args.learning_rate)),
        "optimizer.betas": ("adam_beta1, adam_beta2", (float(args.adam_beta1),
                                                        float(args.adam_beta2))),
        "optimizer.eps": ("adam_epsilon", float(args.adam_epsilon)),
        "optimizer.weight_decay": ("weight_decay", float(args.weight_decay)),
        "gradient_accumulation_steps": ("gradient_accumulation_steps",
                                        int(args.gradient_accumulation_steps)),
        "gradient_clipping": ("max_grad_norm", float(args.max_grad_norm or 0.0)),
        "seed": ("seed", int(args.seed)),
    })
    if args.bf16 and args.fp16:
        raise ConfigError("TrainingArguments: bf16=True and fp16=True; choose one")
    if args.bf16 or args.fp16:
        keys["dtype"] = ("bf16=True" if args.bf16 else "fp16=True", "bf16" if args.bf16 else "fp16")
    return keys


def build_config(args: Any, source: OutcoreConfigSource, model: Any = None) -> Config:
    """The engine's Config: ``source``'s keys plus the Trainer's, with clashes refused."""
    given = given_keys(source, hidden_size(model))
    owned = trainer_keys(args, optimizer_given=_lookup(given, "optimizer.type") is not _MISSING)
    clashes = _deepspeed_clashes(source, args)
    for key, (spelling, value) in owned.items():
        mine = _lookup(given, key)
        if mine is not _MISSING and _normal(mine) != _normal(value):
            shown = list(value) if isinstance(value, tuple) else value
            theirs = spelling if "=" in spelling else f"{spelling}={shown!r}"
            clashes.append(f"outcore_config {key}={mine!r} and TrainingArguments.{theirs}")
    if clashes:
        raise ConfigError("set in both outcore_config and TrainingArguments, with different "
                          "values: " + "; ".join(clashes) + ". Under OutcoreTrainer the "
                          "TrainingArguments give these; remove them from outcore_config (in "
                          "a DeepSpeed file, \"auto\" takes the Trainer's)")
    nested: dict[str, Any] = {}
    for key, (_, value) in owned.items():
        _assign(nested, key, list(value) if isinstance(value, tuple) else value)
    if "dtype" not in owned and _lookup(given, "dtype") is _MISSING:
        nested["dtype"] = "fp32"  # what Trainer trains in without bf16/fp16
    # The Trainer logs the gradient norm every logging step, so the engine computes it.
    nested["track_grad_norm"] = True
    base = source.model_dump() if isinstance(source, Config) else given
    return Config.from_dict(merge_mappings(base, nested))


def _deepspeed_clashes(source: OutcoreConfigSource, args: Any) -> list[str]:
    """What a DeepSpeed file states that the Trainer states otherwise, beyond the engine's
    keys, as transformers' integration compares them (``fill_match``): the batch sizes and
    the scheduler's peak rate (its steps: hf/schedule.py, once the total is known). They were
    used or dropped with one warning line, where the docs promised an error."""
    if source is None or isinstance(source, Config):
        return []
    raw = dict(source) if isinstance(source, dict) else read_mapping(source)
    if not is_deepspeed(raw):
        return []
    micro, gas = int(args.per_device_train_batch_size), int(args.gradient_accumulation_steps)
    theirs = {"train_micro_batch_size_per_gpu": ("per_device_train_batch_size", micro),
              "train_batch_size": ("per_device_train_batch_size x gradient_accumulation_steps "
                                   "x world_size", micro * gas * int(args.world_size)),
              "scheduler.params.warmup_max_lr": ("learning_rate", float(args.learning_rate))}
    return [f"DeepSpeed config {key}={mine!r} and TrainingArguments.{spelling}={value!r}"
            for key, (spelling, value) in theirs.items()
            if (mine := _lookup(raw, key)) not in (_MISSING, None, "auto")
            and _normal(mine) != _normal(value)]


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



def deepspeed_from_args(args: Any, source: OutcoreConfigSource) -> OutcoreConfigSource:
    """``TrainingArguments.deepspeed`` as the engine's config source.

    [Note: a DeepSpeed config in TrainingArguments]
    A script written for transformers' DeepSpeed integration passes its config as
    ``TrainingArguments(deepspeed=path)``. Under ``OutcoreTrainer`` that config is outcore's
    (read as ``outcore_config`` would be), and the argument is cleared, with the flags that
    tell accelerate to start DeepSpeed, so neither transformers nor accelerate wraps the
    model in DeepSpeed's engine. transformers refuses ``deepspeed=`` unless the deepspeed
    package is installed; without it, pass the same file as ``outcore_config``.
    """
    given = getattr(args, "deepspeed", None)
    if not given:
        return source
    if source is not None and source != given:
        raise ConfigError("OutcoreTrainer got both outcore_config and TrainingArguments."
                          "deepspeed; pass the config once")
    args.deepspeed = None
    if hasattr(args, "hf_deepspeed_config"):
        args.hf_deepspeed_config = None
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    return given


def check_world(args: Any) -> None:
    """Refuse a Trainer that sees fewer processes than ``torchrun`` started.

    On a machine without a GPU, transformers joins the process group only with
    ``TrainingArguments(use_cpu=True)``; without it every rank believes it is the only
    process and rank 0, so all of them train on the same batches and write the same files,
    while outcore's engine shards over every rank. Nothing fails; the run just silently
    loses its data parallelism. So it is refused here, in words, before any sharding."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and args.world_size != launched:
        raise ConfigError(
            f"torchrun started {launched} processes but the Trainer sees {args.world_size} "
            "(transformers joins the process group on a machine without a GPU only with "
            "TrainingArguments(use_cpu=True)); pass use_cpu=True, or start one process")
