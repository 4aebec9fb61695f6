#!/usr/bin/env bash
# The host-memory row (params and optimizer in host memory) in one device call, for issue 21's
# target (0.8x no offload's tokens/s, each at the most tokens it fits):
#
#   OUT=$OUT bash bench/gpu/host_rows.sh            # there; about 8 minutes, timeout_s 560
#   OUT=/tmp/h TINY=1 bash bench/gpu/host_rows.sh   # here, on a CPU: the script works
#
# PLAN=partial (the default; bench/gpu/2026-11-27-h100-b/README.md says why): every block
# checkpointed cost a third more compute and left 64 GB of the device unused, so checkpoint
# only as many blocks as the tokens need:
#   none      no offload at 12 x 2048, the most it fits
#   part16    cpu+opt at 16 x 2048, no block checkpointed (3.4 GB of activations a sequence)
#   part24    cpu+opt at 24 x 2048, the first 5 of 24 blocks checkpointed
#   part32    cpu+opt at 32 x 2048, 11 blocks
#   part48    cpu+opt at 48 x 2048, 16 blocks (each predicted at most 75 GB of the device)
# PLAN=tail (the seventh session's rows):
#   tail      cpu+opt at 8 x 2048, 9 steps: does the optimizer's tail grow from step to step?
#   overlap   the same with zero.overlap_step_with_forward
#   none      as above
#   ckpt      cpu+opt with every block checkpointed at 16, 32 and 48 x 2048 (one engine)
# Each row runs in its own bench/gpu.py call with a limit of its own, so one slow row does not
# cost the rest. merged.json holds targets.host_vs_none_at_most_tokens. Everything lands in
# $OUT/host_rows.tgz (the device tool brings back 8 files) and a summary on stdout.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=$(realpath -m "${OUT:-bench/out/host-rows}")
R=$OUT/host_rows
mkdir -p "$R"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ "${TINY:-0}" = 1 ]; then
  G=("$PY" bench/gpu.py --tiny --models tiny --seq 64)
  B8=2 B12=2 B16=2 B24=3 B32=4 B48=6 BIG=4x64,8x64 SCALE=0.2 C24=1 C32=1 C48=2
else
  bash bench/gpu/setup.sh >"$R/setup.txt" 2>&1
  G=("$PY" bench/gpu.py --models gpt-1.3b --seq 2048
     --probe-from bench/gpu/2026-11-26-h100/run1-gpt-1.3b.json)
  B8=8 B12=12 B16=16 B24=24 B32=32 B48=48 BIG=32x2048,48x2048 SCALE=1 C24=5 C32=11 C48=16
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
if [ "${PLAN:-partial}" = tail ]; then
  NAMES="tail overlap none ckpt"
  row tail 70 --rows cpu+opt --batch "$B8" --no-sweep --steps 9 --warmup 2
  row overlap 70 --rows cpu+opt --batch "$B8" --no-sweep --steps 9 --warmup 2 \
    --set zero.overlap_step_with_forward=true
  row none 60 --rows none --batch "$B12" --no-sweep --steps 5 --warmup 1
  row ckpt 140 --rows cpu+opt --batch "$B16" --sweep --sweep-points "$BIG" --checkpoint \
    --steps 5 --warmup 2
else
  NAMES="none part16 part24 part32 part48"
  row none 60 --rows none --batch "$B12" --no-sweep --steps 5 --warmup 1
  row part16 60 --rows cpu+opt --batch "$B16" --no-sweep --steps 5 --warmup 2
  row part24 65 --rows cpu+opt --batch "$B24" --no-sweep --steps 5 --warmup 2 --checkpoint "$C24"
  row part32 70 --rows cpu+opt --batch "$B32" --no-sweep --steps 5 --warmup 2 --checkpoint "$C32"
  row part48 80 --rows cpu+opt --batch "$B48" --no-sweep --steps 5 --warmup 2 --checkpoint "$C48"
fi
# shellcheck disable=SC2046  # the rows' files, by name
"$PY" bench/gpu.py --merge $(for n in $NAMES; do [ "$n" = overlap ] || echo "$R/$n.json"; done) \
  >"$R/merged.json" 2>>"$R/merge.err"
n_rows=$(echo "$NAMES" | wc -w)
for logs in $(ls -dt bench/out/logs/gpu-* | head -"$n_rows"); do cp -r "$logs" "$R/"; done
tar czf "$OUT/host_rows.tgz" -C "$OUT" host_rows
"$PY" - "$R" $NAMES <<'PY'
import json
import sys
from pathlib import Path

for name in sys.argv[2:]:
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
              f"{r['tokens_per_s']:.0f} tok/s; {r.get('checkpointed_blocks', 0)} blocks "
              f"checkpointed; device peak {(r.get('peak_device') or 0) / 1e9:.1f} GB; "
              f"steps {times}; {r.get('updates')}")
try:  # the same arithmetic; CUDA's backward is not deterministic, so runs of one row differ
    a, b = (json.loads(Path(sys.argv[1], f"{n}.json").read_text())["rows"][0]["losses"]
            for n in ("tail", "overlap"))
    worst = max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True))
    print(f"tail vs overlap losses: largest relative difference {worst:.1e} "
          "(runs of one row on an H100 differed by up to 1e-5)")
except (OSError, ValueError, KeyError, IndexError):
    pass  # PLAN=partial has no such pair
try:
    merged = json.loads(Path(sys.argv[1], "merged.json").read_text())
    print("target", merged["targets"]["host_vs_none_at_most_tokens"])
except (OSError, ValueError, KeyError):
    print("target: no merged result")
PY
