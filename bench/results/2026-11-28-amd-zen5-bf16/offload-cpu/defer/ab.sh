#!/bin/bash
# A/B: the step's tail run into the next forward, in the 1/10-of-DeepSpeed setting, 128 tokens
cd /work/wt-exp
for r in 1 2 3; do
  for v in false true; do
    echo "== round $r overlap_step_with_forward=$v $(date +%T)"
    PYTHONPATH=/work/wt-exp /work/main/.venv/bin/python bench/cpu_split.py --row nvme+opt --batch 1 --seq 128 --steps 5 --warmup 2 --phases --pipeline --no-cprofile --nvme-path /work/prof/defer/swap --set offload.host_buffer_bytes=67108864 --set offload.reuse_freed_memory=false --set zero.prefetch_bytes=570425344 --set zero.overlap_step_with_forward=$v > /work/prof/defer/runs/r$r-$v.txt 2>&1
    head -2 /work/prof/defer/runs/r$r-$v.txt | cut -c1-400; sed -n 4,6p /work/prof/defer/runs/r$r-$v.txt
  done
done
