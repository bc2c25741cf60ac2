#!/usr/bin/env bash
# The GPU suites, on a machine with a CUDA device (CI has none: there these
# tests skip). Builds in build-gpu/ with the system compilers (a toolchain
# that links libstdc++ statically into Python modules crashes them), then
# runs the C++ GPU tests and the Python GPU tests, once per placement of the
# ranks: every rank on GPU 0 (several processes sharing it), and, on a host
# with several GPUs, spread one rank per GPU (rank r on GPU r % G). Both the
# C++ rank programs and the Python harness read the placement from
# MOONCAKE_TEST_GPUS (python/mooncake/_gpu_placement.py).
#
#   scripts/gpu_tests.sh [pytest selection ...]       (default: every GPU test file)
#   GPU_CTEST='^EpIpcGroup\.' scripts/gpu_tests.sh     (the CTest regex; "" skips CTest)
#   GPU_PLACEMENTS="1" scripts/gpu_tests.sh            (only the shared-GPU placement;
#                                                       default "1 all" on several GPUs)
# Both placements together took 561 s on two H200s (2026-11-29): against the
# device's 600 s per call, run GPU_PLACEMENTS=all and GPU_PLACEMENTS=1 in two.
set -euo pipefail
cd "$(dirname "$0")/.."
export CC=${CC_GPU:-/usr/bin/gcc} CXX=${CXX_GPU:-/usr/bin/g++} CUDAHOSTCXX=${CXX_GPU:-/usr/bin/g++}
ARCH=${CUDA_ARCH:-90}
[ -f build-gpu/build.ninja ] || cmake -S . -B build-gpu -G Ninja -DMOONCAKE_BUILD_BENCHMARKS=OFF \
  -DCMAKE_CUDA_ARCHITECTURES="$ARCH" > build-gpu.log
ninja -C build-gpu mooncake_pg_py mooncake_ep_ipc_py mooncake_engine_py ep_cuda_tests ep_cuda_rank pg_cuda_tests \
  pg_cuda_rank te_tests >> build-gpu.log || { tail -40 build-gpu.log; exit 1; }

GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")  # honours CUDA_VISIBLE_DEVICES, as gpu_bench.sh
echo "GPUs: $GPUS"
[ "$GPUS" -gt 1 ] && nvidia-smi topo -m || true
PLACEMENTS=${GPU_PLACEMENTS:-$([ "$GPUS" -gt 1 ] && echo "1 all" || echo "1")}
# Only the GPU suites of the C++ tests (the CPU ones run in CI).
DEFAULT_CTEST='^(EpIpcGroup|EpReference|EpRegionLayout|CudaIpcGroup|CudaSchedule|CudaIpc|SoftVerbsGpu)\.'
CTEST_REGEX=${GPU_CTEST-$DEFAULT_CTEST}
SELECTION=("$@")
[ ${#SELECTION[@]} -gt 0 ] || SELECTION=(tests/python/pg/test_cuda.py tests/python/ep/test_ep_cuda.py
                                         tests/python/ep/test_ep_ipc.py tests/python/ep/test_elastic_cuda.py
                                         tests/python/ep/test_elastic_layout_kernels.py
                                         tests/python/ep/test_ep_elastic_mode.py
                                         tests/python/ep/test_moe_ep.py
                                         tests/python/te/test_cuda_ipc.py)
status=0
for placement in $PLACEMENTS; do
  if [ "$placement" = all ]; then unset MOONCAKE_TEST_GPUS; else export MOONCAKE_TEST_GPUS=$placement; fi
  echo "=== placement: ${MOONCAKE_TEST_GPUS:-every GPU} (rank r on GPU r % G)"
  if [ -n "$CTEST_REGEX" ]; then
    ctest --test-dir build-gpu -R "$CTEST_REGEX" --output-on-failure --timeout 120 || status=1
  fi
  PYTHONPATH="$PWD/python" python3 -m pytest -q -ra "${SELECTION[@]}" || status=1
done
exit $status
