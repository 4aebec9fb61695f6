#!/usr/bin/env bash
# The host-memory row (params and optimizer in host memory) in one device call, for issue 21's
# target (0.8x no offload's tokens/s, each at the most tokens it fits) and the question its
# 2026-11-27 record left open (bench/gpu/2026-11-27-h100/README.md, "Next GPU session"):
#
#   OUT=$OUT bash bench/gpu/host_rows.sh            # there; about 8 minutes, timeout_s 560
#   OUT=/tmp/h TINY=1 bash bench/gpu/host_rows.sh   # here, on a CPU: the script works
#
# Rows, each in its own bench/gpu.py call with a limit of its own, so one slow row does not
# cost the rest:
#   tail      cpu+opt at 8 x 2048, 9 steps: does the optimizer's tail after backward grow
#             from step to step (it did in one run of that record)?
#   overlap   the same with zero.overlap_step_with_forward: the tail's updates run into the
#             next forward, which on a GPU does not compete for the host's cores
#   none      no offload at 12 x 2048, the most it fits
#   ckpt      cpu+opt with every block checkpointed at 16, 32 and 48 x 2048 (one engine)
# Then merged.json (none + ckpt) holds targets.host_vs_none_at_most_tokens. Everything lands
# in $OUT/host_rows.tgz (the device tool brings back 8 files) and a summary on stdout.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=$(realpath -m "${OUT:-bench/out/host-rows}")
R=$OUT/host_rows
mkdir -p "$R"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ "${TINY:-0}" = 1 ]; then
  G=("$PY" bench/gpu.py --tiny --models tiny --seq 64)
  B8=2 B12=2 B16=2 BIG=4x64,8x64 SCALE=0.2
else
  bash bench/gpu/setup.sh >"$R/setup.txt" 2>&1
  G=("$PY" bench/gpu.py --models gpt-1.3b --seq 2048
     --probe-from bench/gpu/2026-11-26-h100/run1-gpt-1.3b.json)
  B8=8 B12=12 B16=16 BIG=32x2048,48x2048 SCALE=1
fi
row() {  # name, seconds, bench/gpu.py arguments
  local name=$1 limit
  limit=$(awk "BEGIN {print int($2 * $SCALE) + 30}")
  shift 2
  timeout "$limit" "${G[@]}" "$@" --nvme-path /tmp/outcore-host-rows \
    --out "$R/$name.json" >/dev/null 2>"$R/$name.err"
  echo "$name exit $?"
  tar czf "$OUT/host_rows.tgz" -C "$OUT" host_rows  # after every row: a cut call keeps them
}
row tail 70 --rows cpu+opt --batch "$B8" --no-sweep --steps 9 --warmup 2
row overlap 70 --rows cpu+opt --batch "$B8" --no-sweep --steps 9 --warmup 2 \
  --set zero.overlap_step_with_forward=true
row none 60 --rows none --batch "$B12" --no-sweep --steps 5 --warmup 1
row ckpt 140 --rows cpu+opt --batch "$B16" --sweep --sweep-points "$BIG" --checkpoint \
  --steps 5 --warmup 2
"$PY" bench/gpu.py --merge "$R/none.json" "$R/ckpt.json" >"$R/merged.json" 2>>"$R/ckpt.err"
for logs in $(ls -dt bench/out/logs/gpu-* | head -4); do cp -r "$logs" "$R/"; done  # the rows
tar czf "$OUT/host_rows.tgz" -C "$OUT" host_rows
"$PY" - "$R" <<'PY'
import json
import sys
from pathlib import Path

for name in ("tail", "overlap", "none", "ckpt"):
    try:
        rows = json.loads(Path(sys.argv[1], f"{name}.json").read_text())["rows"]
    except (OSError, ValueError):
        print(f"{name}: no result")
        continue
    for r in rows:
        if r["status"] != "ok":
            print(f"{name}: {r['row']} {r['batch']}x{r['seq']} {r['status']}")
            continue
        times = ", ".join(f"{t:.2f}" for t in r["step_times_s"])
        print(f"{name}: {r['row']} {r['batch']}x{r['seq']} step {r['step_s']:.3f} fwd "
              f"{r['fwd_s']:.3f} bwd {r['bwd_s']:.3f} tail {r['opt_s']:.3f} "
              f"{r['tokens_per_s']:.0f} tok/s; steps {times}; {r.get('updates')}")
try:  # the same arithmetic; CUDA's backward is not deterministic, so runs of one row differ
    a, b = (json.loads(Path(sys.argv[1], f"{n}.json").read_text())["rows"][0]["losses"]
            for n in ("tail", "overlap"))
    worst = max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True))
    print(f"tail vs overlap losses: largest relative difference {worst:.1e} "
          "(runs of one row on an H100 differed by up to 1e-5)")
except (OSError, ValueError, KeyError, IndexError):
    print("tail vs overlap losses: not both measured")
try:
    merged = json.loads(Path(sys.argv[1], "merged.json").read_text())
    print("target", merged["targets"]["host_vs_none_at_most_tokens"])
except (OSError, ValueError, KeyError):
    print("target: no merged result")
PY
