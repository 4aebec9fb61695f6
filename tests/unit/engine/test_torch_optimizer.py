"""``engine.optimizer`` keeps ``torch.optim``'s contract (engine/torch_optimizer.py's note):
what code written for torch optimizers does with it gives what it gives with
``torch.optim.AdamW``."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as sched
from torch.optim.optimizer import register_optimizer_step_post_hook

import outcore
from outcore.device.accel import default_device
from tests.distributed import run_world

HP = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _pair(tmp: Path, offload: str = "nvme", **cfg):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    ref = copy.deepcopy(model).to(default_device())
    engine = outcore.initialize(model, {
        "dtype": "fp32", "optimizer": {"type": "adamw", **HP},
        "offload": {"params": offload, "optimizer": offload, "nvme_path": str(tmp)}, **cfg})
    return model, engine, ref, torch.optim.AdamW(ref.parameters(), **HP)


def _batch(step: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(step)).to(default_device())


def _two_steps_match(engine, model: nn.Module, ref: nn.Module, opt: torch.optim.Optimizer,
                     tol: float) -> None:
    """Steps 1 and 2 on both sides, then the weights equal torch's (within ``tol``); closes."""
    for step in (1, 2):
        _both(engine, ref, opt, step)
    with engine.gathered_parameters():
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.data, q.detach(), rtol=tol, atol=tol / 10)
    engine.close()


def _both(engine, ref: nn.Module, opt: torch.optim.Optimizer, step: int) -> tuple[float, float]:
    x = _batch(step)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.optimizer.step()
    ref_loss = ref(x).pow(2).mean()
    ref_loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item(), ref_loss.item()


def test_is_a_torch_optimizer_over_the_users_parameters(tmp_path: Path) -> None:
    model, engine, _, _ = _pair(tmp_path)
    opt = engine.optimizer
    assert isinstance(opt, torch.optim.Optimizer)
    assert {k: opt.defaults[k] for k in HP} == HP
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    assert opt.param_groups[0]["lr"] == HP["lr"]
    with pytest.raises(outcore.ConfigError, match="param_groups="):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    engine.close()


def test_param_groups_keep_their_parameters_and_overrides(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    decay = [model[0].weight, model[1].weight]
    rest = [model[0].bias, model[1].bias]
    engine = outcore.initialize(model, {"dtype": "fp32"}, [
        {"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}])
    groups = engine.optimizer.param_groups
    assert [g["params"] for g in groups] == [decay, rest]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    engine.close()


SCHEDULERS = {
    "StepLR": lambda o: sched.StepLR(o, step_size=2, gamma=0.5),
    "MultiStepLR": lambda o: sched.MultiStepLR(o, milestones=[1, 3], gamma=0.3),
    "ConstantLR": lambda o: sched.ConstantLR(o, factor=0.5, total_iters=2),
    "LinearLR": lambda o: sched.LinearLR(o, start_factor=0.2, total_iters=3),
    "ExponentialLR": lambda o: sched.ExponentialLR(o, gamma=0.8),
    "PolynomialLR": lambda o: sched.PolynomialLR(o, total_iters=4, power=2.0),
    "CosineAnnealingLR": lambda o: sched.CosineAnnealingLR(o, T_max=4, eta_min=1e-4),
    "CosineAnnealingWarmRestarts": lambda o: sched.CosineAnnealingWarmRestarts(o, T_0=2),
    "CyclicLR": lambda o: sched.CyclicLR(o, base_lr=1e-3, max_lr=1e-2, step_size_up=2),
    "OneCycleLR": lambda o: sched.OneCycleLR(o, max_lr=2e-2, total_steps=10),
    "LambdaLR": lambda o: sched.LambdaLR(o, lambda s: 1.0 / (1 + s)),
    "MultiplicativeLR": lambda o: sched.MultiplicativeLR(o, lambda s: 0.9),
    "SequentialLR": lambda o: sched.SequentialLR(o, [sched.ConstantLR(o, 0.5, 2),
                                                     sched.ExponentialLR(o, 0.9)], [2]),
    "ChainedScheduler": lambda o: sched.ChainedScheduler([sched.ConstantLR(o, 0.5, 2),
                                                          sched.ExponentialLR(o, 0.9)]),
    "ReduceLROnPlateau": lambda o: sched.ReduceLROnPlateau(o, patience=0, factor=0.5),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_every_torch_scheduler_drives_the_shards_as_it_drives_adamw(tmp_path: Path,
                                                                     name: str) -> None:
    """The scheduler's learning rate (and OneCycle/Cyclic's momentum, which they write into
    ``betas``) reaches the update of the shards: same rates, same losses, same weights."""
    model, engine, ref, opt = _pair(tmp_path, offload="cpu")
    ours_s, ref_s = SCHEDULERS[name](engine.optimizer), SCHEDULERS[name](opt)
    lrs, ref_lrs, losses, ref_losses = [], [], [], []
    for step in range(6):
        loss, ref_loss = _both(engine, ref, opt, step)
        losses.append(loss)
        ref_losses.append(ref_loss)
        if name == "ReduceLROnPlateau":
            ours_s.step(1.0)  # never improves: the rate halves
            ref_s.step(1.0)
        else:
            ours_s.step()
            ref_s.step()
        lrs.append([g["lr"] for g in engine.optimizer.param_groups])
        ref_lrs.append([g["lr"] for g in opt.param_groups])
    assert lrs == ref_lrs
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    with engine.gathered_parameters():
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.data, q.detach(), rtol=1e-4, atol=1e-5)
    assert ours_s.state_dict().keys() == ref_s.state_dict().keys()
    engine.close()


@pytest.mark.parametrize("name", ["CyclicLR", "OneCycleLR"])
def test_a_config_sgd_has_its_momentum_cycled_as_torchs_sgd(name: str) -> None:
    """Found by a user-style probe: the config's SGD had Adam's ``betas`` in its defaults, so
    torch's CyclicLR and OneCycleLR cycled those and left ``momentum`` alone: other weights
    than torch's SGD, without a word. Its defaults are SGD's own now."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    ref = copy.deepcopy(model).to(default_device())
    hp = {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.0}
    engine = outcore.initialize(model, {"dtype": "fp32", "optimizer": {"type": "sgd", **hp}})
    opt = torch.optim.SGD(ref.parameters(), **hp)
    assert set(engine.optimizer.defaults) == {"lr", "momentum", "weight_decay", "nesterov"}
    make = {"CyclicLR": lambda o: sched.CyclicLR(o, 1e-3, 5e-2, step_size_up=2,
                                                 base_momentum=0.8, max_momentum=0.9),
            "OneCycleLR": lambda o: sched.OneCycleLR(o, max_lr=5e-2, total_steps=10)}[name]
    ours_s, ref_s = make(engine.optimizer), make(opt)
    for step in range(4):
        _both(engine, ref, opt, step)
        ours_s.step()
        ref_s.step()
        assert engine.optimizer.param_groups[0]["momentum"] == opt.param_groups[0]["momentum"]
    with engine.gathered_parameters():
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.data, q.detach(), rtol=1e-5, atol=1e-6)
    engine.close()


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_every_schedulers_state_resumes_from_client_state(tmp_path: Path, name: str) -> None:
    """A scheduler's ``state_dict()`` saved as ``client_state`` comes back equal and goes on
    as the scheduler that never stopped (MultiStepLR's milestones, a ``Counter`` of ints,
    came back with string keys and never decayed again)."""
    model, engine, _, _ = _pair(tmp_path / "swap", offload="none")
    go_on = SCHEDULERS[name](engine.optimizer)
    for s in range(3):
        engine.backward(engine(_batch(s)).pow(2).mean())
        engine.optimizer.step()
        go_on.step(1.0) if name == "ReduceLROnPlateau" else go_on.step()
    saved = go_on.state_dict()
    engine.save_checkpoint(tmp_path / "ckpt", client_state={"sched": saved})
    rates = []
    for _ in range(4):
        go_on.step(1.0) if name == "ReduceLROnPlateau" else go_on.step()
        rates.append([g["lr"] for g in engine.optimizer.param_groups])
    resumed = SCHEDULERS[name](engine.optimizer)  # made first, as a resuming script does: the
    back = engine.load_checkpoint(tmp_path / "ckpt")["sched"]  # load sets the rates it moved
    assert back == saved
    resumed.load_state_dict(back)
    for want in rates:
        resumed.step(1.0) if name == "ReduceLROnPlateau" else resumed.step()
        assert [g["lr"] for g in engine.optimizer.param_groups] == pytest.approx(want)
    engine.close()


@pytest.mark.parametrize("adopted", [False, True])
def test_state_dict_hooks_run_as_torchs(adopted: bool) -> None:
    """Found by a user-style probe: hooks registered with ``register_state_dict_pre_hook``
    and the three others never ran, and a post-hook's edit was missing from the dict."""
    model = nn.Linear(4, 2)
    brought = torch.optim.AdamW(model.parameters()) if adopted else None
    engine = outcore.initialize(model, {"dtype": "fp32"}, optimizer=brought)
    opt = brought if brought is not None else engine.optimizer
    calls: list[str] = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "mine": calls.append("post") or 1})
    opt.register_load_state_dict_pre_hook(
        lambda o, sd: calls.append("load_pre") or {**sd, "seen": True})
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load_post"))
    engine.backward(engine(torch.randn(3, 4).to(engine.device)).sum())
    engine.step()
    sd = opt.state_dict()
    assert sd["mine"] == 1 and calls == ["pre", "post"]
    opt.load_state_dict(sd)
    assert calls == ["pre", "post", "load_pre", "load_post"]
    with pytest.raises(outcore.ConfigError, match="takes the dict that state_dict"):
        opt.load_state_dict([sd])
    engine.close()


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_a_scheduler_made_before_initialize_drives_the_optimizer_brought(tmp_path: Path,
                                                                         name: str) -> None:
    """``OneCycleLR(opt)`` then ``initialize(model, cfg, optimizer=opt)``, as a Trainer's
    ``optimizers=(opt, scheduler)`` does: the keys a scheduler keeps in the groups (OneCycle's
    ``max_lr``, Cyclic's ``base_momentum``) are taken, and the rates follow torch's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    ref = copy.deepcopy(model).to(default_device())
    brought, opt = torch.optim.AdamW(model.parameters(), **HP), torch.optim.AdamW(
        ref.parameters(), **HP)
    ours_s, ref_s = SCHEDULERS[name](brought), SCHEDULERS[name](opt)
    engine = outcore.initialize(model, {"dtype": "fp32", "offload": {
        "params": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path)}}, optimizer=brought)
    losses, ref_losses = [], []
    for step in range(4):
        loss, ref_loss = _both(engine, ref, opt, step)
        losses.append(loss)
        ref_losses.append(ref_loss)
        for s in (ours_s, ref_s):
            s.step(1.0) if name == "ReduceLROnPlateau" else s.step()
    assert [g["lr"] for g in brought.param_groups] == [g["lr"] for g in opt.param_groups]
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    engine.close()


@pytest.mark.parametrize("how", ["optimizer", "model"])
def test_zero_grad_drops_what_backward_accumulated(tmp_path: Path, how: str) -> None:
    """``optimizer.zero_grad()`` and ``model.zero_grad()`` reach the engine's gradient shards.
    (Clipping keeps every update for step(): see the next test.)"""
    model, engine, ref, opt = _pair(tmp_path, gradient_clipping=10.0)
    x = _batch(0)
    engine.backward(engine(x).pow(2).mean())
    ref(x).pow(2).mean().backward()
    (engine.optimizer if how == "optimizer" else model).zero_grad()
    opt.zero_grad()
    for step in (1, 2):  # plain torch clips too: at 10 it never does here
        x = _batch(step)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        ref(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    with engine.gathered_parameters():
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.data, q.detach(), rtol=1e-4, atol=1e-5)
    engine.close()


def test_zero_grad_after_updates_ran_in_backward_is_refused(tmp_path: Path) -> None:
    """With the optimizer running during backward, a boundary backward has applied its
    updates already: zero_grad() cannot take them back, and says so."""
    _, engine, _, _ = _pair(tmp_path)
    assert engine.overlaps_optimizer
    engine.backward(engine(_batch(0)).pow(2).mean())
    with pytest.raises(outcore.OutcoreError, match="already applied the updates"):
        engine.optimizer.zero_grad()
    assert engine.step()
    engine.optimizer.zero_grad()  # after the step: nothing to drop, fine
    engine.close()


def test_between_a_backward_that_updated_and_step_writes_and_checkpoints_are_refused(
        tmp_path: Path) -> None:
    """Found by a user-style probe, each silently wrong before: a write there lost the step's
    update (step() cannot apply it on top), a save stored half a step (the manifest's step
    count before it, the weights after), a load lost the next update; and a read showed the
    weights from before the update where they stay gathered (the carried first layer), while
    gathered_parameters showed them after. Reads now show the updated values, and the rest
    is refused, naming what, and changes nothing: training goes on as torch's."""
    model, engine, ref, opt = _pair(tmp_path / "swap")
    engine.save_checkpoint(tmp_path / "ckpt")
    x = _batch(0)
    engine.backward(engine(x).pow(2).mean())
    ref(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):  # the updated values
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.state_dict()["0.weight"], ref.state_dict()["0.weight"],
                               rtol=1e-5, atol=1e-6)
    def gathered_write() -> None:  # the way to write at more ranks: refused at its entry
        with engine.gathered_parameters([model[0].weight], modify=True):
            model[0].weight.data.mul_(0.5)

    for what, call in (("a write to parameter 0.bias", lambda: model[0].bias.data.fill_(0.5)),
                       (r"gathered_parameters\(modify=True\)", gathered_write),
                       ("save_checkpoint", lambda: engine.save_checkpoint(tmp_path / "mid")),
                       ("load_checkpoint", lambda: engine.load_checkpoint(tmp_path / "ckpt"))):
        with pytest.raises(outcore.OutcoreError, match=f"{what}.* already applied the updates"):
            call()
    assert not (tmp_path / "mid").exists()
    assert engine.step()
    _two_steps_match(engine, model, ref, opt, tol=1e-4)


def test_step_with_a_closure_returns_its_loss(tmp_path: Path) -> None:
    _, engine, _, _ = _pair(tmp_path, offload="none")
    x = _batch(0)

    def closure() -> torch.Tensor:
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        return loss

    loss = engine.optimizer.step(closure)
    assert isinstance(loss, torch.Tensor) and engine.global_steps == 1
    engine.close()


def _resume(tmp: str, source: str) -> dict:
    """Train 2 steps, take the state dicts, load them into a fresh model and engine, train
    2 more: the same as 2 more on the original. ``source``: whose optimizer state dict is
    loaded, outcore's own (slices) or plain AdamW's (full-shape moments)."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    root = Path(tmp) / f"rank{rank}"
    root.mkdir(exist_ok=True)
    model, engine, ref, opt = _pair(root / "a")
    for step in range(2):
        _both(engine, ref, opt, step)
    if source == "outcore":
        with engine.gathered_parameters():
            weights = {k: v.clone() for k, v in model.state_dict().items()}
        state = engine.optimizer.state_dict()
    else:
        weights, state = ref.state_dict(), opt.state_dict()
    torch.manual_seed(5)
    model2 = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    engine2 = outcore.initialize(model2, {
        "dtype": "fp32", "optimizer": {"type": "adamw", **HP},
        "offload": {"params": "nvme", "optimizer": "nvme", "nvme_path": str(root / "b")}})
    model2.load_state_dict(weights)
    engine2.optimizer.load_state_dict(state)
    out = {"steps": [], "resumed": []}
    for step in range(2, 4):
        out["steps"].append(_both(engine, ref, opt, step)[0])
        x = _batch(step)
        loss = engine2(x).pow(2).mean()
        engine2.backward(loss)
        engine2.optimizer.step()
        out["resumed"].append(loss.item())
    engine.close()
    engine2.close()
    return out


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("source", ["outcore", "torch"])
def test_state_dict_round_trips_and_takes_plain_adamw_state(tmp_path: Path, source: str,
                                                             world: int) -> None:
    for rank in run_world(_resume, world, str(tmp_path), source):
        torch.testing.assert_close(rank["resumed"], rank["steps"], rtol=1e-5, atol=1e-6)


def test_state_dict_of_another_world_size_is_refused_in_words(tmp_path: Path) -> None:
    _, engine, _, _ = _pair(tmp_path)
    _both(engine, *_pair(tmp_path / "ref")[2:], 0)
    state = engine.optimizer.state_dict()
    state["outcore"]["world_size"] = 4
    for entry in state["state"].values():  # slices of a 4-rank layout: a quarter each
        entry["exp_avg"] = entry["exp_avg"][: entry["exp_avg"].numel() // 4]
    said = r"slice at this world size \(\d+ elements at 1; the state dict was saved at 4\)"
    with pytest.raises(outcore.ConfigError, match=said):
        engine.optimizer.load_state_dict(state)
    engine.close()


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD])
def test_a_users_torch_optimizer_and_its_scheduler_are_adopted(tmp_path: Path, cls) -> None:
    """``initialize(model, cfg, optimizer=opt)``: the shards are updated as ``opt`` would
    update the model, and a scheduler made for ``opt`` drives them (param_groups.py's
    [Note: adopting a torch optimizer])."""
    kw = {"lr": 1e-2, "momentum": 0.9} if cls is torch.optim.SGD else {"lr": 1e-2}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    ref = copy.deepcopy(model).to(default_device())
    groups = [{"params": [model[0].weight, model[2].weight], "weight_decay": 0.1},
              {"params": [model[0].bias, model[2].bias], "weight_decay": 0.0}]
    opt = cls(groups, **kw)
    sched = sched_for(opt)
    ref_opt = cls([{"params": [ref[0].weight, ref[2].weight], "weight_decay": 0.1},
                   {"params": [ref[0].bias, ref[2].bias], "weight_decay": 0.0}], **kw)
    ref_sched = sched_for(ref_opt)
    keys = [set(g) for g in opt.param_groups]
    engine = outcore.initialize(model, {"dtype": "fp32", "offload": {
        "params": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path)}}, optimizer=opt)
    assert engine.optimizer.param_groups[0] is opt.param_groups[0]
    assert [set(g) for g in opt.param_groups] == keys  # no other optimizer's keys added
    assert engine.optimizer.defaults == opt.defaults
    for step in range(4):
        _both(engine, ref, ref_opt, step)
        sched.step()
        ref_sched.step()
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    with engine.gathered_parameters():
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.data, q.detach(), rtol=1e-4, atol=1e-5)
    engine.close()


def sched_for(opt: torch.optim.Optimizer):
    return sched.StepLR(opt, step_size=1, gamma=0.7)


def _adopted(tmp: Path, offload: str = "nvme"):
    """A model, an AdamW over it that outcore adopts, and the same pair in plain torch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    ref = copy.deepcopy(model).to(default_device())
    opt, ref_opt = torch.optim.AdamW(model.parameters(), **HP), torch.optim.AdamW(
        ref.parameters(), **HP)
    cfg = {"dtype": "fp32", "offload": {"params": offload, "optimizer": offload,
                                        "nvme_path": str(tmp)}}
    return model, opt, ref, ref_opt, cfg


def _loop(model: nn.Module, opt: torch.optim.Optimizer, scheduler, steps: range,
          engine=None) -> list[float]:
    """A plain torch loop: zero_grad, forward, backward, step, scheduler step; the engine's
    backward where there is one."""
    losses = []
    for step in steps:
        opt.zero_grad()
        loss = model(_batch(step)).pow(2).mean()
        engine.backward(loss) if engine is not None else loss.backward()
        opt.step()
        scheduler.step()
        losses.append(loss.item())
    return losses


@pytest.mark.filterwarnings("error")  # torch's scheduler warns if opt.step looks overridden
@pytest.mark.parametrize("scheduler_made", ["before", "after"])
@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_the_optimizer_a_user_brought_trains_when_they_call_it(tmp_path: Path, offload: str,
                                                                scheduler_made: str) -> None:
    """After ``initialize(model, cfg, optimizer=opt)`` the user's loop keeps calling ``opt``:
    ``opt.zero_grad()`` and ``opt.step()`` are the engine's, and a scheduler made for ``opt``
    before or after adoption drives the lr (torch_optimizer.py's second note). Before, the
    AdamW's own step found no p.grad and the model never changed."""
    model, opt, ref, ref_opt, cfg = _adopted(tmp_path, offload)
    scheduler = sched_for(opt) if scheduler_made == "before" else None
    hooks: list[str] = []
    opt.register_step_pre_hook(lambda o, args, kw: hooks.append(f"pre {len(args)}"))
    engine = outcore.initialize(model, cfg, optimizer=opt)
    opt.register_step_post_hook(lambda o, args, kw: hooks.append(f"post {o is opt}"))
    scheduler = scheduler or sched_for(opt)
    losses = _loop(model, opt, scheduler, range(4), engine)
    assert hooks == ["pre 1", "post True"] * 4  # torch's step hooks, given (opt,) as args
    ref_losses = _loop(ref, ref_opt, sched_for(ref_opt), range(4))
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert engine.global_steps == 4
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] < HP["lr"]
    with engine.gathered_parameters():
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.data, q.detach(), rtol=1e-4, atol=1e-5)
    mine, torch_own = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert mine.keys() == torch_own.keys()  # the moments, not the AdamW's empty state
    for i in mine:  # at one rank in torch's own layout: the parameter's shape
        torch.testing.assert_close(mine[i]["exp_avg"].cpu(), torch_own[i]["exp_avg"].cpu(),
                                   rtol=1e-4, atol=1e-6)
    with pytest.raises(outcore.ConfigError, match="param_groups="):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    copied = copy.deepcopy(opt)  # a copy is a plain AdamW over plain copies of the weights
    assert not set(vars(copied)) & {"step", "zero_grad", "state_dict"}
    assert type(copied.param_groups[0]["params"][0]) is nn.Parameter
    engine.close()


def test_the_optimizer_a_user_brought_is_theirs_again_after_close(tmp_path: Path) -> None:
    """``close()`` gives the AdamW its own methods back (the scheduler's wrapper too), so it
    steps the plain model that ``close()`` hands back; a second engine adopting it takes
    over, and the first is out of the loop."""
    model, opt, _, _, cfg = _adopted(tmp_path)
    scheduler = sched_for(opt)
    wrapped = opt.step
    engine = outcore.initialize(model, cfg, optimizer=opt)
    _loop(model, opt, scheduler, range(2), engine)
    second = outcore.initialize(model, cfg, optimizer=opt)  # takes the model over
    _loop(model, opt, scheduler, range(2, 4), second)
    assert (engine.global_steps, second.global_steps) == (2, 2)
    second.close()
    assert opt.step == wrapped and "zero_grad" not in vars(opt)
    before = model[0].weight.detach().clone()
    _loop(model, opt, scheduler, range(4, 5))  # plain torch now
    assert type(model[0].weight) is nn.Parameter
    assert not torch.equal(model[0].weight.detach(), before)


@pytest.mark.parametrize("loaded", ["after initialize", "before initialize", "plain torch"])
def test_the_optimizer_a_user_brought_saves_and_resumes_the_moments(tmp_path: Path,
                                                                     loaded: str) -> None:
    """``opt.state_dict()`` holds the engine's moments, at one rank in torch's layout, and
    resuming from it trains as the run that never stopped: loaded after ``initialize``
    (the engine's), before it (torch's own ``load_state_dict``, the usual resume order; the
    state moves into the shards and leaves the optimizer), or by plain torch."""
    model, opt, _, _, cfg = _adopted(tmp_path / "a")
    scheduler = sched_for(opt)
    engine = outcore.initialize(model, cfg, optimizer=opt)
    _loop(model, opt, scheduler, range(2), engine)
    weights, state = model.state_dict(), opt.state_dict()
    assert state["state"] and state["param_groups"][0]["lr"] == opt.param_groups[0]["lr"]
    steps = _loop(model, opt, scheduler, range(2, 4), engine)
    model2, opt2, _, _, cfg2 = _adopted(tmp_path / "b")
    model2.load_state_dict(weights)
    engine2 = None
    if loaded == "before initialize":
        opt2.load_state_dict(state)
    if loaded != "plain torch":
        engine2 = outcore.initialize(model2, cfg2, optimizer=opt2)
        # the moments are in the shards, shown through opt2.state, not also kept in it
        assert opt2.state is engine2.optimizer.state
        assert len(opt2.state) == (len(state["state"]) if loaded == "before initialize" else 0)
    if loaded != "before initialize":
        opt2.load_state_dict(state)
    resumed = _loop(model2, opt2, sched_for(opt2), range(2, 4), engine2)
    # the second loss follows one update from the loaded moments and lr
    torch.testing.assert_close(resumed, steps, rtol=1e-5, atol=1e-6)
    engine.close()
    if engine2 is not None:
        engine2.close()


def _another_ranks_state(tmp: str) -> str:
    """Each rank saved its own slices; a rank that loads another's is told so, and the rank
    whose own it was loads nothing either."""
    rank = int(os.environ["RANK"])
    _, engine, ref, opt = _pair(Path(tmp) / f"rank{rank}")
    _both(engine, ref, opt, 0)
    states = [engine.optimizer.state_dict()]
    torch.distributed.broadcast_object_list(states, src=0)  # rank 0's, as a torch.save would
    try:
        engine.optimizer.load_state_dict(states[0])
        return "loaded"
    except outcore.ConfigError as e:
        return str(e)
    finally:
        engine.close()


def test_a_state_dict_of_another_rank_is_refused_in_words(tmp_path: Path) -> None:
    own, other = run_world(_another_ranks_state, 2, str(tmp_path))
    assert "refused on another rank" in own  # the ranks stay alike: neither loads
    assert "holds rank 0's slices; this is rank 1" in other


def test_an_optimizer_outcore_cannot_run_is_refused_in_words() -> None:
    model = nn.Linear(4, 4)
    with pytest.raises(outcore.ConfigError, match="RMSprop cannot run over outcore's shards"):
        outcore.initialize(model, {"dtype": "fp32"},
                           optimizer=torch.optim.RMSprop(model.parameters()))
    with pytest.raises(outcore.ConfigError, match="amsgrad=True is not supported"):
        outcore.initialize(model, {"dtype": "fp32"},
                           optimizer=torch.optim.AdamW(model.parameters(), amsgrad=True))
    assert type(model.weight) is nn.Parameter  # refused before anything was sharded


def _adafactor_run(tmp: str, kw: dict, offload: str) -> dict:
    """Four Adafactor steps on this rank, beside transformers' Adafactor on a plain copy
    (every rank the same batch), then a checkpoint round trip and two steps more."""
    from transformers.optimization import Adafactor

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 5))
    ref = copy.deepcopy(model).to(default_device())
    ref_opt = Adafactor(ref.parameters(), **kw)
    cfg = {"dtype": "fp32", "offload": {"params": offload, "optimizer": offload}}
    engine = outcore.initialize(model, cfg, optimizer=Adafactor(model.parameters(), **kw))
    out = {"gap": [], "resumed": [], "uninterrupted": []}
    for step in range(4):
        _both(engine, ref, ref_opt, step)
    with engine.gathered_parameters():
        out["gap"] = max(float((p.data - q.detach()).abs().max())
                         for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    engine.save_checkpoint(Path(tmp) / "ckpt" / "step-4")
    torch.manual_seed(9)
    model2 = nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 5))
    engine2 = outcore.initialize(model2, cfg, optimizer=Adafactor(model2.parameters(), **kw))
    engine2.load_checkpoint(Path(tmp) / "ckpt" / "step-4")
    for step in range(4, 6):
        for e, key in ((engine, "uninterrupted"), (engine2, "resumed")):
            loss = e(_batch(step)).pow(2).mean()
            e.backward(loss)
            e.step()
            out[key].append(loss.item())
    engine.close()
    engine2.close()
    return {**out, "rank": rank}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("kw", [{"lr": None},
                                {"lr": 1e-2, "relative_step": False, "scale_parameter": False,
                                 "beta1": 0.9, "weight_decay": 0.01}], ids=["relative", "beta1"])
def test_adafactor_over_slices_equals_transformers(tmp_path: Path, world: int,
                                                   kw: dict) -> None:
    """transformers' Adafactor, its factored statistics all-reduced from the ranks' slices
    (adafactor.py's note): the weights it gives, and a checkpoint that resumes it exactly."""
    pytest.importorskip("transformers")
    for result in run_world(_adafactor_run, world, str(tmp_path), kw, "cpu"):
        assert result["gap"] < 1e-5
        assert result["resumed"] == result["uninterrupted"]


def test_adafactor_with_its_state_on_nvme_is_refused_in_words(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model = nn.Linear(4, 4)
    with pytest.raises(outcore.ConfigError, match="Adafactor needs offload.optimizer cpu"):
        outcore.initialize(model, {"dtype": "fp32", "offload": {
            "optimizer": "nvme", "nvme_path": str(tmp_path)}},
            optimizer=transformers.optimization.Adafactor(model.parameters()))


def _frozen_first(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    model[0].requires_grad_(False)  # fine-tuning the head: the optimizer still lists all
    return model


def test_a_frozen_parameter_keeps_torchs_numbering(tmp_path: Path) -> None:
    """torch's optimizers number every parameter of a group, frozen ones too: outcore's
    state dict does the same, so it loads into a plain AdamW over model.parameters(), and a
    plain one's loads back (before initialize as well)."""
    model, ref = _frozen_first(), _frozen_first()
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), **HP) for m in (model, ref))
    engine = outcore.initialize(model, {"dtype": "fp32"}, optimizer=opt)
    losses = _loop(model, opt, sched_for(opt), range(2), engine)
    assert losses == pytest.approx(_loop(ref, ref_opt, sched_for(ref_opt), range(2)), rel=1e-5)
    mine, theirs = opt.state_dict(), ref_opt.state_dict()
    assert mine["param_groups"][0]["params"] == theirs["param_groups"][0]["params"] == [0, 1,
                                                                                        2, 3]
    assert sorted(mine["state"]) == sorted(theirs["state"]) == [2, 3]
    plain = torch.optim.AdamW(_frozen_first().parameters(), **HP)
    plain.load_state_dict(mine)  # outcore's, into plain torch
    torch.testing.assert_close(plain.state_dict()["state"][2]["exp_avg"],
                               theirs["state"][2]["exp_avg"], rtol=1e-4, atol=1e-6)
    model2 = _frozen_first()
    opt2 = torch.optim.AdamW(model2.parameters(), **HP)
    opt2.load_state_dict(theirs)  # plain torch's, loaded before initialize
    engine2 = outcore.initialize(model2, {"dtype": "fp32"}, optimizer=opt2)
    torch.testing.assert_close(opt2.state_dict()["state"][3]["exp_avg_sq"],
                               theirs["state"][3]["exp_avg_sq"], rtol=1e-6, atol=1e-9)
    engine.close()
    engine2.close()


def test_an_optimizer_state_outcore_refuses_leaves_the_model_as_it_was(tmp_path: Path) -> None:
    """A torch optimizer whose loaded state does not fit is refused by initialize, which then
    leaves the model plain, the optimizer its own, and no swap file behind."""
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), **HP)
    opt.state[model[2].weight] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3),
                                  "exp_avg_sq": torch.zeros(3)}
    with pytest.raises(outcore.ConfigError, match=r"has shape \[3\]"):
        outcore.initialize(model, {"dtype": "fp32", "offload": {
            "params": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path)}}, optimizer=opt)
    assert type(model[2].weight) is nn.Parameter and "step" not in vars(opt)
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]
    model(_batch(0).cpu()).sum().backward()  # plain torch again
    opt.state.clear()
    opt.step()


def test_step_hooks_run_once_per_step_on_the_trainers_optimizer() -> None:
    """The Trainer's optimizer (hf/trainer.py's EngineOptimizer) steps through the facade's
    step(): torch's step hooks, its own and global ones, run once per step, not twice."""
    pytest.importorskip("transformers")
    from outcore.hf.trainer import EngineOptimizer

    model = nn.Sequential(nn.Linear(16, 4))
    engine = outcore.initialize(model, {"dtype": "fp32"})
    calls: list[str] = []
    opt = EngineOptimizer(engine)
    opt.register_step_pre_hook(lambda o, args, kw: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kw: calls.append("post"))
    handle = register_optimizer_step_post_hook(lambda o, args, kw: calls.append("global"))
    try:
        engine.backward(engine(_batch(0)).sum())
        opt.step()
    finally:
        handle.remove()
    assert calls == ["pre", "post", "global"]
    engine.close()


class _WithEmpty(nn.Module):
    """A layer and a zero-element parameter that the forward uses (so it gets a gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 4)
        self.empty = nn.Parameter(torch.zeros(0, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x) + self.empty.sum()


def test_adafactor_steps_past_a_parameter_with_no_elements() -> None:
    """A zero-element parameter (an empty prefix, a pruned head) has nothing to update; the
    others train as transformers' Adafactor trains them."""
    pytest.importorskip("transformers")
    from transformers.optimization import Adafactor

    def build() -> nn.Module:
        torch.manual_seed(0)
        return _WithEmpty()

    model, ref = build(), build()
    kw = {"lr": 1e-2, "relative_step": False, "scale_parameter": False}
    engine = outcore.initialize(model, {"dtype": "fp32"}, optimizer=Adafactor(
        model.parameters(), **kw))
    ref_opt = Adafactor(ref.parameters(), **kw)
    engine.backward(engine(_batch(0)).sum())
    assert engine.step()
    ref(_batch(0).cpu()).sum().backward()
    ref_opt.step()
    torch.testing.assert_close(model.layer.weight.detach().cpu(), ref.layer.weight.detach(),
                               rtol=1e-5, atol=1e-6)
    engine.close()


@pytest.mark.parametrize("how", ["close", "takeover"])
def test_the_old_engines_optimizer_refuses_every_state_call(tmp_path: Path, how: str) -> None:
    """After ``close()``, or once a second engine took the model, ``state_dict()`` raised
    ``AssertionError: parameter was garbage-collected`` (close) or returned the step alone
    with no moments (takeover); it is ``EngineClosedError`` as every other call."""
    model, engine, ref, opt = _pair(tmp_path, offload="none")
    _both(engine, ref, opt, 0)
    old = engine.optimizer
    if how == "close":
        engine.close()
    else:
        second = outcore.initialize(model, {"dtype": "fp32"})
    for call in (old.state_dict, lambda: old.load_state_dict({}), old.zero_grad,
                 lambda: old.state[next(model.parameters())]):
        with pytest.raises(outcore.EngineClosedError):
            call()
    if how == "takeover":  # the new engine's own answers
        assert second.optimizer.state_dict()["param_groups"][0]["params"] == [0, 1, 2, 3]
        second.close()


@pytest.mark.parametrize("offload", ["none", "nvme"])
@pytest.mark.parametrize("how", ["optimizer", "engine", "adopted"])
def test_zero_grad_drops_a_grad_from_before_initialize(tmp_path: Path, how: str,
                                                        offload: str) -> None:
    """Found by a user-style probe: a ``p.grad`` left by a plain backward before
    ``initialize`` goes into the first step, as in torch, but ``engine.zero_grad()`` and the
    optimizer's ``zero_grad()`` did not drop it as torch's does: the first update went the
    other way, without a word."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(default_device())
    model(_batch(9)).pow(2).mean().mul(100).backward()  # the stale gradient
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), **HP)
    adopted = torch.optim.AdamW(model.parameters(), **HP) if how == "adopted" else None
    engine = outcore.initialize(model, {
        "dtype": "fp32", "optimizer": {"type": "adamw", **HP},
        "offload": {"params": offload, "optimizer": offload, "nvme_path": str(tmp_path)}},
        optimizer=adopted)
    {"optimizer": engine.optimizer, "engine": engine, "adopted": adopted}[how].zero_grad()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    _two_steps_match(engine, model, ref, opt, tol=1e-5)


def test_the_models_own_zero_grad_runs_from_model_zero_grad(tmp_path: Path) -> None:
    """A model class's ``zero_grad`` (one that resets more) ran from ``model.zero_grad()``,
    and runs again (a reviewer found it skipped); ``optimizer.zero_grad()`` calls none, as
    torch's."""
    class Counting(nn.Sequential):
        calls = 0

        def zero_grad(self, set_to_none: bool = True) -> None:
            Counting.calls += 1
            super().zero_grad(set_to_none)

    model = Counting(nn.Linear(4, 4))
    engine = outcore.initialize(model, {"dtype": "fp32", "offload": {
        "params": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path)}})
    model.zero_grad()
    assert Counting.calls == 1
    engine.optimizer.zero_grad()
    engine.zero_grad()
    assert Counting.calls == 1
    engine.close()


def test_a_config_adafactor_group_with_an_eps_pair_keeps_the_lr_given() -> None:
    """A group of the config's Adafactor that restates transformers' eps pair was taken for
    an adopted one's: its lr became relative, 7e-2 off transformers' Adafactor(lr=1e-2,
    relative_step=False, scale_parameter=False) in five steps."""
    from transformers.optimization import Adafactor

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))

    cfg = {"dtype": "fp32", "optimizer": {"type": "adafactor", "lr": 1e-2}}
    model, plain = build(), build()
    engine = outcore.initialize(model, cfg, param_groups=[
        {"params": list(model.parameters()), "eps": (1e-30, 1e-3)}])
    ref = Adafactor(plain.parameters(), lr=1e-2, relative_step=False, scale_parameter=False)
    for step in range(5):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        plain(x).pow(2).mean().backward()
        ref.step()
        ref.zero_grad()
    engine.close()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.detach().cpu(), b.detach(), rtol=1e-5, atol=1e-6)
