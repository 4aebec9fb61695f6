"""bench/cpu_split.py with a glibc malloc policy applied once the engine is built.

OC_MALLOPT='param=value,...' (glibc's mallopt numbers: -1 M_TRIM_THRESHOLD, -3
M_MMAP_THRESHOLD, -4 M_MMAP_MAX); OC_TRIM=1 calls malloc_trim(0) after every step.
Run from the repository root: python bench/results/.../levers/mallopt_run.py --row nvme+opt
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]
sys.argv[0] = str(REPO / "bench" / "cpu_split.py")
sys.path[:0] = [str(REPO / "bench"), str(REPO)]

import cpu_split  # noqa: E402
import train_worker  # noqa: E402

LIBC = ctypes.CDLL("libc.so.6")
_build = train_worker.outcore_engine


def outcore_engine(spec: dict):  # noqa: ANN201 - train_worker's own signature
    engine, rest = _build(spec)
    for pair in filter(None, os.environ.get("OC_MALLOPT", "").split(",")):
        param, value = pair.split("=")
        assert LIBC.mallopt(int(param), int(value)) == 1, pair
    if os.environ.get("OC_TRIM"):
        step = engine.step

        def trimmed() -> bool:
            out = step()
            LIBC.malloc_trim(0)
            return out

        engine.step = trimmed
    return engine, rest


train_worker.outcore_engine = outcore_engine
sys.exit(cpu_split.main(sys.argv[1:]))
