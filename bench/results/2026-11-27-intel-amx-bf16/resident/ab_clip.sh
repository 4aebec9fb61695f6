#!/bin/bash
# alternating A/B with clipping (the speculative step): base (09de290, worktree) vs main
cd /work/main
for round in 1 2; do
  for side in base new; do
    root=/work/main; [ $side = base ] && root=/work/wt-base
    echo "=== round $round $side $(date -u +%H:%M:%S)"
    PYTHONPATH=$root .venv/bin/python $root/bench/train.py --rows nvme+opt --no-sweep \
      --steps 6 --warmup 2 --clip 100 --probe-each-row --wait-quiet 10 \
      --nvme-path /work/main/bench/out/swap 2>&1 | grep -v "^\[20" | tail -12
  done
done
