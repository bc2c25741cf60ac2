#!/usr/bin/env bash
# The core C++ suites (te_tests, pg_core_tests) built with AddressSanitizer
# and UndefinedBehaviorSanitizer (leaks included) in build-asan/, then run.
# Any report fails the run. Not part of CI's default run: a cold build takes
# about 6 minutes on a 2-core machine (docs/security.md).
#   scripts/sanitize.sh
set -euo pipefail
cd "$(dirname "$0")/.."
flags="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
mkdir -p build-asan
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS=$flags" \
  "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=address,undefined" "-DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=address,undefined" \
  -DMOONCAKE_BUILD_PYTHON=OFF -DMOONCAKE_BUILD_BENCHMARKS=OFF -DMOONCAKE_WITH_CUDA=OFF -DMOONCAKE_WITH_EP=OFF \
  >build-asan/configure.log 2>&1 || { cat build-asan/configure.log; exit 1; }
cmake --build build-asan --target te_tests te_test_peer pg_core_tests
export ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1
status=0
for suite in build-asan/tests/cpp/te/te_tests build-asan/tests/cpp/pg/pg_core_tests; do
  echo "=== $suite"
  timeout 900 "$suite" --gtest_brief=1 || status=1
done
exit $status
