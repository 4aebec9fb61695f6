# Sourced by bench/gpu/session.sh and bench/gpu/rerun.sh (from the repository root, with OUT,
# DEVICE and PYTHON set): the session log, setup, the suite's summary, and the bench row.
LOG=$OUT/session.log
t0=$SECONDS
say() { echo "[$((SECONDS - t0)) s] $*" | tee -a "$LOG"; }

setup() {
  say "setup"
  bash bench/gpu/setup.sh >>"$LOG" 2>&1 || say "setup failed"
}

# $OUT/suite/pytest-*.txt -> failed-$DEVICE.txt, the last line of each, and one archive
summarize_suite() {
  grep -h -E "^(FAILED|ERROR) " "$OUT"/suite/pytest-*.txt | sort >"$OUT/failed-$DEVICE.txt"
  tail -qn 1 "$OUT"/suite/pytest-*.txt | tee -a "$LOG"
  wc -l <"$OUT/failed-$DEVICE.txt" | sed 's/^/failed or errored: /' | tee -a "$LOG"
  tar czf "$OUT/suite-$DEVICE.tgz" -C "$OUT" suite && rm -rf "$OUT/suite"
}

# bench_row SECONDS ROWS STEPS ROW_SECONDS: bench/gpu.py on gpt-1.3b into $OUT/gpt-1.3b.json
bench_row() {
  say "bench/gpu.py gpt-1.3b $2"
  timeout "$1" $PYTHON bench/gpu.py --models gpt-1.3b --rows "$2" --no-sweep \
    --steps "$3" --warmup 1 --row-timeout "$4" --nvme-path /tmp/outcore-gpu-swap \
    --out "$OUT/gpt-1.3b.json" >/dev/null 2>"$OUT/gpt-1.3b.err"
  say "bench exit $?"
  tail -12 "$OUT/gpt-1.3b.err" | tee -a "$LOG"
}
