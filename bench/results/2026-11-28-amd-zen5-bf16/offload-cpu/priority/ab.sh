#!/bin/bash
# A/B: the update thread's scheduling priority (env OUTCORE_EXP_NICE), alternating
cd /work/wt-exp
for r in 1 2 3; do
  for seq in 512 128; do
    for v in base 19 idle; do
      if [ $v = base ]; then E=""; else E="OUTCORE_EXP_NICE=$v"; fi
      echo "== round $r seq $seq variant $v $(date +%T)"
      env $E PYTHONPATH=/work/wt-exp /work/main/.venv/bin/python bench/cpu_split.py --row nvme+opt --batch 1 --seq $seq --steps 5 --warmup 2 --phases --pipeline --no-cprofile --nvme-path /work/prof/nice/swap > /work/prof/nice/runs/r$r-s$seq-$v.txt 2>&1
      head -2 /work/prof/nice/runs/r$r-s$seq-$v.txt
    done
  done
done
