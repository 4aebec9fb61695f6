"""``engine.optimizer.state`` reads and writes the moments in the shards as torch's ``state``
does (engine/optimizer_state.py's [Note: optimizer.state over shards]): what code written for
``torch.optim.AdamW`` reads there equals what AdamW holds, an assignment reaches the next
update, and an in-place write on a copy is refused in words instead of being lost."""

from __future__ import annotations

import copy
import io
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from outcore.device.accel import default_device
from tests.distributed import run_world

HP = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
OFFLOADS = ("none", "nvme")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _engine(model: nn.Module, tmp: Path, offload: str, **extra) -> outcore.Engine:
    return outcore.initialize(model, {
        "dtype": "fp32", "optimizer": {"type": "adamw", **HP},
        "offload": {"params": offload, "optimizer": offload, "nvme_path": str(tmp)}}, **extra)


def _batch(step: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(step)).to(default_device())


def _steps(model: nn.Module, step_fn, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = model(_batch(step)).pow(2).mean()
        step_fn(loss)
        losses.append(loss.item())
    return losses


def _torch_step(opt: torch.optim.Optimizer):
    def step(loss: torch.Tensor) -> None:
        loss.backward()
        opt.step()
        opt.zero_grad()
    return step


def _engine_step(engine: outcore.Engine):
    def step(loss: torch.Tensor) -> None:
        engine.backward(loss)
        engine.step()
    return step


@pytest.mark.parametrize("offload", OFFLOADS)
def test_state_reads_and_assignments_act_as_torchs(tmp_path: Path, offload: str) -> None:
    model = _model()
    ref = copy.deepcopy(model).to(default_device())
    engine = _engine(model, tmp_path, offload)
    opt, ref_opt = engine.optimizer, torch.optim.AdamW(ref.parameters(), **HP)
    params, ref_params = list(model.parameters()), list(ref.parameters())
    # before the first update: no state, as in torch
    assert len(opt.state) == 0 and params[0] not in opt.state and dict(opt.state[params[0]]) == {}
    mine = _steps(model, _engine_step(engine), range(2))
    theirs = _steps(ref, _torch_step(ref_opt), range(2))
    assert mine == pytest.approx(theirs, rel=1e-6)
    assert len(opt.state) == len(ref_opt.state) == 4
    assert [p.shape for p in opt.state] == [p.shape for p in ref_opt.state]
    for p, q in zip(params, ref_params, strict=True):
        assert p in opt.state and sorted(opt.state[p]) == sorted(ref_opt.state[q])
        for key, want in ref_opt.state[q].items():
            torch.testing.assert_close(opt.state[p][key].cpu(), want.cpu(), rtol=1e-5,
                                       atol=1e-7)
    # a restart of one parameter's moments, as ReLoRA-style code does it
    first = opt.state[params[0]]
    with pytest.raises(outcore.ParamAccessError, match=r"zero_ on a copy of optimizer state.*"
                       r"assign the new value instead"):
        first["exp_avg"].zero_()
    with pytest.raises(outcore.ParamAccessError, match="copy of optimizer state"):
        first["step"] += 1
    moment = first["exp_avg_sq"]
    for write in (lambda: moment[0].zero_(), lambda: moment.view(-1).zero_(),
                  lambda: moment.T.zero_(), lambda: moment.data.zero_(),
                  lambda: moment.detach().zero_(), lambda: torch.add(moment, 1, out=moment),
                  lambda: torch._foreach_zero_([moment])):  # views and other paths to it
        with pytest.raises(outcore.ParamAccessError, match="copy of optimizer state"):
            write()
    assert type(moment * 2) is torch.Tensor and not moment.clone().zero_().any()  # new: plain
    with pytest.raises(outcore.ConfigError, match="has shape \\[3\\]"):
        first["exp_avg_sq"] = torch.ones(3)
    assert first["exp_avg_sq"].equal(moment) and moment.any()  # nothing was written
    first["exp_avg"] = torch.zeros_like(first["exp_avg"])
    first["step"] = torch.tensor(1.0)  # AdamW's bias correction restarts too
    ref_opt.state[ref_params[0]]["exp_avg"].zero_()
    ref_opt.state[ref_params[0]]["step"].fill_(1.0)
    assert float(first["step"]) == 1.0 and not first["exp_avg"].any()
    with pytest.raises(outcore.ParamAccessError, match="step 0; outcore counts"):
        first["step"] = torch.tensor(0.0)
    mine = _steps(model, _engine_step(engine), range(2, 5))
    theirs = _steps(ref, _torch_step(ref_opt), range(2, 5))
    assert mine == pytest.approx(theirs, rel=1e-5)
    engine.close()
    for p, q in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), rtol=1e-5, atol=1e-6)


def test_state_of_a_parameter_it_does_not_update_is_empty(tmp_path: Path) -> None:
    model = _model()
    model[0].weight.requires_grad_(False)
    engine = _engine(model, tmp_path, "none")
    _steps(model, _engine_step(engine), range(1))
    frozen = engine.optimizer.state[model[0].weight]
    assert model[0].weight not in engine.optimizer.state and dict(frozen) == {}
    with pytest.raises(outcore.ParamAccessError, match="does not update"):
        frozen["exp_avg"] = torch.zeros(32, 16)
    with pytest.raises(outcore.ParamAccessError, match="has no 'exp_avg_max'"):
        engine.optimizer.state[model[2].weight]["exp_avg_max"] = torch.zeros(4, 32)
    engine.close()


def test_the_optimizer_a_user_brought_shows_the_engines_state_while_held(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), **HP)
    engine = _engine(model, tmp_path, "nvme", optimizer=opt)
    _steps(model, _engine_step(engine), range(2))
    p = model[2].bias
    assert p in opt.state and float(opt.state[p]["step"]) == 2.0
    torch.testing.assert_close(opt.state[p]["exp_avg"], engine.optimizer.state[p]["exp_avg"])
    copied = copy.deepcopy(opt)  # torch's own: plain state over the copies of the weights
    assert type(copied.state).__name__ == "defaultdict" and len(copied.state) == 4
    q = copied.param_groups[0]["params"][3]
    assert type(q) is nn.Parameter and type(copied.state[q]["exp_avg"]) is torch.Tensor
    torch.testing.assert_close(copied.state[q]["exp_avg"], opt.state[p]["exp_avg"])
    engine.close()
    assert type(opt.state).__name__ == "defaultdict" and len(opt.state) == 0  # its own again


def _slices(tmp: str) -> dict:
    rank = int(os.environ["RANK"])
    model = _model()
    engine = _engine(model, Path(tmp) / f"rank{rank}", "cpu")
    _steps(model, _engine_step(engine), range(2))
    out = {n: engine.optimizer.state[p]["exp_avg"].clone()
           for n, p in model.named_parameters()}
    with pytest.raises(outcore.ConfigError, match="more than one rank"):  # slices: no copy
        copy.deepcopy(engine.optimizer)
    engine.close()
    return out


def _one_rank_refuses(tmp: str) -> dict:
    rank = int(os.environ["RANK"])
    model = _model()
    engine = _engine(model, Path(tmp) / f"rank{rank}", "cpu")
    _steps(model, _engine_step(engine), range(1))
    sd = copy.deepcopy(engine.optimizer.state_dict())
    before = engine.optimizer.state[model[0].weight]["exp_avg"].clone()
    sd["state"][0]["exp_avg"] = sd["state"][0]["exp_avg"] + 1.0
    if rank == 1:
        sd["state"][0]["step"] = -1
    with pytest.raises(outcore.ConfigError, match="whole number" if rank else "another rank"):
        engine.optimizer.load_state_dict(sd)
    after = engine.optimizer.state[model[0].weight]["exp_avg"]
    engine.close()
    return {"unchanged": bool(torch.equal(before, after))}


def test_a_load_refused_on_one_rank_is_refused_on_all(tmp_path: Path) -> None:
    assert run_world(_one_rank_refuses, 2, str(tmp_path)) == [{"unchanged": True}] * 2


def test_at_two_ranks_each_holds_its_slice(tmp_path: Path) -> None:
    """At more ranks ``state[p]`` is this rank's slice (as ``state_dict()``): together the
    slices are torch's moment."""
    ranks = run_world(_slices, 2, str(tmp_path))
    ref = _model()
    opt = torch.optim.AdamW(ref.parameters(), **HP)
    _steps(ref, _torch_step(opt), range(2))
    for name, p in ref.named_parameters():
        whole = torch.cat([torch.as_tensor(r[name]).reshape(-1) for r in ranks])
        want = opt.state[p]["exp_avg"].reshape(-1)
        torch.testing.assert_close(whole[:want.numel()], want, rtol=1e-5, atol=1e-7)


def test_state_between_a_backward_that_updated_and_step(tmp_path: Path) -> None:
    """With the optimizer on NVMe and no clipping the boundary backward applies the updates
    (optimizer.py's [Note: updating during backward]): an assignment there would come after
    the update it should precede, so it is refused as zero_grad() is; after step() it works."""
    model = _model()
    engine = _engine(model, tmp_path, "nvme")
    assert engine.overlaps_optimizer
    _steps(model, _engine_step(engine), range(1))
    p = model[0].weight
    engine.backward(model(_batch(1)).pow(2).mean())
    with pytest.raises(outcore.OutcoreError, match="assignment to optimizer state between a "
                       r"backward and step\(\)"):
        engine.optimizer.state[p]["exp_avg"] = torch.zeros(32, 16)
    with pytest.raises(outcore.ConfigError, match=r"copy it after step\(\)"):
        copy.deepcopy((model, engine.optimizer))
    engine.step()
    engine.optimizer.state[p]["exp_avg"] = torch.zeros(32, 16)
    assert not engine.optimizer.state[p]["exp_avg"].any()
    engine.close()


def test_state_as_device_moving_code_and_copies_use_it(tmp_path: Path) -> None:
    model = _model()
    engine = _engine(model, tmp_path, "nvme")
    opt = engine.optimizer
    assert opt.state.get(model[0].weight) is None  # torch's defaultdict.get
    _steps(model, _engine_step(engine), range(2))
    before = {k: v.clone() for k, v in opt.state[model[2].bias].items()}
    for p in list(opt.state):  # Lightning's optimizer_to_device writes each entry back
        opt.state[p] = {k: v.to(default_device()) * (0.5 if k == "exp_avg" else 1)
                        for k, v in opt.state[p].items()}
    after = opt.state.get(model[2].bias)
    torch.testing.assert_close(after["exp_avg"], before["exp_avg"] * 0.5)
    torch.testing.assert_close(after["exp_avg_sq"], before["exp_avg_sq"])
    snapshot = copy.deepcopy(after)
    assert type(snapshot) is dict and type(snapshot["exp_avg"]) is torch.Tensor
    assert type(copy.deepcopy(after["exp_avg"])) is torch.Tensor
    engine.close()
    with pytest.raises(outcore.EngineClosedError):
        len(opt.state)


def test_a_refused_adafactor_factor_changes_neither(tmp_path: Path) -> None:
    """A state dict whose column factor has the wrong size is refused before the row factor
    is written (adafactor.py's ``load_factors``): the next step is the one it would be."""
    def run(bad: bool) -> list[float]:
        model = _model()
        engine = outcore.initialize(model, {"dtype": "fp32", "optimizer": {"type": "adafactor",
                                                                           "lr": 1e-2}})
        losses = _steps(model, _engine_step(engine), range(2))
        sd = engine.optimizer.state_dict()
        if bad:
            entry = sd["state"][0]
            entry["exp_avg_sq_row"] = entry["exp_avg_sq_row"] * 0 + 7.0
            entry["exp_avg_sq_col"] = torch.zeros(entry["exp_avg_sq_col"].numel() + 1)
            with pytest.raises(outcore.ConfigError, match="exp_avg_sq_col"):
                engine.optimizer.load_state_dict(sd)
        losses += _steps(model, _engine_step(engine), range(2, 4))
        engine.close()
        return losses
    assert run(bad=True) == run(bad=False)


@pytest.mark.parametrize("offload", OFFLOADS)
def test_a_refused_state_dict_load_changes_nothing(tmp_path: Path, offload: str) -> None:
    """One bad entry (``BAD``: the last parameter's moment or step, a group's torch key or
    learning rate) refuses the whole load before any moment, step or hyper-parameter is
    written: the next steps are those of a run that never tried."""
    def run(bad: object) -> list[float]:
        model = _model()
        engine = _engine(model, tmp_path / str(bad), offload)
        losses = _steps(model, _engine_step(engine), range(2))
        sd = copy.deepcopy(engine.optimizer.state_dict())
        if bad is not None:
            sd["param_groups"][0]["lr"] = 1.0
            sd["state"][0]["exp_avg"] = sd["state"][0]["exp_avg"] * 0 + 3.0
            last = sd["state"][max(sd["state"])]
            if bad == "shape":
                last["exp_avg_sq"] = torch.zeros(3)
            elif bad == "none":
                last["exp_avg_sq"] = None
            elif bad == "no step":
                del last["step"]
            elif bad == "amsgrad":
                sd["param_groups"][0]["amsgrad"] = True
            elif bad == "lr":
                sd["param_groups"][0]["lr"] = "fast"
            else:
                last["step"] = bad
            with pytest.raises(outcore.ConfigError, match=BAD[bad]):
                engine.optimizer.load_state_dict(sd)
        losses += _steps(model, _engine_step(engine), range(2, 4))
        engine.close()
        return losses
    want = run(None)
    for bad in BAD:
        assert run(bad) == want, bad


BAD: dict = {"shape": "exp_avg_sq", "none": "exp_avg_sq.* not a tensor of numbers",
             "no step": "no 'step'", "amsgrad": "amsgrad=True is not supported",
             "lr": "lr='fast' is not a number"}
BAD.update({v: "whole number from 1" for v in ("many", -3, 0, float("inf"), 2.5)})


def test_numpy_of_a_state_copy_is_read_only(tmp_path: Path) -> None:
    """``m.numpy()`` and ``np.asarray(m)`` share the copy's bytes, so a write through them
    would be lost as one on the copy: numpy refuses it; ``np.array(m)`` is a copy of its own."""
    np = pytest.importorskip("numpy")
    model = _model()
    engine = _engine(model, tmp_path, "none")
    _steps(model, _engine_step(engine), range(1))
    moment = engine.optimizer.state[model[0].weight]["exp_avg"]
    if moment.device.type != "cpu":
        engine.close()
        pytest.skip("numpy() needs host memory; a .cpu() of a device copy is the user's own")
    for shared in (moment.numpy(), np.asarray(moment), moment.detach().numpy()):
        with pytest.raises(ValueError, match="read-only"):
            shared[0, 0] = 1.0
    own = np.array(moment)
    own[0, 0] = 1.0  # its own bytes
    engine.close()


@pytest.mark.parametrize("offload", OFFLOADS)
def test_a_copy_of_the_optimizer_is_torchs_own(tmp_path: Path, offload: str) -> None:
    """``copy.deepcopy((model, engine.optimizer))`` and a pickle of both are a plain model and
    a plain ``torch.optim.AdamW`` with the engine's hyper-parameters and state: training
    them on in plain torch follows the engine (torch_optimizer.py's ``__reduce_ex__``)."""
    model = _model()
    engine = _engine(model, tmp_path, offload)
    _steps(model, _engine_step(engine), range(2))
    copies = [copy.deepcopy((model, engine.optimizer)),
              torch.load(_saved((model, engine.optimizer)), weights_only=False)]
    mine = _steps(model, _engine_step(engine), range(2, 4))
    for plain, opt in copies:
        assert type(opt) is torch.optim.AdamW and opt.param_groups[0]["lr"] == HP["lr"]
        assert [id(p) for p in opt.param_groups[0]["params"]] == [
            id(p) for p in plain.parameters()]
        theirs = _steps(plain.to(default_device()), _torch_step(opt), range(2, 4))
        assert theirs == pytest.approx(mine, rel=1e-5)
    engine.close()


def test_a_copy_in_bf16_steps_as_torchs_would(tmp_path: Path) -> None:
    """With a 16-bit model the copied moments take the copied parameters' dtype, as torch's
    ``load_state_dict`` gives them, so the copy steps; a shallow copy is refused in words."""
    model = _model()
    engine = outcore.initialize(model, {"dtype": "bf16", "optimizer": {"type": "adamw", **HP}})
    for step in range(2):
        engine.backward(model(_batch(step).to(torch.bfloat16)).float().pow(2).mean())
        engine.step()
    plain, opt = copy.deepcopy((model, engine.optimizer))
    plain(_batch(2).to(torch.bfloat16)).float().pow(2).mean().backward()
    opt.step()
    assert {v.dtype for s in opt.state.values() for k, v in s.items() if k != "step"} == {
        torch.bfloat16}
    with pytest.raises(outcore.ConfigError, match="use copy.deepcopy"):
        copy.copy(engine.optimizer)
    engine.close()


def test_a_copy_of_an_adafactor_engine_optimizer_is_refused_in_words() -> None:
    model = _model()
    engine = outcore.initialize(model, {"dtype": "fp32", "optimizer": {"type": "adafactor"}})
    with pytest.raises(outcore.ConfigError, match="save engine.optimizer.state_dict"):
        copy.deepcopy(engine.optimizer)
    engine.close()


def _saved(obj: object) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf
