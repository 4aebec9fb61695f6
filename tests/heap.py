"""Fresh-process probes of glibc's malloc policies, shared by the tests of host memory
(tests/integration/test_host_paths.py, test_fault_free_steps.py).

A malloc policy is process-wide, so each case runs in a process of its own and prints what
it measured as its last line of JSON.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

STEP_FAULTS = """
import json, resource, sys
import torch
from torch import nn
import outcore
from outcore.guard.memory import Available
from outcore.offload import host_memory
from outcore.optim import optimizer
if sys.argv[2]:  # the memory this host has left, as the first step's decision sees it
    optimizer.available_memory = lambda: Available(int(sys.argv[2]), None)
torch.manual_seed(0)
cfg = outcore.Config.from_dict({"dtype": "auto", "optimizer": {"type": "adamw", "lr": 1e-3},
                                "offload": json.loads(sys.argv[1])})
with outcore.init(cfg):
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256))
    at_build = host_memory._policy
engine = outcore.initialize(model, cfg)
x = torch.randn(40000, 256)  # 20 MB activations in bf16, 40 MB in fp32 (auto: per CPU)
widen = int(sys.argv[3])  # the loss's fp32 tensors: widen x 40 MB
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    engine.backward(engine(x).float().repeat(1, widen).pow(2).mean())
    engine.step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
engine.close()
print(json.dumps({"faults": faults, "policy": host_memory._policy, "at_build": at_build}))
"""


FREED_RSS = """
import ctypes, json, sys
import psutil
from outcore.offload import host_memory
if sys.argv[1] == "keep":
    host_memory.keep_freed_memory_for_reuse()
else:
    host_memory.reuse_freed_memory_on_small_host()
    if len(sys.argv) > 2:  # the bound the first step would set
        host_memory.bound_reused_top(int(sys.argv[2]))
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
proc = psutil.Process()
before = proc.memory_info().rss
block = libc.malloc(512 << 20)  # at the heap's top: nothing is allocated after it
ctypes.memset(block, 1, 512 << 20)
grown = proc.memory_info().rss
libc.free(block)
print(json.dumps([before, grown, proc.memory_info().rss]))
"""


def run_fresh(script: str, *args: str) -> object:
    """The JSON a script prints last, run in a fresh process (malloc policies are
    process-wide, so each case needs its own)."""
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def step_faults(offload: dict, room: int | None = None, widen: int = 1) -> dict:
    """Page faults of each of six steps in a fresh process with this ``offload`` config;
    ``room``: the available memory the first step's decision is shown, else the host's;
    ``widen``: the loss's fp32 tensors are that many times the output's 40 MB."""
    room_arg = "" if room is None else str(room)
    return run_fresh(STEP_FAULTS, json.dumps(offload), room_arg, str(widen))


glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc",
                                reason="the malloc policies are glibc's")


def settled(faults: list[int]) -> int:
    # The heap still grows now and then: with threads interleaving differently one step of a
    # few may fault in 30-50k pages even where freed memory is reused (seen in bf16 and in
    # fp32). A policy that does not reuse faults every step, so the fewest of the last three
    # steps tells the policies apart without depending on that noise.
    return min(faults[3:])
