"""Checkpoints as users meet them: a model that changed since the save (a buffer's shape,
the param groups' order), a save or load inside ``gathered_parameters``, a save killed
between its renames or unable to delete what it replaced, files copied in, a path under a
file, and a resume whose config sets other optimizer values than the saved run's."""

from __future__ import annotations

import json
import os
import re
import stat
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import outcore
from outcore.io import publish
from outcore.io.publish import ASIDE
from tests.distributed import run_world


class Scaled(nn.Module):
    """A linear layer and a persistent buffer of ``n`` values that enters the output."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.arange(1.0, n + 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale.mean()


def _fp32(tmp_path: Path, **optimizer: object) -> dict:
    return {"dtype": "fp32", "optimizer": {"lr": 1e-2, **optimizer},
            "offload": {"nvme_path": str(tmp_path / "swap")}}


def _trained(tmp_path: Path, model: nn.Module, **optimizer: object) -> outcore.Engine:
    engine = outcore.initialize(model, _fp32(tmp_path, **optimizer))
    engine.backward(model(torch.ones(2, 4)).sum())
    engine.step()
    return engine


@pytest.mark.parametrize("saved,loaded", [(1, 4), (4, 8)])
def test_a_buffer_of_another_shape_is_refused_before_anything_loads(
        tmp_path: Path, saved: int, loaded: int) -> None:
    """A saved buffer of 1 value was broadcast into a model's 4 without a word; one of 4 into
    8 failed with torch's message after the weights were written."""
    torch.manual_seed(0)
    engine = _trained(tmp_path, Scaled(saved))
    engine.save_checkpoint(tmp_path / "ck")
    engine.close()
    torch.manual_seed(1)
    model = Scaled(loaded)
    engine = outcore.initialize(model, _fp32(tmp_path))
    with engine.gathered_parameters():
        before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(outcore.ConfigError, match=rf"buffer shapes differ.*scale: checkpoint "
                       rf"\[{saved}\], model \[{loaded}\].*nothing was loaded"):
        engine.load_checkpoint(tmp_path / "ck")
    with engine.gathered_parameters():
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert engine.global_steps == 0
    engine.close()


def _grouped(tmp_path: Path, reverse: bool) -> tuple[nn.Module, outcore.Engine]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 1))
    groups = [{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.ndim < 2], "lr": 1e-4,
               "weight_decay": 0.0}]
    engine = outcore.initialize(model, _fp32(tmp_path),
                                param_groups=groups[::-1] if reverse else groups)
    return model, engine


def test_param_groups_built_in_another_order_are_refused(tmp_path: Path) -> None:
    """Matched by position, the biases' group took the weights' learning rate and weight
    decay without a word (torch's own load refuses this)."""
    _, engine = _grouped(tmp_path, reverse=False)
    engine.save_checkpoint(tmp_path / "ck")
    engine.close()
    _, engine = _grouped(tmp_path, reverse=True)
    hps = [dict(g) for g in engine.param_groups]
    with pytest.raises(outcore.ConfigError, match=r"param group 0 holds other parameters"):
        engine.load_checkpoint(tmp_path / "ck")
    assert [g["lr"] for g in engine.param_groups] == [g["lr"] for g in hps]
    engine.close()
    _, engine = _grouped(tmp_path, reverse=False)  # the same groups load
    engine.load_checkpoint(tmp_path / "ck")
    assert [g["weight_decay"] for g in engine.param_groups] == [0.1, 0.0]
    engine.close()


@pytest.mark.parametrize("frozen_at", ["save", "load"])
def test_a_parameter_frozen_or_unfrozen_since_the_save_loads(tmp_path: Path,
                                                            frozen_at: str) -> None:
    """The groups hold trainable parameters only, so the layer norm frozen on one side was in
    one side's group and no group of the other's: that load was refused as groups built in
    another order. Its weights load as saved either way."""
    def grouped(frozen: bool, reverse: bool = False) -> tuple[nn.Module, outcore.Engine]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 1))
        model[1].requires_grad_(not frozen)
        train = [p for p in model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in train if p.ndim >= 2], "weight_decay": 0.1},
                  {"params": [p for p in train if p.ndim < 2], "lr": 1e-4}]
        return model, outcore.initialize(model, _fp32(tmp_path),
                                         param_groups=groups[::-1] if reverse else groups)

    model, engine = grouped(frozen=frozen_at == "save")
    engine.backward(model(torch.ones(2, 8)).sum())
    engine.step()
    with engine.gathered_parameters():
        saved = {k: v.clone() for k, v in model.state_dict().items()}
    engine.save_checkpoint(tmp_path / "ck")
    engine.close()
    model, engine = grouped(frozen=frozen_at == "load")
    engine.load_checkpoint(tmp_path / "ck")
    with engine.gathered_parameters():
        assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    assert [g["weight_decay"] for g in engine.param_groups] == [0.1, 0.0]
    engine.close()
    _, engine = grouped(frozen=frozen_at == "load", reverse=True)  # still refused
    with pytest.raises(outcore.ConfigError, match=r"param group 0 holds other parameters"):
        engine.load_checkpoint(tmp_path / "ck")
    engine.close()


@pytest.mark.parametrize("call", ["save", "load"])
def test_save_and_load_inside_gathered_parameters_are_refused(tmp_path: Path,
                                                              call: str) -> None:
    """Inside ``gathered_parameters(modify=True)`` a load's weights were overwritten by the
    context's on exit, and a save missed the context's edits."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    engine = outcore.initialize(model, _fp32(tmp_path))
    engine.save_checkpoint(tmp_path / "ck")
    with engine.gathered_parameters(modify=True):
        with torch.no_grad():
            model.weight.fill_(7.0)
        with pytest.raises(outcore.ParamAccessError, match=rf"{call}_checkpoint\(\) inside "
                           "gathered_parameters"):
            if call == "save":
                engine.save_checkpoint(tmp_path / "other")
            else:
                engine.load_checkpoint(tmp_path / "ck")
    assert not (tmp_path / "other").exists() and not (tmp_path / "other.partial").exists()
    assert float(model.weight.detach()[0, 0]) == 7.0  # the context's edit, kept
    engine.close()


def _steps(folder: Path) -> int:
    return json.loads((folder / "manifest.json").read_text())["global_steps"]


def test_a_save_killed_between_its_renames_leaves_the_old_checkpoint_found(
        tmp_path: Path) -> None:
    """Killed after moving the old checkpoint aside and before the new one took its place,
    a save left no folder at the path: ``latest_checkpoint`` passed the aside one over (a
    resume started from scratch), and nothing ever deleted it."""
    torch.manual_seed(0)
    engine = _trained(tmp_path, nn.Linear(4, 4))
    root = tmp_path / "ckpts"
    engine.save_checkpoint(root / "latest")
    aside = root / f"latest{ASIDE}0000dead"
    os.replace(root / "latest", aside)  # the state the kill left
    assert outcore.latest_checkpoint(root) == aside
    client = engine.load_checkpoint(aside)  # whole, and loadable where it is
    assert client == {}
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    engine.save_checkpoint(root / "latest")  # puts it back first, then replaces it
    assert sorted(p.name for p in root.iterdir()) == [".outcore-lock", "latest"]
    assert _steps(root / "latest") == 2 and outcore.latest_checkpoint(root) == root / "latest"

    # killed after both renames, before the old one was deleted: the next save deletes it
    os.mkdir(aside)
    for f in (root / "latest").iterdir():
        (aside / f.name).write_bytes(f.read_bytes())
    assert outcore.latest_checkpoint(root) == root / "latest"  # the published one wins
    engine.save_checkpoint(root / "latest")
    assert sorted(p.name for p in root.iterdir()) == [".outcore-lock", "latest"]
    engine.close()


def test_an_old_checkpoint_that_cannot_be_moved_back_is_not_called_deletable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where putting back the only complete copy a kill left aside failed, the warning
    called it "an older copy" and said to delete it by hand."""
    torch.manual_seed(0)
    engine = _trained(tmp_path, nn.Linear(4, 4))
    engine.save_checkpoint(tmp_path / "latest")
    aside = tmp_path / f"latest{ASIDE}0000dead"
    os.replace(tmp_path / "latest", aside)  # the state a kill between the renames left
    real = os.replace

    def denied(src: object, dst: object) -> None:
        if Path(src) == aside:
            raise PermissionError(13, "Permission denied")
        real(src, dst)

    monkeypatch.setattr(publish.os, "replace", denied)
    with pytest.warns(UserWarning, match=r"left .*latest\.replaced-0000dead, the only complete "
                      r"copy of latest .*moving it back failed \(Permission denied\): move it "
                      r"to .*latest by hand"):
        engine.save_checkpoint(tmp_path / "latest")
    assert _steps(aside) == 1 and _steps(tmp_path / "latest") == 1
    engine.close()


def test_an_unreadable_copy_aside_is_a_warning_and_the_save_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy aside that cannot be read (another user's) made every save into the path fail,
    in a message that named neither it nor why."""
    torch.manual_seed(0)
    engine = _trained(tmp_path, nn.Linear(4, 4))
    aside = tmp_path / f"latest{ASIDE}0000dead"
    aside.mkdir()
    real = Path.is_file

    def denied(self: Path) -> bool:
        if self.parent == aside:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "is_file", denied)
    with pytest.warns(UserWarning, match=r"left .*latest\.replaced-0000dead, a copy of latest "
                      r"set aside by an earlier save, which could not be read \(Permission "
                      r"denied\)"):
        path = engine.save_checkpoint(tmp_path / "latest")
    assert _steps(path) == 1 and aside.is_dir()
    engine.close()


def test_a_replaced_checkpoint_that_cannot_be_deleted_is_a_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a read-only folder the new checkpoint was published, yet the save raised
    "failed" and left the old copy aside without saying where."""
    torch.manual_seed(0)
    engine = _trained(tmp_path, nn.Linear(4, 4))
    engine.save_checkpoint(tmp_path / "ck", {"v": 1})

    def denied(folder: Path, extra: object = ()) -> None:
        raise PermissionError(13, "Permission denied", str(folder / "manifest.json"))

    monkeypatch.setattr(publish, "remove_ours", denied)
    with pytest.warns(UserWarning, match=r"saved .*ck; the checkpoint it replaced is left at "
                      r".*ck\.replaced-.*Permission denied"):
        path = engine.save_checkpoint(tmp_path / "ck", {"v": 2})
    assert path == tmp_path / "ck"
    assert json.loads((path / "manifest.json").read_text())["client_state"] == {"v": 2}
    # the next save meets the copy it could not delete: that stopped every later save
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        engine.save_checkpoint(tmp_path / "ck", {"v": 3})
    first, second = (str(w.message) for w in said)  # the older copy, then the one replaced
    assert re.fullmatch(r"left .*ck\.replaced-\w+, an older copy of ck that could not be "
                        r"deleted \(Permission denied\); delete it by hand", first), first
    assert second.startswith(f"saved {path}; the checkpoint it replaced is left at"), second
    assert json.loads((path / "manifest.json").read_text())["client_state"] == {"v": 3}
    engine.close()


def test_files_copied_into_a_checkpoint_are_its_own_and_a_users_are_kept(
        tmp_path: Path) -> None:
    """A ``config.json`` a user put into a checkpoint folder was deleted by the next save
    there (outcore took every ``config.json`` for its own); one passed as ``files=`` is the
    checkpoint's, replaced with it and put beside consolidated weights."""
    torch.manual_seed(0)
    engine = _trained(tmp_path, nn.Linear(4, 4))
    (tmp_path / "config.json").write_text('{"model_type": "mine"}')
    path = engine.save_checkpoint(tmp_path / "ck", files={"config.json": tmp_path /
                                                           "config.json"})
    assert (path / "config.json").read_text() == '{"model_type": "mine"}'
    out = outcore.consolidate(path, tmp_path / "full")
    assert (out.parent / "config.json").read_text() == '{"model_type": "mine"}'
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing of someone else's is left aside
        engine.save_checkpoint(tmp_path / "ck")  # replaced with the checkpoint
    assert not (path / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ck")) == ["ck"]

    (path / "config.json").write_text('{"model_type": "user"}')  # the user's own
    with pytest.warns(UserWarning, match="holds files outcore did not write"):
        engine.save_checkpoint(tmp_path / "ck")
    aside = [p for p in tmp_path.iterdir() if ASIDE in p.name]
    assert [p.name for p in aside[0].iterdir()] == ["config.json"]

    for bad in ("manifest.json", "rank00000-of-00001.safetensors", "a/b", "", "a\0b"):
        with pytest.raises(outcore.ConfigError, match="is not a file name a checkpoint"):
            engine.save_checkpoint(tmp_path / "ck2", files={bad: tmp_path / "config.json"})
    with pytest.raises(outcore.ConfigError, match="names .*missing.json, which is not a file"):
        engine.save_checkpoint(tmp_path / "ck2", files={"x.json": tmp_path / "missing.json"})
    with pytest.raises(outcore.ConfigError, match="names 'a\\\\x00b', which is not a path"):
        engine.save_checkpoint(tmp_path / "ck2", files={"x.json": "a\0b"})
    assert not (tmp_path / "ck2").exists() and not (tmp_path / "ck2.partial").exists()
    engine.close()


class _BytesPath:
    """A path object whose ``__fspath__`` gives bytes, as ``open`` allows."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __fspath__(self) -> bytes:
        return os.fsencode(self.path)


def test_files_named_by_bytes_paths_are_copied(tmp_path: Path) -> None:
    """``open`` takes bytes and a path object giving bytes; ``files=`` refused the first as
    "not a path" and raised a bare ``TypeError`` on the second."""
    torch.manual_seed(0)
    engine = _trained(tmp_path, nn.Linear(4, 4))
    (tmp_path / "a.json").write_text("a")
    (tmp_path / "b.json").write_text("b")
    path = engine.save_checkpoint(tmp_path / "ck", files={
        "a.json": os.fsencode(tmp_path / "a.json"), "b.json": _BytesPath(tmp_path / "b.json")})
    assert ((path / "a.json").read_text(), (path / "b.json").read_text()) == ("a", "b")
    with pytest.raises(outcore.ConfigError, match="names b'a\\\\x00b', which is not a path"):
        engine.save_checkpoint(tmp_path / "ck2", files={"x.json": b"a\0b"})
    engine.close()


def test_group_values_numpy_or_tensors_are_saved_and_loaded(tmp_path: Path) -> None:
    """A NumPy ``float32`` learning rate or weight decay (which ``json.dumps`` refuses), or a
    tensor one (which torch takes), was left out of the manifest: a load then kept the
    loading engine's values without a word. A tensor learning rate loaded stays a tensor."""
    np = pytest.importorskip("numpy")
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    engine = outcore.initialize(model, _fp32(tmp_path), param_groups=[
        {"params": [model.weight], "lr": np.float32(0.05), "weight_decay": np.float32(0.1)},
        {"params": [model.bias], "lr": torch.tensor(0.02), "weight_decay": np.float64(0.3)}])
    engine.backward(model(torch.ones(2, 4)).sum())
    engine.step()
    engine.save_checkpoint(tmp_path / "ck")
    engine.close()
    saved = json.loads((tmp_path / "ck" / "manifest.json").read_text())["param_groups"]
    assert [v for g in saved for v in (g["lr"], g["weight_decay"])] == pytest.approx(
        [0.05, 0.1, 0.02, 0.3])
    assert not any("params" in g for g in saved)  # the members are not values
    model = nn.Linear(4, 1)
    engine = outcore.initialize(model, _fp32(tmp_path), param_groups=[
        {"params": [model.weight]}, {"params": [model.bias], "lr": torch.tensor(1e-3)}])
    engine.load_checkpoint(tmp_path / "ck")
    assert isinstance(engine.param_groups[1]["lr"], torch.Tensor)  # a tensor still
    assert [float(v) for g in engine.param_groups for v in (g["lr"], g["weight_decay"])] == (
        pytest.approx([0.05, 0.1, 0.02, 0.3]))
    engine.close()


def test_groups_sharing_one_tensor_lr_each_load_their_own(tmp_path: Path) -> None:
    """torch gives every group of ``AdamW(groups, lr=torch.tensor(...))`` the same tensor;
    a load filled it in place group by group, so every group got the last group's rate. A
    tensor of several values came back a list; a NumPy bool was left out of the manifest."""
    np = pytest.importorskip("numpy")
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    engine = outcore.initialize(model, _fp32(tmp_path), param_groups=[
        {"params": [model.weight], "lr": 0.05, "max_lr": torch.tensor([0.1, 0.2])},
        {"params": [model.bias], "lr": 0.002, "weight_decay": 0.0}])
    engine.backward(model(torch.ones(2, 4)).sum())
    engine.step()
    engine.save_checkpoint(tmp_path / "ck")
    engine.close()
    model = nn.Linear(4, 1)
    opt = torch.optim.AdamW([{"params": [model.weight], "max_lr": torch.tensor([1.0, 1.0])},
                             {"params": [model.bias], "weight_decay": 0.0}],
                            lr=torch.tensor(0.01))
    assert opt.param_groups[0]["lr"] is opt.param_groups[1]["lr"]
    engine = outcore.initialize(model, _fp32(tmp_path), optimizer=opt)
    with pytest.warns(UserWarning, match="optimizer settings replace"):
        engine.load_checkpoint(tmp_path / "ck")
    lrs = [g["lr"] for g in engine.param_groups]
    assert all(isinstance(lr, torch.Tensor) for lr in lrs)
    assert [float(lr) for lr in lrs] == pytest.approx([0.05, 0.002])
    max_lr = engine.param_groups[0]["max_lr"]
    assert isinstance(max_lr, torch.Tensor) and max_lr.tolist() == pytest.approx([0.1, 0.2])
    engine.close()

    model = nn.Linear(4, 1)
    sgd = {**_fp32(tmp_path), "optimizer": {"type": "sgd", "lr": 1e-2, "momentum": 0.9}}
    engine = outcore.initialize(model, sgd, param_groups=[
        {"params": list(model.parameters()), "nesterov": np.bool_(True)}])
    engine.save_checkpoint(tmp_path / "sgd")
    engine.close()
    saved = json.loads((tmp_path / "sgd" / "manifest.json").read_text())["param_groups"]
    assert saved[0]["nesterov"] is True


def test_a_checkpoint_path_under_a_file_is_a_storage_error(tmp_path: Path) -> None:
    torch.manual_seed(0)
    engine = _trained(tmp_path, nn.Linear(4, 4))
    (tmp_path / "afile").write_text("x")
    with pytest.raises(outcore.StorageError, match=r"afile is a file, not a folder"):
        engine.save_checkpoint(tmp_path / "afile" / "ck")
    engine.close()


def test_a_resume_with_other_optimizer_values_says_the_checkpoints_win(
        tmp_path: Path) -> None:
    torch.manual_seed(0)
    engine = _trained(tmp_path, nn.Linear(4, 4), weight_decay=0.0)
    engine.save_checkpoint(tmp_path / "ck")
    engine.close()
    engine = outcore.initialize(nn.Linear(4, 4), _fp32(tmp_path, lr=5e-4, weight_decay=0.1))
    with pytest.warns(UserWarning, match=r"the checkpoint's optimizer settings replace this "
                      r"engine's config \(lr 0.0005 -> 0.01, weight_decay 0.1 -> 0.0\)"):
        engine.load_checkpoint(tmp_path / "ck")
    assert (engine.param_groups[0]["lr"], engine.param_groups[0]["weight_decay"]) == (1e-2, 0.0)
    engine.close()
    engine = outcore.initialize(nn.Linear(4, 4), _fp32(tmp_path, weight_decay=0.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same settings: no word
        engine.load_checkpoint(tmp_path / "ck")
    engine.close()
    engine = outcore.initialize(nn.Linear(4, 4), _fp32(tmp_path, lr=5e-4, weight_decay=0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # kept on purpose: no word
        engine.load_checkpoint(tmp_path / "ck", keep_settings=True)
    assert (engine.param_groups[0]["lr"], engine.param_groups[0]["weight_decay"]) == (5e-4, 0.1)
    assert engine.global_steps == 1
    engine.close()


def _client_state_on_one_rank(root: str) -> str:
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    engine = outcore.initialize(model, {"dtype": "fp32"})
    try:
        engine.save_checkpoint(Path(root) / "ck", {"when": object() if rank == 1 else 1})
        said = "saved"
    except outcore.OutcoreError as e:
        said = f"{type(e).__name__}: {e}"
    engine.close()
    return said


def test_a_client_state_refused_on_one_rank_is_refused_on_every_rank(tmp_path: Path) -> None:
    """Rank 1's client_state held what cannot be stored: it raised at once, and rank 0 waited
    in the save's first collective for a rank that never came, then failed with a CommError."""
    zero, one = run_world(_client_state_on_one_rank, 2, str(tmp_path))
    assert one.startswith("ConfigError: client_state['when'] (object) cannot be stored"), one
    assert zero.startswith("ConfigError: save_checkpoint() was refused on another rank"), zero
    assert not (tmp_path / "ck").exists() and not (tmp_path / "ck.partial").exists()


def test_consolidating_where_nothing_can_be_written_is_a_storage_error(tmp_path: Path) -> None:
    """``outcore consolidate`` into /proc, or under a file, ended in a traceback."""
    torch.manual_seed(0)
    engine = _trained(tmp_path, nn.Linear(4, 4))
    path = engine.save_checkpoint(tmp_path / "ck")
    engine.close()
    (tmp_path / "afile").write_text("x")
    with pytest.raises(outcore.StorageError, match=r"cannot write .*afile/w.safetensors: "
                       r".*afile is a file, not a folder"):
        outcore.consolidate(path, tmp_path / "afile" / "w.safetensors")
    with pytest.raises(outcore.StorageError, match=r"cannot write /proc/outcore-w.safetensors"):
        outcore.consolidate(path, "/proc/outcore-w.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "ck"]


def test_checkpoints_and_consolidated_weights_follow_the_umask(tmp_path: Path) -> None:
    """Found by a user-style probe: checkpoint folders were 0700 and their files, and the
    consolidated weights meant for sharing, 0600, whatever the umask (the swap files stay
    private: they are scratch)."""
    old = os.umask(0o022)
    try:
        torch.manual_seed(0)
        engine = outcore.initialize(nn.Linear(4, 4), {"dtype": "fp32"})
        path = engine.save_checkpoint(tmp_path / "ck")
        engine.close()
        out = outcore.consolidate(path, tmp_path / "w.safetensors")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o755
    for f in [*path.iterdir(), out]:
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f
