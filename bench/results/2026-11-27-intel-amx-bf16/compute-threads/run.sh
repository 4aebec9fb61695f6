#!/bin/bash
cd /work/main
for i in 1 2 3; do
  for ct in 2 1; do
    if [ $ct = 2 ]; then rows=none,nvme+opt; else rows=nvme+opt; fi
    .venv/bin/python bench/train.py --no-sweep --rows $rows --steps 6 --warmup 2 --compute-threads $ct \
      --wait-quiet 10 --probe-each-row --nvme-path /work/prof/ct1/swap > /work/prof/ct1/p$i-ct$ct.txt 2>&1
    date -u >> /work/prof/ct1/p$i-ct$ct.txt
  done
done
