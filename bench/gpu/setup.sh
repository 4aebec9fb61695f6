#!/usr/bin/env bash
# Make this checkout runnable on the GPU machine (no network; torch preinstalled): install the
# wheels carried in bench/gpu/wheels where missing, then outcore itself without dependencies.
# Idempotent and quick, so every command of the GPU session can start with it.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_BREAK_SYSTEM_PACKAGES=1
PY=${PYTHON:-python3}
# only what is missing: pip keeps an installed package that satisfies the requirement
$PY -m pip install -q --find-links bench/gpu/wheels pydantic pytest xxhash
# transformers and peft in the `hf` extra's range, from bench/gpu/hf_wheels.sh's folder when
# carried (the image's own are kept where they satisfy it; their dependencies are there)
if [ -d bench/gpu/wheels/hf ]; then
  $PY -m pip install -q --no-deps --find-links bench/gpu/wheels/hf "transformers>=5.23,<6" \
    "peft>=0.21" || echo "setup: transformers/peft from bench/gpu/wheels/hf failed" >&2
fi
$PY -m pip install -q --no-deps --no-build-isolation -e . 2>/dev/null \
  || echo "setup: editable install failed; run with PYTHONPATH=$PWD" >&2
$PY - <<'PY'
import importlib.util
import sys
missing = [m for m in ("torch", "pydantic", "yaml", "safetensors", "tqdm", "psutil", "numpy",
                       "xxhash", "matplotlib", "pytest", "transformers")
           if importlib.util.find_spec(m) is None]
import torch
print(f"setup: python {sys.version.split()[0]}, torch {torch.__version__}, CUDA "
      f"{torch.version.cuda}, GPU {torch.cuda.get_device_name() if torch.cuda.is_available() else None}"
      f"; missing: {', '.join(missing) or 'nothing'}")
PY
