#!/bin/bash
run() { side=$1; repo=$2; i=$3
  cd $repo && timeout 1500 /work/main/.venv/bin/python bench/train.py --rows none --sweep-rows nvme+opt --sweep-points 1x128,1x512,4x512 --steps 5 --warmup 2 --probe-each-row --wait-quiet 20 > /work/prof/sweep/$side-$i.txt 2>&1
  echo "$side-$i done $(date +%T) $(grep results: /work/prof/sweep/$side-$i.txt)"; }
run new /work/main 1
run old /work/exp 1
run old /work/exp 2
run new /work/main 2
