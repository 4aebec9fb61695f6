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
WORKERS=${WORKERS:-12}
BENCH_S=${BENCH_S:-150}
BENCH_ROWS=${BENCH_ROWS:-none,cpu+opt,nvme+opt}
mkdir -p "$OUT"
. bench/gpu/common.sh
setup
{ nvidia-smi -L; nvidia-smi; } >"$OUT/nvidia-smi.txt" 2>&1 || echo "no nvidia-smi" >>"$LOG"
{ echo "nproc $(nproc)"; free -g; df -h /tmp | tail -1; git log --oneline -1; } >>"$LOG" 2>&1

if [ "${TINY:-1}" = 1 ]; then
  say "bench/gpu.py --tiny"
  timeout 100 $PYTHON bench/gpu.py --tiny --nvme-path /tmp/outcore-gpu-tiny \
    --out "$OUT/tiny.json" >/dev/null 2>>"$LOG"
  say "tiny exit $?"
fi

say "the suite on $DEVICE, in $WORKERS processes"
# Plain pytest processes side by side, each over a share of the test files (xdist's workers
# were seen not to exit at the session's end). SIGINT at the limit: pytest then stops, prints
# the failures so far and writes its junit file.
mkdir -p "$OUT/suite"
$PYTHON - "$WORKERS" $SUITE >"$OUT/suite/groups.txt" <<'PY'
import sys
from pathlib import Path
n, args = int(sys.argv[1]), sys.argv[2:]
ignore = {Path(a.split("=", 1)[1]) for a in args if a.startswith("--ignore=")}
files = sorted({f for a in args if not a.startswith("-") for f in
                (Path(a).rglob("test_*.py") if Path(a).is_dir() else [Path(a)])} - ignore,
               key=lambda f: -f.stat().st_size)
groups = [[] for _ in range(n)]
sizes = [0] * n
for f in files:  # largest first into the lightest group
    i = sizes.index(min(sizes))
    groups[i].append(str(f))
    sizes[i] += f.stat().st_size
print("\n".join(" ".join(g) for g in groups if g))
PY
i=0
while read -r group; do
  # shellcheck disable=SC2086  # a group is a list of paths
  OMP_NUM_THREADS=2 timeout -s INT -k 30 "$SUITE_S" $PYTHON -m pytest --device "$DEVICE" -q \
    -rfEs --tb=short --junitxml="$OUT/suite/junit-$i.xml" $group >"$OUT/suite/pytest-$i.txt" 2>&1 &
  i=$((i + 1))
done <"$OUT/suite/groups.txt"
wait
say "suite done"
summarize_suite

if [ "$BENCH_S" -gt 0 ]; then
  bench_row "$BENCH_S" "$BENCH_ROWS" 4 "${ROW_S:-45}"
fi
say "done"
