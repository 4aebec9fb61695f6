"""What a ``Trainer`` user writes around ``OutcoreTrainer`` and expects to work as it does
around ``transformers.Trainer``: label smoothing, a subclass's ``compute_loss`` reading the
model, a model with nothing to train, and the files ``save_model`` writes after the user's
own ``save_pretrained``. Each against plain ``Trainer`` on the same seed and data."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

import outcore
from tests.common import LLAMA, LORA, arguments, build, dataset, nvme

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")

from outcore.hf import OutcoreTrainer, apply_lora  # noqa: E402

pytestmark = pytest.mark.filterwarnings("error::outcore.GradReadWarning")


def losses(trainer) -> list[float]:
    return logged(trainer, "loss")


def logged(trainer, key: str) -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h]


def test_label_smoothing_shifts_the_labels_as_trainer_does(tmp_path: Path) -> None:
    """``Trainer.compute_loss`` shifts the labels for label smoothing only when the unwrapped
    model is a causal LM; ours was the engine's wrapper, so each token was compared with
    itself (7.40 against 6.93 before any training)."""
    args = {"label_smoothing_factor": 0.1, "max_steps": 3}
    ref = transformers.Trainer(model=build("llama"), args=arguments(tmp_path / "ref", **args),
                               train_dataset=dataset())
    ours = OutcoreTrainer(model=build("llama"), args=arguments(tmp_path / "ours", **args),
                          train_dataset=dataset(), outcore_config=nvme(tmp_path))
    held_out = dataset(26)[22:]
    assert ours.evaluate(eval_dataset=held_out)["eval_loss"] == pytest.approx(
        ref.evaluate(eval_dataset=held_out)["eval_loss"], rel=1e-6)
    ref.train()
    ours.train()
    torch.testing.assert_close(losses(ours), losses(ref), rtol=1e-5, atol=1e-6)
    ours.close()


class ReadsTheModel(transformers.Trainer):
    """A subclass as users write them: its loss reads the model's config and head."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        vocab = model.config.vocab_size
        assert self.accelerator.unwrap_model(model) is self.model
        assert model.lm_head.weight.shape[0] == vocab
        labels = inputs.pop("labels")
        logits = model(**inputs).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1))
        return (loss, logits) if return_outputs else loss


class OursReadsTheModel(OutcoreTrainer):
    compute_loss = ReadsTheModel.compute_loss


def test_a_subclass_reads_model_config_and_unwraps_it(tmp_path: Path) -> None:
    """``model.config`` and ``accelerator.unwrap_model(model).config`` in ``compute_loss``
    raised torch's "'EngineModel' object has no attribute 'config'"."""
    ref = ReadsTheModel(model=build("llama"), args=arguments(tmp_path / "ref", max_steps=3),
                        train_dataset=dataset())
    ref.train()
    ours = OursReadsTheModel(model=build("llama"), args=arguments(tmp_path / "ours", max_steps=3),
                             train_dataset=dataset(), outcore_config=nvme(tmp_path))
    ours.train()
    assert len(losses(ours)) == 3
    torch.testing.assert_close(losses(ours), losses(ref), rtol=1e-5, atol=1e-6)
    ours.close()


@pytest.mark.parametrize("how", [{}, {"optim": "adafactor"}, "sgd"])
def test_a_model_with_nothing_to_train_evaluates(tmp_path: Path, how) -> None:
    """Every parameter frozen (an evaluation-only trainer), whatever optimizer the arguments
    name: the construction raised torch's "optimizer got an empty parameter list"; train()
    says there is nothing to train, where torch said "element 0 of tensors does not require
    grad"."""
    def frozen() -> torch.nn.Module:
        model = build("llama")
        model.requires_grad_(False)
        return model

    kw = {"optimizer_cls_and_kwargs": (torch.optim.SGD, {"lr": 0.1})} if how == "sgd" else {}
    args = {} if how == "sgd" else how
    held_out = dataset(26)[22:]
    ref = transformers.Trainer(model=frozen(), args=arguments(tmp_path / "ref", **args), **kw)
    ours = OutcoreTrainer(model=frozen(), args=arguments(tmp_path / "ours", **args),
                          train_dataset=dataset(), outcore_config={}, **kw)
    assert ours.evaluate(eval_dataset=held_out)["eval_loss"] == pytest.approx(
        ref.evaluate(eval_dataset=held_out)["eval_loss"], rel=1e-6)
    with pytest.raises(outcore.ConfigError, match="nothing to train"):
        ours.train()
    ours.close()


@pytest.mark.parametrize(("init_dtype", "train_dtype"), [
    ("bf16", "fp32"), ("bf16", "fp16"), ("fp32", "fp32"), ("fp32", "bf16"), ("bf16", "bf16")])
def test_a_frozen_base_stored_in_another_dtype_is_said(tmp_path: Path, init_dtype: str,
                                                       train_dtype: str) -> None:
    """A LoRA base built under ``outcore.init(frozen=True)`` keeps only that init's dtype; a
    trainer in another (fp32 without ``bf16=True``, or fp16) computes on values rounded to
    it: said once, naming both dtypes and the fixes, at the user's line. A base built in
    fp32, or in the trainer's dtype, is rounded once as asked: nothing said."""
    with outcore.init({"dtype": init_dtype}, frozen=True):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    model = apply_lora(model, LORA)
    flag = {} if train_dtype == "fp32" else {train_dtype: True, "use_cpu": True}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer = OutcoreTrainer(model=model, args=arguments(tmp_path / "out", max_steps=1,
                                                            **flag),
                                 train_dataset=dataset(), outcore_config={})
    said = [w for w in seen if "frozen parameters" in str(w.message)]
    if init_dtype == "fp32" or init_dtype == train_dtype:
        assert said == []
    else:
        frozen = sum(1 for p in model.parameters() if not p.requires_grad)
        assert len(said) == 1, [str(w.message) for w in said]
        text = str(said[0].message)
        assert text.startswith(f"{frozen} frozen parameters (")
        assert f"hold only {init_dtype} values" in text and f"computes in {train_dtype}" in text
        assert f'"dtype": "{train_dtype}"' in text and f"{init_dtype}=True" in text
        assert said[0].filename == __file__  # the user's line, not outcore's
    trainer.train()  # it trains either way
    trainer.close()


def test_save_model_names_the_dtype_of_the_weights_it_wrote(tmp_path: Path) -> None:
    """On a bf16 engine the model shows bf16, so the user's own ``save_pretrained`` records
    ``bfloat16`` in the config; ``save_model`` writes fp32 values and said bfloat16 beside
    them, and ``from_pretrained`` rounded them."""
    model = build("llama")
    cfg = {**nvme(tmp_path), "dtype": "bf16"}
    trainer = OutcoreTrainer(model=model, args=arguments(tmp_path / "out", max_steps=2),
                             train_dataset=dataset(), outcore_config=cfg)
    trainer.train()
    model.save_pretrained(tmp_path / "theirs")
    assert json.loads((tmp_path / "theirs" / "config.json").read_text())["dtype"] == "bfloat16"
    trainer.save_model(tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["dtype"] == "float32"
    loaded = type(model).from_pretrained(tmp_path / "ours")
    trainer.close()  # hands back the trained fp32 values
    for key, value in model.state_dict().items():
        assert loaded.state_dict()[key].dtype == torch.float32
        torch.testing.assert_close(loaded.state_dict()[key], value, rtol=0, atol=0)


def test_the_trainers_optimizer_runs_state_dict_hooks(tmp_path: Path) -> None:
    """The Trainer's optimizer saves its groups in ``checkpoint-N``; hooks registered on it
    (inside accelerate's wrapper, which takes no hooks of its own, as with plain Trainer) run
    around that as torch runs them."""
    ours = OutcoreTrainer(model=build("llama"), args=arguments(tmp_path / "o", max_steps=1),
                          train_dataset=dataset(), outcore_config=nvme(tmp_path))
    ours.train()
    calls: list[str] = []
    inner = ours.optimizer.optimizer
    inner.register_state_dict_post_hook(lambda o, sd: {**sd, "mine": 1})
    inner.register_load_state_dict_post_hook(lambda o: calls.append("loaded"))
    saved = ours.optimizer.state_dict()
    assert saved["mine"] == 1
    ours.optimizer.load_state_dict(saved)
    assert calls == ["loaded"]
    ours.close()


def test_a_plain_trainer_resumes_an_outcore_trainers_checkpoint(tmp_path: Path) -> None:
    """A run moved to a machine without outcore: plain ``Trainer`` resumes OutcoreTrainer's
    ``checkpoint-N`` (it raised ``KeyError: 'params'`` on the ``optimizer.pt`` of groups only)
    from its weights, step and schedule with new moments, as it resumes a DeepSpeed one."""
    kw = {"save_strategy": "steps", "save_steps": 4}
    ours = OutcoreTrainer(model=build("llama"), args=arguments(tmp_path / "ours", **kw),
                          train_dataset=dataset(), outcore_config=nvme(tmp_path))
    ours.train()
    ours.close()
    plain = transformers.Trainer(model=build("llama"), args=arguments(tmp_path / "plain", **kw),
                                 train_dataset=dataset())
    plain.train(resume_from_checkpoint=str(tmp_path / "ours" / "checkpoint-4"))
    assert plain.state.global_step == 8
    # step 5's loss comes before any update after the resume: the checkpoint's weights
    assert logged(plain, "loss")[4] == pytest.approx(logged(ours, "loss")[4], rel=1e-5)
    assert logged(plain, "learning_rate") == logged(ours, "learning_rate")
    group = plain.optimizer.param_groups[0]
    assert group["decoupled_weight_decay"] is True and group["weight_decay"] == 0.1


def test_an_outcore_trainer_resumes_a_plain_trainers_checkpoint_exactly(tmp_path: Path) -> None:
    """The other way: a plain ``Trainer``'s ``optimizer.pt`` holds torch's whole state, which
    goes into the engine's moments, so the losses after the resume are plain Trainer's (the
    moments were dropped under a warning that named ``save_only_model``)."""
    kw = {"save_strategy": "steps", "save_steps": 4}
    plain = transformers.Trainer(model=build("llama"), args=arguments(tmp_path / "plain", **kw),
                                 train_dataset=dataset())
    plain.train()
    ours = OutcoreTrainer(model=build("llama"), args=arguments(tmp_path / "ours", **kw),
                          train_dataset=dataset(), outcore_config=nvme(tmp_path))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*save_only_model")
        ours.train(resume_from_checkpoint=str(tmp_path / "plain" / "checkpoint-4"))
    torch.testing.assert_close(logged(ours, "loss"), logged(plain, "loss"), rtol=1e-5,
                               atol=1e-6)
    ours.close()


def test_a_lora_run_moves_between_the_trainers(tmp_path: Path) -> None:
    """With LoRA every trained parameter decays, so Trainer's second group is empty; the
    engine keeps no empty group, and either trainer refused the other's optimizer.pt as
    another number of groups (found by a reviewer of the resume fix)."""
    kw = {"save_strategy": "steps", "save_steps": 4}
    plain = transformers.Trainer(model=build("llama", lora=LORA),
                                 args=arguments(tmp_path / "plain", **kw), train_dataset=dataset())
    plain.train()
    ours = OutcoreTrainer(model=build("llama", lora=LORA), args=arguments(tmp_path / "ours", **kw),
                          train_dataset=dataset(), outcore_config=nvme(tmp_path))
    ours.train(resume_from_checkpoint=str(tmp_path / "plain" / "checkpoint-4"))
    torch.testing.assert_close(logged(ours, "loss"), logged(plain, "loss"), rtol=1e-5,
                               atol=1e-6)
    ours.close()
    ours = OutcoreTrainer(model=build("llama", lora=LORA), args=arguments(tmp_path / "o2", **kw),
                          train_dataset=dataset(), outcore_config=nvme(tmp_path / "o2"))
    ours.train()
    ours.close()
    again = transformers.Trainer(model=build("llama", lora=LORA),
                                 args=arguments(tmp_path / "again", **kw),
                                 train_dataset=dataset())
    again.train(resume_from_checkpoint=str(tmp_path / "o2" / "checkpoint-4"))
    assert again.state.global_step == 8
    assert logged(again, "loss")[4] == pytest.approx(logged(ours, "loss")[4], rel=1e-5)
    assert logged(again, "learning_rate") == logged(ours, "learning_rate")


def test_a_lora_checkpoint_written_with_one_group_still_resumes(tmp_path: Path) -> None:
    """OutcoreTrainer dropped Trainer's empty group before it kept it (the test above): such
    a checkpoint-N (one group in its manifest, optimizer.pt and scheduler.pt) resumes, to the
    losses of an uninterrupted run."""
    from outcore.io.manifest import manifest_checksum

    kw = {"save_strategy": "steps", "save_steps": 4}
    whole = OutcoreTrainer(model=build("llama", lora=LORA), args=arguments(tmp_path / "w", **kw),
                           train_dataset=dataset(), outcore_config=nvme(tmp_path / "w"))
    whole.train()
    whole.close()
    folder = tmp_path / "w" / "checkpoint-4"
    man = json.loads((folder / "manifest.json").read_text())
    assert [len(m) for m in man["group_members"]][1] == 0  # the empty group, kept now
    for key in ("param_groups", "group_members"):
        man[key] = man[key][:1]
    man["manifest_checksum"] = manifest_checksum(man)
    (folder / "manifest.json").write_text(json.dumps(man))
    opt = torch.load(folder / "optimizer.pt", weights_only=True)
    torch.save({**opt, "param_groups": opt["param_groups"][:1]}, folder / "optimizer.pt")
    sched = torch.load(folder / "scheduler.pt", weights_only=True)
    torch.save({k: v[:1] if isinstance(v, list) and len(v) == 2 else v
                for k, v in sched.items()}, folder / "scheduler.pt")
    again = OutcoreTrainer(model=build("llama", lora=LORA), args=arguments(tmp_path / "a", **kw),
                           train_dataset=dataset(), outcore_config=nvme(tmp_path / "a"))
    again.train(resume_from_checkpoint=str(folder))
    torch.testing.assert_close(logged(again, "loss"), logged(whole, "loss"), rtol=1e-5,
                               atol=1e-6)
    again.close()
