"""What the engine builds over a model: here, the prefetch budget it gives the schedule."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import outcore
from outcore.offload.tier import Tier
from outcore.sizing import placement
from outcore.zero.build import prefetch_budget

MiB = 1 << 20
GiB = 1 << 30


def _groups(*sizes: int, persistent: int = 0, frozen: int = 0) -> list:
    """Groups of one parameter each (2 bytes per element), the first ``frozen`` of them frozen."""
    return [SimpleNamespace(full_bytes=s, persistent=i < persistent, zero_copy=False,
                            params=[SimpleNamespace(numel=s // 2, trainable=i >= frozen)])
            for i, s in enumerate(sizes)]


def test_a_default_budget_grows_to_the_two_largest_fetched_groups() -> None:
    cfg = outcore.Config()
    assert prefetch_budget(cfg, _groups(8 * MiB, 50 * MiB)) == 128 * MiB  # small layers
    # a 13B Llama's MLP projections (141 MB) and embedding (328 MB): both largest fit
    assert prefetch_budget(cfg, _groups(141_557_760, 327_680_000, 52_428_800, 141_557_760)
                           ) == 327_680_000 + 141_557_760
    # groups kept gathered for good are not fetched: they do not count
    assert prefetch_budget(cfg, _groups(900 * MiB, 200 * MiB, 100 * MiB, persistent=1)) == (
        300 * MiB)


def test_a_budget_the_user_set_is_kept() -> None:
    cfg = outcore.Config(zero={"prefetch_bytes": 64 * MiB})
    assert prefetch_budget(cfg, _groups(141_557_760, 327_680_000)) == 64 * MiB
    cfg = outcore.Config(zero={"prefetch_bytes": 256 * MiB})
    assert prefetch_budget(cfg, _groups(141_557_760, 327_680_000)) == 256 * MiB


def test_the_default_survives_the_round_trips_configs_make() -> None:
    """Config.auto, DeepSpeed files and the Trainer dump and rebuild configs, writing every
    key: the default value still grows."""
    cfg = outcore.Config.from_dict(outcore.Config().model_dump(mode="json"))
    cfg = cfg.with_overrides({"offload": {"params": "cpu"}})
    assert prefetch_budget(cfg, _groups(141_557_760, 327_680_000)) == 469_237_760


def _rt(params: Tier) -> SimpleNamespace:
    """The runtime's two facts the floor reads: the parameters' tier, the compute device."""
    return SimpleNamespace(plan=SimpleNamespace(inputs=SimpleNamespace(params=params)),
                           device=torch.device("cpu"))


@pytest.mark.parametrize(("free", "want"), [(20 * GiB, 1024 * MiB), (100 * GiB, 2048 * MiB),
                                            (GiB, 128 * MiB)])
def test_parameters_on_nvme_get_what_the_free_memory_affords(
        monkeypatch: pytest.MonkeyPatch, free: int, want: int) -> None:
    """build.py's [Note: a budget for parameters on NVMe follows the free memory]: 5% of it,
    64 MiB to 2 GiB, and never less than the default's own rule; a budget the user set
    stays; parameters in memory keep the default's rule."""
    monkeypatch.setattr(placement, "device_free", lambda device: free)
    cfg = outcore.Config()
    share = placement.nvme_fetch_share(_rt(Tier.NVME))
    assert prefetch_budget(cfg, _groups(8 * MiB, 50 * MiB), share) == want
    assert placement.nvme_fetch_share(_rt(Tier.HOST)) == 0
    assert prefetch_budget(cfg, _groups(8 * MiB, 50 * MiB), 0) == 128 * MiB
    cfg = outcore.Config(zero={"prefetch_bytes": 64 * MiB})
    assert prefetch_budget(cfg, _groups(8 * MiB, 50 * MiB), share) == 64 * MiB
    # mostly frozen (a LoRA base on NVMe): the host was left short, the default's rule stays
    cfg = outcore.Config()
    assert prefetch_budget(cfg, _groups(50 * MiB, 8 * MiB, frozen=1), share) == 128 * MiB
    assert prefetch_budget(cfg, _groups(8 * MiB, 50 * MiB, frozen=1), share) == want


def test_inputs_go_to_the_compute_device_and_dtype() -> None:
    """build.to_compute, what the engine applies to a forward's inputs (entry.py's note):
    every tensor moved, floating ones cast, containers kept as they were."""
    from collections import namedtuple

    from outcore.zero.build import to_compute

    Batch = namedtuple("Batch", "x ids")
    x, ids = torch.randn(2, 3), torch.arange(4)
    out = to_compute({"b": Batch(x, ids), "l": [x], "t": (ids, "keep"), "n": 3},
                     torch.device("cpu"), torch.bfloat16)
    assert type(out["b"]) is Batch and out["b"].x.dtype == torch.bfloat16
    assert out["b"].ids.dtype == torch.int64 and out["l"][0].dtype == torch.bfloat16
    assert out["t"][1] == "keep" and out["n"] == 3
    assert to_compute(x, torch.device("cpu"), None) is x  # fp32 compute: nothing to cast


def test_a_float64_parameter_is_named_as_trained_in_fp32() -> None:
    """It trained in fp32 and came back float64 at close() with fp32's precision, with no
    word (dtype_choice said only 'fp32 as configured')."""
    model = torch.nn.Linear(3, 2).double()
    with pytest.warns(UserWarning, match=r"parameters weight, bias are float64: outcore keeps "
                      r"fp32 masters"):
        engine = outcore.initialize(model, {"dtype": "fp32"})
    engine.close()
    assert model.weight.dtype == torch.float64


def test_a_float64_parameter_built_under_init_is_named_too() -> None:
    with outcore.init({"dtype": "fp32"}):
        model = torch.nn.Linear(3, 2).double()
    with pytest.warns(UserWarning, match="parameters weight, bias are float64"):
        engine = outcore.initialize(model, {"dtype": "fp32"})
    engine.close()
