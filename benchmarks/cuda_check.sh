#!/usr/bin/env bash
# The checks and timings that need a CUDA GPU, in one run: the CUDA tests (tests/cuda: the Triton kernels
# compiled, against the float64 reference), `attnkit bench --device cuda` and the tile sweep of the Triton
# potential kernels (benchmarks/triton_tiles.py). Usage: bash benchmarks/cuda_check.sh OUT_DIR
# Runs from a source checkout with the Python that has torch and triton (PYTHON, default python3).
set -uo pipefail
OUT="${1:?usage: bash benchmarks/cuda_check.sh OUT_DIR}"
case "$OUT" in /*) ;; *) OUT="$PWD/$OUT" ;; esac  # the caller's folder, before the cd below
if [ -e "$OUT" ] && [ -n "$(ls -A "$OUT" 2>/dev/null)" ]; then  # an earlier GPU run's results are kept
  echo "error: $OUT is not empty; pass a new folder (the results of an earlier run would be replaced)" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "error: no CUDA device is visible to $PY (torch.cuda.is_available() is False); run this on a GPU" >&2
  exit 2
fi
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" ATTNKIT_NO_CPP=1 TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
CLI=("$PY" -c "import sys; from attnkit.cli import main; sys.argv[0] = 'attnkit'; main()")  # attnkit ...
failed=()  # the steps that did not exit 0; the script's exit code is 1 when any did
step() {  # step NAME STATUS
  [ "$2" -eq 0 ] || failed+=("$1 (exit $2)")
}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
step nvidia-smi $?
"$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/gpu.txt"
step versions $?
start=$(date +%s)
# compile-heavy parts side by side (CPU cores), the timed parts one at a time afterwards
timeout "${TEST_TIMEOUT:-200}" "$PY" -m pytest tests/cuda -q -n "${TEST_WORKERS:-10}" -p no:cacheprovider \
  > "$OUT/cuda_tests.log" 2>&1 &
tests=$!
compiles=()
# the tile sweep's candidates: the tiles whose sm_90 builds keep each kernel in registers, per head size
# (written by `triton_tiles.py --phase candidates`); both head sizes of the half-precision table
CANDIDATES=(--candidates benchmarks/tile_candidates.json)
mkdir -p "$OUT/tiles_logs"
for D in 64 128; do
  for kernel in col_fwd row_fwd col_bwd row_bwd row_fwd_hybrid col_bwd_hybrid row_bwd_hybrid; do
    timeout 200 "$PY" benchmarks/triton_tiles.py --phase compile --kernel "$kernel" --shape "4,16,4096,$D" \
      "${CANDIDATES[@]}" > "$OUT/tiles_logs/${kernel}_$D.log" 2>&1 &
    compiles+=($!)
  done
done
wait $tests; status=$?; step tests/cuda $status
echo "tests exit $status after $(( $(date +%s) - start )) s"; tail -n 25 "$OUT/cuda_tests.log"
for pid in "${compiles[@]}"; do wait "$pid"; step "tile compile phase" $?; done
echo "compile phase done after $(( $(date +%s) - start )) s"; tail -n 3 "$OUT"/tiles_logs/*.log
timeout 120 "${CLI[@]}" bench --device cuda --lengths 1024,4096,8192 --backends efficient,reference --repeats 5 \
  --no-memory --out "$OUT/bench_cuda.json" --overwrite 2>&1 | tail -n 30
step "bench B=1 H=8" $?
# B=1, H=8 leaves SDPA's flash kernel launch-bound below L=8192: the same at a batch that fills the GPU
timeout 60 "${CLI[@]}" bench --device cuda --lengths 4096 --batch 4 --heads 16 --backends efficient --repeats 5 \
  --no-memory --out "$OUT/bench_cuda_b4h16.json" --overwrite 2>&1 | tail -n 9
step "bench B=4 H=16" $?
echo "bench done after $(( $(date +%s) - start )) s"
for D in 64 128; do
  timeout 120 "$PY" benchmarks/triton_tiles.py --phase time --shape "4,16,4096,$D" "${CANDIDATES[@]}" \
    --out "$OUT/tiles_$D.json" 2>&1 | tail -n 8
  step "tile sweep D=$D" $?
done
echo "sweep done after $(( $(date +%s) - start )) s"
timeout 100 "${CLI[@]}" bench --device cuda --lengths 4096 --backends efficient,flex --repeats 5 \
  --out "$OUT/bench_cuda_flex.json" --overwrite 2>&1 | tail -n 16
step "bench flex" $?
echo "all done after $(( $(date +%s) - start )) s"
if [ ${#failed[@]} -gt 0 ]; then
  printf 'failed: %s\n' "${failed[@]}" >&2
  exit 1
fi
