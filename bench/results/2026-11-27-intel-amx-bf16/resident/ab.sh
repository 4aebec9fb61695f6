#!/bin/bash
# alternating A/B: base (09de290, worktree) vs resident copies (main working tree)
cd /work/main
for round in 1 2; do
  for side in base new; do
    root=/work/main; [ $side = base ] && root=/work/wt-base
    echo "=== round $round $side $(date -u +%H:%M:%S)"
    PYTHONPATH=$root .venv/bin/python $root/bench/train.py --rows none --sweep-rows nvme+opt \
      --sweep-points 1x128,1x512,4x512 --steps 5 --warmup 2 --probe-each-row --wait-quiet 20 \
      --nvme-path /work/main/bench/out/swap 2>&1 | grep -v "^\[20" | tail -40
  done
done
