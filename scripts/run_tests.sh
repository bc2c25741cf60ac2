#!/usr/bin/env bash
# Sets up a fresh machine (scripts/setup.sh), then runs every test: the C++
# suites through CTest and the Python suites through pytest. Each test has a
# hard timeout, so a hang fails instead of blocking.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# Each phase says how long it took: the whole run must stay well under CI's limit.
phase_start=$SECONDS
took() { echo "== $1 took $((SECONDS - phase_start)) s"; phase_start=$SECONDS; }
scripts/setup.sh
took "setup and build"

# clang-format and clang-tidy on what changed since .ci/lint-base (old code is
# not reformatted in bulk; each change is held to the rules). Needs the build's
# compile_commands.json, so it runs after setup. Once a landing passed it, the
# base may move to that landing's commit, which keeps the check short.
echo "== format and lint of the C++ changed since $(cat .ci/lint-base)"
scripts/check_format.sh "$(cat .ci/lint-base)"
scripts/check_tidy.sh
took "format and lint"

echo "== C++ tests (ctest)"
ctest --test-dir build --output-on-failure -j2 --timeout 300
took "ctest"

echo "== Python tests (pytest)"
PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m pytest -q -ra --durations=15 tests/python
took "pytest"

# ElasticBuffer's NCCL transport compiles (-DMOONCAKE_WITH_NCCL_DEVICE=ON in
# build-nccl/, against PyPI's nvidia-nccl-cu13 headers, one CUDA arch); it
# skips, saying why, without a CUDA toolkit or without PyPI and a cached wheel.
if [ "${NCCL_BUILD:-1}" != 0 ]; then
  echo "== NCCL transport: compile only"
  scripts/build_nccl_device.sh
  took "NCCL transport build"
fi

# The install users type: an isolated `pip wheel .`, installed into a fresh
# virtual environment, runs the quick start (WHEEL_SMOKE=0 skips it).
if [ "${WHEEL_SMOKE:-1}" != 0 ]; then
  echo "== pip wheel . into a fresh environment"
  scripts/wheel_smoke.sh
  took "wheel smoke"
fi

# The wire-facing decoders under libFuzzer with ASan/UBSan, from their seed
# corpora, bounded (docs/security.md). Skipped, saying so, without clang.
if command -v clang++ >/dev/null; then
  echo "== fuzz targets (${FUZZ_SECONDS:-30} s each)"
  FUZZ_SECONDS=${FUZZ_SECONDS:-30} scripts/fuzz.sh
  took "fuzz targets"
else
  echo "== fuzz targets skipped: clang++ not found (Debian: clang)"
fi
# One core suite under ASan/UBSan per run, the other the next day
# (SANITIZE=te, pg, both, or 0 to skip; default: by the day of the year's parity).
day=$((10#$(date +%j)))
SANITIZE=${SANITIZE:-$([ $((day % 2)) = 0 ] && echo te || echo pg)}
if [ "$SANITIZE" != 0 ]; then
  echo "== ASan/UBSan: $SANITIZE"
  if [ "$SANITIZE" = both ]; then scripts/sanitize.sh te pg; else scripts/sanitize.sh "$SANITIZE"; fi
  took "sanitizers ($SANITIZE)"
fi
echo "== all tests took $SECONDS s"
