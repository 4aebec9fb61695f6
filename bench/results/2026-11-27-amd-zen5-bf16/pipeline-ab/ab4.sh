#!/bin/bash
# 4 configs x 2 sizes x 2 rounds, bench/train.py with the floor from a probe after each row
for round in 1 2; do
for s in 128 512; do
for cfg in base d2 defer d2defer; do
  d=1; extra=""
  case $cfg in d2) d=2;; defer) extra="--set zero.overlap_step_with_forward=true";; d2defer) d=2; extra="--set zero.overlap_step_with_forward=true";; esac
  OUTCORE_EXP_AHEAD=$d PYTHONPATH=/work/wt-b timeout 900 /work/main/.venv/bin/python /work/wt-b/bench/train.py --no-sweep --rows none,nvme+opt --batch 1 --seq $s --steps 6 --warmup 2 --probe-each-row --wait-quiet 10 $extra --nvme-path /work/prof/s8/swap > ab4-r$round-$s-$cfg.txt 2>&1
  echo "r$round s$s $cfg: $(grep -E 'nvme\+opt|none' ab4-r$round-$s-$cfg.txt | grep -v '^#' | head -4 | tr -s ' ' | tr '\n' '|')"
done; done; done
