"""metrics.jsonl (one line per step, truncated on resume) and the PNG report."""

from __future__ import annotations

import json
import math

import pytest

from outcore.app.report import MetricsWriter, read_metrics, write_report

_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _record(step: int) -> dict:
    return {"step": step, "loss": 5.0 / step, "tokens_per_s": 1000.0 + step, "lr": 1e-3,
            "elapsed_s": 0.1 * step, "bytes_device": 0, "bytes_host": 2**20 * step,
            "bytes_nvme": 2**22}


def test_one_flushed_line_per_step(tmp_path) -> None:
    path = tmp_path / "run" / "metrics.jsonl"
    with MetricsWriter(path) as w:
        for s in range(1, 4):
            w.write(_record(s))
            lines = path.read_text().splitlines()  # visible before close: flushed per step
            assert len(lines) == s
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert {"step", "loss", "tokens_per_s", "bytes_device", "bytes_host", "bytes_nvme",
            "elapsed_s", "lr"} <= set(records[0])


def test_resume_drops_later_steps_and_partial_lines(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path) as w:
        for s in range(1, 8):
            w.write(_record(s))
    with path.open("a") as f:
        f.write('{"step": 8, "loss": 0.')  # a run killed mid-line
    with MetricsWriter(path, resume_step=5) as w:
        assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 5]
        w.write(_record(6))
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 5, 6]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp files left


def test_fresh_run_replaces_old_metrics(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path) as w:
        w.write(_record(1))
        w.write(_record(2))
    with MetricsWriter(path) as w:
        w.write(_record(1))
    assert len(read_metrics(path)) == 1
    with pytest.raises(ValueError, match="step"), MetricsWriter(path, resume_step=1) as w:
        w.write({"loss": 1.0})


def test_report_is_a_png(tmp_path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    with MetricsWriter(metrics) as w:
        for s in range(1, 51):
            w.write(_record(s))
    png = write_report(metrics, tmp_path / "out" / "report.png", title="test run")
    data = png.read_bytes()
    assert data[:8] == _PNG_MAGIC
    assert len(data) > 10_000  # two panels with curves, not an empty canvas
    assert [p.name for p in png.parent.iterdir()] == ["report.png"]  # written atomically


def test_report_without_steps_still_renders(tmp_path) -> None:
    png = write_report(tmp_path / "missing.jsonl", tmp_path / "report.png")
    assert png.read_bytes()[:8] == _PNG_MAGIC


def test_numbers_that_are_not_finite_are_written_as_null(tmp_path) -> None:
    """A step skipped for an fp16 overflow has an infinite gradient norm, a diverged run a
    NaN loss: json wrote Infinity and NaN, which strict JSON readers (jq, browsers) refuse.
    The report still draws the run."""
    metrics = tmp_path / "metrics.jsonl"
    with MetricsWriter(metrics) as w:
        for s in range(1, 6):
            w.write({**_record(s), "grad_norm": float("inf") if s == 2 else 1.0,
                     "loss": float("nan") if s == 4 else 5.0 / s})
    lines = metrics.read_text().splitlines()
    assert "Infinity" not in lines[1] and "NaN" not in lines[3]
    records = [json.loads(line, parse_constant=pytest.fail) for line in lines]
    assert records[1]["grad_norm"] is None and records[3]["loss"] is None
    assert math.isnan(read_metrics(metrics)[3]["loss"])  # read back as the run had it
    assert write_report(metrics, tmp_path / "report.png").read_bytes()[:8] == _PNG_MAGIC
