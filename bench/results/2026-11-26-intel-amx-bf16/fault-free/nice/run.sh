#!/bin/bash
cd /work/exp
run() { name=$1; shift; env "$@" timeout 600 /work/main/.venv/bin/python bench/cpu_split.py --row nvme+opt --batch 4 --seq 512 --steps 4 --warmup 2 --nvme-path /work/prof --phases --top 3 --out /work/prof/nice/$name.json > /work/prof/nice/$name.txt 2>&1; echo "$name $(head -2 /work/prof/nice/$name.txt | cut -c60-400)"; }
for r in 1 2; do
run n0-$r X=1
run n5-$r EXP_NICE=5
run n10-$r EXP_NICE=10
run n19-$r EXP_NICE=19
done
