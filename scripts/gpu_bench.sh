#!/usr/bin/env bash
# The GPU benchmarks whose results go to docs/, in one go (after
# scripts/gpu_tests.sh has built build-gpu/ and put the modules in python/).
# Outputs land in $OUT (default bench-out/): pgbench logs for
# plot_pgbench_cuda.py, the EP low-latency CSV for plot_ep_ll.py.
#
#   OUT=/some/dir scripts/gpu_bench.sh
#
# On a host with several GPUs the ranks run one per GPU (MOONCAKE_TEST_GPUS
# unset): all_reduce of "mooncake" against NCCL at world 2 (and 4 with four
# GPUs), which the issue compares by bus bandwidth, eagerly and replayed from
# CUDA graphs (-G: the GPU side without the host's launch cost), and the EP benchmark with
# its peer-GPU copy bound. On one GPU: the shared-GPU runs, time-sliced and
# under MPS (NCCL refuses several ranks on one GPU; it runs at world 1 only).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/python"
export MOONCAKE_PG_REQUIRE_CUDA_IPC=1  # never time the staged path by mistake
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")  # honours CUDA_VISIBLE_DEVICES
SIZES=(-b 4K -e 256M -f 4 -w 5 -n 50)
run() {  # name, then the command; a failure is reported and the others still run
  local name=$1
  shift
  echo "=== $name"
  "$@" > "$OUT/$name.txt" 2>&1 || echo "FAILED: $name (see $OUT/$name.txt)"
  grep -E "^ +[0-9]|^world" "$OUT/$name.txt" | tail -4
}

run nccl_w1 python3 benchmarks/pgbench.py --collective all_reduce --backend nccl -g 1 "${SIZES[@]}"
run mooncake_w1 python3 benchmarks/pgbench.py --collective all_reduce --backend mooncake -g 1 "${SIZES[@]}"
if [ "$GPUS" -gt 1 ]; then
  unset MOONCAKE_TEST_GPUS  # rank r on GPU r % GPUS
  for w in 2 4; do
    [ "$w" -le "$GPUS" ] || continue
    run "nccl_w${w}_spread" python3 benchmarks/pgbench.py --collective all_reduce --backend nccl -g "$w" "${SIZES[@]}"
    run "mooncake_w${w}_spread" python3 benchmarks/pgbench.py --collective all_reduce --backend mooncake -g "$w" \
      "${SIZES[@]}" --bound
    # The GPU side alone (the calls captured in a CUDA graph): both backends.
    run "nccl_w${w}_spread_graph" python3 benchmarks/pgbench.py --collective all_reduce --backend nccl -g "$w" \
      "${SIZES[@]}" -G 5
    run "mooncake_w${w}_spread_graph" python3 benchmarks/pgbench.py --collective all_reduce --backend mooncake \
      -g "$w" "${SIZES[@]}" -G 5
    # Small all_reduces as one kernel (CudaIpcGroupOptions::fused_bytes, off by default), up to 4 MiB.
    for mode in "" "-G 5"; do
      MOONCAKE_PG_CUDA_FUSED_BYTES=65536 run "mooncake_w${w}_spread_fused${mode:+_graph}" python3 \
        benchmarks/pgbench.py --collective all_reduce --backend mooncake -g "$w" -b 4K -e 4M -f 4 -w 5 -n 50 $mode
    done
  done
  worlds=(2)
  [ "$GPUS" -ge 4 ] && worlds=(2 4)
  run ep_ll_spread python3 benchmarks/ep_ll_bench.py --worlds "${worlds[@]}" --iters 30 --collective-iters 3 \
    --label spread --csv "$OUT/ep_ll.csv"
else
  export MOONCAKE_TEST_GPUS=1
  for w in 2 4; do
    run "mooncake_w${w}_shared" python3 benchmarks/pgbench.py --collective all_reduce --backend mooncake -g "$w" \
      "${SIZES[@]}" --bound
  done
  run ep_ll_shared python3 benchmarks/ep_ll_bench.py --worlds 1 2 4 --iters 30 --collective-iters 3 \
    --label time-sliced --csv "$OUT/ep_ll.csv"
  if nvidia-cuda-mps-control -d; then
    sleep 1
    for w in 2 4; do
      run "mooncake_w${w}_mps" python3 benchmarks/pgbench.py --collective all_reduce --backend mooncake -g "$w" \
        "${SIZES[@]}" --bound
    done
    run ep_ll_mps python3 benchmarks/ep_ll_bench.py --worlds 2 4 --iters 30 --collective-iters 3 --label mps \
      --csv "$OUT/ep_ll.csv" --append
    echo quit | nvidia-cuda-mps-control
  else
    echo "MPS did not start: no MPS runs"
  fi
fi
echo "outputs in $OUT"
