"""A learning rate set between backward and ``step()`` (optim/hyperparams.py's [Note:
hyper-parameters set after backward]). Updates that overlap backward read their group's
values when they start, but torch reads them in ``step()``: a loop written "backward, set
lr, step" (build-nanogpt's) must train as torch would. Every run here is compared bit for
bit with ``zero.overlap_optimizer: false``, where every update reads them in ``step()``."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from outcore.device.compute_dtype import EmulatedDtypeWarning
from outcore.optim.optimizer import ShardedOptimizer
from tests.common import arguments, build, dataset, nvme
from tests.distributed import run_world

LRS = [3e-3, 1e-2, 5e-3, 2e-3, 1e-3]  # the schedule; the config's own lr is 2e-2
PARAMS = 4  # two weights and two biases
# what the warning says this step did
APPLIED = (f"This step's updates of {PARAMS} parameters made during backward used the earlier "
           "values.")
REDONE = "This step's updates made during backward are redone with the new values."
NEW = "This step used the new values."


class _Messages(logging.Handler):
    """The outcore logger's warnings while it is in use (in a rank's process too, where
    pytest's caplog does not reach)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> _Messages:
        logging.getLogger("outcore").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("outcore").removeHandler(self)


def _values(engine: outcore.Engine) -> dict[str, torch.Tensor]:
    with engine.gathered_parameters():  # at any number of ranks
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 4))


def _config(swap: str, overlap: bool, clip: float, params: str, dtype: str = "fp32") -> dict:
    return {"dtype": dtype, "gradient_clipping": clip, "loss_scale": {"initial_scale_power": 4},
            "optimizer": {"type": "adamw", "lr": 2e-2, "weight_decay": 0.1},
            "zero": {"overlap_optimizer": overlap},
            "offload": {"optimizer": "nvme", "params": params, "nvme_path": swap}}


def _train(swap: str, overlap: bool, clip: float, params: str,
           events: dict[tuple[int, str], float], dtype: str = "fp32") -> dict:
    """Five steps; ``events`` sets ``lr`` at (step, "before" the forward, "late": between
    backward and step(), or "after" step())."""
    with (_Messages() as handler,
          outcore.initialize(_model(), _config(swap, overlap, clip, params, dtype)) as engine):
        assert engine.plan.overlaps_optimizer is overlap
        losses = []
        for step in range(len(LRS)):
            for when in ("before", "late", "after"):
                if when == "late":
                    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(
                        100 * step + engine.rank)).to(engine.device)
                    loss = engine(x).float().pow(2).mean()
                    engine.backward(loss)
                    losses.append(loss.item())
                if (step, when) in events:
                    for group in engine.param_groups:
                        group["lr"] = events[step, when]
                if when == "late":
                    engine.step()
        stats = dict(engine.sharded_optimizer.stats)
        values = _values(engine)
        room = engine.memory_report()["by_kind"].get("nvme.tentative", 0)
    return {"losses": losses, "values": values, "stats": stats, "messages": handler.messages,
            "room_aside": room}


def _late_every_step(swap: str, clip: float, params: str) -> tuple[dict, dict]:
    """build-nanogpt's loop: the lr of each step is set after its backward."""
    late = {(s, "late"): lr for s, lr in enumerate(LRS)}
    # without clipping the first step overlaps (the note says why), so its updates took the
    # lr as it was: the reference sets it after that step instead
    earlier = {k: v for k, v in late.items() if clip or k != (0, "late")}
    return (_train(swap + "/on", True, clip, params, late),
            _train(swap + "/off", False, clip, params, earlier))


def _assert_same(on: dict, off: dict) -> None:
    assert on["losses"] == off["losses"]
    for name, value in off["values"].items():  # numpy arrays from another rank
        assert torch.equal(torch.as_tensor(on["values"][name]), torch.as_tensor(value)), name


def _one_warning(messages: list[str], change: str, this_step: str) -> None:
    """One warning, naming the group, the key, both values and what this step did."""
    late = [m for m in messages if "changed between backward and step()" in m]
    assert len(late) == 1, messages
    assert late[0].startswith("outcore: param_groups[0]['lr'] changed between backward and "
                              f"step() ({change}). {this_step}"), late[0]
    assert "From now on every update waits for step()" in late[0]


@pytest.mark.parametrize("params", ["nvme", "cpu"])
@pytest.mark.parametrize("clip", [0.0, 100.0])
def test_an_lr_set_after_each_backward_reaches_the_updates(tmp_path: Path, clip: float,
                                                           params: str) -> None:
    """From the first step whose lr moved after backward, every update waits for step() and
    uses the new value; with clipping (no speculation in the first step) that is every step,
    and without it the first step's overlapped updates kept the earlier lr, as the warning
    says."""
    on, off = _late_every_step(str(tmp_path), clip, params)
    _assert_same(on, off)
    _one_warning(on["messages"], "0.02 -> 0.003", APPLIED if clip == 0 else NEW)
    assert on["stats"]["updates_during_backward"] == (PARAMS if clip == 0 else 0)


@pytest.mark.parametrize("params", ["nvme", "cpu"])
@pytest.mark.parametrize("clip", [0.0, 100.0])
def test_a_one_off_late_change_is_redone_or_named(tmp_path: Path, clip: float,
                                                  params: str) -> None:
    """A loop that sets lr before forward, except once after backward: a tentative update
    (clipping with no step clipped: speculation) is redone with the new lr, exactly; one
    applied for good kept the earlier lr, and the warning says so. Either way the later
    steps wait for step()."""
    events = {(s, "before"): LRS[s] for s in (0, 1, 2, 4)}
    on = _train(str(tmp_path / "on"), True, clip, params, {**events, (3, "late"): LRS[3]})
    # what the overlapped run did: the late lr in step 3 (redone), or from step 4 on
    off = _train(str(tmp_path / "off"), False, clip, params,
                 {**events, (3, "late" if clip else "after"): LRS[3]})
    _assert_same(on, off)
    stats = on["stats"]
    if clip:  # speculated in steps 1 to 3; step 3's taken back and redone
        _one_warning(on["messages"], "0.005 -> 0.002", REDONE)
        assert stats["tentative_kept"] == 2 * PARAMS and stats["tentative_redone"] == PARAMS
        assert stats["updates_during_backward"] == 3 * PARAMS
    else:
        _one_warning(on["messages"], "0.005 -> 0.002", APPLIED)
        assert stats["updates_during_backward"] == 4 * PARAMS
    # the first step (no speculation in it) and step 3's redo with clipping; then step 4
    assert stats["updates_at_step"] == (3 if clip else 1) * PARAMS
    # nothing speculates any more, so the room for tentative writes went back to the disk
    assert on["room_aside"] == 0 and (off["room_aside"] == 0)


def test_a_scheduler_stepped_after_step_keeps_the_overlap(tmp_path: Path) -> None:
    """A torch LR scheduler stepped after ``step()`` (torch's order, the Trainer's) sets lr
    before the next backward: every step's updates overlap it, no warning, and training
    equals updates at ``step()``."""
    runs = {}
    for overlap in (True, False):
        with _Messages() as handler:
            model = _model()
            adamw = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
            engine = outcore.initialize(model, _config(str(tmp_path / str(overlap)), overlap,
                                                       0.0, "nvme"), optimizer=adamw)
            with engine:
                sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 1 / (s + 1))
                for step in range(len(LRS)):
                    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
                    engine.backward(engine(x.to(engine.device)).pow(2).mean())
                    engine.optimizer.step()
                    sched.step()
                runs[overlap] = (_values(engine), dict(engine.sharded_optimizer.stats))
        assert handler.messages == []
    for name, value in runs[False][0].items():
        assert torch.equal(runs[True][0][name], value), name
    assert runs[True][1]["updates_during_backward"] == len(LRS) * PARAMS
    assert runs[True][1]["updates_at_step"] == 0


def test_two_ranks_agree_on_a_late_lr(tmp_path: Path) -> None:
    """At two ranks (each with its own batch, the same lr schedule) both see the move and
    wait from then on; each equals its rank of the run whose updates all wait."""
    for on, off in run_world(_late_every_step, 2, str(tmp_path), 0.0, "nvme"):
        _assert_same(on, off)
        _one_warning(on["messages"], "0.02 -> 0.003", APPLIED)


def test_nothing_to_say_where_no_update_overlaps(tmp_path: Path) -> None:
    """Where no update overlaps backward (here ``zero.overlap_optimizer: false``; also the
    state in memory on a CPU), a late lr is simply what step() reads: no warning."""
    cfg = _config(str(tmp_path), False, 0.0, "nvme")
    with _Messages() as handler, outcore.initialize(_model(), cfg) as engine:
        assert not engine.plan.overlaps_optimizer
        for step, lr in enumerate(LRS):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
            engine.backward(engine(x.to(engine.device)).pow(2).mean())
            engine.param_groups[0]["lr"] = lr
            engine.step()
    assert handler.messages == []


@pytest.mark.filterwarnings("ignore", category=EmulatedDtypeWarning)
def test_fp16_redoes_a_late_change_from_unscaled_gradients(tmp_path: Path) -> None:
    """fp16 without clipping speculates, and its tentative updates leave the gradients scaled
    (staging.py's [Note: the gradient an update reads]); a redo for a late lr must read them
    unscaled, not 16 times too large."""
    events = {(s, "before"): LRS[s] for s in (0, 1, 2, 4)}
    on = _train(str(tmp_path / "on"), True, 0.0, "nvme", {**events, (3, "late"): LRS[3]},
                dtype="fp16")
    off = _train(str(tmp_path / "off"), False, 0.0, "nvme", {**events, (3, "late"): LRS[3]},
                 dtype="fp16")
    _assert_same(on, off)
    _one_warning(on["messages"], "0.005 -> 0.002", REDONE)
    assert on["stats"]["tentative_redone"] == PARAMS


def test_a_tensor_lr_changed_in_place_reaches_no_queued_update(tmp_path: Path,
                                                               monkeypatch) -> None:
    """torch's schedulers change a tensor lr in place (``fill_``). Updates still queued when
    it changes keep the value they were submitted with, so the warning's "used the earlier
    values" is true, and training equals the change applied after that step."""
    apply = ShardedOptimizer.apply

    def slow_apply(self, work, hp) -> None:  # updates lag: some are queued when lr changes
        time.sleep(0.1)
        apply(self, work, hp)

    monkeypatch.setattr(ShardedOptimizer, "apply", slow_apply)
    runs = {}
    for overlap in (True, False):
        with _Messages() as handler:
            model = _model()
            adamw = torch.optim.AdamW(model.parameters(), lr=torch.tensor(LRS[0]),
                                      weight_decay=0.1)
            cfg = _config(str(tmp_path / str(overlap)), overlap, 0.0, "nvme")
            with outcore.initialize(model, cfg, optimizer=adamw) as engine:
                for step in range(3):
                    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
                    engine.backward(engine(x.to(engine.device)).pow(2).mean())
                    if overlap and step == 1:
                        engine.optimizer.param_groups[0]["lr"].fill_(LRS[1])
                    engine.optimizer.step()
                    if not overlap and step == 1:
                        engine.optimizer.param_groups[0]["lr"].fill_(LRS[1])
                runs[overlap] = _values(engine)
        if overlap:
            _one_warning(handler.messages, "0.003 -> 0.01", APPLIED)
    for name, value in runs[False].items():
        assert torch.equal(runs[True][name], value), name


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_outcore_trainer_never_sets_the_lr_late(tmp_path: Path, clip: float) -> None:
    """The Trainer steps its LR scheduler after ``step()`` (warm-up, then linear decay), so
    no step finds the lr moved after backward: no warning, and without clipping every
    update of every step overlaps backward."""
    pytest.importorskip("transformers")
    from outcore.hf import OutcoreTrainer

    (tmp_path / "s").mkdir()
    with _Messages() as handler:
        trainer = OutcoreTrainer(model=build("gpt2"), train_dataset=dataset(),
                                 args=arguments(tmp_path / "o", max_steps=4, max_grad_norm=clip),
                                 outcore_config=nvme(tmp_path / "s"))
        trainer.train()
        stats = dict(trainer.outcore_engine.sharded_optimizer.stats)
        trainer.close()
    assert [m for m in handler.messages if "changed between backward" in m] == []
    assert len({h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h}) > 2
    if not clip:
        assert stats["updates_during_backward"] > 0 and stats["updates_at_step"] == 0
