"""What each rank hands outcore must be alike, or every rank refuses together, naming what
differs. Found by a user-style probe at 2 ranks: a model with a layer more on one rank, or a
dtype, offload tier or clipping given to one rank, aborted gloo in C++ ("Received data size
doesn't match expected size") with no word of the model or config; a learning rate given to
one rank trained a model whose halves followed two runs, silently; and ``load_checkpoint``
of another folder on each rank loaded a mix equal to neither checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from outcore.errors import ConfigError
from tests.distributed import run_world


def _model(extra: bool) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)]
    return nn.Sequential(*layers, *([nn.Linear(4, 4)] if extra else []))


def _initialize(cfg_of_rank: dict, extra_layer_on_rank1: bool, swap: str) -> str | None:
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else int(__import__("os").environ["RANK"])
    cfg = {"dtype": "fp32", "offload": {"params": "nvme", "optimizer": "nvme",
                                        "nvme_path": f"{swap}/rank{rank}"}}
    for key, value in cfg_of_rank.get(rank, {}).items():
        section, _, name = key.partition(".")
        cfg.setdefault(section, {}).update({name: value}) if name else cfg.update({key: value})
    try:
        engine = outcore.initialize(_model(extra_layer_on_rank1 and rank == 1), cfg)
    except ConfigError as e:
        return str(e)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    engine.close()
    return None


def test_a_model_with_a_layer_more_on_one_rank_is_refused(tmp_path: Path) -> None:
    said = run_world(_initialize, 2, {}, True, str(tmp_path))
    assert said[0] is not None and said[1] is not None
    assert "the ranks passed different models: this rank's has 4 parameters" in said[0]
    assert "this rank's has 6 parameters" in said[1]


@pytest.mark.parametrize(("differ", "named"), [
    ({"optimizer.lr": 1e-3}, "optimizer.lr=0.001"),
    ({"dtype": "bf16"}, "dtype='bf16'"),
    ({"offload.params": "none", "offload.optimizer": "none"}, "offload.params='none'"),
    ({"gradient_clipping": 1.0}, "gradient_clipping=1.0")])
def test_a_setting_given_to_one_rank_is_refused_by_name(tmp_path: Path, differ: dict,
                                                        named: str) -> None:
    said = run_world(_initialize, 2, {1: differ}, False, str(tmp_path))
    assert said[0] is not None and said[1] is not None
    assert "the ranks run with different configs" in said[1] and named in said[1]
    assert ("dtype: auto picks by the host" in said[1]) == ("dtype" in differ)
    assert ("plans by each host's free memory" in said[1]) == ("offload.params" in differ)


def test_a_swap_folder_memory_and_seed_of_each_ranks_own_pass(tmp_path: Path) -> None:
    """And the optimizer state's tier, and an fp32 run's loss-scale settings, which it does
    not read (a reviewer found both refused where they had trained right)."""
    own = {"offload.host_buffer_bytes": 64 << 20, "zero.prefetch_bytes": 1 << 20, "seed": 7,
           "offload.optimizer": "cpu", "loss_scale.initial_scale_power": 8}
    assert run_world(_initialize, 2, {1: own}, False, str(tmp_path)) == [None, None]


def _grouped(groups_of_rank: dict, adopt: bool, swap: str, kind: str = "adamw") -> str | None:
    rank = int(__import__("os").environ["RANK"])
    model = _model(False)
    first, second = model[0], model[2]
    groups = {"lr": [{"params": [*first.parameters()], "lr": 1e-2},
                     {"params": [*second.parameters()]}],
              "members": [{"params": [first.weight]},
                          {"params": [first.bias, *second.parameters()]}],
              "count": [{"params": [*model.parameters()]}],
              "reordered": [{"params": [first.bias, first.weight]},
                            {"params": [*second.parameters()]}],
              "clip": [{"params": [*first.parameters()], "clip_threshold": 0.5},
                       {"params": [*second.parameters()]}],
              }.get(groups_of_rank.get(rank), [{"params": [*first.parameters()]},
                                                {"params": [*second.parameters()]}])
    cfg = {"dtype": "fp32", "offload": {"nvme_path": f"{swap}/rank{rank}"},
           "optimizer": {"type": kind, "lr": 1e-3}}
    try:
        if adopt:
            engine = outcore.initialize(model, cfg, optimizer=torch.optim.AdamW(groups, lr=1e-3))
        else:
            engine = outcore.initialize(model, cfg, param_groups=groups)
    except ConfigError as e:
        return str(e)
    engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
    engine.step()
    engine.close()
    return None


@pytest.mark.parametrize(("differ", "named"), [
    ("lr", "param_groups[0] lr=0.01 on this rank (rank 1) differs on another"),
    ("members", "param_groups[0] holds other parameters on another rank than on this rank "
                "(rank 1) (1: 0.weight)"),
    ("count", "1 group on this rank (rank 1), another number on another")])
@pytest.mark.parametrize("adopt", [False, True])
def test_param_groups_that_differ_between_ranks_are_refused(tmp_path: Path, differ: str,
                                                            named: str, adopt: bool) -> None:
    """A learning rate per group given to one rank trained the halves of each parameter with
    two rates, with no word (the config's own settings were compared, the groups not)."""
    said = run_world(_grouped, 2, {1: differ}, adopt, str(tmp_path))
    assert said[0] is not None and said[1] is not None, said
    assert "the ranks pass different param_groups" in said[0]
    assert named in said[1], said[1]


def test_adafactor_keys_that_differ_between_ranks_are_refused(tmp_path: Path) -> None:
    """Adafactor's runner reads every key of its group: a ``clip_threshold`` on one rank only
    clipped the halves of each parameter apart (only the hyper-parameters were compared)."""
    said = run_world(_grouped, 2, {1: "clip"}, False, str(tmp_path), "adafactor")
    assert said[0] is not None and said[1] is not None, said
    assert "param_groups[0] clip_threshold=0.5 on this rank (rank 1) differs" in said[1], said


def test_param_groups_alike_on_every_rank_train(tmp_path: Path) -> None:
    """A group's parameters in another order on one rank are the same group (a set, say)."""
    assert run_world(_grouped, 2, {}, False, str(tmp_path)) == [None, None]
    assert run_world(_grouped, 2, {1: "reordered"}, False, str(tmp_path)) == [None, None]


def _load_by_rank(root: str) -> str | None:
    import torch.distributed as dist

    engine = outcore.initialize(_model(False), {"dtype": "fp32"})
    x = torch.randn(4, 8)
    engine.save_checkpoint(Path(root) / "a")
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    engine.save_checkpoint(Path(root) / "b")
    try:
        engine.load_checkpoint(Path(root) / ("a" if dist.get_rank() == 0 else "b"))
    except ConfigError as e:
        return str(e)
    finally:
        engine.close()
    return None


def test_another_checkpoint_on_each_rank_is_refused(tmp_path: Path) -> None:
    said = run_world(_load_by_rank, 2, str(tmp_path))
    assert all(s is not None and "load_checkpoint() was given another checkpoint on some "
               "rank" in s for s in said)


def _client_state_by_rank(root: str, same: bool) -> tuple[list[str], dict]:
    import warnings

    import torch.distributed as dist

    engine = outcore.initialize(_model(False), {"dtype": "fp32"})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        engine.save_checkpoint(Path(root) / "c", client_state={
            "position": 5 if same else 5 + dist.get_rank()})
    loaded = engine.load_checkpoint(Path(root) / "c")
    engine.close()
    return [str(w.message) for w in seen], loaded


@pytest.mark.parametrize("same", [True, False])
def test_a_client_state_that_differs_between_ranks_is_said(tmp_path: Path, same: bool) -> None:
    """Rank 0's is kept, as DeepSpeed keeps it; rank 1's own was replaced without a word."""
    (said0, loaded0), (said1, loaded1) = run_world(_client_state_by_rank, 2, str(tmp_path), same)
    assert loaded0 == loaded1 == {"position": 5}
    assert said1 == []
    assert [s for s in said0 if "client_state differs between ranks" in s] == (
        [] if same else ["save_checkpoint(): client_state differs between ranks; the checkpoint "
                         "keeps rank 0's, which every rank's load_checkpoint returns (gather "
                         "what each rank needs into it first, e.g. with "
                         "torch.distributed.all_gather_object)"])
