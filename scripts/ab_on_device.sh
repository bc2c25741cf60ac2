#!/usr/bin/env bash
# An A/B of two builds in one call on the GPU machine, which gets a copy of
# the working tree without git: B is the tree as it is, A the same tree with
# a diff taken back (made here before the call, in an untracked file that
# travels with the tree). Both build side by side (the Python modules only),
# then the command runs once per build and repetition, alternating A and B,
# with PYTHONPATH pointing at that build and LABEL set to A or B.
#
#   git diff BASE HEAD > ab.diff                                   # here
#   scripts/ab_on_device.sh ab.diff 'python3 benchmarks/ep_bench.py --device cuda --elastic-only \
#       --shape 128 4096 256 8 --worlds 1 --label $LABEL --csv $OUT/ab.csv --append'   # on the device
#
# REPS (default 1): how many times over; MPS=1 runs the commands under an
# MPS daemon (several ranks sharing the GPU side by side); CMAKE_FLAGS adds
# to both builds' configuration (-DMOONCAKE_EP_TRACE=ON: compare the
# kernels' steps with ep_bench.py --trace, which moves far less than a time
# taken from the host). A stays built in /tmp/ab-base until the machine goes back.
set -uo pipefail
[ $# -eq 2 ] || { echo "usage: scripts/ab_on_device.sh DIFF COMMAND" >&2; exit 2; }
DIFF=$(realpath "$1")
cd "$(dirname "$0")/.." || exit 1
COMMAND=$2
BASE=/tmp/ab-base
LOGS=${OUT:-/tmp}
export CC=${CC_GPU:-/usr/bin/gcc} CXX=${CXX_GPU:-/usr/bin/g++} CUDAHOSTCXX=${CXX_GPU:-/usr/bin/g++}

rm -rf "$BASE" && mkdir -p "$BASE"
tar --exclude=./build-gpu --exclude=./build -cf - . | tar -xf - -C "$BASE"
(cd "$BASE" && patch -s -R -p1 < "$DIFF") || { echo "ab_on_device: $1 does not come off this tree" >&2; exit 1; }

build() {  # tree, label
  # shellcheck disable=SC2086 # CMAKE_FLAGS: several words
  cmake -S "$1" -B "$1/build-gpu" -G Ninja -DMOONCAKE_BUILD_BENCHMARKS=OFF -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" \
    ${CMAKE_FLAGS:-} > "$LOGS/ab-build-$2.log" 2>&1 &&
    ninja -C "$1/build-gpu" -j8 mooncake_pg_py mooncake_ep_ipc_py mooncake_engine_py >> "$LOGS/ab-build-$2.log" 2>&1
}
start=$(date +%s)
build "$PWD" B & b=$!
build "$BASE" A & a=$!
wait $b || { echo "ab_on_device: B did not build (ab-build-B.log)"; tail -20 "$LOGS/ab-build-B.log"; exit 1; }
wait $a || { echo "ab_on_device: A did not build (ab-build-A.log)"; tail -20 "$LOGS/ab-build-A.log"; exit 1; }
echo "ab_on_device: both built in $(($(date +%s) - start)) s"

[ "${MPS:-0}" = 1 ] && nvidia-cuda-mps-control -d
status=0
for rep in $(seq "${REPS:-1}"); do
  for label in A B; do
    tree=$([ $label = A ] && echo "$BASE" || echo "$PWD")
    echo "=== $label, run $rep"
    LABEL=$label PYTHONPATH="$tree/python" bash -c "$COMMAND" || status=1
  done
done
[ "${MPS:-0}" = 1 ] && echo quit | nvidia-cuda-mps-control
echo "ab_on_device: done in $(($(date +%s) - start)) s"
exit $status
