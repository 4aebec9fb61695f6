#!/usr/bin/env bash
# Peak RSS and step time of gpt-335m with params + optimizer on NVMe: every block as it came,
# offloaded (--offload-activations) and checkpointed (--checkpoint), alternating, ROUNDS
# rounds, at 512 and 2048 tokens (batch 1 and 4 x 512), with the defaults and the smallest
# footprint (--lean). Run from a worktree: WT=/path/to/worktree bash ab.sh OUTDIR
set -euo pipefail
WT=${WT:?worktree}; OUTDIR=${1:?outdir}; ROUNDS=${ROUNDS:-2}
PY=/work/main/.venv/bin/python
mkdir -p "$OUTDIR"
for round in $(seq 1 "$ROUNDS"); do
  for lean in "" "--lean"; do
    for batch in 1 4; do
      for mode in none offload checkpoint; do
        flag=""; [ "$mode" = offload ] && flag="--offload-activations"
        [ "$mode" = checkpoint ] && flag="--checkpoint"
        name="r${round}-b${batch}${lean:+-lean}-${mode}"
        echo "[$(date -u +%H:%M:%S)] $name"
        PYTHONPATH=$WT $PY "$WT/bench/rss_split.py" --batch "$batch" --steps 4 $lean $flag \
          --nvme-path /work/prof/rss-swap > "$OUTDIR/$name.json" 2> "$OUTDIR/$name.err" || echo "FAILED $name"
      done
    done
  done
done
