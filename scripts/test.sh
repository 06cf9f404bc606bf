#!/usr/bin/env bash
# Set up the environment from nothing and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The report is checked in a real browser (tests/runner/test_browser.py): install Debian's chromium when missing.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo -n"
  { $SUDO apt-get install -y -q chromium >/dev/null 2>&1 \
    || { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q chromium >/dev/null 2>&1; }; } \
    || echo "warning: could not install chromium (apt-get); the browser checks of the report will be skipped" >&2
fi
# The [triton] extra: its kernels are tested on the CPU in Triton's interpreter (tests/kernels/test_triton_*).
.venv/bin/python -m pip install -q -e ".[triton]" 2>&1 | grep -v '^WARNING: Location' || true
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
# One thread per test process: pytest -n 2 runs two processes on two cores, and more threads than cores
# slow small tensor operations by several times (tests of threaded kernels set their thread counts).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
.venv/bin/ruff check src tests benchmarks
exec .venv/bin/python -m pytest -n 2 -q "$@"
