#!/usr/bin/env bash
# An A/B of builds in one call on the GPU machine, which gets a copy of the
# working tree without git: B is the tree as it is, A the same tree with a
# diff taken back (made here before the call, in an untracked file that
# travels with the tree). All build side by side (the Python modules only),
# then the command runs once per build and repetition, alternating them,
# with PYTHONPATH pointing at that build and LABEL set to its label.
#
#   git diff BASE HEAD > ab.diff                                   # here
#   scripts/ab_on_device.sh ab.diff 'python3 benchmarks/ep_bench.py --device cuda --elastic-only \
#       --shape 128 4096 256 8 --worlds 1 --label $LABEL --csv $OUT/ab.csv --append'   # on the device
#
# Several diffs bisect a branch in one call: each makes a tree of its own,
# labelled A, C, D, ... in the order given, or by LABELS (one word per diff):
#
#   git diff main HEAD > main.diff; git diff HEAD~3 HEAD > cut.diff       # here
#   LABELS="main cut" scripts/ab_on_device.sh main.diff cut.diff 'COMMAND' # runs main, B, cut
#
# REPS (default 1): how many times over; MPS=1 runs the commands under an
# MPS daemon (several ranks sharing the GPU side by side); CMAKE_FLAGS adds
# to every build's configuration (-DMOONCAKE_EP_TRACE=ON: compare the
# kernels' steps with ep_bench.py --trace, which moves far less than a time
# taken from the host). A stays built in /tmp/ab-base, another label's tree
# in /tmp/ab-LABEL, until the machine goes back.
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: scripts/ab_on_device.sh DIFF [DIFF ...] COMMAND" >&2; exit 2; }
DIFFS=()
for diff in "${@:1:$#-1}"; do DIFFS+=("$(realpath "$diff")"); done
COMMAND=${!#}
cd "$(dirname "$0")/.." || exit 1
LOGS=${OUT:-/tmp}
export CC=${CC_GPU:-/usr/bin/gcc} CXX=${CXX_GPU:-/usr/bin/g++} CUDAHOSTCXX=${CXX_GPU:-/usr/bin/g++}

# The labels of the diffs' trees: LABELS, else A, C, D, ... (B is the tree as it is).
read -r -a NAMES <<< "${LABELS:-A C D E F G H I J K}"
[ ${#NAMES[@]} -ge ${#DIFFS[@]} ] || { echo "ab_on_device: LABELS names ${#NAMES[@]} trees for ${#DIFFS[@]} diffs" >&2; exit 2; }
DIFF_TREES=()
DIFF_LABELS=()
for i in "${!DIFFS[@]}"; do
  label=${NAMES[$i]}
  [ "$label" != B ] || { echo "ab_on_device: B is the tree as it is, not a diff's label" >&2; exit 2; }
  tree=$([ "$label" = A ] && echo /tmp/ab-base || echo "/tmp/ab-$label")
  rm -rf "$tree" && mkdir -p "$tree"
  tar --exclude=./build-gpu --exclude=./build -cf - . | tar -xf - -C "$tree"
  (cd "$tree" && patch -s -R -p1 < "${DIFFS[$i]}") ||
    { echo "ab_on_device: ${DIFFS[$i]} does not come off this tree" >&2; exit 1; }
  DIFF_TREES+=("$tree")
  DIFF_LABELS+=("$label")
done
# Runs go the first diff's tree, the tree as it is, then the other diffs' (A, B, C, ...).
TREES=("${DIFF_TREES[0]}" "$PWD" "${DIFF_TREES[@]:1}")
ORDER=("${DIFF_LABELS[0]}" B "${DIFF_LABELS[@]:1}")

JOBS=$(( $(nproc) / ${#TREES[@]} ))
[ $JOBS -ge 2 ] || JOBS=2
build() {  # tree, label
  # shellcheck disable=SC2086 # CMAKE_FLAGS: several words
  cmake -S "$1" -B "$1/build-gpu" -G Ninja -DMOONCAKE_BUILD_BENCHMARKS=OFF -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" \
    ${CMAKE_FLAGS:-} > "$LOGS/ab-build-$2.log" 2>&1 &&
    ninja -C "$1/build-gpu" -j$JOBS mooncake_pg_py mooncake_ep_ipc_py mooncake_engine_py >> "$LOGS/ab-build-$2.log" 2>&1
}
start=$(date +%s)
pids=()
for i in "${!TREES[@]}"; do build "${TREES[$i]}" "${ORDER[$i]}" & pids+=($!); done
for i in "${!TREES[@]}"; do
  wait "${pids[$i]}" || { echo "ab_on_device: ${ORDER[$i]} did not build (ab-build-${ORDER[$i]}.log)";
                          tail -20 "$LOGS/ab-build-${ORDER[$i]}.log"; exit 1; }
done
echo "ab_on_device: ${ORDER[*]} built in $(($(date +%s) - start)) s"

[ "${MPS:-0}" = 1 ] && nvidia-cuda-mps-control -d
status=0
for rep in $(seq "${REPS:-1}"); do
  for i in "${!TREES[@]}"; do
    echo "=== ${ORDER[$i]}, run $rep"
    LABEL=${ORDER[$i]} PYTHONPATH="${TREES[$i]}/python" bash -c "$COMMAND" || status=1
  done
done
[ "${MPS:-0}" = 1 ] && echo quit | nvidia-cuda-mps-control
echo "ab_on_device: done in $(($(date +%s) - start)) s"
exit $status
