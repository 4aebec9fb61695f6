"""What a training run leaves behind for people: per-step metrics and a PNG report.

[Note: metrics survive a kill and a resume]
``metrics.jsonl`` holds one JSON object per optimizer step, flushed as it is written, so a
run killed at any moment leaves every finished step on disk (at worst one partial last line).
A resumed run restarts from its checkpoint's step, so lines after that step describe work that
is being redone: ``MetricsWriter(path, resume_step=s)`` drops them (and any partial line)
before appending, leaving one line per step, in order, as an uninterrupted run would have.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from outcore.offload.storage import Tier

__all__ = ["MetricsWriter", "read_metrics", "write_report"]


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every complete record in a metrics file; a partial last line (a killed run) is skipped."""
    records = []
    p = Path(path)
    if not p.exists():
        return records
    with p.open() as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and "step" in rec:
                if "loss" in rec and rec["loss"] is None:  # written null: not finite (_encode)
                    rec["loss"] = math.nan
                records.append(rec)
    return records


def _atomic_write(path: Path, data: bytes) -> None:
    """Write via a temporary name and rename, so readers see the old file or the new one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class MetricsWriter:
    """Appends one JSON line per step to ``path``; see [Note: metrics survive a kill and a resume].

    ``resume_step=None`` starts a fresh file (a new run replaces an old one's metrics);
    an int keeps the records with ``step <= resume_step``.
    """

    def __init__(self, path: str | Path, resume_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [] if resume_step is None else [
            r for r in read_metrics(self.path) if int(r["step"]) <= resume_step]
        _atomic_write(self.path, b"".join(_encode(r) for r in kept))
        self._file = self.path.open("ab")

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (must hold ``step``) and flush it to the OS."""
        if "step" not in record:
            raise ValueError("a metrics record needs a 'step'")
        self._file.write(_encode(record))
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _encode(record: dict[str, Any]) -> bytes:
    """One line of strict JSON: a number that is not finite (a skipped fp16 step's gradient
    norm, a diverged loss) is null, not the ``Infinity`` or ``NaN`` that jq and browsers
    refuse; the report reads a null loss as NaN."""
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v
             for k, v in record.items()}
    return (json.dumps(clean, separators=(",", ":"), allow_nan=False) + "\n").encode()


def _smooth(values: tuple[float, ...], span: int = 20) -> list[float]:
    """Bias-corrected exponential moving average: byte-level loss is noisy step to step."""
    alpha, avg, out = 2.0 / (span + 1), 0.0, []
    for i, v in enumerate(values, 1):
        avg = (1 - alpha) * avg + alpha * v
        out.append(avg / (1 - (1 - alpha) ** i))
    return out


def write_report(metrics_path: str | Path, png_path: str | Path, title: str | None = None) -> Path:
    """A PNG with the loss curve and the bytes held in each tier, both against the step.

    The memory panel is the point of outcore: it shows where the model states live (and
    that the device and host stay flat while the model trains out of NVMe).
    """
    import matplotlib

    matplotlib.use("Agg")  # no display on a training box
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    steps = [int(r["step"]) for r in records]
    fig, (ax_loss, ax_mem) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    losses = [(s, float(r["loss"])) for s, r in zip(steps, records, strict=True) if "loss" in r]
    if losses:
        xs, ys = zip(*losses, strict=True)
        ax_loss.plot(xs, ys, lw=0.8, color="tab:blue", alpha=0.35, label="per step")
        ax_loss.plot(xs, _smooth(ys), lw=1.8, color="tab:blue", label="smoothed")
        ax_loss.legend()
    ax_loss.set(xlabel="step", ylabel="training loss", title="loss")
    ax_loss.grid(alpha=0.3)
    for tier in Tier:
        key, label = f"bytes_{tier.value}", tier.value
        points = [(s, r[key] / 2**20) for s, r in zip(steps, records, strict=True) if key in r]
        if points:
            ax_mem.plot(*zip(*points, strict=True), lw=1.5, label=label)
    ax_mem.set(xlabel="step", ylabel="MiB", title="memory per tier")
    ax_mem.grid(alpha=0.3)
    if ax_mem.lines:
        ax_mem.legend()
    if not records:
        for ax in (ax_loss, ax_mem):
            ax.text(0.5, 0.5, "no steps recorded", ha="center", va="center",
                    transform=ax.transAxes)
    if title:
        fig.suptitle(title)
    png = Path(png_path)
    png.parent.mkdir(parents=True, exist_ok=True)
    tmp = png.with_name(f".{png.name}.tmp-{os.getpid()}.png")
    try:
        fig.savefig(tmp, dpi=100)
        os.replace(tmp, png)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return png
