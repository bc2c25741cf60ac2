#!/usr/bin/env bash
# The runs behind docs/benchmarks/ep_cuda.md and moe_ep_cuda.md, on a host
# with one CUDA GPU (every rank on GPU 0): builds the Python modules in
# build-gpu/ with the system compilers (as scripts/gpu_tests.sh), then runs
# benchmarks/ep_bench.py and benchmarks/moe_ep_bench.py at worlds 1, 2, 4
# with the ranks time-sharing the GPU, and again at worlds 2 and 4 under MPS.
#
#   bash benchmarks/ep_cuda_runs.sh [output folder]     (default: docs/benchmarks)
#
# Writes ep_cuda.csv, moe_ep_cuda.csv and runs.log there. Each step has its
# own time limit (STEP_LIMIT seconds, default 150), so that one hung world
# does not take the others with it; ITERS (default 20) timed calls per row;
# STEPS="ep" or "moe" runs one of the two benchmarks (default both).
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-docs/benchmarks}
LIMIT=${STEP_LIMIT:-150}
ITERS=${ITERS:-20}  # timed calls per row (after 5 warm-ups)
STEPS=${STEPS:-"ep moe"}  # which benchmarks run
mkdir -p "$DEST"
export CC=${CC_GPU:-/usr/bin/gcc} CXX=${CXX_GPU:-/usr/bin/g++} CUDAHOSTCXX=${CXX_GPU:-/usr/bin/g++}
start=$(date +%s)
{ [ -f build-gpu/build.ninja ] || cmake -S . -B build-gpu -G Ninja -DMOONCAKE_BUILD_BENCHMARKS=OFF \
    -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}"; } > "$DEST/build.log" 2>&1 &&
  ninja -C build-gpu mooncake_pg_py mooncake_ep_ipc_py mooncake_engine_py >> "$DEST/build.log" 2>&1 ||
  { tail -40 "$DEST/build.log"; exit 1; }
echo "built in $(( $(date +%s) - start )) s"
export PYTHONPATH="$PWD/python" PYTHONUNBUFFERED=1 MOONCAKE_TEST_GPUS=1
LOG="$DEST/runs.log"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c 'import torch; print("torch", torch.__version__, "GPUs", torch.cuda.device_count())'; } | tee "$LOG"
status=0
step() {  # name, command...
  local t0; t0=$(date +%s)
  echo "=== $1" | tee -a "$LOG"
  shift
  timeout -k 5 "$LIMIT" "$@" >> "$LOG" 2>&1 || { echo "step failed: rc $?" | tee -a "$LOG"; status=1; }
  echo "=== $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
}
has() { [[ " $STEPS " == *" $1 "* ]]; }
has ep && step "ep, time-sliced" python3 benchmarks/ep_bench.py --device cuda --worlds 1 2 4 --label time-sliced \
  --iters "$ITERS" --csv "$DEST/ep_cuda.csv"
has moe && step "moe_ep, time-sliced" python3 benchmarks/moe_ep_bench.py --worlds 1 2 4 --label time-sliced \
  --iters "$ITERS" --csv "$DEST/moe_ep_cuda.csv"
if nvidia-cuda-mps-control -d; then
  has ep && step "ep, mps" python3 benchmarks/ep_bench.py --device cuda --worlds 2 4 --label mps \
    --iters "$ITERS" --csv "$DEST/ep_cuda.csv" --append
  has moe && step "moe_ep, mps" python3 benchmarks/moe_ep_bench.py --worlds 2 4 --label mps --no-dense \
    --iters "$ITERS" --csv "$DEST/moe_ep_cuda.csv" --append
  echo quit | nvidia-cuda-mps-control
else
  echo "MPS did not start: no mps rows" | tee -a "$LOG"
fi
grep '^\[' "$LOG" || true
echo "total $(( $(date +%s) - start )) s"
exit $status
