#!/usr/bin/env bash
# One bench/gpu.py row over several commits in one device call, to find which change moved a
# GPU timing (device time is too short for one call per commit).
#
#   bash bench/gpu/ab.sh prepare d624f02 088993f        # here: bench/out/ab/<commit>/
#   OUT=$OUT bash bench/gpu/ab.sh run --models gpt-1.3b --rows cpu+opt --batch 8 --seq 2048 \
#       --no-sweep --steps 4 --warmup 1 --row-timeout 90  # there, carry ["bench/out/ab"]
#
# `run` times the working tree first ("tree"), then each prepared commit in the order given to
# `prepare`, each from its own copy of outcore/ and bench/ (PYTHONPATH, so the installed
# outcore is not the one imported). Each run gets AB_S seconds (default 100; a cold machine
# took over 46 s for one gpt-1.3b row at 8 x 2048). The probe comes from PROBE (default: the
# third H100 session's), so no run spends 30 s measuring the card; the host-device link is
# measured first, since it differs between machines. In $OUT: summary.txt (the link's rates,
# then one line per commit: step, forward, backward, optimizer seconds, CPU-s per step) and
# ab.tgz.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
AB=bench/out/ab
case "${1:-}" in
  prepare)
    shift
    rm -rf "$AB" && mkdir -p "$AB"
    for c in "$@"; do
      sha=$(git rev-parse --short "$c") || exit 1
      mkdir -p "$AB/$sha"
      git archive "$sha" outcore 'bench/*.py' | tar x -C "$AB/$sha" || exit 1
      echo "$sha" >>"$AB/order.txt"
    done
    du -sh "$AB"
    ;;
  run)
    shift
    OUT=$(realpath -m "${OUT:-bench/out/ab-run}")  # each run starts in its own copy
    PY=${PYTHON:-python3}
    PROBE=${PROBE:-$ROOT/bench/gpu/2026-11-26-h100/run1-gpt-1.3b.json}
    mkdir -p "$OUT/ab"
    export PYTHONUNBUFFERED=1
    bash bench/gpu/setup.sh >"$OUT/ab/setup.log" 2>&1
    one() {  # name, folder
      (cd "$2" && PYTHONPATH=$PWD timeout "${AB_S:-100}" $PY bench/gpu.py "${@:3}" \
        --probe-from "$PROBE" --nvme-path /tmp/outcore-ab --out "$OUT/ab/$1.json" \
        >/dev/null 2>"$OUT/ab/$1.err")
      local rc=$?
      # the row's own log (a failed row's error is more than the line bench/gpu.py prints)
      cp -r "$(ls -dt "$2"/bench/out/logs/gpu-* 2>/dev/null | head -1)" "$OUT/ab/$1-logs" \
        2>/dev/null
      echo "$1 exit $rc: $($PY - "$OUT/ab/$1.json" <<'PY'
import json
import sys
try:
    rows = json.load(open(sys.argv[1]))["rows"]
except (OSError, ValueError):
    print("no result")
    sys.exit()
print("; ".join(f"{r['row']} {r['batch']}x{r['seq']} " + (
    f"step {r['step_s']:.3f} fwd {r['fwd_s']:.3f} bwd {r['bwd_s']:.3f} opt {r['opt_s']:.3f} "
    f"cpu {r['user_s_per_step']:.2f}" if r["status"] == "ok" else r["status"]) for r in rows))
PY
)" | tee -a "$OUT/summary.txt"
    }
    # this machine's own page-locked copy rates: a slower link moves a row as much as code
    (cd bench && $PY -c "import gpu; print('link', gpu.link_rates() or 'no CUDA')") 2>&1 \
      | tee -a "$OUT/summary.txt"
    # packed after every run: a call stopped at its limit still brings back what ran, in
    # the few files the device tool returns
    one tree "$ROOT" "$@"
    tar czf "$OUT/ab.tgz" -C "$OUT" ab
    if [ -f "$AB/order.txt" ]; then
      while read -r sha; do
        one "$sha" "$AB/$sha" "$@"
        tar czf "$OUT/ab.tgz" -C "$OUT" ab
      done <"$AB/order.txt"
    fi
    rm -rf "$OUT/ab"
    ;;
  *)
    echo "usage: ab.sh prepare COMMIT... | ab.sh run BENCH_GPU_ARGS..." >&2
    exit 2
    ;;
esac
