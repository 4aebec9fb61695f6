"""``OutcoreTrainer``: Hugging Face's ``Trainer`` with outcore's engine under it.

[Note: the Trainer's loop, the engine's steps]
The Trainer keeps everything it owns: data order and sampling across ranks, the learning-rate
schedule, loss normalisation across accumulation (by the tokens of the whole accumulated
batch), logging, evaluation, callbacks, checkpoint folders and their rotation. The engine
replaces exactly the places where a Trainer would touch whole parameters:

* the model the loop calls is a thin module over the engine (``_wrap_model``), so neither DDP
  nor accelerate wraps it, and forward fetches each layer's shards as it runs;
* ``training_step`` hands the Trainer-normalised loss to ``engine.backward`` (which then does
  not divide it again) and tells it which backward ends the accumulation, which the Trainer
  decides (the last one of an epoch may come early);
* the optimizer the Trainer steps and schedules is a view of the engine's (``EngineOptimizer``):
  its ``param_groups`` *are* the engine's, so the scheduler's learning rate reaches the shards'
  update; clipping by ``max_grad_norm`` happens inside ``engine.step()`` over the sharded
  gradients, and the norm the Trainer logs is the engine's;
* checkpoints: Trainer's ``checkpoint-N`` folder *is* an outcore checkpoint (written
  atomically, every rank its shard), beside which the Trainer writes its state, scheduler and
  RNG files; resuming loads it back, exactly.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import Trainer
from transformers.trainer import OPTIMIZER_NAME

from outcore.config import Config, read_mapping
from outcore.config.deepspeed import is_deepspeed
from outcore.engine import Engine, lifetime
from outcore.engine.torch_optimizer import TorchOptimizer, hooked_load, hooked_state_dict
from outcore.errors import ConfigError
from outcore.hf import saving
from outcore.hf.args import OutcoreConfigSource, build_config, check_world, deepspeed_from_args
from outcore.hf.schedule import deepspeed_scheduler
from outcore.io.manifest import with_empty
from outcore.io.publish import MANIFEST
from outcore.optim.param_groups import TORCH_GROUP_KEYS

# Trainer methods OutcoreTrainer overrides; private ones move between transformers releases
OVERRIDDEN = ("create_accelerator_and_postprocess", "_move_model_to_device", "_wrap_model",
              "create_optimizer", "create_scheduler", "_prepare_for_training", "training_step",
              "_clip_grad_norm", "_get_grad_norm", "_maybe_log_save_evaluate", "save_model",
              "_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_best_model",
              "call_model_init", "train", "end")
TESTED = ">=5.23,<6"


def check_transformers() -> None:
    """Refuse a transformers whose Trainer lacks a method this class replaces: the override
    would silently not run, and the Trainer would touch whole parameters."""
    import transformers

    missing = [name for name in OVERRIDDEN if not callable(getattr(Trainer, name, None))]
    if missing:
        raise ConfigError(f"OutcoreTrainer needs transformers{TESTED}; the installed "
                          f"{transformers.__version__} has no Trainer.{', '.join(missing)}: "
                          "pip install 'outcore[hf]'")


class EngineOptimizer(TorchOptimizer):
    """The engine's optimizer as the Trainer and its scheduler see it: ``engine.optimizer``'s
    torch contract (engine/torch_optimizer.py's note), plus what accelerate's wrapper is told
    about skipped steps. Its ``state_dict()`` holds the hyper-parameters only: the moments live
    in the outcore checkpoint of the same ``checkpoint-N`` folder.

    [Note: optimizer.pt in a checkpoint-N folder]
    The Trainer writes this ``state_dict()`` as ``optimizer.pt``. It has torch's layout (each
    group's ``params`` as indices, the keys torch's optimizer of the type keeps) and an empty
    ``state``, so a plain ``Trainer`` resuming the folder, on a machine without outcore's
    engine, loads it into its own optimizer and goes on from the weights, step and schedule
    with new moments, as it resumes a DeepSpeed checkpoint; it raised ``KeyError: 'params'``.
    Writing the moments here too would store every checkpoint's optimizer state twice."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.accelerated: Any = None  # accelerate's wrapper, told about skipped steps

    @property
    def empty(self) -> list[int]:
        """The groups that hold no parameter (Trainer's no-decay group in a LoRA run):
        older checkpoints of OutcoreTrainer's lack them (io/manifest.py's
        ``align_empty_groups``)."""
        return [i for i, g in enumerate(self.param_groups) if not g["params"]]

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = super().step(closure)
        if self.accelerated is not None:
            self.accelerated._is_overflow = self.skipped
        return loss

    # torch wraps each optimizer class's step() to run the step hooks; the facade's step,
    # called above, already runs them, so this one is marked as wrapped (hooks run once)
    step.hooked = True  # type: ignore[attr-defined]

    def state_dict(self) -> dict[str, Any]:
        return hooked_state_dict(self, self._groups_only)

    def _groups_only(self) -> dict[str, Any]:
        """torch's layout with no state (see [Note: optimizer.pt in a checkpoint-N folder])."""
        torch_keys = TORCH_GROUP_KEYS.get(self._engine.cfg.optimizer.type, {})
        index, groups = 0, []
        for g in self.param_groups:
            count = len(g["params"])
            groups.append({**torch_keys, **{k: v for k, v in g.items() if k != "params"},
                           "params": list(range(index, index + count))})
            index += count
        return {"state": {}, "param_groups": groups}

    def _ours(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``state_dict`` with the empty groups an older checkpoint lacks, as the engine's."""
        groups, empty = state_dict.get("param_groups"), self.empty
        if not (empty and isinstance(groups, list)
                and len(groups) == len(self.param_groups) - len(empty)):
            return state_dict
        return {**state_dict, "param_groups": with_empty(
            groups, empty, lambda i: {**self.param_groups[i], "params": []})}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        hooked_load(self, state_dict, self._load_groups)  # between its hooks, as torch's

    def _load_groups(self, state_dict: dict[str, Any]) -> None:
        """The hyper-parameters of an OutcoreTrainer's ``optimizer.pt``; a torch optimizer's
        whole state (a plain ``Trainer``'s checkpoint) goes into the engine's moments."""
        state_dict = self._ours(state_dict)
        if state_dict.get("state"):
            self._load_state_dict(state_dict)  # TorchOptimizer's: checked, then written
            return
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ConfigError(f"optimizer state has {len(groups)} param groups, this run has "
                              f"{len(self.param_groups)}")
        added = TORCH_GROUP_KEYS.get(self._engine.cfg.optimizer.type, {})
        for mine, saved in zip(self.param_groups, groups, strict=True):
            # the keys ``state_dict`` added for torch's optimizer stay out of the engine's groups
            mine.update({k: v for k, v in saved.items()
                         if k != "params" and (k in mine or k not in added)})


class EngineModel(nn.Module):
    """What the Trainer's loop calls: the engine, seen as a module (train/eval reach the
    model; calls go through the engine).

    [Note: the wrapper the Trainer hands around is the model to its users]
    ``compute_loss``, ``prediction_step`` and the hooks a ``Trainer`` subclass overrides get
    this wrapper as ``model``; with a plain ``Trainer`` in one process they get the model
    itself, and code written there reads ``model.config`` or ``model.lm_head``. So an
    attribute the wrapper lacks is the model's. ``accelerator.unwrap_model`` (what such code
    calls to be safe under DDP, and what ``Trainer.compute_loss`` calls to learn whether the
    model is a causal LM, whose labels ``label_smoothing_factor`` must shift) returns the model,
    as it returns DDP's ``.module`` (``OutcoreTrainer.create_accelerator_and_postprocess``).
    Both found by a user's probe: a subclass's ``model.config`` raised torch's "'EngineModel'
    object has no attribute", and label smoothing compared each token with itself, a loss
    7.40 against Trainer's 6.93 on the same model."""

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.module = engine.module
        object.__setattr__(self, "engine", engine)  # not a submodule: Engine is no nn.Module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("module")
            if inner is None:
                raise
            return getattr(inner, name)


def unwrap_engine_model(unwrap: Any) -> Any:
    """``accelerator.unwrap_model`` that also sees through ``EngineModel`` (its note)."""
    def unwrap_model(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        return unwrap(model.module if isinstance(model, EngineModel) else model, *args, **kwargs)
    return unwrap_model


class OutcoreTrainer(Trainer):
    """``transformers.Trainer`` training a ZeRO-3 sharded, offloaded model.

    Takes every argument ``Trainer`` takes, plus ``outcore_config`` (a ``Config``, a dict, a
    JSON/YAML path or a DeepSpeed config path) for placement, precision and budgets. The
    model is sharded when the trainer is made (or was, under ``outcore.init``); call
    ``close()`` (or ``end()``) when done to delete its swap files.
    """

    def __init__(self, model: nn.Module | None = None, args: Any = None, *more: Any,
                 outcore_config: OutcoreConfigSource = None, **kwargs: Any) -> None:
        check_transformers()
        self._source = deepspeed_from_args(args, outcore_config)
        self._given_optimizer = (kwargs.get("optimizers") or (None, None))[0]
        self._optimizer_cls_and_kwargs = kwargs.get("optimizer_cls_and_kwargs")
        self.outcore_engine: Engine | None = None
        super().__init__(model, args, *more, **kwargs)
        check_world(self.args)
        self._take(self.model)

    def _take(self, model: nn.Module) -> None:
        """Shard ``model`` under a new engine (at construction, and for each fresh model
        ``model_init`` makes), with the optimizer the arguments ask for."""
        cfg = build_config(self.args, self._source, model)
        optimizer = self._given_optimizer
        decay = set(self.get_decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        trainers = [  # Trainer's two groups, one of which may be empty (all LoRA's decay)
            {"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        groups = trainers if any(g["params"] for g in trainers) else []
        # nothing trainable (an evaluation-only trainer): no optimizer to build
        if groups and optimizer is None and self._optimizer_cls_and_kwargs is not None:
            cls, kw = self._optimizer_cls_and_kwargs
            optimizer = cls(groups, **kw)
        elif groups and optimizer is None and cfg.optimizer.type == "adafactor":
            cls, kw = self.get_optimizer_cls_and_kwargs(self.args, model)  # transformers' own
            optimizer = cls(groups, **kw)
        if optimizer is not None:  # param_groups.py's [Note: adopting a torch optimizer]
            self.outcore_engine = Engine(model, cfg, optimizer=optimizer)
        else:  # nothing trainable (an evaluation): no groups, as initialize() takes it
            self.outcore_engine = Engine(model, cfg, groups or None)
        self._engine_model = EngineModel(self.outcore_engine)
        self._engine_optimizer = EngineOptimizer(self.outcore_engine)

    def call_model_init(self, trial: Any = None) -> nn.Module:
        """A fresh model for this run (``model_init``): the engine of the last one closes,
        and the new model is sharded under its own."""
        model = super().call_model_init(trial)
        if self.outcore_engine is not None:
            self.outcore_engine.close(keep_values=False)
            self._given_optimizer = None  # it was built over the old model's parameters
            self._take(model)
        return model

    def create_scheduler(self, num_training_steps: int,
                         optimizer: torch.optim.Optimizer | None = None) -> Any:
        """The Trainer's scheduler, or the DeepSpeed config's (schedule.py's note)."""
        spec = self._deepspeed_scheduler()
        if self.lr_scheduler is None and spec is not None:
            self.lr_scheduler = deepspeed_scheduler(spec, optimizer or self.optimizer,
                                                    self.args, num_training_steps)
            self._created_lr_scheduler = True
        return super().create_scheduler(num_training_steps, optimizer)

    def _deepspeed_scheduler(self) -> dict[str, Any] | None:
        source = self._source
        if isinstance(source, (str, os.PathLike)):
            source = read_mapping(source)
        if isinstance(source, dict) and is_deepspeed(source):
            return source.get("scheduler")
        return None

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        self.accelerator.unwrap_model = unwrap_engine_model(self.accelerator.unwrap_model)

    @property
    def outcore_config(self) -> Config:
        """The config the engine runs with (dtype resolved)."""
        return self.outcore_engine.cfg

    # -- the engine in the Trainer's loop (see [Note: the Trainer's loop, the engine's steps]) --
    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """The engine places every shard itself."""

    def _wrap_model(self, model: nn.Module, training: bool = True,
                    dataloader: Any = None) -> nn.Module:
        return self._engine_model

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        self.optimizer = self._engine_optimizer
        return self.optimizer

    def _prepare_for_training(self, *args: Any, **kwargs: Any) -> Any:
        out = super()._prepare_for_training(*args, **kwargs)
        if self.optimizer is not self._engine_optimizer:  # accelerate's wrapper around it
            self._engine_optimizer.accelerated = self.optimizer
            # With fp16 accelerate would step through a GradScaler, which unscales gradients
            # in param_groups' tensors; the engine scales the loss and unscales its shards.
            if getattr(self.optimizer, "scaler", None) is not None:
                self.optimizer.scaler = None
        return out

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """Trainer's step with the engine's backward: the same loss normalisation."""
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or \
                self.compute_loss_func is not None
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        boundary = bool(self.accelerator.gradient_state.sync_gradients)
        self.outcore_engine.backward(loss, scale_for_accumulation=False, boundary=boundary)
        return loss.detach()

    def _clip_grad_norm(self, model: nn.Module) -> None:
        """``engine.step()`` clips by ``max_grad_norm`` over the sharded gradients."""
        return None

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> None:
        return None  # known after engine.step(): _maybe_log_save_evaluate reads it

    def _maybe_log_save_evaluate(self, tr_loss: torch.Tensor, grad_norm: Any,
                                 *args: Any, **kwargs: Any) -> None:
        norm = self.outcore_engine.last_grad_norm
        super()._maybe_log_save_evaluate(tr_loss, norm, *args, **kwargs)

    # -- saving and resuming ----------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A folder ``from_pretrained`` loads: consolidated fp32 safetensors and config (a PEFT
        model: the adapter files ``PeftModel.from_pretrained`` loads). Every rank calls it.

        Inside ``checkpoint-N`` folders (``_internal_call``) the folder is also an outcore
        checkpoint (every rank's shards, for an exact resume), so ``from_pretrained`` and
        ``resume_from_checkpoint`` both work on it."""
        out = Path(output_dir if output_dir is not None else self.args.output_dir)
        engine, rank = self.outcore_engine, self.outcore_engine.rank
        peft = saving.is_peft_model(self.model)
        if _internal_call:  # checkpoint-N: what save_pretrained writes, and the shards
            if not self.args.save_only_model:  # (asked for: the model alone, as Trainer's)
                engine.save_checkpoint(out, replace_folder=True)  # the Trainer's folder
            if peft:
                saving.save_adapters(self.model, rank, out)
            else:
                saving.save_full(self.model, rank, out)
        elif peft:
            saving.save_adapters(self.model, rank, out)
        else:
            saving.save_full(self.model, rank, out)
        if rank == 0:
            self._save_extras(out)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_extras(self, out: Path) -> None:
        """What ``Trainer._save`` writes beside the weights: tokenizer and training args."""
        from transformers.trainer import TRAINING_ARGS_NAME

        tokenizer = self.processing_class or getattr(self.data_collator, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(out))
        torch.save(self.args, os.path.join(out, TRAINING_ARGS_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str,
                              model: nn.Module | None = None) -> None:
        folder = Path(resume_from_checkpoint)
        if not folder.is_dir():  # transformers' own words and exception type
            raise ValueError(f"Can't find a valid checkpoint at {resume_from_checkpoint}")
        if not (folder / MANIFEST).is_file() and saving.holds_weights(folder):
            # a plain Trainer's checkpoint: its optimizer.pt, if any, holds torch's whole
            # state, which the Trainer loads next (EngineOptimizer._load_groups)
            if not (folder / OPTIMIZER_NAME).is_file():
                warnings.warn(f"{resume_from_checkpoint} was saved with save_only_model=True: "
                              "the run goes on from its weights and step with a new optimizer "
                              "state, as Trainer resumes such a checkpoint", stacklevel=2)
            saving.load_saved(self.model, folder)
            return
        if not (folder / MANIFEST).is_file():
            raise ConfigError(f"Can't find a valid checkpoint at {resume_from_checkpoint}: "
                              f"it is no checkpoint OutcoreTrainer wrote (no {MANIFEST}); "
                              "resume from a checkpoint-N folder of an OutcoreTrainer run")
        self.outcore_engine.load_checkpoint(folder)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Trainer's. An older checkpoint's ``scheduler.pt`` lacks a value for each empty
        group (``EngineOptimizer.empty``): the first group's stands in (torch's schedulers
        refuse lists shorter than the groups)."""
        scheduler, empty = self.lr_scheduler, self._engine_optimizer.empty
        if scheduler is None or not empty:
            return super()._load_optimizer_and_scheduler(checkpoint)
        load, width = scheduler.load_state_dict, len(self.optimizer.param_groups) - len(empty)

        def ours(state: dict[str, Any]) -> None:
            load({k: with_empty(v, empty, lambda i, v=v: v[0])
                  if isinstance(v, list) and len(v) == width and v else v
                  for k, v in state.items()})

        scheduler.load_state_dict = ours  # type: ignore[method-assign]
        try:
            return super()._load_optimizer_and_scheduler(checkpoint)
        finally:
            del scheduler.load_state_dict

    def _load_best_model(self) -> None:
        """The best checkpoint's weights, and nothing else, as ``Trainer`` loads them (a
        full restore rewound the optimizer's moments and the RNG to that step too)."""
        best = self.state.best_model_checkpoint
        if best is not None:
            saving.load_saved(self.model, Path(best))

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; when it returns, no update or read of outcore's is in flight
        (the last ``step()`` reads ahead for a next step that does not come: a trainer
        dropped then would outlive a ``gc.collect()`` by those reads, swap file and all), and
        the output folder's lock is released (the next save takes it again), so nothing of
        outcore's is left in ``output_dir``."""
        if self.model_init is None and not any(p.requires_grad for p in self.model.parameters()):
            raise ConfigError("OutcoreTrainer.train(): every parameter of the model has "
                              "requires_grad=False, so there is nothing to train; evaluate() "
                              "and predict() work on such a model")
        try:
            out = super().train(*args, **kwargs)
            if self.outcore_engine is not None and not self.outcore_engine.closed:
                lifetime.quiesce(self.outcore_engine)
            return out
        finally:
            if self.outcore_engine is not None and not self.outcore_engine.closed:
                self.outcore_engine.release_folders()

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Delete this rank's swap files and remove the hooks; the trainer cannot train after."""
        self.outcore_engine.close()

    def end(self) -> None:
        self.close()
        super().end()
