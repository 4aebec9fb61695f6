#!/bin/bash
# A/B: the optimizer's share of offload.host_buffer_bytes (eighths) in the 1/10-of-DeepSpeed setting, 128 tokens
cd /work/wt-exp
for r in 1 2 3; do
  for v in "64 4" "64 7" "48 7"; do
    set -- $v; hb=$1; e=$2
    echo "== round $r hb $hb MiB stage $e/8 $(date +%T)"
    OUTCORE_EXP_STAGE8=$e PYTHONPATH=/work/wt-exp /work/main/.venv/bin/python bench/cpu_split.py --row nvme+opt --batch 1 --seq 128 --steps 5 --warmup 2 --phases --pipeline --no-cprofile --nvme-path /work/prof/stage/swap --set offload.host_buffer_bytes=$((hb*1048576)) --set offload.reuse_freed_memory=false --set zero.prefetch_bytes=570425344 > /work/prof/stage/runs/r$r-hb$hb-s$e.txt 2>&1
    head -2 /work/prof/stage/runs/r$r-hb$hb-s$e.txt | cut -c1-400; sed -n 4,5p /work/prof/stage/runs/r$r-hb$hb-s$e.txt
  done
done
