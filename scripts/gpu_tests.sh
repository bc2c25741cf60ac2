#!/usr/bin/env bash
# The GPU suites, on a machine with a CUDA device (CI has none: there these
# tests skip). Builds in build-gpu/ with the system compilers (a toolchain
# that links libstdc++ statically into Python modules crashes them), then
# runs the C++ GPU tests and the Python GPU tests.
#
#   scripts/gpu_tests.sh [pytest selection ...]     (default: every GPU test file)
#   GPU_CTEST='Ep|CudaIpcGroup' scripts/gpu_tests.sh   (the CTest regex; "" skips CTest)
set -euo pipefail
cd "$(dirname "$0")/.."
export CC=${CC_GPU:-/usr/bin/gcc} CXX=${CXX_GPU:-/usr/bin/g++} CUDAHOSTCXX=${CXX_GPU:-/usr/bin/g++}
ARCH=${CUDA_ARCH:-90}
[ -f build-gpu/build.ninja ] || cmake -S . -B build-gpu -G Ninja -DMOONCAKE_BUILD_BENCHMARKS=OFF \
  -DCMAKE_CUDA_ARCHITECTURES="$ARCH" > build-gpu.log
ninja -C build-gpu mooncake_pg_py mooncake_ep_ipc_py ep_cuda_tests ep_cuda_rank pg_cuda_tests pg_cuda_rank \
  >> build-gpu.log || { tail -40 build-gpu.log; exit 1; }
CTEST_REGEX=${GPU_CTEST-Ep|CudaIpcGroup}
if [ -n "$CTEST_REGEX" ]; then
  ctest --test-dir build-gpu -R "$CTEST_REGEX" --output-on-failure --timeout 120
fi
SELECTION=("$@")
[ ${#SELECTION[@]} -gt 0 ] || SELECTION=(tests/python/pg/test_cuda.py tests/python/ep/test_ep_cuda.py
                                         tests/python/ep/test_ep_ipc.py)
PYTHONPATH="$PWD/python" python3 -m pytest -q -ra "${SELECTION[@]}"
