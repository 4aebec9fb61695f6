"""Config from a DeepSpeed config, and automatic placement."""

from __future__ import annotations

import json
import warnings

import pytest

import outcore
from outcore.sizing.placement import plan

GiB = 1 << 30


def test_deepspeed_zero3_nvme_config_maps_and_reports_ignored_keys(tmp_path) -> None:
    ds = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95],
                                                  "eps": 1e-8, "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": 3, "sub_group_size": 1e9, "stage3_max_live_parameters": 1e9,
            "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5,
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True,
                              "buffer_count": 5, "buffer_size": 1e8},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path),
                                  "buffer_count": 4},
        },
        "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 2,
                "single_submit": False},
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    with pytest.warns(UserWarning) as caught:
        cfg = outcore.Config.from_deepspeed(path)
    text = str(caught[0].message)
    for key in ("train_micro_batch_size_per_gpu", "sub_group_size",
                "stage3_max_live_parameters", "offload_param.pin_memory", "aio.queue_depth"):
        assert key in text
    assert len(caught) == 1
    assert caught[0].filename == __file__, "the warning points at the caller's line"
    with pytest.warns(UserWarning) as caught:
        outcore.Config.load(ds)  # wherever a config is taken
    assert caught[0].filename == __file__
    assert cfg.dtype == "bf16" and cfg.gradient_accumulation_steps == 2
    assert cfg.optimizer.lr == 3e-4 and cfg.optimizer.weight_decay == 0.1
    assert cfg.offload.params == "nvme" and cfg.offload.optimizer == "nvme"
    assert cfg.offload.nvme_path == str(tmp_path)
    assert cfg.offload.host_buffer_bytes == 5 * 10**8 * 2
    assert cfg.zero.prefetch_bytes == 10**8 and cfg.zero.persistence_threshold_bytes == 2 * 10**5
    assert cfg.offload.io_block_bytes == 1 << 20 and cfg.offload.io_threads == 2


def test_deepspeed_errors_name_the_key() -> None:
    with pytest.raises(outcore.ConfigError, match="zero_optimization.stage: 2"):
        outcore.Config.from_deepspeed({"zero_optimization": {"stage": 2}})
    with pytest.raises(outcore.ConfigError, match="optimizer.type: 'Lamb'"):
        outcore.Config.from_deepspeed({"optimizer": {"type": "Lamb"}})
    with pytest.raises(outcore.ConfigError, match="amsgrad=True"):
        outcore.Config.from_deepspeed({"optimizer": {"type": "Adam",
                                                     "params": {"amsgrad": True}}})
    adam = outcore.Config.from_deepspeed({"optimizer": {"type": "Adam",
                                                        "params": {"adam_w_mode": False}}})
    assert adam.optimizer.type == "adam"  # L2 weight decay, torch's Adam
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to ignore, so no warning
        cfg = outcore.Config.from_deepspeed({"fp16": {"enabled": True, "loss_scale_window": 50}})
    assert cfg.dtype == "fp16" and cfg.loss_scale.growth_interval == 50


@pytest.mark.parametrize(
    ("params", "dev", "host", "disk", "expected"),
    [
        (10**8, 8 * GiB, 64 * GiB, 100 * GiB, ("none", "none")),   # 1.6 GB of states fits
        (10**9, 8 * GiB, 64 * GiB, 100 * GiB, ("none", "cpu")),    # 2 GB params fit, 16 GB not
        (3 * 10**9, 8 * GiB, 128 * GiB, 100 * GiB, ("cpu", "cpu")),
        (3 * 10**9, 8 * GiB, 64 * GiB, 100 * GiB, ("cpu", "nvme")),
        # 3B: bf16 params (6 GB) beside a whole step's fp32 gradients (12 GB, held for the
        # clipping norm) do not fit 60% of 24 GiB of host memory
        (3 * 10**9, 8 * GiB, 24 * GiB, 100 * GiB, ("nvme", "nvme")),
    ],
)
def test_auto_placement_picks_the_fastest_tier_that_fits(params, dev, host, disk,
                                                         expected, tmp_path) -> None:
    settings = outcore.Config.from_dict({"dtype": "bf16", "gradient_clipping": 1.0})
    chosen = plan(params, device_free=dev, host_free=host, disk_free=disk,
                  nvme_path=str(tmp_path), settings=settings, device="cpu")
    assert (chosen.params, chosen.optimizer) == expected
    assert "fits" in chosen.explain()


def test_auto_placement_applies_the_estimators_tier_model(tmp_path) -> None:
    """Model states may take ``USABLE.states_only()`` of each tier's free bytes (estimate.py's
    one model: 67.5% of device memory, 60% of host memory, 71% of the disk); here the host's
    limit decides between keeping the optimizer state in host memory and moving it to NVMe."""
    from outcore.sizing.estimate import USABLE, Overheads

    frac = USABLE.states_only()
    assert (frac.device, frac.host, frac.nvme) == pytest.approx((0.675, 0.6, 0.7125))
    n = 10**9  # host needs 16 GB of fp32 state + gradients beside device-resident parameters
    kw = {"device_free": 8 * GiB, "disk_free": 100 * GiB, "nvme_path": str(tmp_path),
          "device": "cpu"}
    fits = plan(n, host_free=int(16 * n / frac.host) + 1, **kw)
    assert (fits.params, fits.optimizer) == ("none", "cpu")
    spills = plan(n, host_free=int(16 * n / frac.host) - 1, **kw)
    assert (spills.params, spills.optimizer) == ("cpu", "nvme")
    assert "GiB (60% usable)" in spills.explain()
    roomy = plan(n, host_free=int(16 * n / frac.host) - 1, usable=Overheads(0.7, 0.7, 0.7), **kw)
    assert roomy.optimizer == "cpu"  # a caller can still pass its own fractions


def test_overlapped_updates_free_gradients_so_larger_models_fit(tmp_path) -> None:
    """Placement prices each candidate by the execution plan it would run with: with the
    optimizer on NVMe and overlapped with backward, gradients are freed group by group; with
    clipping (no overlap) all 80 GB of fp32 gradients wait in host memory for the step."""
    kw = {"device_free": 8 * GiB, "host_free": 24 * GiB, "disk_free": 900 * GiB,
          "nvme_path": str(tmp_path), "device": "cpu"}
    clipped = outcore.Config.from_dict({"dtype": "bf16", "gradient_clipping": 1.0})
    with pytest.raises(outcore.ConfigError):
        plan(20 * 10**9, settings=clipped, **kw)
    chosen = plan(20 * 10**9, settings=outcore.Config.from_dict({"dtype": "bf16"}), **kw)
    assert (chosen.params, chosen.optimizer) == ("nvme", "nvme")


def test_gradients_kept_beside_a_state_in_memory_are_priced_on_a_gpu() -> None:
    """On a GPU the updates run during backward with the state in host memory too, but each
    gradient's buffer is kept from step to step there (param.py's [Note: gradient buffers]),
    so the 4 bytes a parameter are priced; with the state on NVMe they are freed."""
    from outcore.sizing.placement import state_bytes

    n, bf16 = 10**9, outcore.Config.from_dict({"dtype": "bf16"})
    in_memory = state_bytes(n, 1, bf16, "cuda", "cpu", "cpu")
    assert in_memory["host"] == 2 * n + 12 * n + 4 * n  # shards, master and moments, gradient
    on_nvme = state_bytes(n, 1, bf16, "cuda", "cpu", "nvme")
    assert on_nvme["nvme"] == 12 * n and on_nvme["host"] == 2 * n


def test_auto_placement_fails_clearly_when_nothing_fits(tmp_path) -> None:
    """The message says what everything on NVMe would take and what each tier has free, so
    a user sees which one is short (here the disk)."""
    with pytest.raises(outcore.ConfigError, match=r"does not fit this machine even with "
                       r"everything on NVMe at .*: params=nvme, optimizer=nvme: does not fit "
                       r"\(nvme .* GiB.*; free device 8\.0 GiB .*, host 16\.0 GiB .*, "
                       r"disk 1\.0 GiB"):
        plan(10**12, device_free=8 * GiB, host_free=16 * GiB, disk_free=GiB,
             nvme_path=str(tmp_path))


def test_config_auto_returns_a_valid_config(tmp_path, capsys) -> None:
    cfg = outcore.Config.auto(10**6, {"dtype": "fp32"}, nvme_path=str(tmp_path))
    assert cfg.dtype == "fp32" and cfg.offload.params == "none"
    assert "placement: params=none" in capsys.readouterr().err


def test_a_frozen_base_is_priced_by_its_16_bit_shards(tmp_path) -> None:
    """LoRA over a 7B base: 14 GB of bf16 shards and the adapters' state fit 24 GiB of host
    memory; priced as a full fine-tune (16 bytes per parameter) the state would go to NVMe."""
    from outcore.sizing.placement import check_fits, state_bytes

    n, adapters = 7 * 10**9, 20 * 10**6
    bf16 = outcore.Config.from_dict({"dtype": "bf16"})
    kw = {"device_free": 24 * GiB, "host_free": 24 * GiB, "disk_free": 900 * GiB,
          "nvme_path": str(tmp_path), "device": "cpu"}
    assert plan(n, settings=bf16, **kw).optimizer == "nvme"
    lora = plan(n, settings=bf16, trainable=adapters, **kw)
    assert (lora.params, lora.optimizer) == ("none", "none")
    assert "20,000,000 of them train" in lora.explain()
    use = state_bytes(n, 1, bf16, "cpu", "nvme", "cpu", trainable=adapters)
    # the frozen base's bf16 shards on NVMe; the adapters' bf16 copies are cast from their
    # masters in host memory and stored nowhere (storage.py's CastShard)
    assert use["nvme"] == 2 * (n - adapters) and use["host"] == 12 * adapters + 4 * adapters
    # fp32 with the shards as masters: a frozen parameter is its 4 bytes of values (and here
    # the updates run during backward, so no step's worth of gradients is held)
    fp32 = outcore.Config.from_dict({"dtype": "fp32"})
    assert state_bytes(n, 1, fp32, "cpu", "cpu", "cpu", trainable=adapters)["host"] == \
        4 * n + 12 * adapters
    on_cpu = bf16.with_overrides({"offload": {"params": "cpu", "optimizer": "cpu"}})
    with pytest.raises(outcore.ConfigError, match="need 126 GB of model states in memory"):
        check_fits(on_cpu, n, host_free=24 * GiB, device="cpu")
    assert check_fits(on_cpu, n, host_free=24 * GiB, device="cpu", trainable=adapters) is None
