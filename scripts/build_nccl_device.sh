#!/usr/bin/env bash
# Compiles ElasticBuffer's NCCL transport (-DMOONCAKE_WITH_NCCL_DEVICE=ON) in
# a build folder of its own, against the NCCL headers of PyPI's
# nvidia-nccl-cu13 (the first wheel with NCCL >= 2.30.4's device API). CI's
# check that the transport compiles; nothing here runs it (that needs two
# GPUs and the wheel's libnccl.so.2 preloaded: docs/ep-elastic.md).
#
# The wheel is fetched by name with `pip download --no-deps` into a cache
# outside the repository (MOONCAKE_NCCL_CACHE, default ~/.cache/mooncake/nccl)
# and reused when present; nothing is vendored, and the CMake build itself
# downloads nothing. Without PyPI and without a cached wheel it skips, saying
# so, and succeeds. One CUDA architecture (90) keeps it short.
#   MOONCAKE_NCCL_BUILD_DIR   build folder (default build-nccl)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEEL_SPEC="nvidia-nccl-cu13==2.32.6"
CACHE=${MOONCAKE_NCCL_CACHE:-$HOME/.cache/mooncake/nccl}
BUILD=${MOONCAKE_NCCL_BUILD_DIR:-build-nccl}
ROOT="$CACHE/nvidia-nccl-cu13-2.32.6"  # include/ and lib/ of the wheel

if ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "build_nccl_device: skipped: no CUDA toolkit (nvcc), which the transport's kernels need"
  exit 0
fi

if [ ! -f "$ROOT/include/nccl_device.h" ]; then
  mkdir -p "$CACHE"
  wheel=$(ls "$CACHE"/nvidia_nccl_cu13-2.32.6-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$wheel" ]; then
    if ! "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
         -d "$CACHE" "$WHEEL_SPEC" >"$CACHE/pip-download.log" 2>&1; then
      echo "build_nccl_device: skipped: pip cannot fetch $WHEEL_SPEC from PyPI (see $CACHE/pip-download.log)"
      exit 0
    fi
    wheel=$(ls "$CACHE"/nvidia_nccl_cu13-2.32.6-*.whl | head -1)
  fi
  # Only nvidia/nccl/include/ and nvidia/nccl/lib/, into $ROOT.
  "$PYTHON" - "$wheel" "$ROOT" <<'PY'
import pathlib, shutil, sys, zipfile
wheel, root = sys.argv[1], pathlib.Path(sys.argv[2])
staging = root.with_name(root.name + ".partial")
shutil.rmtree(staging, ignore_errors=True)
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        for part in ("include", "lib"):
            prefix = f"nvidia/nccl/{part}/"
            if name.startswith(prefix) and not name.endswith("/"):
                target = staging / part / name[len(prefix):]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(z.read(name))
shutil.rmtree(root, ignore_errors=True)
staging.rename(root)
PY
fi

echo "build_nccl_device: NCCL headers from $ROOT, build folder $BUILD"
cmake -S . -B "$BUILD" -G Ninja -DPython_EXECUTABLE="$(command -v "$PYTHON")" \
  -DMOONCAKE_WITH_NCCL_DEVICE=ON -DNCCL_ROOT="$ROOT" -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DMOONCAKE_BUILD_BENCHMARKS=OFF -DMOONCAKE_PYTHON_PACKAGE_DIR="$PWD/$BUILD/python/mooncake" \
  >"$BUILD.configure.log" 2>&1 || { cat "$BUILD.configure.log"; exit 1; }
rm -f "$BUILD.configure.log"
cmake --build "$BUILD" -j2 --target mooncake_ep_nccl mooncake_ep_nccl_py ep_nccl_rules_tests

# NCCL is opened at run time, never linked: a linked symbol would make the
# module fail to load beside torch's older NCCL instead of saying so.
module=$(ls "$BUILD"/python/mooncake/_ep_nccl*.so)
if nm -D --undefined-only "$module" | grep -qw 'nccl[A-Za-z]*'; then
  echo "build_nccl_device: $module links NCCL symbols:"
  nm -D --undefined-only "$module" | grep -w 'nccl[A-Za-z]*'
  exit 1
fi
echo "build_nccl_device: the NCCL transport compiles ($module)"
