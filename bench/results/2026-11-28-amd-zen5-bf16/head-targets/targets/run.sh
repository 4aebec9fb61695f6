#!/bin/bash
# issue 29's targets at HEAD (Zen 5), two rounds of the Z1 command
wt=/work/wt-bench
cd $wt
for r in 1 2; do
  echo "=== round $r $(date -u +%H:%M:%S)"
  PYTHONPATH=$wt /work/main/.venv/bin/python $wt/bench/train.py \
    --rows plain,none,nvme,nvme+opt,nvme+opt-small,nvme+opt-lean,deepspeed \
    --sweep-rows nvme+opt --sweep-points 1x128,1x512,4x512 --steps 5 --warmup 2 --wait-quiet 30 \
    --probe-each-row --nvme-path /work/prof/z7/swap
  echo "=== end round $r $(date -u +%H:%M:%S)"
done
