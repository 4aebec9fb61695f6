#!/usr/bin/env bash
# alternate base (100022a) and new (e8ed83f): bench/train.py none,nvme at 512 tokens
for i in 3; do
  for side in base new; do
    root=/work/main; [ $side = base ] && root=/tmp/wt-base
    cd $root && PYTHONPATH=$root timeout 900 /work/main/.venv/bin/python bench/train.py --rows none,nvme --no-sweep --steps 6 --warmup 2 --wait-quiet 5 > /tmp/ab/$side-$i.txt 2>&1
    echo "$side-$i rc $? $(date +%T)" >> /tmp/ab/progress.txt
  done
done
