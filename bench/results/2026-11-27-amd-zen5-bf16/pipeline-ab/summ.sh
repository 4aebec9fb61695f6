#!/bin/bash
cd /work/prof/s8
for f in ab4-r*-*.txt; do
  row=$(grep "params+optimizer on NVMe |" $f | awk -F'|' '{print $3, $9, $10, $11}')
  none=$(grep "no offload |" $f | awk -F'|' '{print $3}')
  echo "$f none=$none | offload s, floor, ratio, phases: $row"
done
