"""Signals to a whole job: ``torchrun`` starts each worker in a session of its own, so a
signal to the launcher's process group never reaches the ranks."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

import psutil


def signal_job(proc: subprocess.Popen, sig: signal.Signals) -> list[psutil.Process]:
    """Send ``sig`` to ``proc`` (started with ``start_new_session=True``), its process group
    and every process below it, workers in sessions of their own included; returns those."""
    below: list[psutil.Process] = []
    with contextlib.suppress(psutil.NoSuchProcess):
        below = psutil.Process(proc.pid).children(recursive=True)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    for p in below:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(sig)
    return below


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL the whole job and wait until every process of it is gone."""
    below = signal_job(proc, signal.SIGKILL)
    proc.wait()
    psutil.wait_procs(below, timeout=30)
