"""Engine behaviour beyond parity: init, release, gathering, fp16 overflow, eval, memory."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import outcore
from outcore.zero.group import GroupState
from outcore.zero.registry import managed
from tests.common import VOCAB, Quirky
from tests.distributed import run_world


class CustomInit(nn.Module):
    """Init that reads previous values (mul_, add_ on a slice) as well as overwriting ones."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(48, 40)
        self.b = nn.Linear(40, 7)
        self.table = nn.Parameter(torch.randn(5, 3))
        nn.init.orthogonal_(self.a.weight)
        with torch.no_grad():
            self.a.weight.mul_(0.5)
            self.b.weight[:, 0].add_(1.0)
            self.b.bias.data.fill_(0.25)
        nn.init.trunc_normal_(self.table, std=0.1)


def _init_equals_plain() -> dict:
    cfg = outcore.Config(dtype="fp32")
    out = {}
    for cls in (CustomInit, Quirky):
        torch.manual_seed(7)
        plain = cls()
        torch.manual_seed(7)
        with outcore.init(cfg):
            sharded = cls()
        # built but not yet given to an engine: shards only, placeholders of the true shape
        for (n, p), (_, q) in zip(sharded.named_parameters(), plain.named_parameters(),
                                  strict=True):
            assert p.shape == q.shape, n
            assert p.untyped_storage().nbytes() <= p.element_size(), n
        with outcore.gathered_parameters(sharded):
            for (n, p), (_, q) in zip(sharded.named_parameters(), plain.named_parameters(),
                                      strict=True):
                out[f"{cls.__name__}.{n}"] = bool(torch.equal(p.data.cpu(), q.data))
        # sharded construction drew exactly the random numbers plain construction drew
        torch.manual_seed(7)
        cls()
        after_plain = torch.rand(4)
        torch.manual_seed(7)
        with outcore.init(cfg):
            cls()
        out[f"{cls.__name__}.rng_stream"] = bool(torch.equal(torch.rand(4), after_plain))
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_init_context_weights_equal_plain_construction(world: int) -> None:
    for result in run_world(_init_equals_plain, world):
        bad = [k for k, ok in result.items() if not ok]
        assert not bad, f"differ from plain construction: {bad}"


def _release_frees_storage() -> dict:
    cfg = outcore.Config(dtype="fp32", zero={"persistence_threshold_bytes": 0})
    torch.manual_seed(0)
    with outcore.init(cfg):
        model = Quirky()
    engine = outcore.initialize(model, cfg)
    fc1 = model.blocks[0].fc1
    seen: dict[str, object] = {}

    def spy(module: nn.Module, args: tuple, output: object) -> None:
        # a forward hook: runs while fc1's full weight is gathered. Holding the storage object
        # (and the view autograd saved, which shares it) must not keep its bytes alive.
        storage = module.weight.untyped_storage()
        seen["storage"] = storage
        seen["view"] = module.weight.t()
        seen["bytes_during"] = storage.nbytes()
        seen["ptr_during"] = storage.data_ptr()
        seen["full_during"] = engine.memory_report()["by_kind"].get("device.unsharded", 0)

    fc1.register_forward_hook(spy, prepend=True)
    idx = torch.randint(0, VOCAB, (2, 8)).to(engine.device)
    loss = engine(idx, idx)
    storage = seen["storage"]
    out = {
        "bytes_during": seen["bytes_during"],
        "ptr_during": seen["ptr_during"],
        "full_during": seen["full_during"],
        "bytes_after_forward": storage.nbytes(),
        "ptr_after_forward": storage.data_ptr(),
        "view_bytes_after_forward": seen["view"].untyped_storage().nbytes(),
        "group_state_after_forward": managed(fc1.weight).group.state.value,
    }
    engine.backward(loss)
    out["bytes_after_backward"] = storage.nbytes()
    out["unsharded_after_backward"] = engine.memory_report()["by_kind"].get("device.unsharded", 0)
    out["states_after_backward"] = sorted({g.state.value for g in engine.groups})
    engine.close()
    return out


def test_released_parameter_storage_is_really_freed() -> None:
    for r in run_world(_release_frees_storage, 2):
        # the full fc1 weight (64 x 32 fp32) existed while fc1 ran ...
        assert r["bytes_during"] == 64 * 32 * 4 and r["ptr_during"] != 0
        assert r["full_during"] > 0
        # ... and afterwards its allocation is gone, even though a view of it is still held
        assert r["bytes_after_forward"] == 0 and r["ptr_after_forward"] == 0
        assert r["view_bytes_after_forward"] == 0
        assert r["group_state_after_forward"] == GroupState.SHARDED.value
        assert r["bytes_after_backward"] == 0
        assert r["unsharded_after_backward"] == 0
        assert r["states_after_backward"] == [GroupState.SHARDED.value]


def _fp16_overflow() -> dict:
    # 2**24 times logit gradients of ~1/16 is ~1e6, far past fp16's 65504: backward overflows
    # until the scale has been halved enough times.
    cfg = outcore.Config(dtype="fp16", optimizer={"lr": 1e-2},
                         loss_scale={"initial_scale_power": 24})
    torch.manual_seed(0)
    with outcore.init(cfg):
        model = Quirky()
    engine = outcore.initialize(model, cfg)
    idx = torch.randint(0, VOCAB, (2, 8)).to(engine.device)

    def weights() -> torch.Tensor:
        with engine.gathered_parameters():
            return torch.cat([p.data.reshape(-1).clone() for p in model.parameters()])

    start = weights()
    scales, stepped, unchanged = [engine.scaler.scale], [], []
    for _ in range(16):
        engine.backward(engine(idx, idx))
        stepped.append(engine.step())
        scales.append(engine.scaler.scale)
        unchanged.append(bool(torch.equal(weights(), start)))
        if stepped[-1]:
            break
    out = {"scales": scales, "stepped": stepped, "unchanged": unchanged,
           "skipped": engine.scaler.skipped_steps}
    engine.close()
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_fp16_overflow_skips_step_and_lowers_scale(world: int) -> None:
    for r in run_world(_fp16_overflow, world):
        skips = r["stepped"].index(True)
        assert skips >= 1, "the first step at scale 2**24 should have overflowed"
        assert r["skipped"] == skips
        # every skipped step halved the scale and left every weight untouched
        for i in range(skips):
            assert r["scales"][i + 1] == r["scales"][i] / 2
            assert r["unchanged"][i]
        # the first step without overflow changed the weights and kept the scale
        assert not r["unchanged"][skips]
        assert r["scales"][skips + 1] == r["scales"][skips]


def _gather_modify_and_eval() -> dict:
    cfg = outcore.Config(dtype="fp32", zero={"persistence_threshold_bytes": 0})
    torch.manual_seed(0)
    model = Quirky()  # built in plain PyTorch: initialize shards it
    engine = outcore.initialize(model, cfg)
    idx = torch.randint(0, VOCAB, (2, 8)).to(engine.device)
    with engine.gathered_parameters([model.gate.weight, model.scale], modify=True):
        model.gate.weight.data.zero_()
        model.scale.data.fill_(2.0)
    with engine.gathered_parameters():
        gate_zero = bool((model.gate.weight.data == 0).all())
        scale_two = bool((model.scale.data == 2.0).all())
        emb = model.emb.weight.data.clone()
    # an exception inside the context writes nothing back
    try:
        with engine.gathered_parameters([model.scale], modify=True):
            model.scale.data.fill_(-1.0)
            raise KeyError("boom")
    except KeyError:
        pass
    with engine.gathered_parameters([model.scale]):
        scale_kept = bool((model.scale.data == 2.0).all())
    engine.eval()
    with torch.no_grad():
        l1 = engine(idx, idx)
        l2 = engine(idx, idx)
    engine.train()
    states = sorted({g.state.value for g in engine.groups})
    # the reference: the same modification applied to a plain model
    torch.manual_seed(0)
    ref = Quirky().to(engine.device)
    with torch.no_grad():
        ref.gate.weight.zero_()
        ref.scale.fill_(2.0)
        ref_loss = ref(idx, idx)
    engine.close()
    return {"gate_zero": gate_zero, "scale_two": scale_two, "scale_kept": scale_kept,
            "emb_finite": bool(emb.isfinite().all()), "eval_loss": l1.item(),
            "eval_repeat": l2.item(), "ref_loss": ref_loss.item(), "states": states}


@pytest.mark.parametrize("world", [1, 2])
def test_gathered_parameters_write_back_and_eval_no_grad(world: int) -> None:
    for r in run_world(_gather_modify_and_eval, world):
        assert r["gate_zero"] and r["scale_two"] and r["scale_kept"] and r["emb_finite"]
        assert r["eval_loss"] == r["eval_repeat"]
        assert math.isclose(r["eval_loss"], r["ref_loss"], rel_tol=1e-6)
        expected = ["unsharded"] if world == 1 else ["sharded"]
        assert r["states"] == expected


def test_parameters_keep_shape_and_count_under_init() -> None:
    cfg = outcore.Config(dtype="bf16")
    with outcore.init(cfg):
        model = nn.Sequential(nn.Linear(100, 200), nn.Linear(200, 3))
    assert sum(p.numel() for p in model.parameters()) == 100 * 200 + 200 + 200 * 3 + 3
    assert model[0].weight.shape == (200, 100)
    engine = outcore.initialize(model, cfg)
    out = engine(torch.randn(4, 100).to(engine.device))
    assert out.dtype == torch.bfloat16 and out.shape == (4, 3)
    engine.close()


def test_own_param_group_keys_are_kept_and_a_foreign_tensor_is_a_config_error() -> None:
    model = nn.Linear(4, 4)
    engine = outcore.initialize(model, {"dtype": "fp32"},
                                [{"params": list(model.parameters()), "lr_decay": 0.5}])
    assert engine.optimizer.param_groups[0]["lr_decay"] == 0.5  # kept, as torch keeps it
    assert engine.optimizer.state_dict()["param_groups"][0]["lr_decay"] == 0.5
    engine.close()
    model2 = nn.Linear(4, 4)
    with pytest.raises(outcore.ConfigError, match="not a parameter of this model"):
        outcore.initialize(model2, {"dtype": "fp32"}, [{"params": [torch.zeros(3)]}])


def test_step_between_accumulation_boundaries_is_a_no_op() -> None:
    cfg = outcore.Config(dtype="fp32", gradient_accumulation_steps=3, optimizer={"lr": 0.1})
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    engine = outcore.initialize(model, cfg)
    x = torch.randn(5, 3).to(engine.device)
    results = []
    for _ in range(3):
        engine.backward(F.mse_loss(engine(x), torch.zeros(5, 1, device=engine.device)))
        results.append(engine.step())
    assert results == [False, False, True]
    engine.close()


def test_repr_names_the_model_the_placement_and_whether_the_engine_is_usable() -> None:
    """A notebook showed ``<outcore.engine.core.Engine object at 0x...>`` in every state."""
    model = nn.Sequential(nn.Linear(4, 4))
    first = outcore.initialize(model, {"dtype": "fp32"})
    assert repr(first) == ("<outcore Engine of Sequential: 2 parameter tensors, rank 0 of 1, fp32, "
                           "offload params=none optimizer=none, 0 steps; open>")
    second = outcore.initialize(model, {"dtype": "fp32"})
    assert repr(first).endswith("; handed its model to a newer engine>")
    second.close()
    assert repr(second).endswith("; was closed>")
