#!/usr/bin/env bash
# Set up the environment from nothing and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The [triton] extra: its kernels are tested on the CPU in Triton's interpreter (tests/kernels/test_triton_*).
.venv/bin/python -m pip install -q -e ".[triton]" 2>&1 | grep -v '^WARNING: Location' || true
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
exec .venv/bin/python -m pytest -n 2 -q "$@"
