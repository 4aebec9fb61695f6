"""DeepSpeed's engine methods on outcore's engine, for scripts moving from ``deepspeed.initialize``.

[Note: DeepSpeed's names on the engine]
A DeepSpeed script that swaps ``deepspeed.initialize`` for ``outcore.initialize`` keeps
calling its engine's methods: ``engine.get_lr()`` to log, ``save_16bit_model`` at the end,
``engine.local_rank`` for the device. Where outcore has the very same value, the method is
here under DeepSpeed's name and returns what DeepSpeed's returns, so the line keeps working
(``get_lr``, ``get_global_grad_norm``, ``gradient_accumulation_steps``,
``zero_optimization_stage``; ``backward``, ``step``,
``zero_grad``, ``no_sync``, ``module``, ``optimizer`` and ``global_steps`` already share
DeepSpeed's names). Where outcore does the job another way, or not at all, emulating it would
hide a difference the user must know (``save_16bit_model`` gathers a whole model into one
process, where outcore consolidates a checkpoint; ``is_gradient_accumulation_boundary``
answers for the micro-batch in progress, before its backward too, where outcore's
``is_accumulation_boundary`` answers for the last backward), so the name raises an AttributeError
that says what to write here. It is still an AttributeError, so ``hasattr`` and
``getattr(engine, name, default)`` keep their meaning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from outcore.errors import ConfigError

if TYPE_CHECKING:
    from outcore.engine.core import Engine

_SAVE_16BIT = ("on every rank engine.save_checkpoint(path), then on one rank "
               "outcore.consolidate(path, out_dir), which writes the full weights as "
               "safetensors (fp32); under OutcoreTrainer, trainer.save_model(out_dir)")
_BATCH = ("outcore does not batch your data: a step's batch is what your loop passes, "
          "times engine.gradient_accumulation_steps(), times engine.world_size (a DeepSpeed "
          "config's train_batch_size only sets the accumulation)")

# DeepSpeed's engine attribute -> what to write with outcore's engine
ELSEWHERE: dict[str, str] = {
    "save_16bit_model": _SAVE_16BIT,
    "save_fp16_model": _SAVE_16BIT,
    "local_rank": ("engine.device is this process's device; the local rank is "
                   "int(os.environ['LOCAL_RANK']), as torchrun sets it"),
    "global_rank": "engine.rank",
    "train_batch_size": _BATCH,
    "train_micro_batch_size_per_gpu": _BATCH,
    "set_train_batch_size": _BATCH,
    "global_samples": "count the samples in your loop (engine.global_steps counts updates)",
    "get_mom": ("engine.param_groups[i]['betas'] (Adam, AdamW) or "
                "engine.param_groups[i]['momentum'] (SGD)"),
    "was_step_applied": ("engine.step() returns whether it updated (False for a step skipped "
                         "for an fp16 overflow)"),
    "skipped_steps": ("engine.step() returns False for a step skipped for an fp16 overflow; "
                      "count those in your loop"),
    "lr_scheduler": ("outcore.deepspeed_scheduler(engine.optimizer, ds_config) builds the "
                     "config's scheduler section (or any torch.optim.lr_scheduler on "
                     "engine.optimizer); call its step() when engine.step() returns True, "
                     "once per update, as DeepSpeed's engine steps its own"),
    "set_gradient_accumulation_boundary": (
        "with engine.no_sync(): engine.backward(loss) accumulates; the backward after the "
        "block ends the accumulation, as under DDP"),
    "is_gradient_accumulation_boundary": (
        "engine.is_accumulation_boundary (a property) says whether the last backward ended an "
        "accumulation, so that step() updates; DeepSpeed's answers for the micro-batch in "
        "progress, before its backward too"),
    "fp16_enabled": ("engine.dtype == torch.float16 (the compute dtype; the engine casts "
                     "floating inputs to it)"),
    "bfloat16_enabled": ("engine.dtype == torch.bfloat16 (the compute dtype; the engine casts "
                         "floating inputs to it)"),
    "dp_world_size": "engine.world_size",
    "gradient_clipping": "engine.cfg.gradient_clipping",
    "config": "engine.cfg, outcore's Config (a DeepSpeed file's keys translated)",
    "destroy": "engine.close()",
    "empty_partition_cache": ("nothing: a layer's full weights exist only while it runs, "
                              "and are released after"),
}


class DeepSpeedNames:
    """DeepSpeed's engine methods that outcore answers as DeepSpeed does, and the others named
    (see the note)."""

    def get_lr(self: Engine) -> list[float]:
        """Each param group's learning rate now, as DeepSpeed's ``get_lr()``."""
        return [group["lr"] for group in self.param_groups]

    def get_global_grad_norm(self: Engine) -> float | None:
        """The last step's global gradient norm (``engine.last_grad_norm``). DeepSpeed's ZeRO-3
        always computes it; outcore only with clipping or ``track_grad_norm``, else None."""
        return self.last_grad_norm

    def gradient_accumulation_steps(self: Engine) -> int:
        """Backwards per update, as configured (``gradient_accumulation_steps``)."""
        return self.cfg.gradient_accumulation_steps

    def zero_optimization_stage(self: Engine) -> int:
        """3: parameters, gradients and optimizer state are all sharded."""
        return 3

    def __getattr__(self, name: str) -> Any:
        # reached for a name the engine does not have, and for a property of the engine's
        # that raised AttributeError: run it again, so its own error is what is seen
        if isinstance(getattr(type(self), name, None), property):
            return object.__getattribute__(self, name)
        hint = ELSEWHERE.get(name)
        if hint is None:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'",
                                 name=name, obj=self)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}' (a "
                             f"DeepSpeed engine's); with outcore: {hint}", name=name, obj=self)


def check_keep_settings(keep_settings: object) -> None:
    """``load_checkpoint``'s second argument is ``keep_settings``: a DeepSpeed script's
    ``load_checkpoint(load_dir, tag)`` would pass its tag there (a string, so true) and keep
    this engine's settings without a word."""
    if not isinstance(keep_settings, bool):
        raise ConfigError(
            f"load_checkpoint(path, keep_settings): keep_settings is True or False, got "
            f"{keep_settings!r}. DeepSpeed's load_checkpoint(load_dir, tag) is "
            "load_checkpoint(os.path.join(load_dir, tag)) here, and it returns the client "
            "state alone (DeepSpeed's returns (path, client_state))")
