"""``torch.compile(model)`` on a model outcore manages trains as the eager model does.

Dynamo traces a compiled module's hooks with it; outcore's fetch and release hooks touch
state that changes every call (the swap's finalizers, the schedule), so a guard made on one
call failed on the same frame ("Guard failed on the same frame it was created") with the
parameters on NVMe, and an op writing into ``out=`` raised on a parameter in every tier. The
hooks now run outside the compiled graph (compiled.py). Each case runs in its
own interpreter: compiling leaves caches and threads behind, and a crash fails one case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
import torch
import outcore

offload, swap = sys.argv[1], sys.argv[2]

def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))

g = torch.Generator().manual_seed(1)
batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(4)]
plain = net()
opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.0)
expected = []
for x, y in batches:
    loss = torch.nn.functional.mse_loss(plain(x), y)
    loss.backward(); opt.step(); opt.zero_grad()
    expected.append(loss.item())
model = net()
cfg = {"dtype": "fp32", "optimizer": {"lr": 1e-2, "weight_decay": 0.0},
       "offload": {"params": offload, "optimizer": offload, "nvme_path": swap}}
engine = outcore.initialize(model, cfg)
compiled = torch.compile(model)
got = []
for x, y in batches:
    loss = torch.nn.functional.mse_loss(compiled(x), y)
    engine.backward(loss); engine.step()
    got.append(loss.item())
with torch.no_grad():  # a read into out= on a parameter
    out = torch.empty(32)
    torch.add(model[0].bias, 1, out=out)
    same = torch.equal(out, model[0].bias.detach() + 1)
engine.close()
print(json.dumps({"expected": expected, "got": got, "out_ok": same}))
"""


@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_a_compiled_model_trains_as_the_eager_one(tmp_path: Path, offload: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-c", SCRIPT, offload, str(tmp_path / "swap")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["out_ok"]
    assert result["got"] == pytest.approx(result["expected"], rel=1e-5, abs=1e-6)

