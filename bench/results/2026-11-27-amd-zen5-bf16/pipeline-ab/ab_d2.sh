#!/bin/bash
# more alternating pairs: read-ahead depth 1 (3 slots) vs 2 (4 slots), cpu_split --phases
for round in 1 2 3 4 5; do
for s in 512 128; do
  [ $s = 128 ] && [ $round -gt 3 ] && continue
  for d in 1 2; do
    OUTCORE_EXP_AHEAD=$d PYTHONPATH=/work/wt-b timeout 600 /work/main/.venv/bin/python /work/wt-b/bench/cpu_split.py --row nvme+opt --batch 1 --seq $s --steps 5 --warmup 2 --phases --no-cprofile --nvme-path /work/prof/s8/swap > d2-r$round-$s-d$d.txt 2>&1
    echo "r$round s$s d$d: $(head -2 d2-r$round-$s-d$d.txt | tr '\n' ' ' | sed 's/.*torch threads 2: //; s/process CPU.*disk busy \([0-9]*%\) of the time (\([0-9.]* GB\/s\) while busy).*forward/busy \1 at \2; forward/')"
  done
done; done
