#!/usr/bin/env bash
# Fetch, on this machine, the Hugging Face wheels the GPU image lacks in a supported version
# (it has transformers 5.17; outcore's `hf` extra needs >=5.23). They land in
# bench/gpu/wheels/hf/ (ignored by git, 14 MB): name that folder in the device call's `carry`,
# and bench/gpu/setup.sh installs them there.
set -euo pipefail
cd "$(dirname "$0")/../.."
PIP=${PIP:-.venv/bin/pip}
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 -d bench/gpu/wheels/hf "transformers==5.24.0" "peft==0.21.2"
ls -la bench/gpu/wheels/hf
