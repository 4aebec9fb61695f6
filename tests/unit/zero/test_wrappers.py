"""DDP or FSDP around a model outcore shards (zero/wrappers.py's note)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import outcore
from outcore.errors import ConfigError, ParamAccessError
from tests.distributed import run_world


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def _cfg(swap: Path) -> dict:  # the optimizer on NVMe: its updates run during backward
    return {"dtype": "fp32", "offload": {"params": "none", "optimizer": "nvme",
                                         "nvme_path": str(swap)}}


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """The process group a DDP script makes, at one rank."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_model_wrapped_in_ddp_is_refused_by_initialize(tmp_path: Path,
                                                         one_rank_group: None) -> None:
    with pytest.raises(ConfigError, match=r"the model is wrapped in DistributedDataParallel: "
                       r"outcore already runs the data parallelism .* \(ddp_model\.module,"):
        outcore.initialize(DDP(_model()), _cfg(tmp_path))


def test_a_forward_through_ddp_after_initialize_is_refused(tmp_path: Path,
                                                          one_rank_group: None) -> None:
    """At one rank DDP's constructor reads every parameter fine, and the forward through it
    trained weights 1e-2 from DDP's after three steps with the optimizer on NVMe."""
    model = _model()
    engine = outcore.initialize(model, _cfg(tmp_path))
    x = torch.randn(4, 6)
    with pytest.raises(ConfigError, match="was wrapped in DistributedDataParallel after "
                       "outcore.initialize"):
        DDP(model)(x)
    engine.backward(engine(x).pow(2).mean())  # the engine goes on, unharmed
    engine.step()
    engine.close()


def test_fully_shard_after_initialize_is_refused(tmp_path: Path, one_rank_group: None) -> None:
    """FSDP2 makes the parameters its own DTensors, and its hooks run before outcore's: the
    weights trained 0.03 from the unwrapped run's in three steps, silently."""
    from torch.distributed.fsdp import fully_shard

    model = _model()
    engine = outcore.initialize(model, _cfg(tmp_path))
    fully_shard(model)
    with pytest.raises(ConfigError, match=r"wrapped in FSDPModule after outcore.initialize.*"
                       r"the model before fully_shard"):
        model(torch.randn(4, 6))
    engine.close()


def test_an_outcore_model_called_inside_another_models_ddp_passes(
        tmp_path: Path, one_rank_group: None) -> None:
    """Distillation: a DDP student calls a frozen teacher outcore holds. DDP wraps the
    student alone, so the teacher's forward is not refused."""
    teacher = _model()
    engine = outcore.initialize(teacher, _cfg(tmp_path))
    x = torch.randn(4, 6)
    expected = teacher(x).detach()

    class Student(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(6, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                target = teacher(x)
            torch.testing.assert_close(target, expected)
            return (self.head(x) - target.to(x.device)).pow(2).mean()

    DDP(Student())(x).backward()
    engine.close()


def _wrap_after(swap: str) -> str:
    model = _model()
    engine = outcore.initialize(model, _cfg(Path(swap) / os.environ["RANK"]))
    try:
        DDP(model)
    except ParamAccessError as e:
        return str(e)
    finally:
        engine.close()
    return "not refused"


def test_ddps_read_at_more_ranks_names_the_wrap(tmp_path: Path) -> None:
    """DDP's constructor reads each parameter outside the forward: the refusal named
    gathered_parameters, which is not the way out, and then the wrap; it now says the wrap
    alone."""
    for said in run_world(_wrap_after, 2, str(tmp_path)):
        assert said.startswith("DDP or FSDP around a model outcore holds read parameter "), said
        assert "outcore already runs the data parallelism" in said, said
        assert "gathered_parameters" not in said, said


def test_dcps_optimizer_state_before_the_first_step_names_the_way(
        tmp_path: Path, one_rank_group: None) -> None:
    """get_optimizer_state_dict makes an empty state by assigning zero gradients and
    stepping; the refusal said to put the gradient into the loss."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = outcore.initialize(model, _cfg(tmp_path), optimizer=opt)
    with pytest.raises(ParamAccessError, match=r"here torch.distributed.checkpoint's "
                       r"get/set_optimizer_state_dict made the call.*after the first step"):
        get_optimizer_state_dict(model, opt)
    engine.backward(engine(torch.randn(4, 6)).pow(2).mean())
    engine.step()
    assert get_optimizer_state_dict(model, opt)["state"]  # after a step: torch's layout
    engine.close()
