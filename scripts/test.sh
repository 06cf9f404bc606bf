#!/usr/bin/env bash
# Set up the environment from nothing and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
.venv/bin/ruff check src tests benchmarks
exec .venv/bin/python -m pytest -n 2 -q "$@"
