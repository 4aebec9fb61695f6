"""``outcore.init(cfg, weights=folder)``: a model built without values and bound to its
files by name; a frozen base on NVMe read in place, in its own dtype, and never written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import outcore
from outcore.errors import ConfigError
from outcore.offload.file_shard import FileShard
from outcore.zero.registry import managed
from tests.common import hf_steps
from tests.distributed import run_world

transformers = pytest.importorskip("transformers")


def _config(tie: bool = False):
    return transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tie)


def _folder(tmp_path: Path, tie: bool = False, dtype: torch.dtype = torch.bfloat16) -> Path:
    torch.manual_seed(0)
    folder = tmp_path / ("tied" if tie else "untied")
    transformers.LlamaForCausalLM(_config(tie)).to(dtype).save_pretrained(
        folder, max_shard_size="100KB")  # several files and an index
    return folder


def _cfg(swap: str, params: str = "nvme", dtype: str = "fp32") -> dict:
    return {"dtype": dtype, "optimizer": {"lr": 1e-2},
            "offload": {"params": params, "optimizer": "cpu", "nvme_path": swap}}


def _logits(folder: str, swap: str, tie: bool, params: str) -> dict:
    cfg = _cfg(swap, params)
    torch.manual_seed(0)  # every rank builds the same way (init checks it)
    with outcore.init(cfg, frozen=True, weights=folder) as ctx:
        model = transformers.AutoModelForCausalLM.from_config(_config(tie))
    rt = ctx.runtime
    in_place = [isinstance(managed(p).compute_shard, FileShard) for p in model.parameters()]
    engine = outcore.initialize(model, cfg)
    x = torch.arange(32).reshape(2, 16) % 300
    with torch.no_grad():
        logits = engine(input_ids=x).logits.clone()
    out = {"logits": logits, "in_place": in_place, "read": rt.reader.bytes_read,
           "written": rt._nvme.bytes_written if rt._nvme is not None else 0,
           "tied": model.lm_head.weight is model.model.embed_tokens.weight,
           # the reader's buffers are host memory outcore holds: on the ledger
           "charged": rt.ledger.snapshot().get("host.io_buffers", 0) >= rt.reader.capacity_bytes}
    engine.close()
    return out


@pytest.mark.parametrize(("world", "tie", "params"),
                         [(1, False, "nvme"), (1, True, "nvme"), (2, False, "nvme"),
                          (1, False, "cpu")])
def test_the_bound_model_computes_what_from_pretrained_computes(
        tmp_path: Path, world: int, tie: bool, params: str) -> None:
    folder = _folder(tmp_path, tie)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    x = torch.arange(32).reshape(2, 16) % 300
    with torch.no_grad():
        want = ref(input_ids=x).logits
    results = run_world(_logits, world, str(folder), str(tmp_path / "swap"), tie, params) \
        if world > 1 else [_logits(str(folder), str(tmp_path / "swap"), tie, params)]
    base_bytes = sum(p.numel() * 2 for p in ref.parameters())  # bf16 on disk
    for r in results:
        torch.testing.assert_close(torch.as_tensor(r["logits"]).cpu(), want, rtol=1e-5,
                                   atol=1e-5)
        assert r["tied"] is tie and r["charged"]
        assert r["written"] == 0  # nothing of the base went to the swap file
        # on NVMe every parameter reads its bf16 bytes in place; in memory they are loaded once
        assert all(r["in_place"]) is (params == "nvme")
    # each rank reads its slices once, in the files' bf16 (not the fp32 it computes in): on
    # NVMe for the forward, where a tied head reads the embedding a second time (it is used
    # twice, far apart); in memory once, at the bind
    again = 300 * 64 * 2 if tie and params == "nvme" else 0
    assert sum(r["read"] for r in results) == base_bytes + again


def test_mismatches_are_refused_by_name_before_anything_is_kept(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    cfg = _cfg(str(tmp_path / "swap"))
    other = _config()
    other.intermediate_size = 96
    with pytest.raises(ConfigError, match=r"shape mismatch .*mlp\.gate_proj\.weight: file "
                                          r"\[128, 64\] vs model \[96, 64\]"), \
            outcore.init(cfg, frozen=True, weights=folder):
        model = transformers.AutoModelForCausalLM.from_config(other)  # noqa: F841
    more = _config()
    more.num_hidden_layers = 3
    with pytest.raises(ConfigError, match=r"missing model\.layers\.2\."), \
            outcore.init(cfg, frozen=True, weights=folder):
        model = transformers.AutoModelForCausalLM.from_config(more)  # noqa: F841
    with pytest.raises(ConfigError, match="pretrained weights not found"):
        outcore.init(cfg, weights=tmp_path / "nowhere")
    swap = tmp_path / "swap"
    assert not swap.exists() or not [p for p in swap.rglob("*") if p.is_file()]


def _finetune(folder: str, swap: str, deferred: bool) -> list[float]:
    cfg = _cfg(swap, dtype="fp32")
    torch.manual_seed(0)
    with outcore.init(cfg, weights=folder if deferred else None):
        model = transformers.AutoModelForCausalLM.from_config(_config())
    if not deferred:
        outcore.load_pretrained(model, folder)
    engine = outcore.initialize(model, cfg)
    losses = hf_steps(engine, torch.arange(32).reshape(2, 16) % 300, 3)
    engine.close()
    return losses


def test_full_fine_tune_from_weights_equals_load_pretrained(tmp_path: Path) -> None:
    folder = str(_folder(tmp_path))
    a = _finetune(folder, str(tmp_path / "s1"), deferred=True)
    b = _finetune(folder, str(tmp_path / "s2"), deferred=False)
    assert a == b and a[-1] < a[0]


def test_a_write_to_an_in_place_weight_gets_its_own_shard(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.iterdir()}
    cfg = _cfg(str(tmp_path / "swap"))
    with outcore.init(cfg, frozen=True, weights=folder):
        model = transformers.AutoModelForCausalLM.from_config(_config())
    engine = outcore.initialize(model, cfg)
    w = model.model.layers[0].mlp.up_proj.weight
    with torch.no_grad():
        w[0, :4] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert not managed(w).compute_shard.read_only  # moved to the swap file, not the folder
    with engine.gathered_parameters([w]):
        assert w[0, :4].tolist() == [1.0, 2.0, 3.0, 4.0]
    # load_state_dict does the same for every weight it writes
    sd = model.state_dict()
    sd["model.layers.1.self_attn.o_proj.weight"] = torch.full((64, 64), 0.5)
    model.load_state_dict(sd)
    o = model.model.layers[1].self_attn.o_proj.weight
    assert not managed(o).compute_shard.read_only
    with engine.gathered_parameters([o]):
        assert bool((o == 0.5).all())
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.iterdir()} == before
    engine.close()


def test_a_base_file_changed_during_the_run_is_caught(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    cfg = {**_cfg(str(tmp_path / "swap")), "zero": {"persistence_threshold_bytes": 0}}
    with outcore.init(cfg, frozen=True, weights=folder):
        model = transformers.AutoModelForCausalLM.from_config(_config())
    engine = outcore.initialize(model, cfg)
    x = torch.arange(32).reshape(2, 16) % 300
    with torch.no_grad():
        engine(input_ids=x)  # the first reads record what the files hold
    shard = managed(model.model.layers[1].mlp.down_proj.weight).compute_shard
    raw = bytearray(shard.path.read_bytes())
    raw[shard.entry.offset + 10] ^= 0x40
    fd = os.open(shard.path, os.O_WRONLY)
    os.pwrite(fd, bytes(raw), 0)
    os.fsync(fd)
    os.close(fd)
    with pytest.raises(outcore.errors.StorageError, match="changed while outcore used it"), \
            torch.no_grad():
        engine(input_ids=x)


def test_deep_copied_layers_and_relative_paths_are_bound_too(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """``copy.deepcopy`` of a layer registers nothing (nn.TransformerEncoder builds its layers
    so); its copies are bound by name like the rest, and a relative path is resolved once."""
    import copy

    from safetensors.torch import save_file

    torch.manual_seed(0)
    want = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    save_file({k: v.contiguous() for k, v in want.state_dict().items()},
              tmp_path / "m.safetensors")
    monkeypatch.chdir(tmp_path)
    cfg = _cfg(str(tmp_path / "swap"))
    with outcore.init(cfg, frozen=True, weights="m.safetensors"):
        template = torch.nn.Linear(8, 8)
        model = torch.nn.Sequential(*[copy.deepcopy(template) for _ in range(3)])
    monkeypatch.chdir("/")
    assert not any(p.is_meta for p in model.parameters())
    engine = outcore.initialize(model, cfg)
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(engine(x.to(engine.device)).cpu(), want(x))
    assert str(managed(model[0].weight).compute_shard.path) == str(tmp_path / "m.safetensors")
    engine.close()


def test_a_second_engine_and_the_hand_back_keep_the_files_values(tmp_path: Path) -> None:
    """What users do around an engine with a base read in place: a second engine on the same
    model (its own placement), then close(keep_values=True) hands back a plain model holding
    the files' values; state_dict works at every step."""
    from safetensors.torch import load_file

    folder = _folder(tmp_path)
    want = {}
    for f in folder.glob("*.safetensors"):
        want.update(load_file(f))
    cfg = _cfg(str(tmp_path / "swap"))
    with outcore.init(cfg, frozen=True, weights=folder):
        model = transformers.AutoModelForCausalLM.from_config(_config())
    engine = outcore.initialize(model, cfg)
    x = (torch.arange(32).reshape(2, 16) % 300).to(engine.device)
    with torch.no_grad():
        first = engine(input_ids=x).logits.clone()
    engine.close()  # keeps the shards: the model stays sharded for the next engine
    engine = outcore.initialize(model, _cfg(str(tmp_path / "swap2"), params="cpu"))
    assert not any(managed(p).compute_shard.read_only for p in model.parameters())
    with torch.no_grad():
        torch.testing.assert_close(engine(input_ids=x).logits, first)
    sd = model.state_dict()
    torch.testing.assert_close(sd["model.norm.weight"].cpu(), want["model.norm.weight"].float())
    engine.close(keep_values=True)
    assert managed(model.lm_head.weight) is None  # a plain model again
    torch.testing.assert_close(model.lm_head.weight.detach().cpu(),
                               want["lm_head.weight"].float())


def test_a_tensor_in_two_files_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from outcore.zero.deferred import folder_tensors

    save_file({"w": torch.zeros(2)}, tmp_path / "a.safetensors")
    save_file({"w": torch.ones(2)}, tmp_path / "b.safetensors")
    with pytest.raises(ConfigError, match="'w' is in both a.safetensors and b.safetensors"):
        folder_tensors(tmp_path)
