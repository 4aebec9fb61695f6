#!/bin/bash
# A/B: the update thread's torch intra-op threads, 1 (today) vs 2
wt=/work/wt-bench
cd $wt
for r in 1 2 3; do
  for seq in 512 128; do
    for n in 1 2; do
      echo "== round $r seq $seq update threads $n $(date -u +%T)"
      OUTCORE_UPDATE_THREADS=$n PYTHONPATH=$wt /work/main/.venv/bin/python bench/cpu_split.py --row nvme+opt --batch 1 --seq $seq --steps 5 --warmup 2 --phases --pipeline --no-cprofile --nvme-path /work/prof/ut/swap > /work/prof/ut/runs/r$r-s$seq-t$n.txt 2>&1
      head -2 /work/prof/ut/runs/r$r-s$seq-t$n.txt | cut -c1-240
    done
  done
done
