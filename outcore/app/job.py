"""``outcore train``'s own settings (the config file's ``train:`` section and the flags that
share its keys): their defaults, how the two sources merge, and the checks that turn a bad
value into one line naming the key."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from outcore.app import blocks
from outcore.errors import ConfigError

__all__ = ["JOB_DEFAULTS", "LR_SCHEDULES", "job_settings"]

JOB_DEFAULTS: dict[str, Any] = {
    "model": "small", "data": None, "steps": 300, "save_every": 100, "out": "./outcore-run",
    "batch": 8, "seq": None, "offload": "nvme", "lr_schedule": "cosine", "lora": None,
    "checkpoint_activations": "auto", "offload_activations": "off",
}
"""The job's own settings when neither a flag nor the config file's ``train:`` section sets them."""

LR_SCHEDULES = ("cosine", "constant")


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
    for key in ("steps", "save_every", "batch", "seq"):
        value = job[key]  # YAML's true is an int to Python, not a count
        if value is not None and (type(value) is not int or value < 1):
            raise ConfigError(f"--{key.replace('_', '-')}: must be a whole number >= 1, "
                              f"got {value!r}")
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
