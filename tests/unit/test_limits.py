"""Errors a process limit causes name the limit (errors.py's ``limit_hint``), and the CLI
prints memory that ran out as one line (``out_of_memory``)."""

from __future__ import annotations

import errno
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from outcore.app import cli
from outcore.errors import out_of_memory

ROOT = Path(__file__).resolve().parents[2]


def test_memory_errors_are_one_line_and_others_keep_their_traceback() -> None:
    assert "out of memory: [Errno 12] Cannot allocate memory" in out_of_memory(
        OSError(errno.ENOMEM, "Cannot allocate memory"))
    assert out_of_memory(MemoryError()).startswith("out of memory: MemoryError")
    assert out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried"))
    assert out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    for other in (RuntimeError("shapes differ"), OSError(errno.EIO, "I/O error"), ValueError()):
        assert out_of_memory(other) is None


def test_the_cli_prints_memory_that_ran_out_as_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def no_memory(args: object) -> int:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    parser = cli.build_parser()
    real = parser.parse_known_args

    def parse(argv: list[str]) -> tuple[object, list[str]]:
        args, extra = real(argv)
        args.run = no_memory
        return args, extra

    monkeypatch.setattr(cli, "build_parser", lambda *a, **k: parser)
    monkeypatch.setattr(parser, "parse_known_args", parse)
    assert cli.main(["estimate", "--params", "1B"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "outcore estimate: error: out of memory: [Errno 12] Cannot allocate memory; ")


SAVE = """
import resource, sys, torch, outcore
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
engine = outcore.initialize(torch.nn.Linear(1024, 1024), {"dtype": "fp32"})
try:
    engine.save_checkpoint(sys.argv[1])
except outcore.StorageError as e:
    print(e)
"""


@pytest.mark.skipif(resource.getrlimit(resource.RLIMIT_FSIZE)[1] != resource.RLIM_INFINITY,
                    reason="the file-size limit cannot be raised back here")
def test_a_checkpoint_over_the_file_size_limit_names_the_limit(tmp_path: Path) -> None:
    """It said "File too large (N bytes free on that filesystem)": the disk, not the limit."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(SAVE), str(tmp_path / "ck")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "File too large; the file-size limit (ulimit -f) is 1.0 MiB" in proc.stdout, (
        proc.stdout + proc.stderr)
    assert "free on that filesystem" not in proc.stdout
