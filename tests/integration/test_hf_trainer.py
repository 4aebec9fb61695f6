"""OutcoreTrainer against plain ``transformers.Trainer``: same seed, data and arguments (fp32,
dropout off), the same per-step losses, gradient norms and saved weights."""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import outcore
from tests.common import GPT2_LORA, LLAMA, LORA, REPO, arguments, build, dataset, nvme
from tests.distributed import run_world

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("accelerate")

from outcore.hf import OutcoreTrainer, apply_lora  # noqa: E402

# the Trainer, accelerate and peft never read p.grad where outcore shows None in its place
# (zero/surface.py's [Note: p.grad stays None, and says so]): a read would fail its test
pytestmark = pytest.mark.filterwarnings("error::outcore.GradReadWarning")


def logged(trainer, key: str) -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h]


@pytest.mark.parametrize(("name", "lora", "extra"), [
    ("gpt2", None, {}), ("llama", None, {}), ("gpt2", GPT2_LORA, {}), ("llama", LORA, {}),
    ("llama", LORA, {"activation_checkpointing": True})])
def test_equals_plain_trainer_with_state_on_nvme(tmp_path: Path, name: str, lora: str | None,
                                                  extra: dict) -> None:
    ref = transformers.Trainer(model=build(name, lora=lora),
                               args=arguments(tmp_path / "ref", **extra), train_dataset=dataset())
    ref.train()
    cfg = nvme(tmp_path)
    # GPT-2 is sharded by the trainer, Llama as it is created (outcore.init)
    model = build(name, cfg if name == "llama" else None, lora=lora)
    ours = OutcoreTrainer(model=model, args=arguments(tmp_path / "ours", **extra),
                          train_dataset=dataset(), outcore_config=cfg)
    ours.train()
    assert len(logged(ours, "loss")) == 8
    torch.testing.assert_close(logged(ours, "loss"), logged(ref, "loss"), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logged(ours, "grad_norm"), logged(ref, "grad_norm"),
                               rtol=1e-5, atol=1e-6)
    assert logged(ours, "learning_rate") == logged(ref, "learning_rate")
    held_out = dataset(26)[22:]
    assert ours.evaluate(eval_dataset=held_out)["eval_loss"] == pytest.approx(
        ref.evaluate(eval_dataset=held_out)["eval_loss"], rel=1e-5)
    torch.testing.assert_close(torch.as_tensor(ours.predict(held_out).predictions),
                               torch.as_tensor(ref.predict(held_out).predictions),
                               rtol=1e-4, atol=1e-4)
    ours.save_model(tmp_path / "saved")
    ours.close()
    assert not list((tmp_path / "swap").rglob("*.swap")), "close() leaves no swap file"
    ref.model.cpu().eval()  # Trainer moved it to its device; outcore hands ours back on the CPU
    ids = dataset()[0]["input_ids"][None, :6]
    with torch.no_grad():
        expect = ref.model(input_ids=ids).logits
    if lora is None:
        loaded = type(ref.model).from_pretrained(tmp_path / "saved").eval()
        for key, value in ref.model.state_dict().items():
            # AdamW divides by sqrt(v): a gradient near zero turns fp32 summation-order
            # differences into update differences of a fraction of lr (1e-2) per step
            torch.testing.assert_close(loaded.state_dict()[key], value, rtol=1e-4, atol=1e-4)
    else:
        loaded = peft.PeftModel.from_pretrained(build(name), tmp_path / "saved").eval()
        adapters = {k: v for k, v in ref.model.state_dict().items() if "lora_" in k}
        for key, value in adapters.items():
            assert value.numel() > 0
            torch.testing.assert_close(loaded.state_dict()[key], value, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, expect, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("born_frozen", [False, True])
def test_lora_base_is_16_bit_only(tmp_path: Path, born_frozen: bool) -> None:
    """A frozen base keeps one training-dtype shard: no master, gradient or optimizer state;
    built under ``outcore.init(frozen=True)`` it never had an fp32 master, not even briefly."""
    cfg = {**nvme(tmp_path), "dtype": "bf16"}
    torch.manual_seed(0)
    with outcore.init(cfg, frozen=born_frozen) as built:
        base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    torch.manual_seed(1)
    model = apply_lora(base, LORA)
    trainer = OutcoreTrainer(model=model, args=arguments(tmp_path / "out", max_steps=2),
                             train_dataset=dataset(), outcore_config=cfg)
    engine = trainer.outcore_engine
    trainer.train()
    frozen = [sp for sp in engine.params if not sp.trainable]
    adapters = [sp for sp in engine.params if sp.trainable]
    assert frozen and adapters
    assert all(sp.master_shard is None and sp.grad is None for sp in frozen)
    assert all(sp.compute_shard.dtype == torch.bfloat16 for sp in frozen)
    tracked = {id(sp) for sp in engine.sharded_optimizer.state}
    assert tracked == {id(sp) for sp in adapters}
    kinds = engine.memory_report()["by_kind"]
    adapter_numel = sum(sp.shard_numel for sp in adapters)
    base_numel = sum(sp.shard_numel for sp in frozen)
    assert kinds["nvme.params"] >= 2 * base_numel
    assert kinds["nvme.master"] == 4 * adapter_numel
    assert kinds["nvme.optimizer"] == 8 * adapter_numel
    peak_master = built.runtime.ledger.snapshot()["peak.nvme.master"]
    if born_frozen:
        assert peak_master == 4 * adapter_numel
    else:  # fp32 values until the engine found the base frozen
        assert peak_master >= 4 * base_numel
    trainer.close()


def test_a_parameter_born_frozen_cannot_be_trained(tmp_path: Path) -> None:
    cfg = {**nvme(tmp_path), "dtype": "bf16"}
    with outcore.init(cfg, frozen=True):
        model = torch.nn.Linear(4, 4)
    assert not model.weight.requires_grad
    model.weight.requires_grad_(True)
    with pytest.raises(outcore.ConfigError, match=r"frozen=True\), .* is now trainable"):
        outcore.initialize(model, cfg)


class _StopAt(transformers.TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


@pytest.mark.parametrize("lora", [None, LORA])
def test_resume_from_checkpoint_equals_uninterrupted(tmp_path: Path, lora: str | None) -> None:
    cfg = nvme(tmp_path)
    args = {"save_strategy": "steps", "save_steps": 3}
    whole = OutcoreTrainer(model=build("llama", cfg, lora), args=arguments(tmp_path / "a", **args),
                           train_dataset=dataset(), outcore_config=cfg)
    whole.train()
    expect = logged(whole, "loss")
    whole.save_model(tmp_path / "a-final")
    whole.close()

    first = OutcoreTrainer(model=build("llama", cfg, lora), args=arguments(tmp_path / "b", **args),
                           train_dataset=dataset(), outcore_config=cfg, callbacks=[_StopAt(4)])
    first.train()
    first.close()
    ckpt = tmp_path / "b" / "checkpoint-3"
    assert (ckpt / "manifest.json").is_file() and (ckpt / "trainer_state.json").is_file()
    if lora:
        assert (ckpt / "adapter_model.safetensors").is_file()
    second = OutcoreTrainer(model=build("llama", cfg, lora), args=arguments(tmp_path / "b", **args),
                            train_dataset=dataset(), outcore_config=cfg)
    # True: the Trainer finds the latest checkpoint-N itself
    second.train(resume_from_checkpoint=True if lora else str(ckpt))
    # the log history is the Trainer's: steps 1-3 come from checkpoint-3, 4-8 from this run
    steps = [h["step"] for h in second.state.log_history if "loss" in h]
    assert steps == list(range(1, 9))
    assert logged(second, "loss") == expect, "the resumed run continues the other exactly"
    second.save_model(tmp_path / "b-final")
    second.close()
    name = "adapter_model.safetensors" if lora else "model.safetensors"
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "a-final" / name), load_file(tmp_path / "b-final" / name)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # save_total_limit-style rotation is the Trainer's: checkpoint-6 exists beside checkpoint-3
    assert (tmp_path / "b" / "checkpoint-6" / "manifest.json").is_file()


def test_evaluation_during_training_and_the_best_model_at_end(tmp_path: Path) -> None:
    """Evaluation forwards between steps leave training exact; load_best_model_at_end loads
    the best checkpoint's weights and nothing else, as plain Trainer does (it rewound the
    torch RNG and the optimizer's moments and step count to that checkpoint too)."""
    kw = {"eval_strategy": "steps", "eval_steps": 2, "save_strategy": "steps", "save_steps": 2,
          "load_best_model_at_end": True, "metric_for_best_model": "loss",
          "learning_rate": 5e-2}  # large enough that the last step is not the best
    held_out = dataset(30)[22:]
    ref = transformers.Trainer(model=build("llama"), args=arguments(tmp_path / "ref", **kw),
                               train_dataset=dataset(), eval_dataset=held_out)
    ref.train()
    ref_rng = torch.get_rng_state()
    cfg = nvme(tmp_path)
    ours = OutcoreTrainer(model=build("llama", cfg), args=arguments(tmp_path / "ours", **kw),
                          train_dataset=dataset(), eval_dataset=held_out, outcore_config=cfg)
    ours.train()
    assert torch.equal(torch.get_rng_state(), ref_rng)
    assert ours.outcore_engine.global_steps == 8
    steps = {int(s["step"]) for s in ours.outcore_engine.optimizer.state_dict()["state"].values()}
    assert steps == {8}
    torch.testing.assert_close(logged(ours, "loss"), logged(ref, "loss"), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logged(ours, "eval_loss"), logged(ref, "eval_loss"),
                               rtol=1e-5, atol=1e-6)
    best = Path(ref.state.best_model_checkpoint).name
    assert best != "checkpoint-8", "the test needs a best model other than the last one"
    assert Path(ours.state.best_model_checkpoint).name == best
    ours.save_model(tmp_path / "best")
    ours.close()
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "best")
    for key, value in ref.model.state_dict().items():  # Trainer moved ref to its device
        torch.testing.assert_close(loaded.state_dict()[key], value.cpu(), rtol=1e-4, atol=1e-4)


def test_save_only_model_writes_and_resumes_as_trainer(tmp_path: Path) -> None:
    """``save_only_model=True`` wrote outcore's shards (the optimizer's moments, three times
    the model's bytes) into every checkpoint-N anyway, and a resume took them up: now the
    folder holds what Trainer's holds, and a resume goes on from its weights and step with
    a new optimizer state, as Trainer's does."""
    kw = {"save_strategy": "steps", "save_steps": 4, "save_only_model": True}
    ref = transformers.Trainer(model=build("llama"), args=arguments(tmp_path / "ref", **kw),
                               train_dataset=dataset())
    ref.train()
    cfg = nvme(tmp_path)
    ours = OutcoreTrainer(model=build("llama"), args=arguments(tmp_path / "ours", **kw),
                          train_dataset=dataset(), outcore_config=cfg)
    ours.train()
    ours.close()
    folder = tmp_path / "ours" / "checkpoint-4"
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        p.name for p in (tmp_path / "ref" / "checkpoint-4").iterdir())
    again = transformers.Trainer(model=build("llama"), args=arguments(tmp_path / "ref", **kw),
                                 train_dataset=dataset())
    again.train(resume_from_checkpoint=str(tmp_path / "ref" / "checkpoint-4"))
    ours = OutcoreTrainer(model=build("llama"), args=arguments(tmp_path / "ours", **kw),
                          train_dataset=dataset(), outcore_config=cfg)
    with pytest.warns(UserWarning, match="save_only_model=True: the run goes on from its "
                                         "weights and step with a new optimizer state"):
        ours.train(resume_from_checkpoint=str(folder))
    torch.testing.assert_close(logged(ours, "loss"), logged(again, "loss"), rtol=1e-5,
                               atol=1e-6)
    ours.close()


def test_generate_equals_plain_model(tmp_path: Path) -> None:
    """Greedy generation through the sharded model, between training steps and after."""
    cfg = nvme(tmp_path)
    ref = build("llama")
    trainer = OutcoreTrainer(model=build("llama", cfg), args=arguments(tmp_path / "o", max_steps=2),
                             train_dataset=dataset(), outcore_config=cfg)
    prompt = dataset()[0]["input_ids"][None, :5]
    with torch.no_grad():
        expect = ref.generate(input_ids=prompt, max_new_tokens=8, do_sample=False)
    got = trainer.model.generate(input_ids=prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, expect)
    trainer.train()  # generation in between left the engine able to train
    plain = transformers.Trainer(model=ref, args=arguments(tmp_path / "r", max_steps=2),
                                 train_dataset=dataset())
    plain.train()
    with torch.no_grad():
        expect = ref.generate(input_ids=prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(trainer.model.generate(input_ids=prompt, max_new_tokens=8,
                                              do_sample=False), expect)
    trainer.close()


def test_generate_never_gathers_the_whole_model(tmp_path: Path) -> None:
    from outcore.zero.group import GroupState

    cfg = {**nvme(tmp_path), "zero": {"prefetch_bytes": 0, "persistence_threshold_bytes": 0}}
    model = build("llama", cfg)
    trainer = OutcoreTrainer(model=model, args=arguments(tmp_path / "o"), outcore_config=cfg)
    engine = trainer.outcore_engine
    total = sum(g.full_bytes for g in engine.groups if not g.persistent)
    peak = []

    def measure(*_: object) -> None:
        peak.append(sum(g.full_bytes for g in engine.groups
                        if g.state is GroupState.UNSHARDED and not g.persistent))

    handles = [m.register_forward_hook(measure) for m in model.modules()]
    prompt = dataset()[0]["input_ids"][None, :5]
    model.generate(input_ids=prompt, max_new_tokens=4, do_sample=False)
    for h in handles:
        h.remove()
    assert peak and max(peak) < total / 2, (max(peak), total)
    assert engine.schedule_stats()["fetches"] > 4 * len(engine.groups) / 2
    trainer.close()


def _two_ranks(out: str) -> dict:
    """Plain Trainer (DDP over gloo) and OutcoreTrainer on the same two ranks, each rank
    with its own half of every batch."""
    rank = int(os.environ["RANK"])
    tmp = Path(out)
    # use_cpu=True: without it, transformers on a machine without a GPU leaves the process
    # group alone and every rank trains alone on all the data (OutcoreTrainer refuses that)
    cpu = {"use_cpu": True} if not torch.cuda.is_available() else {}
    plain = transformers.Trainer(model=build("llama"),
                                 args=arguments(tmp / "ref", max_steps=4, **cpu),
                                 train_dataset=dataset())
    plain.train()
    cfg = {"offload": {"params": "nvme", "optimizer": "nvme",
                       "nvme_path": str(tmp / f"swap{rank}")}}
    ours = OutcoreTrainer(model=build("llama", cfg), args=arguments(tmp / "ours", max_steps=4,
                                                                    save_strategy="steps",
                                                                    save_steps=4, **cpu),
                          train_dataset=dataset(), outcore_config=cfg)
    ours.train()
    # sequences of different lengths per rank: every rank must keep running forwards
    prompt = dataset()[rank]["input_ids"][None, :4]
    new = 3 if rank == 0 else 7
    got = ours.model.generate(input_ids=prompt, max_new_tokens=new, do_sample=False)
    plain.model.eval()
    with torch.no_grad():
        expect = plain.model.generate(input_ids=prompt, max_new_tokens=new, do_sample=False,
                                      synced_gpus=False)
    ours.save_model(tmp / "saved")
    ours.close()
    return {"plain": logged(plain, "loss"), "ours": logged(ours, "loss"),
            "gen_equal": bool(torch.equal(got, expect)), "gen_len": got.shape[1]}


def test_two_ranks_equal_plain_ddp_trainer(tmp_path: Path) -> None:
    results = run_world(_two_ranks, 2, str(tmp_path), timeout=300)
    for r in results:
        assert len(r["ours"]) == 4
        torch.testing.assert_close(r["ours"], r["plain"], rtol=1e-5, atol=1e-6)
        assert r["gen_equal"]
    assert [r["gen_len"] for r in results] == [4 + 3, 4 + 7]
    manifest = json.loads((tmp_path / "ours" / "checkpoint-4" / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert (tmp_path / "saved" / "model.safetensors").is_file()


@pytest.mark.parametrize("same_folder", [True, False])
def test_the_same_model_in_a_second_trainer_equals_plain(tmp_path: Path,
                                                         same_folder: bool) -> None:
    """A user's second Trainer on the model the first one trained (a new batch size, a
    second phase): the first engine hands the model over, the second trains on from its
    values, and both phases match plain Trainer. A weight read between making the trainer
    and training gives the value plain PyTorch gives."""
    plain = build("gpt2")
    ours = build("gpt2")
    losses = {"plain": [], "ours": []}
    for phase in range(2):
        args = dict(max_steps=3, per_device_train_batch_size=2 + phase)
        ref = transformers.Trainer(model=plain, args=arguments(tmp_path / f"r{phase}", **args),
                                   train_dataset=dataset())
        folder = tmp_path / (f"p{phase}" if not same_folder else "one")
        folder.mkdir(exist_ok=True)
        cfg = nvme(folder)
        trainer = OutcoreTrainer(model=ours, args=arguments(tmp_path / f"o{phase}", **args),
                                 train_dataset=dataset(), outcore_config=cfg)
        # Trainer moves the plain model to its device; ours stays where it was built
        torch.testing.assert_close(ours.lm_head.weight.norm().cpu(),
                                   plain.lm_head.weight.norm().cpu(), rtol=1e-5, atol=1e-6)
        if phase == 0:
            first = trainer
        ref.train()
        trainer.train()
        losses["plain"] += logged(ref, "loss")
        losses["ours"] += logged(trainer, "loss")
    torch.testing.assert_close(losses["ours"], losses["plain"], rtol=1e-4, atol=1e-5)
    with pytest.raises(outcore.EngineClosedError, match="newer engine"):
        first.train()
    trainer.close()
    assert not list(tmp_path.rglob("*.swap"))
    for key, value in plain.state_dict().items():  # close() handed the trained model back
        torch.testing.assert_close(ours.state_dict()[key], value.cpu(), rtol=1e-4, atol=1e-4)


def test_optimizer_queries_and_min_lr_schedules(tmp_path: Path) -> None:
    """What Trainer code asks the optimizer: its groups' parameters (the weight-decay split),
    ``defaults['lr']`` for the min-lr cosine schedules."""
    kw = dict(lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr": 1e-4},
              max_steps=4)
    ref = transformers.Trainer(model=build("llama"), args=arguments(tmp_path / "r", **kw),
                               train_dataset=dataset())
    ref.train()
    model = build("llama")
    ours = OutcoreTrainer(model=model, args=arguments(tmp_path / "o", **kw),
                          train_dataset=dataset(), outcore_config=nvme(tmp_path))
    ours.train()
    assert logged(ours, "learning_rate") == logged(ref, "learning_rate")
    groups = ours.get_optimizer_group()
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for g in groups for p in g} == {n for n, _ in model.named_parameters()}
    assert ours.optimizer.defaults["lr"] == 1e-2
    ours.close()


def _pair_losses(tmp_path: Path, kw, check_lr: bool = True, **args_kw) -> None:
    """Plain Trainer and OutcoreTrainer with the same extra arguments (``kw``: a dict, or a
    function of the model for objects each side needs its own of): the same losses and
    learning rates."""
    ref_model, model = build("gpt2"), build("gpt2")
    args_kw = {"max_steps": 4, **args_kw}
    ref = transformers.Trainer(model=ref_model, args=arguments(tmp_path / "r", **args_kw),
                               train_dataset=dataset(), **kw(ref_model) if callable(kw)
                               else kw)
    ref.train()
    cfg = nvme(tmp_path)
    if args_kw.get("optim") == "adafactor" or kw is _adafactor_relative:
        cfg["offload"]["optimizer"] = "cpu"  # Adafactor's state stays in memory
    ours = OutcoreTrainer(model=model, args=arguments(tmp_path / "o", **args_kw),
                          train_dataset=dataset(), outcore_config=cfg,
                          **kw(model) if callable(kw) else kw)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ours.train()
    # a scheduler bound to the user's optimizer sees it stepped, as under the plain Trainer
    assert not [w for w in seen if "lr_scheduler.step()" in str(w.message)]
    torch.testing.assert_close(logged(ours, "loss"), logged(ref, "loss"), rtol=1e-4, atol=1e-5)
    if check_lr:
        torch.testing.assert_close(logged(ours, "learning_rate"), logged(ref, "learning_rate"))
    ours.close()


def _adafactor_relative(model: torch.nn.Module) -> dict:
    """transformers' documented Adafactor recipe: lr=None, its own relative step size."""
    from transformers.optimization import Adafactor, AdafactorSchedule

    opt = Adafactor(model.parameters(), lr=None, scale_parameter=True, relative_step=True,
                    warmup_init=True)
    return {"optimizers": (opt, AdafactorSchedule(opt))}


def _adamw_and_lambda(model: torch.nn.Module) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.01)
    return {"optimizers": (opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s)))}


@pytest.mark.parametrize(("name", "kw", "args_kw"), [
    ("optimizers", _adamw_and_lambda, {}),
    ("optimizer_cls_and_kwargs",
     {"optimizer_cls_and_kwargs": (torch.optim.SGD, {"lr": 5e-2, "momentum": 0.9})}, {}),
    ("optim-sgd", {}, {"optim": "sgd", "optim_args": "momentum=0.9", "learning_rate": 5e-2}),
    ("polynomial", {}, {"lr_scheduler_type": "polynomial",
                        "lr_scheduler_kwargs": {"power": 2.0, "lr_end": 1e-4}}),
    ("cosine-restarts", {}, {"lr_scheduler_type": "cosine_with_restarts",
                             "lr_scheduler_kwargs": {"num_cycles": 2}}),
    ("optim-adafactor", {}, {"optim": "adafactor", "learning_rate": 1e-2}),
    ("adafactor-lr-none", _adafactor_relative, {}),
    ("plateau", {"eval_dataset": dataset(4)},
     {"lr_scheduler_type": "reduce_lr_on_plateau", "eval_strategy": "steps", "eval_steps": 2,
      "lr_scheduler_kwargs": {"patience": 0, "factor": 0.5}}),
])
def test_optimizers_and_schedules_as_plain_trainer(tmp_path: Path, name: str, kw, args_kw) -> None:
    # AdafactorSchedule reads the rate back from parameters' .grad, which outcore keeps in
    # its shards: only the losses are compared there
    _pair_losses(tmp_path, kw, check_lr=name != "adafactor-lr-none", **args_kw)


def test_model_init_gives_each_run_a_fresh_engine(tmp_path: Path) -> None:
    """``model_init``: each ``train()`` shards a fresh model (the last engine closes), and the
    losses are plain Trainer's."""
    kw = {"model_init": lambda: build("gpt2"), "model": None}
    ref = transformers.Trainer(args=arguments(tmp_path / "r", max_steps=3),
                               train_dataset=dataset(), **kw)
    ref.train()
    ours = OutcoreTrainer(args=arguments(tmp_path / "o", max_steps=3), train_dataset=dataset(),
                          outcore_config=nvme(tmp_path), **kw)
    first = ours.outcore_engine
    ours.train()
    assert first.closed and ours.outcore_engine is not first
    torch.testing.assert_close(logged(ours, "loss"), logged(ref, "loss"), rtol=1e-4, atol=1e-5)
    ours.close()


def test_a_deepspeed_config_in_training_arguments_is_honoured(tmp_path: Path) -> None:
    """``TrainingArguments.deepspeed`` (set after construction here: transformers' own check
    wants the deepspeed package) is outcore's config; its scheduler drives the rate."""
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "bf16": {"enabled": "auto"},
          "scheduler": {"type": "WarmupDecayLR", "params": {
              "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": 3,
              "total_num_steps": "auto", "warmup_type": "linear"}},
          "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto",
                                "offload_param": {"device": "nvme",
                                                  "nvme_path": str(tmp_path)},
                                "offload_optimizer": {"device": "cpu"}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    args = arguments(tmp_path / "o", max_steps=6, warmup_steps=3)  # as the file says
    args.deepspeed = str(path)
    trainer = OutcoreTrainer(model=build("gpt2"), args=args, train_dataset=dataset())
    cfg = trainer.outcore_config
    assert (cfg.offload.params, cfg.offload.optimizer) == ("nvme", "cpu")
    assert cfg.zero.prefetch_bytes == outcore.Config().zero.prefetch_bytes  # "auto": outcore's
    assert args.deepspeed is None
    trainer.train()
    lr, steps = 1e-2, 6
    # DeepSpeed's order: its first two updates both at the curve's first value
    want = [lr * s / 3 if s < 3 else lr * (steps - s) / (steps - 3)
            for s in (max(0, k - 1) for k in range(steps))]
    got = logged(trainer, "learning_rate")
    assert len(got) == steps and len(set(got)) > 3  # the rate moved as the recipe says
    torch.testing.assert_close(got, want)
    trainer.close()


@pytest.mark.parametrize(("ds", "said"), [
    ({"train_micro_batch_size_per_gpu": 8}, "train_micro_batch_size_per_gpu=8 and "
     "TrainingArguments.per_device_train_batch_size="),
    ({"train_batch_size": 64}, "train_batch_size=64 and TrainingArguments."
     "per_device_train_batch_size x gradient_accumulation_steps x world_size="),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 5e-3}}},
     "scheduler.params.warmup_max_lr=0.005 and TrainingArguments.learning_rate="),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100}}},
     "total_num_steps=100 and the Trainer's number of training steps=2 differ"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}}},
     "warmup_num_steps=4 and the Trainer's warmup_steps=")])
def test_deepspeed_numbers_the_trainer_states_otherwise_are_refused(tmp_path: Path, ds: dict,
                                                                    said: str) -> None:
    """As transformers' integration refuses them: they were used, or dropped, with one
    warning line (a micro batch of 8 trained at the Trainer's, a warm-up of 2 ran where the
    Trainer said 3)."""
    config = {"zero_optimization": {"stage": 3}, **ds}
    with pytest.raises(outcore.ConfigError, match=re.escape(said)):
        trainer = OutcoreTrainer(model=build("gpt2"), args=arguments(tmp_path / "o",
                                                                      max_steps=2),
                                 train_dataset=dataset(), outcore_config=config)
        trainer.train()


def test_resume_from_a_missing_folder_says_what_transformers_says(tmp_path: Path) -> None:
    trainer = OutcoreTrainer(model=build("gpt2"), args=arguments(tmp_path / "o"),
                             train_dataset=dataset(), outcore_config=nvme(tmp_path))
    with pytest.raises(ValueError, match="Can't find a valid checkpoint at"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "nowhere"))
    trainer.close()


def _neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    return GPTNeoXForCausalLM(GPTNeoXConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        vocab_size=128, max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0))


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=3))


@pytest.mark.parametrize("max_shard_size", ["50GB", "40KB"])
@pytest.mark.parametrize("make", [_neox, _mixtral])
def test_saved_files_and_names_are_save_pretrained_s(tmp_path: Path, make: Any,
                                                     max_shard_size: str) -> None:
    """The files, tensor names (GPT-NeoX's embed_out; Mixtral's experts, one fused parameter
    in memory, one tensor per expert on disk, which OutcoreTrainer's every save refused) and
    index save_pretrained writes, from live shards, one parameter at a time."""
    from safetensors import safe_open

    from outcore.hf import saving

    plain = make()
    plain.save_pretrained(tmp_path / "plain", max_shard_size=max_shard_size)
    model = make()
    engine = outcore.initialize(model, {"dtype": "fp32", **nvme(tmp_path)})
    saving.save_full(model, 0, tmp_path / "ours", max_shard_size=max_shard_size)
    engine.close(keep_values=False)

    def tensors(folder: Path) -> dict[str, torch.Tensor]:
        out = {}
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(file, "pt") as f:
                out.update({key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118
        return out

    files = sorted(p.name for p in (tmp_path / "plain").iterdir())
    # save_pretrained packs the per-expert tensors it computes by their storage, which only
    # the real conversion has: a sharded Mixtral folder may split its files elsewhere (the
    # index says where each tensor is); one file, or anything not converted, splits alike
    same_split = make is _neox or max_shard_size == "50GB"
    ours = sorted(p.name for p in (tmp_path / "ours").iterdir())
    assert ours == files if same_split else len(ours) > 3
    want, got = tensors(tmp_path / "plain"), tensors(tmp_path / "ours")
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    if make is _neox:
        assert "embed_out.weight" in got and "lm_head.weight" not in got
    else:
        assert "model.layers.1.block_sparse_moe.experts.2.w3.weight" in got
    if max_shard_size == "40KB":
        index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
        plain_index = json.loads((tmp_path / "plain" / "model.safetensors.index.json").read_text())
        assert sorted(index["weight_map"]) == sorted(plain_index["weight_map"])
        assert index["weight_map"] == plain_index["weight_map"] or not same_split
        for key, file in index["weight_map"].items():
            with safe_open(tmp_path / "ours" / file, "pt") as f:
                assert key in f.keys(), (key, file)  # noqa: SIM118
    loaded = type(plain).from_pretrained(tmp_path / "ours")
    for key, value in plain.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_a_mixture_of_experts_trains_and_saves_under_outcore_trainer(tmp_path: Path) -> None:
    """The user's path for the MoE save above: checkpoints every step, then save_model; each
    folder loads with from_pretrained into the trained values (every save refused before,
    stopping train() at its first checkpoint)."""
    args = arguments(tmp_path / "o", max_steps=2, save_strategy="steps", save_steps=1)
    trainer = OutcoreTrainer(model=_mixtral(), args=args, train_dataset=dataset(),
                             outcore_config=nvme(tmp_path))
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    with trainer.outcore_engine.gathered_parameters():
        trained = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    trainer.close()
    assert sorted(os.listdir(tmp_path / "o")) == ["checkpoint-1", "checkpoint-2"]
    for folder in (tmp_path / "o" / "checkpoint-2", tmp_path / "final"):
        loaded = dict(type(_mixtral()).from_pretrained(folder).named_parameters())
        assert sorted(loaded) == sorted(trained)
        for key, value in trained.items():
            assert torch.equal(loaded[key], value.cpu()), (folder.name, key)


def test_checkpoint_folders_load_with_from_pretrained(tmp_path: Path) -> None:
    """A checkpoint-N folder: from_pretrained loads it, and it resumes exactly; nothing of
    outcore's is left in output_dir once training ends (no lock file)."""
    args = arguments(tmp_path / "o", max_steps=4, save_strategy="steps", save_steps=2)
    trainer = OutcoreTrainer(model=build("gpt2"), args=args, train_dataset=dataset(),
                             outcore_config=nvme(tmp_path))
    trainer.train()
    assert sorted(os.listdir(tmp_path / "o")) == ["checkpoint-2", "checkpoint-4"]
    ckpt = tmp_path / "o" / "checkpoint-4"
    loaded = transformers.GPT2LMHeadModel.from_pretrained(ckpt)
    with trainer.outcore_engine.gathered_parameters():
        for key, value in trainer.model.state_dict().items():
            if key in loaded.state_dict():
                assert torch.equal(loaded.state_dict()[key], value.cpu()), key
    trainer.close()


def test_a_trainer_never_closed_leaves_no_swap_behind(tmp_path: Path) -> None:
    """Every Trainer script: train, save, exit, no close(). The swap goes at exit, and with
    the trainer and model once the garbage collector has them. Each read of the swap file
    takes 50 ms longer here, as on a busy disk: the last step's read-ahead for a next step
    that never comes then outlasted ``train()`` and held the swap through the collection
    (this test failed now and then on a loaded machine)."""
    code = f"""
import gc, sys, time
sys.path.insert(0, {str(REPO)!r})
from pathlib import Path
from outcore.offload import aio
real = aio.transfer
def slow(op, fd, view, offset, path):
    if op == "read":
        time.sleep(0.05)
    return real(op, fd, view, offset, path)
aio.transfer = slow
from tests.common import arguments, build, dataset, nvme
from outcore.hf import OutcoreTrainer
tmp = Path({str(tmp_path)!r})
def run():
    trainer = OutcoreTrainer(model=build("gpt2"), args=arguments(tmp / "o", max_steps=2),
                             train_dataset=dataset(), outcore_config=nvme(tmp / "gc"))
    trainer.train()
(tmp / "gc").mkdir()
run()
gc.collect(); gc.collect()
print("after gc:", len(list((tmp / "gc").rglob("*.swap"))))
trainer = OutcoreTrainer(model=build("gpt2"), args=arguments(tmp / "o2", max_steps=2),
                         train_dataset=dataset(), outcore_config=nvme(tmp))
trainer.train()
print("before exit:", len(list((tmp / "swap").rglob("*.swap"))))
"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "after gc: 0" in out.stdout and "before exit: 1" in out.stdout
    assert not list((tmp_path / "swap").rglob("*.swap")), "the swap is gone at exit"


def test_a_second_run_into_the_same_output_dir_replaces_its_checkpoints(
        tmp_path: Path) -> None:
    """The script run again into its ``output_dir``: each ``checkpoint-N`` is replaced whole
    (the Trainer's own files in it too), with no folder left aside and no warning; a
    folder beside them that is not the Trainer's is left alone."""
    keep = tmp_path / "o" / "notes"
    keep.mkdir(parents=True)
    (keep / "mine.txt").write_text("mine")
    runs = []
    for seed in (0, 1):
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="left .*outcore did not write")
            trainer = OutcoreTrainer(model=build("gpt2"),
                                     args=arguments(tmp_path / "o", max_steps=2, seed=seed,
                                                    save_strategy="steps", save_steps=2),
                                     train_dataset=dataset(), outcore_config=nvme(tmp_path))
            trainer.train()
        runs.append(logged(trainer, "loss"))
        trainer.close()
    out = tmp_path / "o"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "notes"]
    assert (keep / "mine.txt").read_text() == "mine"
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert [h["loss"] for h in state["log_history"] if "loss" in h] == runs[1]  # the new run's
    assert runs[0] != runs[1]
