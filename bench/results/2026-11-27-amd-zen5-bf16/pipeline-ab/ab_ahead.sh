#!/bin/bash
# A/B the pipeline's read-ahead depth (OUTCORE_EXP_AHEAD), cpu_split --phases
for round in 1 2; do
for s in 128 512; do
for d in 1 2 3; do
  OUTCORE_EXP_AHEAD=$d PYTHONPATH=/work/wt-b timeout 600 /work/main/.venv/bin/python /work/wt-b/bench/cpu_split.py --row nvme+opt --batch 1 --seq $s --steps 5 --warmup 2 --phases --pipeline --no-cprofile --nvme-path /work/prof/s8/swap > ahead-r$round-$s-d$d.txt 2>&1
  echo "r$round s$s d$d: $(head -2 ahead-r$round-$s-d$d.txt | tr '\n' ' ' | sed 's/.*torch threads 2: //')"
done; done; done
