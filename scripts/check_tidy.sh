#!/usr/bin/env bash
# clang-tidy (.clang-tidy's checks) on the C++ files changed since BASE
# (default: .ci/lint-base) that the build compiles (build/compile_commands.json):
# prints the findings and exits 1 if there are any. CUDA sources are left to
# nvcc. Old files are not checked in bulk: a file is checked once it changes.
#   scripts/check_tidy.sh [BASE]
set -euo pipefail
cd "$(dirname "$0")/.."
command -v clang-tidy >/dev/null || { echo "check_tidy: clang-tidy not found (Debian: clang-tidy)"; exit 2; }
[ -f build/compile_commands.json ] || { echo "check_tidy: build/compile_commands.json missing (run scripts/setup.sh)"; exit 2; }
base=${1:-$(cat .ci/lint-base)}
mapfile -t files < <(python3 - "$base" <<'PY'
import json, subprocess, sys, os
changed = subprocess.run(["git", "diff", "--name-only", "--diff-filter=ACMR", sys.argv[1], "--", "*.cpp"],
                         capture_output=True, text=True, check=True).stdout.split()
compiled = {os.path.realpath(c["file"]) for c in json.load(open("build/compile_commands.json"))}
for f in changed:
    if os.path.realpath(f) in compiled:
        print(f)
PY
)
if [ ${#files[@]} -eq 0 ]; then
  echo "check_tidy: no compiled C++ file changed since $base"
  exit 0
fi
echo "check_tidy: ${#files[@]} file(s) changed since $base"
printf '%s\n' "${files[@]}" | xargs -P 2 -n 4 clang-tidy -p build --quiet 2>/dev/null
echo "check_tidy: clean"
