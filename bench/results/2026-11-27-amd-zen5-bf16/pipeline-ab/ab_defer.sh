#!/bin/bash
for round in 1 2; do
for s in 128 512; do
for d in off on; do
  extra=""; [ $d = on ] && extra="--set zero.overlap_step_with_forward=true"
  PYTHONPATH=/work/wt-b timeout 600 /work/main/.venv/bin/python /work/wt-b/bench/cpu_split.py --row nvme+opt --batch 1 --seq $s --steps 5 --warmup 2 --phases --pipeline --no-cprofile $extra --nvme-path /work/prof/s8/swap > defer-r$round-$s-$d.txt 2>&1
  echo "r$round s$s $d: $(head -2 defer-r$round-$s-$d.txt | tr '\n' ' ' | sed 's/.*torch threads 2: //')"
done; done; done
