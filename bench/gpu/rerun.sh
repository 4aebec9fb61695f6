#!/usr/bin/env bash
# A GPU session's second call: rerun the tests a first call saw fail (a file of pytest node
# IDs, one per line) in parallel pytest processes under a time limit, then, with the time
# left, one bench/gpu.py row. Everything lands in $OUT.
#
#   OUT=$OUT bash bench/gpu/rerun.sh bench/gpu/<session>/run1-failed-ids.txt
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 OUTCORE_TEST_CPU_WORLDS=skip PYTHON=${PYTHON:-python3}
IDS=$1
OUT=${OUT:-bench/out/gpu-rerun}
DEVICE=${DEVICE:-cuda}
SUITE_S=${SUITE_S:-150}
WORKERS=${WORKERS:-12}
BENCH_S=${BENCH_S:-0}
BENCH_ROWS=${BENCH_ROWS:-nvme+opt}
mkdir -p "$OUT/suite"
. bench/gpu/common.sh
setup
git log --oneline -1 >>"$LOG" 2>&1
# the IDs of one test file stay together (module fixtures run once), files spread over the
# processes by how many IDs they hold
$PYTHON - "$WORKERS" "$IDS" "$OUT/suite" <<'PY'
import collections
import sys
n, ids, out = int(sys.argv[1]), open(sys.argv[2]).read().split(), sys.argv[3]
by_file = collections.defaultdict(list)
for i in ids:
    by_file[i.split("::")[0]].append(i)
groups, sizes = [[] for _ in range(n)], [0] * n
for f, its in sorted(by_file.items(), key=lambda kv: -len(kv[1])):
    k = sizes.index(min(sizes))
    groups[k] += its
    sizes[k] += len(its)
for k, g in enumerate(g for g in groups if g):
    with open(f"{out}/ids-{k}.txt", "w") as fh:
        fh.write("\n".join(g) + "\n")
PY
say "rerun of $(wc -l <"$IDS") tests on $DEVICE"
for f in "$OUT"/suite/ids-*.txt; do
  k=${f##*ids-}; k=${k%.txt}
  OMP_NUM_THREADS=2 timeout -s INT -k 20 "$SUITE_S" $PYTHON -m pytest --device "$DEVICE" -q \
    -rfEs --tb=short --junitxml="$OUT/suite/junit-$k.xml" "@$f" >"$OUT/suite/pytest-$k.txt" 2>&1 &
done
wait
say "rerun done"
summarize_suite

if [ "$BENCH_S" -gt 0 ]; then
  bench_row "$BENCH_S" "$BENCH_ROWS" "${STEPS:-3}" "$((BENCH_S - 25))"
fi
say "done"
