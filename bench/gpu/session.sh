#!/usr/bin/env bash
# One device call that does the GPU session's work in order of value, each part under its own
# time limit, so a short lease (15 minutes of device time, a machine start included) still
# brings back: the machine, a smoke run of bench/gpu.py, the whole suite on CUDA (in parallel
# workers), and one 1.3B benchmark. Everything lands in $OUT (at most 8 files come back).
#
#   bash bench/gpu/session.sh                 # on the device machine, via the device tool
#   DEVICE=cpu SUITE="tests/unit/zero" bash bench/gpu/session.sh   # rehearsal on a CPU box
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 OUTCORE_TEST_CPU_WORLDS=skip PYTHON=${PYTHON:-python3}
OUT=${OUT:-bench/out/gpu-session}
DEVICE=${DEVICE:-cuda}
SUITE=${SUITE:-tests --ignore=tests/integration/test_two_nodes.py}
SUITE_S=${SUITE_S:-250}
BENCH_S=${BENCH_S:-150}
BENCH_ROWS=${BENCH_ROWS:-none,cpu+opt,nvme+opt}
mkdir -p "$OUT"
LOG=$OUT/session.log
t0=$SECONDS
say() { echo "[$((SECONDS - t0)) s] $*" | tee -a "$LOG"; }

say "setup"
bash bench/gpu/setup.sh >>"$LOG" 2>&1 || say "setup failed"
{ nvidia-smi -L; nvidia-smi; } >"$OUT/nvidia-smi.txt" 2>&1 || echo "no nvidia-smi" >>"$LOG"
{ echo "nproc $(nproc)"; free -g; df -h /tmp | tail -1; git log --oneline -1; } >>"$LOG" 2>&1

say "bench/gpu.py --tiny"
timeout 100 $PYTHON bench/gpu.py --tiny --nvme-path /tmp/outcore-gpu-tiny \
  --out "$OUT/tiny.json" >/dev/null 2>>"$LOG"
say "tiny exit $?"

say "the suite on $DEVICE"
par=()
$PYTHON -c "import xdist" 2>/dev/null && par=(-n "${WORKERS:-12}")
$PYTHON -c "import pytest_timeout" 2>/dev/null && par+=(--timeout 150)
# shellcheck disable=SC2086  # SUITE is a list of paths and options
timeout "$SUITE_S" $PYTHON -m pytest --device "$DEVICE" "${par[@]}" -q -rfEs \
  --junitxml="$OUT/junit-$DEVICE.xml" $SUITE >"$OUT/pytest-$DEVICE.txt" 2>&1
say "suite exit $? (124: cut at ${SUITE_S} s)"
tail -5 "$OUT/pytest-$DEVICE.txt" | tee -a "$LOG"

say "bench/gpu.py gpt-1.3b $BENCH_ROWS"
timeout "$BENCH_S" $PYTHON bench/gpu.py --models gpt-1.3b --rows "$BENCH_ROWS" --no-sweep \
  --steps 4 --warmup 1 --row-timeout "${ROW_S:-45}" --nvme-path /tmp/outcore-gpu-swap \
  --out "$OUT/gpt-1.3b.json" >/dev/null 2>"$OUT/gpt-1.3b.err"
say "bench exit $?"
tail -12 "$OUT/gpt-1.3b.err" | tee -a "$LOG"
say "done"
