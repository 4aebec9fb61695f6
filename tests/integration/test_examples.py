"""Every script in ``examples/`` runs as a user would run it, in its ``--tiny`` form.

Each example is a separate process started the way its docstring says (``python script`` or
``torchrun``), from a scratch working folder, importing the outcore of this checkout. The
scripts end with one ``RESULT {json}`` line; the tests check behaviour from it and from the
files left behind: the loss fell, the saved model or adapter loads and is better than what
it started from, swap files are gone, and a DeepSpeed config's ``"auto"`` values were
filled by the Trainer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def run_example(script: str, *args: str, cwd: Path, ranks: int = 0,
                timeout: float = 180) -> tuple[dict[str, Any], str]:
    """Run ``examples/<script> --tiny args`` (under torchrun with ``ranks`` ranks when given)
    and return its ``RESULT`` record and its whole output.

    The child imports this checkout's outcore (PYTHONPATH), and computes on the suite's
    device (tests/conftest.py's switch) at one rank; a torchrun world is gloo on the CPU.
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    env.pop("OUTCORE_EXAMPLE_TINY", None)
    if ranks or env.get("OUTCORE_DEVICE", "cpu") != "cuda":
        env.update(OUTCORE_DEVICE="cpu", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable]
    if ranks:
        cmd += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    cmd += [str(EXAMPLES / script), "--tiny", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{output[-6000:]}"
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(results) == 1, f"expected one RESULT line (rank 0 only):\n{output[-6000:]}"
    return json.loads(results[0].removeprefix("RESULT ")), output


def swap_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.swap"))


def assert_learned(result: dict[str, Any], factor: float) -> None:
    """The mean loss of the last fifth of the steps is at most ``factor`` of the first's."""
    assert result["last_loss"] < factor * result["first_loss"], result


@pytest.mark.parametrize("ranks", [2, 0], ids=["torchrun-2-ranks", "one-process"])
def test_plain_loop_trains_with_state_on_nvme(tmp_path: Path, ranks: int) -> None:
    swap = tmp_path / "swap"
    result, _ = run_example("plain_loop.py", "--nvme-path", str(swap), cwd=tmp_path,
                            ranks=ranks)
    assert result["world_size"] == max(ranks, 1)
    assert_learned(result, 0.8)
    assert result["bytes_nvme"] > 0, "parameters and optimizer state live on NVMe"
    assert swap.is_dir() and not swap_files(swap), "close() deletes every rank's swap file"


def test_larger_than_memory_keeps_every_state_on_nvme(tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    result, _ = run_example("larger_than_memory.py", "--nvme-path", str(swap), cwd=tmp_path)
    assert_learned(result, 0.8)
    # 16-bit (or fp32) weights + fp32 masters + two AdamW moments: at least 12 bytes a
    # parameter in the swap file, nothing of it in memory
    assert result["bytes_nvme"] >= 12 * result["params"], result
    assert not swap_files(swap)


def test_hf_trainer_full_saves_a_model_that_loads_and_has_learned(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    result, _ = run_example("hf_trainer_full.py", "--out", str(tmp_path / "run"),
                            "--nvme-path", str(tmp_path / "swap"), cwd=tmp_path)
    assert_learned(result, 0.7)
    assert {"config.json", "model.safetensors"} <= set(result["saved"])
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    # the reloaded model (from_pretrained in the script) scores like the trained one, far
    # below the random model's first losses
    assert result["reloaded_loss"] < 0.7 * result["first_loss"], result
    assert not swap_files(tmp_path / "swap")


def test_hf_trainer_lora_adapter_loads_with_peft_and_helps(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    pytest.importorskip("accelerate")
    result, _ = run_example("hf_trainer_lora.py", "--out", str(tmp_path / "run"),
                            "--nvme-path", str(tmp_path / "swap"), cwd=tmp_path)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(result["saved"])
    assert not (tmp_path / "run" / "adapter" / "model.safetensors").exists(), \
        "a PEFT model saves its adapter, not the base"
    # PeftModel.from_pretrained(base, adapter) in the script: the adapter lowers the loss
    assert result["adapter_loss"] < result["base_loss"] - 0.1, result
    assert_learned(result, 0.95)
    assert not swap_files(tmp_path / "swap")


@pytest.fixture(scope="module")
def deepspeed_trainer_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, Path]:
    """from_deepspeed.py with OutcoreTrainer, once for the tests below."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    cwd = tmp_path_factory.mktemp("from_deepspeed")
    result, output = run_example("from_deepspeed.py", "--out", str(cwd / "run"), cwd=cwd)
    return result, output, cwd


def test_deepspeed_config_with_auto_values_drives_the_trainer(
        deepspeed_trainer_run: tuple[dict, str, Path]) -> None:
    result, output, cwd = deepspeed_trainer_run
    assert_learned(result, 0.7)
    # The config's WarmupLR scheduler, its "auto"s from TrainingArguments (learning_rate
    # 1e-2, warmup_steps 4): from 0 up to the peak, then flat, where the Trainer's own
    # default schedule would have decayed linearly
    lrs = result["learning_rates"]
    assert lrs[0] == 0.0 and lrs[-1] == pytest.approx(1e-2), lrs
    assert lrs[:5] == sorted(lrs[:5]) and all(lr == pytest.approx(1e-2) for lr in lrs[4:]), lrs
    # the file's NVMe offload, at its relative nvme_path, used and cleaned up
    assert (cwd / "nvme-swap").is_dir() and not swap_files(cwd / "nvme-swap")
    assert (cwd / "run" / "final" / "model.safetensors").is_file()
    # keys without meaning in outcore are named once, with their reasons
    assert "zero_optimization.sub_group_size: " in output


def test_deepspeed_auto_prefetch_bucket_holds_a_layer(
        deepspeed_trainer_run: tuple[dict, str, Path]) -> None:
    _, output, _ = deepspeed_trainer_run
    assert "such groups are fetched on demand" not in output


def test_deepspeed_config_in_a_plain_loop(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    result, output = run_example("from_deepspeed.py", "--loop", cwd=tmp_path)
    assert result["mode"] == "loop"
    assert_learned(result, 0.9)
    assert result["learning_rates"] == [pytest.approx(1e-2)], "the script's override of 'auto'"
    assert "optimizer.params.lr: \"auto\" outside the Trainer" in output
    assert (tmp_path / "nvme-swap").is_dir() and not swap_files(tmp_path / "nvme-swap")
