#!/bin/bash
# A/B: read-ahead depth D (OUTCORE_EXP_AHEAD) in the 1/10-of-DeepSpeed setting, 128 tokens
cd /work/wt-exp
for r in 1 2 3; do
  for d in 1 2 3; do
    echo "== round $r D $d $(date +%T)"
    OUTCORE_EXP_AHEAD=$d PYTHONPATH=/work/wt-exp /work/main/.venv/bin/python bench/cpu_split.py --row nvme+opt --batch 1 --seq 128 --steps 5 --warmup 2 --phases --pipeline --no-cprofile --nvme-path /work/prof/ahead/swap --set offload.host_buffer_bytes=67108864 --set offload.reuse_freed_memory=false --set zero.prefetch_bytes=570425344 > /work/prof/ahead/runs/r$r-d$d.txt 2>&1
    head -2 /work/prof/ahead/runs/r$r-d$d.txt | cut -c1-400; sed -n 4,5p /work/prof/ahead/runs/r$r-d$d.txt
  done
done
