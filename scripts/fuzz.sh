#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz (clang, ASan + UBSan, every
# library instrumented) in build-fuzz/ and runs each for FUZZ_SECONDS
# (default 30) from its seed corpus in tests/fuzz/corpus/<target>/. A crash,
# a leak or a sanitizer report fails the run; its input is kept in
# build-fuzz/artifacts/ (add it to the corpus with a regression test).
#
#   scripts/fuzz.sh                 # every target
#   FUZZ_SECONDS=300 scripts/fuzz.sh fuzz_control_frames
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=${FUZZ_SECONDS:-30}
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(fuzz_control_frames fuzz_segment_descriptor fuzz_connection_opening fuzz_eager_slot)

if ! command -v clang++ >/dev/null; then
  echo "fuzz.sh: clang++ not found (Debian: clang); the fuzz targets need libFuzzer" >&2
  exit 1
fi
CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DMOONCAKE_BUILD_FUZZERS=ON -DMOONCAKE_BUILD_PYTHON=OFF -DMOONCAKE_BUILD_TESTS=OFF \
  -DMOONCAKE_BUILD_BENCHMARKS=OFF -DMOONCAKE_WITH_CUDA=OFF -DMOONCAKE_WITH_EP=OFF -DMOONCAKE_WITH_RDMA=OFF >/dev/null
cmake --build build-fuzz --target "${TARGETS[@]}"

mkdir -p build-fuzz/artifacts
status=0
for target in "${TARGETS[@]}"; do
  work=build-fuzz/corpus/$target
  mkdir -p "$work"
  echo "=== $target: ${SECONDS_EACH} s"
  # The working corpus grows in build-fuzz; the seeds in the repository stay as they are.
  if ! ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
      "build-fuzz/tests/fuzz/$target" -max_total_time="$SECONDS_EACH" -timeout=10 -rss_limit_mb=2048 \
      -print_final_stats=1 -artifact_prefix="build-fuzz/artifacts/$target-" "$work" "tests/fuzz/corpus/$target" \
      2>"build-fuzz/$target.log"; then
    echo "$target FAILED: see build-fuzz/$target.log and build-fuzz/artifacts/" >&2
    tail -30 "build-fuzz/$target.log" >&2
    status=1
  else
    grep -E "stat::number_of_executed_units|Done [0-9]+ runs" "build-fuzz/$target.log" | tail -2
  fi
done
exit $status
