"""``dtype: auto``: the choice table, the engine training exactly as in the dtype it resolves
to, one warning where a 16-bit dtype is emulated, and checkpoints that change dtype."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

import outcore
from outcore.config import Config
from outcore.config.deepspeed import translate
from outcore.device import compute_dtype
from outcore.device.compute_dtype import Capabilities, EmulatedDtypeWarning, choose
from tests.common import checkpoint_engine as _engine
from tests.common import train_steps as _train
from tests.common import weights_of as _weights

AMX = Capabilities("cpu", "Intel Xeon", bf16=True, fp16=False, detail="AMX")
AVX512_BF16 = Capabilities("cpu", "AMD EPYC 9004", bf16=True, fp16=False, detail="AVX512-BF16")
AVX2 = Capabilities("cpu", "AMD EPYC", bf16=False, fp16=False, detail="no AVX512-BF16, no AMX")
H100 = Capabilities("cuda", "NVIDIA H100", bf16=True, fp16=True, detail="compute capability 9.0")
V100 = Capabilities("cuda", "Tesla V100", bf16=False, fp16=True, detail="compute capability 7.0")
P100 = Capabilities("cuda", "Tesla P100", bf16=False, fp16=False, detail="compute capability 6.0")

BASE = {"optimizer": {"type": "adamw", "lr": 1e-2}, "zero": {"persistence_threshold_bytes": 0}}


@pytest.mark.parametrize(("caps", "name", "why"), [
    (H100, "bf16", "multiplies bf16 natively"),
    (V100, "fp16", "dynamic loss scaling"),
    (P100, "fp32", "no native bf16"),
    (AMX, "bf16", "AMX"),
    (AVX512_BF16, "bf16", "AVX512-BF16"),
    (AVX2, "fp32", "no native bf16"),
])
def test_auto_picks_the_fastest_native_dtype(caps: Capabilities, name: str, why: str) -> None:
    choice = choose("auto", caps)
    assert (choice.name, choice.requested, choice.native) == (name, "auto", True)
    assert why in choice.reason and caps.name in choice.reason


@pytest.mark.parametrize(("requested", "caps", "native"), [
    ("bf16", AVX2, False), ("bf16", AMX, True), ("fp16", AVX2, False), ("fp16", V100, True),
    ("bf16", V100, False), ("fp32", AVX2, True), ("fp32", H100, True),
])
def test_an_explicit_dtype_is_kept_and_marked_native_or_not(requested: str, caps: Capabilities,
                                                           native: bool) -> None:
    choice = choose(requested, caps)
    assert (choice.name, choice.requested, choice.native) == (requested, requested, native)
    assert ("emulates" in choice.reason) is (not native)


def test_cpu_capabilities_follow_torchs_own_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    for amx, avx512_bf16 in ((False, False), (True, False), (False, True)):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        compute_dtype.cpu_features.cache_clear()
        caps = compute_dtype.capabilities(torch.device("cpu"))
        assert caps.bf16 is (amx or avx512_bf16)
        assert choose("auto", caps).name == ("bf16" if caps.bf16 else "fp32")
    compute_dtype.cpu_features.cache_clear()


def test_config_defaults_to_auto_and_rejects_other_names() -> None:
    assert Config().dtype == "auto"
    with pytest.raises(outcore.ConfigError, match="dtype: got 'bfloat16'; allowed"):
        Config(dtype="bfloat16")


@pytest.mark.parametrize(("ds", "dtype"), [
    ({"bf16": {"enabled": "auto"}}, "auto"),
    ({"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}, "auto"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": "auto"}}, "fp16"),
    ({"bf16": {"enabled": True}}, "bf16"),
    ({"bf16": {"enabled": False}}, "fp32"),
    ({}, "fp32"),
])
def test_deepspeed_auto_means_auto(ds: dict, dtype: str) -> None:
    assert translate(ds)[0]["dtype"] == dtype


@pytest.mark.parametrize(("ds", "says"), [
    ({"bf16": True}, "'bf16'"),
    ({"fp16": {"enabled": 1}}, "'fp16'"),  # DeepSpeed's own check wants a bool
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "both"),
])
def test_deepspeed_precision_sections_are_checked(ds: dict, says: str) -> None:
    with pytest.raises(outcore.ConfigError, match=says):
        translate(ds)


def _fake(monkeypatch: pytest.MonkeyPatch, caps: Capabilities) -> None:
    monkeypatch.setattr(compute_dtype, "capabilities", lambda device: caps)
    monkeypatch.setattr(compute_dtype, "_warned", set())


def _losses(cfg: dict, steps: int = 3) -> tuple[list[float], dict, outcore.Engine]:
    model, eng = _engine(cfg, 0)
    losses = _train(eng, range(steps))
    weights = _weights(eng, model)
    eng.close()
    return losses, weights, eng


@pytest.mark.parametrize("caps", [AMX, AVX2, V100])
def test_auto_trains_exactly_like_the_dtype_it_resolves_to(monkeypatch: pytest.MonkeyPatch,
                                                            caps: Capabilities) -> None:
    """The engine is built on a (faked) device; auto must be the resolved dtype, bit for bit,
    loss scaling included where it resolves to fp16."""
    _fake(monkeypatch, caps)
    name = choose("auto", caps).name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulatedDtypeWarning)  # this CPU may emulate it
        auto_losses, auto_w, auto_eng = _losses({**BASE, "dtype": "auto"})
        same_losses, same_w, same_eng = _losses({**BASE, "dtype": name})
    assert auto_eng.dtype == same_eng.dtype == compute_dtype.DTYPES[name]
    assert auto_eng.cfg.dtype == name and auto_eng.dtype_choice.requested == "auto"
    assert auto_eng.scaler.enabled is (name == "fp16")
    assert auto_losses == same_losses
    assert all(torch.equal(auto_w[k], same_w[k]) for k in auto_w)


def test_emulated_dtype_warns_once_and_still_trains(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake(monkeypatch, AVX2)
    with pytest.warns(EmulatedDtypeWarning, match="Use dtype 'auto' \\(here: fp32\\)") as got:
        losses, _, eng = _losses({**BASE, "dtype": "bf16"}, steps=2)
    mine = [w for w in got if w.category is EmulatedDtypeWarning]
    assert len(mine) == 1
    # it points at the first caller outside outcore (tests/common.py's checkpoint_engine)
    assert mine[0].filename.endswith("common.py"), mine[0].filename
    assert not eng.dtype_choice.native and eng.dtype == torch.bfloat16
    assert all(torch.isfinite(torch.tensor(losses)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", EmulatedDtypeWarning)  # a second engine: no repeat
        _losses({**BASE, "dtype": "bf16"}, steps=1)


def test_the_choice_is_reported_and_recorded(monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    _fake(monkeypatch, AVX2)
    model, eng = _engine({**BASE, "dtype": "auto"}, 0)
    _train(eng, range(1))
    report = eng.memory_report()["dtype"]
    assert report["name"] == "fp32" and report["requested"] == "auto"
    assert "AMD EPYC" in report["reason"]
    eng.save_checkpoint(tmp_path / "ck")
    eng.close()
    man = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert man["dtype"] == "fp32" and man["config"]["dtype"] == "fp32"
    assert man["dtype_reason"] == eng.dtype_choice.reason


@pytest.mark.parametrize(("first", "then"), [("bf16", "fp32"), ("fp32", "bf16")])
def test_a_checkpoint_resumes_in_another_dtype(tmp_path: Path, first: str, then: str) -> None:
    """The masters are fp32 in either dtype, so they come back bit for bit; training goes on."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulatedDtypeWarning)
        model, eng = _engine({**BASE, "dtype": first}, 0)
        _train(eng, range(3))
        saved = _weights(eng, model)
        eng.save_checkpoint(tmp_path / "ck")
        eng.close()
        model, eng = _engine({**BASE, "dtype": then}, 1)
        eng.load_checkpoint(tmp_path / "ck")
        loaded = _weights(eng, model)
        losses = _train(eng, range(3, 5))
        eng.close()
    assert eng.dtype == compute_dtype.DTYPES[then]
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert all(torch.isfinite(torch.tensor(losses)))


def test_placement_prices_fp32_shards_as_their_masters() -> None:
    """In fp32 a parameter shard in the optimizer's tier *is* its master (12 B of state and
    4 B of gradients per parameter in host memory); in bf16 it is 2 B more. 17 GB of host
    room holds the first, not the second."""
    from outcore.sizing.estimate import USABLE
    from outcore.sizing.placement import plan

    room = {"device_free": 1, "host_free": int(17e9 / USABLE.states_only().host),
            "disk_free": 10**13, "device": "cpu"}
    fp32 = plan(10**9, settings=outcore.Config.from_dict({"dtype": "fp32"}), **room)
    bf16 = plan(10**9, settings=outcore.Config.from_dict({"dtype": "bf16"}), **room)
    assert (fp32.params, fp32.optimizer) == ("cpu", "cpu")
    assert (bf16.params, bf16.optimizer) == ("cpu", "nvme")
