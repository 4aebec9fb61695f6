#!/bin/bash
for r in 3 4 5 6; do
 for v in base exp; do
  if [ $v = exp ]; then export OC_EXP_EARLY=1; else unset OC_EXP_EARLY; fi
  cd /work/wt-$v && PYTHONPATH=/work/wt-$v /work/main/.venv/bin/python bench/cpu_split.py --row nvme+opt --phases --pipeline --no-cprofile --steps 6 --warmup 2 > /tmp/exp/$v-$r.txt 2>&1
  echo "$v $r done $(date +%T)"
 done
done
