"""Checkpoints: exact resume, resharding to other world sizes, consolidation, crashes, corruption.

The model is test_parity's Quirky (tied weights, a block skipped on odd steps so parameters
have different step counts, two param groups) plus buffers that change every forward and
enter the loss, so a resume that forgot a buffer, an optimizer step count or the RNG shows up
as a different loss. The global batch is the same at every world size, split across ranks.
"""

from __future__ import annotations

import errno
import json
import pickle
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

import outcore
from outcore.io import checkpoint
from outcore.io.safetensors_stream import StreamWriter, TensorSpec
from tests.common import BASE, DIM, GLOBAL_BATCH, SEQ, VOCAB, Buffered, Quirky  # noqa: F401
from tests.common import checkpoint_batch as _batch
from tests.common import checkpoint_engine as _engine
from tests.common import max_rel as _max_rel
from tests.common import train_steps as _train
from tests.common import weights_of as _weights
from tests.distributed import run_world


class Renamed(Buffered):
    """A different model: ``gate`` is called ``gate2`` here."""

    def __init__(self) -> None:
        super().__init__()
        self.gate2 = self.gate
        del self.gate


# -- functions run on every rank ---------------------------------------------------------------
def _save_then_resume(cfg: dict, root: str) -> dict:
    """Train 3 steps, save, train 2 more; then a fresh engine loads and trains the same 2."""
    model, eng = _engine(cfg, 0)
    torch.manual_seed(100 + eng.rank)  # each rank's RNG differs: each file keeps its own
    eng.param_groups[0]["lr"] = 2e-3  # as a schedule would: the checkpoint must keep it
    _train(eng, range(3))
    eng.save_checkpoint(Path(root) / "step-3", {"step": 3, "note": ["json", 1.5]})
    probe = torch.rand(4)
    w3 = _weights(eng, model)
    losses = _train(eng, range(3, 5))
    w5 = _weights(eng, model)
    eng.close()
    torch.manual_seed(123)
    model, eng = _engine(cfg, 1)
    client = eng.load_checkpoint(Path(root) / "step-3")
    out = {"client": client, "probe2": torch.rand(4), "w3b": _weights(eng, model)}
    out.update(losses2=_train(eng, range(3, 5)), w5b=_weights(eng, model), probe=probe, w3=w3,
               losses=losses, w5=w5)
    eng.close()
    return out


def _load_and_continue(cfg: dict, ckpt: str) -> dict:
    model, eng = _engine(cfg, 1)
    client = eng.load_checkpoint(ckpt)
    out = {"client": client, "w3": _weights(eng, model), "losses": _train(eng, range(3, 5)),
           "w5": _weights(eng, model)}
    eng.close()
    return out


def _crash_during_save(cfg: dict, root: str) -> None:
    """Save step 1, then die (on rank 0) right after writing the first rank file of step 2."""
    model, eng = _engine(cfg, 0)
    _train(eng, range(1))
    eng.save_checkpoint(Path(root) / "step-1", {"step": 1})
    _train(eng, range(1, 2))
    original = checkpoint._write_rank_file

    def dying(engine, folder):
        info = original(engine, folder)
        if engine.rank == 0:
            raise RuntimeError("simulated crash after the first rank file")
        return info

    checkpoint._write_rank_file = dying
    eng.save_checkpoint(Path(root) / "step-2", {"step": 2})


def _nvme_round_trip(cfg_a: dict, cfg_b: dict, root: str) -> dict:
    model, eng = _engine(cfg_a, 0, freeze=True)
    _train(eng, range(2))
    eng.save_checkpoint(Path(root) / "ckpt", {})
    w2 = _weights(eng, model)
    losses = _train(eng, range(2, 4))
    eng.close()
    model, eng = _engine(cfg_b, 1, freeze=True)
    eng.load_checkpoint(Path(root) / "ckpt")
    out = {"w2": w2, "w2b": _weights(eng, model), "losses": losses,
           "losses2": _train(eng, range(2, 4))}
    eng.close()
    return out


# -- tests -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("ckpt")
    return root / "step-3", run_world(_save_then_resume, 2, BASE, str(root))


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(torch.as_tensor(a[name]).cpu(), torch.as_tensor(b[name]).cpu()), name


def test_resume_at_same_world_size_is_exact(saved) -> None:
    ckpt, results = saved
    for r in results:
        assert r["client"] == {"step": 3, "note": ["json", 1.5]}
        assert r["losses2"] == r["losses"]  # identical fp32 losses, not merely close
        _equal(r["w3b"], r["w3"])
        _equal(r["w5b"], r["w5"])
        assert (r["probe2"] == r["probe"]).all(), "RNG state not restored"
    assert results[0]["probe"].tolist() != results[1]["probe"].tolist()  # per-rank RNG
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == ["manifest.json", "rank00000-of-00002.safetensors",
                     "rank00001-of-00002.safetensors"]
    # Format correctness: the reference safetensors reader loads our streamed files.
    rank0 = safetensors.torch.load_file(ckpt / names[1])
    assert {"emb.weight::master", "emb.weight::exp_avg", "__rng__::torch_cpu",
            "__buffer__::shift", "__buffer__::count"} <= rank0.keys()
    assert rank0["emb.weight::master"].numel() == VOCAB * DIM // 2
    assert "__buffer__::count" not in safetensors.torch.load_file(ckpt / names[2])


@pytest.mark.parametrize("world", [1, 4])
def test_resume_at_another_world_size(saved, world: int) -> None:
    ckpt, results = saved
    base = results[0]
    if world == 1:
        got = [_load_and_continue(BASE, str(ckpt))]
    else:
        got = run_world(_load_and_continue, world, BASE, str(ckpt))
    for r in got:
        assert r["client"]["step"] == 3
        _equal(r["w3"], base["w3"])  # re-cutting the shards is exact
        for a, b in zip(r["losses"], base["losses"], strict=True):
            assert abs(a - b) <= 1e-6 * abs(b), (r["losses"], base["losses"])
        for name, w in base["w5"].items():
            assert _max_rel(r["w5"][name], w) <= 1e-5, name


def _forbid_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("pickle was used")

    for mod, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"),
                      (torch, "load")):
        monkeypatch.setattr(mod, name, refuse)


def test_consolidate_loads_strictly_into_a_plain_model(saved, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = shutil.copytree(saved[0], tmp_path / "ckpt")
    (ckpt / "config.json").write_text('{"model_type": "quirky"}')
    _forbid_pickle(monkeypatch)
    out = outcore.consolidate(ckpt, tmp_path / "hf" / "model.safetensors")
    assert out == tmp_path / "hf" / "model.safetensors"
    assert (tmp_path / "hf" / "config.json").read_text() == '{"model_type": "quirky"}'
    state = safetensors.torch.load_file(out)
    assert torch.equal(state["head.weight"], state["emb.weight"])  # tied: two copies
    _equal({n: state[n] for n in saved[1][0]["w3"]}, saved[1][0]["w3"])
    plain = Buffered()
    plain.load_state_dict(state, strict=True)
    # a new name is a folder, as `outcore consolidate CKPT final` means it: it used to be
    # written as a file named final, with config.json beside it in the working folder
    for name in ("final", "weights.v2"):
        assert outcore.consolidate(ckpt, tmp_path / name) == tmp_path / name / "model.safetensors"
        assert (tmp_path / name / "config.json").is_file()
    (tmp_path / "mine.bin").write_bytes(b"old")  # an existing file is the file, replaced
    assert outcore.consolidate(ckpt, tmp_path / "mine.bin") == tmp_path / "mine.bin"
    assert safetensors.torch.load_file(tmp_path / "mine.bin").keys() == state.keys()
    model, eng = _engine(BASE, 1)
    eng.load_checkpoint(ckpt)
    plain.to(eng.device)
    x, y = (t.to(eng.device) for t in _batch(7, 0, 1))
    with torch.no_grad():
        assert torch.allclose(eng(x, y), plain(x, y), rtol=1e-6, atol=0)
    eng.close()


def test_crash_mid_save_leaves_previous_checkpoint_as_latest(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="simulated crash"):
        run_world(_crash_during_save, 2, BASE, str(tmp_path))
    partial = tmp_path / "step-2.partial"
    assert (partial / "rank00000-of-00002.safetensors").exists()
    assert not (partial / "manifest.json").exists() and not (tmp_path / "step-2").exists()
    assert outcore.latest_checkpoint(tmp_path) == tmp_path / "step-1"
    model, eng = _engine(BASE, 1)
    assert eng.load_checkpoint(outcore.latest_checkpoint(tmp_path)) == {"step": 1}
    _train(eng, range(1, 2))
    eng.save_checkpoint(tmp_path / "step-2", {"step": 2})  # clears the stale .partial
    eng.save_checkpoint(tmp_path / "step-2", {"step": 2, "again": True})  # replaces it
    eng.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-2"]
    assert outcore.latest_checkpoint(tmp_path) == tmp_path / "step-2"
    assert json.loads((tmp_path / "step-2" / "manifest.json").read_text())["client_state"] == {
        "step": 2, "again": True}
    assert outcore.latest_checkpoint(tmp_path / "missing") is None


def _corrupt(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        del data[-100:]
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("victim", "how"), [("rank00001-of-00002.safetensors", "flip"),
                                             ("rank00000-of-00002.safetensors", "truncate")])
def test_corrupt_or_truncated_file_is_refused(saved, tmp_path: Path, victim: str,
                                              how: str) -> None:
    ckpt = shutil.copytree(saved[0], tmp_path / "ckpt")
    _corrupt(ckpt / victim, how)
    model, eng = _engine(BASE, 1)
    before = _weights(eng, model)
    with pytest.raises(outcore.StorageError, match=victim):
        eng.load_checkpoint(ckpt)
    _equal(_weights(eng, model), before)  # nothing was half-loaded
    eng.close()
    if how == "truncate":
        assert outcore.latest_checkpoint(tmp_path) is None
    with pytest.raises(outcore.StorageError, match=victim):
        outcore.consolidate(ckpt, tmp_path / "out.safetensors")


def _load_refused(cfg: dict, ckpt: str) -> tuple[str, str, bool]:
    model, eng = _engine(cfg, 1)
    before = _weights(eng, model)
    try:
        eng.load_checkpoint(ckpt)
    except outcore.StorageError as e:
        error = (type(e).__name__, str(e))
    else:
        raise AssertionError("the load was not refused")
    unchanged = all(torch.equal(a, b) for a, b in zip(
        before.values(), _weights(eng, model).values(), strict=True))
    eng.close()
    return (*error, unchanged)


def test_every_rank_names_a_damaged_rank_file(saved, tmp_path: Path) -> None:
    """Rank 0, whose own file is sound, said only "failed on rank(s) [1]; see their errors":
    now each rank raises the damaged rank's kind of error, quoting it (agreement.py's second
    note), so ``outcore train --resume``'s advice reaches rank 0 as well."""
    ckpt = shutil.copytree(saved[0], tmp_path / "ckpt")
    _corrupt(ckpt / "rank00001-of-00002.safetensors", "flip")
    results = run_world(_load_refused, 2, BASE, str(ckpt))
    for kind, text, unchanged in results:
        assert kind == "CorruptCheckpointError", text
        assert "rank00001-of-00002.safetensors is corrupt" in text
        assert unchanged  # nothing was half-loaded on either rank
    assert results[0][1].startswith(f"checking checkpoint {ckpt} failed on rank 1: checkpoint "
                                    "file")


def _agree_on_a_bare_error(cfg: dict) -> tuple[str, str]:
    from outcore.io.agreement import agree

    model, eng = _engine(cfg, 1)
    try:
        agree(eng.rt, OSError() if eng.rank == 1 else None, "reading")
    except OSError as e:
        said = (type(e).__name__, str(e))
    eng.rt.comm.barrier()  # both ranks are still in step
    eng.close()
    return said


def test_a_failed_rank_with_no_message_still_agrees() -> None:
    """An error whose text is empty (an OSError() the load path passes on) made the failed
    rank skip the second collective, and the others waited for it until the timeout."""
    results = run_world(_agree_on_a_bare_error, 2, BASE)
    assert results[1] == ("OSError", "")
    assert results[0] == ("StorageError", "reading failed on rank 1: OSError")


def test_model_mismatch_names_the_parameters(saved) -> None:
    model, eng = _engine(BASE, 1, cls=Renamed)
    with pytest.raises(outcore.ConfigError, match=r"\['gate2\.weight', 'gate2\.bias'\].*"
                                                  r"\['gate\.bias', 'gate\.weight'\]"):
        eng.load_checkpoint(saved[0])
    eng.close()


def test_edited_manifest_is_refused(saved, tmp_path: Path) -> None:
    ckpt = shutil.copytree(saved[0], tmp_path / "ckpt")
    text = (ckpt / "manifest.json").read_text()
    (ckpt / "manifest.json").write_text(text.replace('"lr": 0.002', '"lr": 0.003', 1))
    model, eng = _engine(BASE, 1)
    with pytest.raises(outcore.StorageError, match="manifest.json is corrupt"):
        eng.load_checkpoint(ckpt)
    eng.close()
    assert outcore.latest_checkpoint(tmp_path) is None


def test_disk_full_is_a_clear_error_and_keeps_the_previous_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, eng = _engine(BASE, 0)
    eng.save_checkpoint(tmp_path / "a", {"n": 1})

    def full(self, name, tensor):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(StreamWriter, "write", full)
    with pytest.raises(outcore.StorageError,
                       match=r"b\.partial.*No space left.* free on that filesystem"):
        eng.save_checkpoint(tmp_path / "b", {"n": 2})
    with pytest.raises(outcore.StorageError, match="No space left"):
        eng.save_checkpoint(tmp_path / "a", {"n": 3})  # overwriting fails: the old one stays
    eng.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # partial folders removed
    assert outcore.latest_checkpoint(tmp_path) == tmp_path / "a"
    model, eng = _engine(BASE, 1)
    assert eng.load_checkpoint(tmp_path / "a") == {"n": 1}
    eng.close()


def test_client_state_without_a_stored_form_is_refused(tmp_path: Path) -> None:
    model, eng = _engine(BASE, 0)
    with pytest.raises(outcore.ConfigError, match=r"'sampler'\] \(Generator\)"):
        eng.save_checkpoint(tmp_path / "c", {"step": 1, "sampler": torch.Generator()})
    eng.close()
    assert list(tmp_path.iterdir()) == []


def test_scaler_and_hyperparameters_round_trip(tmp_path: Path) -> None:
    cfg = {**BASE, "dtype": "fp16"}
    model, eng = _engine(cfg, 0)
    eng.scaler.load_state_dict({"scale": 1024.0, "good_steps": 7, "skipped_steps": 2})
    eng.param_groups[1]["betas"] = (0.8, 0.9)
    eng.global_steps = 11
    eng.save_checkpoint(tmp_path / "c")
    eng.close()
    model, eng = _engine(cfg, 1)
    eng.load_checkpoint(tmp_path / "c")
    assert eng.scaler.state_dict() == {"scale": 1024.0, "good_steps": 7, "skipped_steps": 2}
    assert eng.param_groups[1]["betas"] == (0.8, 0.9) and eng.global_steps == 11
    eng.close()


def test_stream_writer_matches_the_reference_reader(tmp_path: Path) -> None:
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).bfloat16(), "empty": torch.zeros(0),
               "rng": torch.get_rng_state(), "i": torch.arange(5), "flag": torch.tensor(True)}
    specs = [TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    with StreamWriter(tmp_path / "x.safetensors", specs, {"format": "pt"}) as w:
        for k, v in tensors.items():
            w.write(k, v)
        info = w.finish()
    raw = (tmp_path / "x.safetensors").read_bytes()
    assert info.nbytes == len(raw) and (8 + int.from_bytes(raw[:8], "little")) % 8 == 0
    _equal(safetensors.torch.load_file(tmp_path / "x.safetensors"), tensors)
    with pytest.raises(ValueError, match="expected 'a'"), \
            StreamWriter(tmp_path / "y.safetensors", specs) as w:
        w.write("b", tensors["b"])
    assert list(tmp_path.iterdir()) == [tmp_path / "x.safetensors"]  # no tmp file left


def test_nvme_offloaded_state_round_trips(tmp_path: Path) -> None:
    def cfg(swap: str) -> dict:
        return {**BASE, "dtype": "bf16", "offload": {"optimizer": "nvme", "params": "nvme",
                                                     "nvme_path": str(tmp_path / swap)}}

    results = run_world(_nvme_round_trip, 2, cfg("swap-a"), cfg("swap-b"), str(tmp_path))
    for r in results:
        _equal(r["w2b"], r["w2"])  # masters, and the frozen parameter's bf16 values
        assert r["losses2"] == r["losses"]
    # the same checkpoint into memory tiers at one rank: the shards are the same numbers
    model, eng = _engine({**BASE, "dtype": "bf16"}, 1, freeze=True)
    eng.load_checkpoint(tmp_path / "ckpt")
    _equal(_weights(eng, model), results[0]["w2"])
    eng.close()


def test_no_module_imports_another_modules_private_names() -> None:
    """full_weights.py uses checkpoint.py's public ``check_file`` and safetensors_stream's
    ``DTYPES_BY_NAME``; no module of outcore reaches for another's underscore names."""
    import ast

    from outcore.io import safetensors_stream as sts

    assert all(sts.DTYPES_BY_NAME[name] is dtype for dtype, name in sts.DTYPE_NAMES.items())
    root = Path(outcore.__file__).parent
    leaks = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("outcore"):
                leaks += [f"{path.relative_to(root)}: {node.module}.{a.name}"
                          for a in node.names if a.name.startswith("_")]
    assert not leaks


@pytest.mark.parametrize("replace_folder", [False, True])
def test_saving_over_a_checkpoint_with_other_files_in_it(tmp_path: Path,
                                                          replace_folder: bool) -> None:
    """Saving over a checkpoint replaces it atomically. Files outcore did not write stay, in
    the old folder set aside with a warning, unless ``replace_folder=True`` says the caller
    owns the folder (io/checkpoint.py's [Note: replacing a folder]); a folder that is no
    checkpoint at all is refused unless the caller owns it."""
    model, engine = _engine(BASE, 0)
    path = tmp_path / "ckpt" / "step-1"
    engine.save_checkpoint(path)
    (path / "trainer_state.json").write_text("{}")  # someone else's file in it
    if replace_folder:
        engine.save_checkpoint(path, replace_folder=True)
    else:
        with pytest.warns(UserWarning, match="outcore did not write"):
            engine.save_checkpoint(path)
    aside = [p for p in path.parent.iterdir() if p.name.startswith("step-1.")]
    assert (path / checkpoint.MANIFEST).exists() and not (path / "trainer_state.json").exists()
    if replace_folder:
        assert aside == []
    else:
        assert [sorted(f.name for f in a.iterdir()) for a in aside] == [["trainer_state.json"]]
    plain = tmp_path / "ckpt" / "notes"
    plain.mkdir()
    (plain / "mine.txt").write_text("mine")
    if replace_folder:
        engine.save_checkpoint(plain, replace_folder=True)
        assert (plain / checkpoint.MANIFEST).exists() and not (plain / "mine.txt").exists()
    else:
        with pytest.raises(outcore.StorageError, match="not an outcore checkpoint"):
            engine.save_checkpoint(plain)
        assert (plain / "mine.txt").read_text() == "mine"
    engine.close()


def test_a_rank_lost_while_preparing_leaves_no_partial_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another rank dying just after rank 0 made ``<path>.partial`` (the first agreement
    raises ``CommError``) left the empty folder behind on the surviving rank."""
    model, eng = _engine(BASE, 0)
    agree = checkpoint.agree

    def peer_gone(rt, err, what, row=()):
        if what.startswith("preparing"):
            assert (tmp_path / "step-1.partial").is_dir()  # rank 0 made it
            raise outcore.CommError("rank 0/2: preparing failed; another rank probably died")
        return agree(rt, err, what, row)

    monkeypatch.setattr(checkpoint, "agree", peer_gone)
    with pytest.raises(outcore.CommError, match="another rank probably died"):
        eng.save_checkpoint(tmp_path / "step-1", {"n": 1})
    assert not (tmp_path / "step-1.partial").exists()
    eng.close()


def _save_to_own_path(cfg: dict, root: str) -> str:
    model, eng = _engine(cfg, 0)
    try:
        eng.save_checkpoint(Path(root) / f"rank{eng.rank}" / "step-1", {"n": 1})
    except outcore.ConfigError as e:
        return str(e)
    finally:
        eng.close()
    return "saved"


def test_ranks_given_different_paths_are_refused_in_words(tmp_path: Path) -> None:
    """Each rank writes into rank 0's folder: a path that differs between ranks made rank 1
    fail with 'No such file or directory' and named nothing. Now every rank refuses, naming
    its own path, and rank 0 takes its ``.partial`` folder back."""
    said = run_world(_save_to_own_path, 2, BASE, str(tmp_path))
    for rank, text in enumerate(said):
        assert "given another path on some rank" in text, text
        assert str(tmp_path / f"rank{rank}" / "step-1") in text
    assert not list(tmp_path.rglob("*.partial")) and not list(tmp_path.rglob("step-1"))
