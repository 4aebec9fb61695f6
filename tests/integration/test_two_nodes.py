"""Two torchrun agents on this machine acting as two nodes (``--nnodes 2``, c10d rendezvous on
localhost, two ranks each) run ``outcore train`` as on a cluster: LoRA and full training give
what one node with the same four ranks gives, and a checkpoint written at 2x2 resumes at 1x2
and at 1x1."""

from __future__ import annotations

import argparse
import inspect
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from outcore.app.report import read_metrics
from tests.common import REPO, save_tiny_llama

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

pytestmark = pytest.mark.slow
SPEC = "r=4,alpha=8,targets=q_proj,v_proj"


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama (about 109K parameters) with config.json and model.safetensors."""
    return save_tiny_llama(tmp_path_factory.mktemp("llama"), torch.bfloat16)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(Path(inspect.getsourcefile(argparse)).read_text())
    return path


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(nodes: int, per_node: int, args: list[str], cwd: Path) -> str:
    """``outcore train args`` under ``nodes`` torchrun agents of ``per_node`` ranks each; the
    agents' output, after all of them exited 0."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OUTCORE_DEVICE": "cpu",
           "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    port = _port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
           "--nproc-per-node", str(per_node), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"outcore-{port}",
           "-m", "outcore", "train", *args]
    agents = [subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for _ in range(nodes)]
    outputs = [a.communicate(timeout=300)[0] for a in agents]
    for a, out in zip(agents, outputs, strict=True):
        assert a.returncode == 0, f"{' '.join(cmd)} exited {a.returncode}:\n{out[-5000:]}"
    return "\n".join(outputs)


def _args(llama: Path, corpus: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return ["--model", str(llama), "--data", str(corpus), "--out", str(out), "--steps",
            str(steps), "--batch", "2", "--seq", "32", "--lr-schedule", "constant",
            "--dtype", "fp32", "--offload", "nvme", *extra]


@pytest.fixture(scope="module")
def lora_2x2(tmp_path_factory: pytest.TempPathFactory, llama: Path, corpus: Path) -> Path:
    """A LoRA run of 2 steps on two agents of two ranks: its --out folder."""
    out = tmp_path_factory.mktemp("runs") / "2x2"
    _torchrun(2, 2, _args(llama, corpus, out, 2, "--lora", SPEC), out.parent)
    return out


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_two_nodes_train_as_one_node_with_the_same_ranks(
        tmp_path: Path, llama: Path, corpus: Path, lora: bool, lora_2x2: Path) -> None:
    extra = ("--lora", SPEC) if lora else ()
    losses = {}
    for nodes, per_node in ((2, 2), (1, 4)):
        out = lora_2x2 if lora and nodes == 2 else tmp_path / f"{nodes}x{per_node}"
        if out != lora_2x2:
            _torchrun(nodes, per_node, _args(llama, corpus, out, 2, *extra), tmp_path)
        losses[nodes] = [r["loss"] for r in read_metrics(out / "metrics.jsonl")]
        assert len(losses[nodes]) == 2
    assert losses[2] == pytest.approx(losses[1], rel=1e-5)
    assert losses[2][-1] < losses[2][0]


def test_a_two_node_checkpoint_resumes_on_one_node_at_fewer_ranks(
        tmp_path: Path, llama: Path, corpus: Path, lora_2x2: Path) -> None:
    first = lora_2x2
    for ranks in (2, 1):
        out = tmp_path / f"1x{ranks}"
        subprocess.run(["cp", "-r", str(first), str(out)], check=True)
        (out / "adapter").exists() and subprocess.run(["rm", "-rf", str(out / "adapter")],
                                                      check=True)
        log = _torchrun(1, ranks, _args(llama, corpus, out, 3, "--lora", SPEC, "--resume"),
                        tmp_path)
        assert "resuming at step 2" in log
        records = read_metrics(out / "metrics.jsonl")
        assert [r["step"] for r in records] == [1, 2, 3]
        assert (out / "adapter" / "adapter_model.safetensors").is_file()
