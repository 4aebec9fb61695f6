#!/bin/bash
# A/B: offload.io_block_bytes 4 MiB (default) vs 16 vs 64 MiB, alternating
cd /work/wt-exp
for r in 1 2 3; do
  for seq in 512 128; do
    for b in 4 16 64; do
      echo "== round $r seq $seq block $b MiB $(date +%T)"
      PYTHONPATH=/work/wt-exp /work/main/.venv/bin/python bench/cpu_split.py --row nvme+opt --batch 1 --seq $seq --steps 5 --warmup 2 --phases --pipeline --no-cprofile --nvme-path /work/prof/blk/swap --set offload.io_block_bytes=$((b*1048576)) > /work/prof/blk/runs/r$r-s$seq-b$b.txt 2>&1
      head -2 /work/prof/blk/runs/r$r-s$seq-b$b.txt; grep -A5 "^thread " /work/prof/blk/runs/r$r-s$seq-b$b.txt | tail -5
    done
  done
done
