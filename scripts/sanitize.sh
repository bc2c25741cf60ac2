#!/usr/bin/env bash
# The core C++ suites (te_tests, pg_core_tests) built with AddressSanitizer
# and UndefinedBehaviorSanitizer (leaks included) in build-asan/, then run.
# Any report fails the run. A cold build of both takes about 6 minutes on a
# 2-core machine, so CI runs one suite per run, alternating by the day of the
# year (scripts/run_tests.sh; docs/security.md).
#   scripts/sanitize.sh [te] [pg]      (default: both)
set -euo pipefail
cd "$(dirname "$0")/.."
suites=("$@")
[ ${#suites[@]} -gt 0 ] || suites=(te pg)
targets=() programs=()
for s in "${suites[@]}"; do
  case "$s" in
    te) targets+=(te_tests te_test_peer); programs+=(build-asan/tests/cpp/te/te_tests) ;;
    pg) targets+=(pg_core_tests); programs+=(build-asan/tests/cpp/pg/pg_core_tests) ;;
    *) echo "sanitize.sh: unknown suite '$s' (te or pg)" >&2; exit 2 ;;
  esac
done
flags="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
mkdir -p build-asan
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS=$flags" \
  "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=address,undefined" "-DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=address,undefined" \
  -DMOONCAKE_BUILD_PYTHON=OFF -DMOONCAKE_BUILD_BENCHMARKS=OFF -DMOONCAKE_WITH_CUDA=OFF -DMOONCAKE_WITH_EP=OFF \
  >build-asan/configure.log 2>&1 || { cat build-asan/configure.log; exit 1; }
cmake --build build-asan --target "${targets[@]}"
export ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1
status=0
for suite in "${programs[@]}"; do
  echo "=== $suite"
  timeout 900 "$suite" --gtest_brief=1 || status=1
done
exit $status
