#!/bin/bash
cd /work/exp
run() { name=$1; shift; env "$@" timeout 600 /work/main/.venv/bin/python bench/cpu_split.py --row nvme+opt --batch 4 --seq 512 --steps 4 --warmup 2 --nvme-path /work/prof --top 3 --out /work/prof/ab1/$name.json > /work/prof/ab1/$name.txt 2>&1; echo "$name $(head -1 /work/prof/ab1/$name.txt | cut -c1-400)"; }
for r in 1 2; do
run base$r X=1
run trim$r EXP_TRIM=-1
run cap$r EXP_CAP=2147483648
run both$r EXP_TRIM=-1 EXP_CAP=2147483648
done
