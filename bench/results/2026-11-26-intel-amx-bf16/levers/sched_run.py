"""bench/cpu_split.py with outcore's I/O threads under another scheduling policy.

OC_SCHED=batch (SCHED_BATCH), idle (SCHED_IDLE) or niceN (nice N), set by each I/O thread
as it starts. Run from the repository root: python bench/results/.../levers/sched_run.py
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]
sys.argv[0] = str(REPO / "bench" / "cpu_split.py")
sys.path[:0] = [str(REPO / "bench"), str(REPO)]

import cpu_split  # noqa: E402

from outcore.offload import aio  # noqa: E402

MODE = os.environ.get("OC_SCHED", "")
_serve = aio._worker


def worker(tasks: object) -> None:
    tid = threading.get_native_id()
    if MODE == "batch":
        os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
    elif MODE == "idle":
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    elif MODE.startswith("nice"):
        os.setpriority(os.PRIO_PROCESS, tid, int(MODE[4:]))
    _serve(tasks)


aio._worker = worker
sys.exit(cpu_split.main(sys.argv[1:]))
