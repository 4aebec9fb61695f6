#!/bin/bash
wt=/work/wt-bench
cd /work/prof/tail
for r in 1 2; do
for cfg in "128 def" "512 def" "128 tenth"; do
  set -- $cfg
  extra=""
  if [ $2 = tenth ]; then extra="--set offload.host_buffer_bytes=67108864 --set offload.reuse_freed_memory=false --set zero.prefetch_bytes=570425344"; fi
  echo "== r$r seq $1 $2 $(date -u +%T)"
  PYTHONPATH=$wt /work/main/.venv/bin/python tail_jobs.py --seq $1 --steps 4 --warmup 2 --nvme-path /work/prof/tail/swap --out r$r-s$1-$2.json $extra 2>&1 | grep -v Warning
done
done
