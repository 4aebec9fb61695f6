"""``outcore train``'s own settings (the config file's ``train:`` section and the flags that
share its keys): their defaults, how the two sources merge, and the checks that turn a bad
value into one line naming the key."""

from __future__ import annotations

import argparse
import os
import warnings
from pathlib import Path
from typing import Any

from outcore.app import blocks
from outcore.app.models import is_hf_folder
from outcore.config import Config, read_mapping
from outcore.config.deepspeed import is_deepspeed, names_precision, translate, warn_ignored
from outcore.errors import ConfigError, CorruptCheckpointError
from outcore.io.manifest import latest_checkpoint, read_manifest
from outcore.io.publish import MANIFEST

__all__ = ["JOB_DEFAULTS", "LR_SCHEDULES", "RUN_OPTIONS", "check_out", "check_resume",
           "drifted", "job_settings", "placement", "read_config_file", "resumed_settings",
           "run_record", "same_setting", "step_of"]

JOB_DEFAULTS: dict[str, Any] = {
    "model": "small", "data": None, "steps": 300, "save_every": 100, "out": "./outcore-run",
    "batch": 8, "seq": None, "offload": "nvme", "lr_schedule": "cosine", "lora": None,
    "checkpoint_activations": "auto", "offload_activations": "off",
}
"""The job's own settings when neither a flag nor the config file's ``train:`` section sets them."""

LR_SCHEDULES = ("cosine", "constant")


def read_config_file(path: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``--config``'s settings, and the defaults that lie under them.

    A DeepSpeed config means what DeepSpeed makes of it: what it leaves out takes
    ``Config``'s defaults, DeepSpeed's own (no offload where it names none, Adam's betas
    0.9, 0.999, no clipping), not the job's. Only the NVMe folder (``--nvme-path`` or
    ``OUT/swap``) and the learning rate (the job's default for the model) stay the job's.
    The two are returned apart, the file's settings (translated) first: a resume asks what
    the file itself sets ([Note: a resume is started as its run was]); the caller merges the
    defaults under it after that. For an outcore file the defaults are empty: the job's
    apply."""
    if path is None:
        return {}, {}
    loaded = read_mapping(path)
    if not is_deepspeed(loaded):
        return loaded, {}
    defaults = Config().model_dump(mode="json")
    del defaults["offload"]["nvme_path"], defaults["optimizer"]["lr"]
    settings, ignored = translate(loaded)
    micro = loaded.get("train_micro_batch_size_per_gpu")
    if isinstance(micro, int) and not isinstance(micro, bool) and micro > 0:
        settings["train"] = {"batch": micro}  # the job is the data loader: --batch's default
    taken = "train_micro_batch_size_per_gpu:" if "train" in settings else None
    ignored = [("scheduler: not read by outcore train, which runs --lr-schedule (cosine over "
                "--steps by default)") if line.startswith("scheduler:") else line
               for line in ignored if taken is None or not line.startswith(taken)]
    warn_ignored(ignored, stacklevel=2)
    if not names_precision(loaded) and "dtype" in settings:
        defaults["dtype"] = settings.pop("dtype")  # fp32 (or auto) by default, not by the file
    return settings, defaults


def job_settings(args: argparse.Namespace, file_job: Any) -> dict[str, Any]:
    """The job: defaults < the file's ``train:`` section < flags, checked."""
    if not isinstance(file_job, dict):
        raise ConfigError(f"train: expected a mapping of job keys ({', '.join(JOB_DEFAULTS)}), "
                          f"got {file_job!r}")
    unknown = set(file_job) - set(JOB_DEFAULTS)
    if unknown:
        raise ConfigError(f"unknown config key 'train.{sorted(unknown)[0]}'; allowed keys here: "
                          + ", ".join(sorted(JOB_DEFAULTS)))
    job = {**JOB_DEFAULTS, **file_job}
    for key in JOB_DEFAULTS:
        if getattr(args, key, None) is not None:
            job[key] = getattr(args, key)
    def source(key: str) -> str:  # where the value came from: the flag, or the file
        return (f"--{key.replace('_', '-')}" if getattr(args, key, None) is not None
                else f"train.{key}")

    for key in ("steps", "save_every", "batch", "seq"):  # the file's too, where a flag wins
        for where, value in ((source(key), job[key]), (f"train.{key}", file_job.get(key))):
            # YAML's true is an int to Python, not a count
            if value is not None and (type(value) is not int or value < 1):
                raise ConfigError(f"{where}: must be a whole number >= 1, got {value!r}")
    for key, may_be_none in (("model", False), ("out", False), ("data", True)):
        value = job[key]
        if not (isinstance(value, str | Path) and str(value)) and not (
                may_be_none and value is None):
            raise ConfigError(f"--{key} (train.{key}): expected a path or name, got {value!r}")
    if job["lr_schedule"] not in LR_SCHEDULES:
        raise ConfigError(f"train.lr_schedule: got {job['lr_schedule']!r}; allowed: "
                          + ", ".join(LR_SCHEDULES))
    try:  # YAML's unquoted on / off arrive as booleans, "4" as on the command line
        job["checkpoint_activations"] = blocks.checkpoint_mode(job["checkpoint_activations"])
    except ConfigError as e:
        raise ConfigError(f"train.checkpoint_activations: {e}") from None
    if job["offload_activations"] is False:  # YAML's unquoted off
        job["offload_activations"] = "off"
    if job["offload_activations"] not in blocks.ACTIVATION_PLACES:
        raise ConfigError(f"train.offload_activations: got {job['offload_activations']!r}; "
                          "allowed: " + ", ".join(blocks.ACTIVATION_PLACES))
    if job["offload"] not in ("none", "cpu", "nvme", "auto"):
        raise ConfigError(f"train.offload: got {job['offload']!r}; allowed: none, cpu, nvme, auto")
    job["out"] = Path(job["out"])
    return job


RUN_OPTIONS = ("model", "data", "steps", "save_every", "batch", "seq", "offload", "nvme_path",
               "lr", "lr_schedule", "dtype", "checkpoint_activations", "offload_activations",
               "lora")
"""The flags a checkpoint records (with the config file's contents) so that ``--resume`` with
``--out`` alone continues the run as it was started; ``seed`` travels on its own."""


_PATHS = ("model", "data", "nvme_path")
"""Settings that may name a path: recorded resolved, so a resume from another folder finds
them (a model only where it is a Hugging Face folder: a preset's name stays a name, though a
folder of that name may exist)."""

# where each flag's value lives in the config file, for a --config given anew on resume
# (any of the places: --offload stands for both placements and the job's own key)
_IN_CONFIG = {"lr": [("optimizer", "lr")], "dtype": [("dtype",)],
              "nvme_path": [("offload", "nvme_path")],
              "offload": [("offload", "params"), ("offload", "optimizer"), ("train", "offload")]}


def _resolved(key: str, value: Any) -> Any:
    if key not in _PATHS or not isinstance(value, str) or value == "":
        return value
    path = Path(value).expanduser()  # a swap folder is made by the run: resolved as it is
    if key == "nvme_path" or (is_hf_folder(path) if key == "model" else path.exists()):
        return str(path.resolve())
    return value


def same_setting(key: str, a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are one value of setting ``key`` (a path however spelled)."""
    if key == "lora":  # one spec spelled two ways is the same; another is refused (lora.py)
        return True
    return bool(_resolved(key, a) == _resolved(key, b))


def placement(tier: str, cfg: Config) -> str:
    """The tiers a run ran with, as a resume names them: one where both are there, else
    each (a config file may place them apart, or where ``--offload``'s default is not)."""
    if tier == "auto":  # what the plan chose is printed; a resume plans again
        return tier
    if cfg.offload.params == cfg.offload.optimizer:
        return cfg.offload.params
    return f"params {cfg.offload.params}, optimizer {cfg.offload.optimizer}"


def _config_sets(file_cfg: dict[str, Any], key: str) -> bool:
    """Whether the config file sets the flag ``key`` (its ``train:`` section, or the engine's
    key the flag stands for)."""
    return any(_holds(file_cfg, parts) for parts in _IN_CONFIG.get(key, [("train", key)]))


def _holds(mapping: Any, parts: tuple[str, ...]) -> bool:
    for part in parts:
        if not isinstance(mapping, dict) or part not in mapping:
            return False
        mapping = mapping[part]
    return True


DRIFTS = ("lr", "dtype", "offload", "data", "batch", "seq")
"""What a resume names when it runs with another value than its run did (``drifted``)."""


def drifted(record: dict[str, Any], effective: dict[str, Any], said: list[str]) -> list[str]:
    """A line for each setting a resume runs with other than its run did, that no line in
    ``said`` names already: a config given again may change one without any flag
    (``optimizer.lr``, a placement), and a checkpoint of an older outcore may have run with a
    default that has changed since."""
    before = (record.get("run") or {}).get("effective") or {}
    return [f"{key} {effective[key]} (the run had {before[key]})"
            for key in DRIFTS if key in before and key in effective
            and not any(line.startswith(f"--{key} ") for line in said)
            and not same_setting(key, effective[key], before[key])]


def run_record(args: argparse.Namespace, file_cfg: dict[str, Any]) -> dict[str, Any]:
    """How this run was started: the flags given and the config file as read, its paths
    resolved (JSON only). The caller adds ``effective``: the settings the run ran with."""
    options = {k: _resolved(k, getattr(args, k)) for k in RUN_OPTIONS
               if getattr(args, k, None) is not None}
    config = {k: dict(v) if isinstance(v, dict) else v for k, v in file_cfg.items()}
    for section, key in (("train", "data"), ("train", "model"), ("offload", "nvme_path")):
        if isinstance(config.get(section), dict) and key in config[section]:
            config[section][key] = _resolved(key, config[section][key])
    return {"options": options, "config": config}


def resumed_settings(args: argparse.Namespace, file_cfg: dict[str, Any],
                     client: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Fill ``args``' flags not given from a checkpoint's ``client`` state, in place; return
    the config file to use and a line for each flag given anew that changes the run's.

    [Note: a resume is started as its run was]
    ``outcore train --out run1 --resume`` must continue run1, not start the job's defaults
    on run1's weights: a 300-step cosine schedule where the run had 1,000 steps, the
    default data, another model (which the load then refuses). So each checkpoint records
    the flags the run was started with, its config file as read, paths resolved
    (``run_record``), and the settings it ran with. A resume takes them as its own. A flag
    given again overrides the run's and is named against what the run ran with, wherever
    that came from. A ``--config`` given again replaces the run's file, and the run's flags
    then apply only where the new file does not set them; a learning rate, precision or
    tier that it changes is named too (``drifted``, once the config is built). Checkpoints
    written before this record carry the model alone.
    """
    record = client.get("run")
    if not isinstance(record, dict):
        record = {"options": {"model": client["model"]} if "model" in client else {},
                  "config": None}
    options = record.get("options") or {}
    effective = {**options, **(record.get("effective") or {})}
    changed = [f"--{key.replace('_', '-')} {getattr(args, key)} (the run had {effective[key]})"
               for key in RUN_OPTIONS if getattr(args, key, None) is not None
               and key in effective and not same_setting(key, getattr(args, key), effective[key])]
    for key, value in options.items():
        if key in RUN_OPTIONS and getattr(args, key, None) is None and not (
                args.config is not None and _config_sets(file_cfg, key)):
            setattr(args, key, value)
    if "model" in options and not same_setting("model", args.model, options["model"]):
        changed = []  # another model is refused before the build, in a line of its own
    saved_cfg = record.get("config")
    if args.config is None and isinstance(saved_cfg, dict):
        file_cfg = saved_cfg
    elif isinstance(saved_cfg, dict) and isinstance(saved_cfg.get("train"), dict):
        # the run's own train section where the file given again sets nothing: it was the
        # run's model and data, which the job's defaults would replace without a word
        file_cfg = {**file_cfg, "train": {**saved_cfg["train"], **(file_cfg.get("train") or {})}}
    return file_cfg, changed


def warn_unused_nvme_path(args: argparse.Namespace, cfg: Any, job: dict[str, Any]) -> None:
    """``--nvme-path`` where nothing goes to NVMe (``--offload cpu``) was ignored silently."""
    off = cfg.offload
    if args.nvme_path is not None and "nvme" not in (off.params, off.optimizer) and (
            job["offload_activations"] != "nvme"):
        warnings.warn(f"--nvme-path {args.nvme_path} is unused: nothing is placed on NVMe "
                      f"(params {off.params}, optimizer {off.optimizer})", stacklevel=2)


def check_out(out: Path) -> None:
    """``--out`` is a run's folder, not one of its checkpoints nor their ``checkpoints``
    folder: given those (a natural slip with ``--resume``), a run found no checkpoint in
    ``OUT/checkpoints`` and started a new run from step 0 inside them."""
    run = out.parent.parent if out.parent.name == "checkpoints" else out.parent
    if (out / MANIFEST).is_file():
        raise ConfigError(f"--out {out} is a checkpoint, not a run's folder; give the run's "
                          f"folder ({run}), which holds checkpoints/")
    if out.name == "checkpoints" and latest_checkpoint(out) is not None:
        raise ConfigError(f"--out {out} is a run's checkpoints folder; give the run's folder "
                          f"({out.parent})")


def check_resume(latest: Path, client: dict[str, Any], model: str, steps: int,
                 batch: int) -> list[str]:
    """Before the build, from ``latest``'s client state: refuse a checkpoint of another model
    (loading it would fail on its parameter names, in a line listing all of them) or one past
    ``steps`` (the total, not a count of more steps), and one in the way of the run's
    saves; return the lines that say which newer step folders ``latest_checkpoint``
    passed over as incomplete or damaged, and how another number of ranks changes the
    global batch."""
    saved = client.get("model")
    # a base read in place whose folder has moved since (the folder the checkpoint records
    # is gone) may be named anew: its files are checked one by one against that record
    base = (read_manifest(latest).get("base") or {}) if saved is not None else {}
    moved = (base.get("folder") is not None and not os.path.exists(base["folder"])
             and is_hf_folder(Path(model).expanduser()))
    if saved is not None and not moved and not same_setting("model", saved, model):
        raise ConfigError(f"--resume: {latest} is a checkpoint of model {saved!r}, not "
                          f"{model!r}; give --model {saved} to continue it, or another --out")
    done = client.get("step")
    if isinstance(done, int) and done > steps:
        raise ConfigError(f"--steps {steps}: the run is at step {done} already ({latest.name}); "
                          f"--steps is the total to reach, so give more than {done}")
    newer = sorted(p.name for p in latest.parent.glob("step-*")
                   if p.is_dir() and p.name > latest.name and "." not in p.name)
    # one with no manifest is no checkpoint to replace: the save of its step would fail,
    # after the steps since the last checkpoint were trained again, on every retry
    blocked = [n for n in newer if not (latest.parent / n / MANIFEST).exists()
               and any((latest.parent / n).iterdir()) and step_of(n) <= steps]
    if blocked:
        raise ConfigError(f"--resume: {latest.parent / blocked[0]} is in the way of this run's "
                          "saves: it holds no manifest.json, so it is no checkpoint outcore may "
                          "replace. Move it out of the checkpoints folder (or delete it), then "
                          "resume")
    lines = [] if not newer else [
        f"passing over {', '.join(newer)} (incomplete or damaged: a rank file missing or cut "
        f"short, or no valid manifest); resuming from {latest.name}"]
    return lines + _world_change(read_manifest(latest), client, batch)


def _world_change(man: dict[str, Any], client: dict[str, Any], batch: int) -> list[str]:
    """The line naming another number of ranks than the run's: each rank draws ``--batch``
    rows of the global batch (data.py's note), so the global batch follows the ranks, and a
    run resumed at half its ranks trained on half its batch without a word."""
    then, now = man.get("world_size"), int(os.environ.get("WORLD_SIZE", "1"))
    run = client.get("run")
    parts = [run.get(k) for k in ("effective", "options")] if isinstance(run, dict) else []
    had = next((p["batch"] for p in parts if isinstance(p, dict) and "batch" in p), None)
    if not isinstance(then, int) or then == now or not isinstance(had, int):
        return []
    before, after = had * then, batch * now
    keep = ("it stays the same" if before == after else
            f"give --batch {before // now} to keep it" if before % now == 0 else
            f"no --batch keeps it at {now} ranks")
    return [f"{now} rank{'s' * (now != 1)} (the run had {then}): the global batch is {batch} "
            f"x {now} = {after} sequences, the run's {had} x {then} = {before}; {keep}"]


def load_latest(engine: Any, latest: Path) -> dict[str, Any]:
    """Load the run's newest checkpoint for a resume; return its client state. One damaged
    after its save (a bit flip: ``latest_checkpoint`` checks sizes, not checksums) stopped
    every ``--resume`` with a line that named the file and no way on: it now names the
    checkpoint before it and how to resume from that."""
    try:
        return engine.load_checkpoint(latest, keep_settings=True) or {}
    except CorruptCheckpointError as e:
        earlier = [p.name for p in sorted(latest.parent.glob("step-*")) if p.is_dir()
                   and "." not in p.name and p.name < latest.name and (p / MANIFEST).is_file()]
        to = f"resume from {earlier[-1]}" if earlier else "start over from step 0"
        raise CorruptCheckpointError(f"{e}. To {to}, move {latest} out of {latest.parent} "
                                     "(or delete it), then --resume again") from e


def step_of(name: str) -> int:
    """The step of a ``step-NNNNNNNN`` folder's name (0 for another name)."""
    digits = name.removeprefix("step-")
    return int(digits) if digits.isdigit() else 0
