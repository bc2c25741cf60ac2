#!/usr/bin/env bash
# clang-format on the C++/CUDA lines changed since BASE (default: the
# merge-base with main, else HEAD~1): prints the changes it would make and
# exits 1 if there are any. Old lines are not reformatted in bulk.
#   scripts/check_format.sh [BASE]
set -euo pipefail
cd "$(dirname "$0")/.."
command -v clang-format-diff >/dev/null || { echo "check_format: clang-format-diff not found (Debian: clang-format)"; exit 2; }
base=${1:-$(git merge-base HEAD main 2>/dev/null || git rev-parse HEAD~1)}
# clang-format-diff's default -iregex leaves out .cu and .cuh: name them.
out=$(git diff -U0 --no-color "$base" -- '*.cpp' '*.h' '*.cu' '*.cuh' |
  clang-format-diff -p1 -style=file -iregex '.*\.(cpp|h|cu|cuh)')
if [ -n "$out" ]; then
  echo "$out"
  echo "check_format: the lines above changed since $base do not follow .clang-format"
  exit 1
fi
echo "check_format: lines changed since $base follow .clang-format"
