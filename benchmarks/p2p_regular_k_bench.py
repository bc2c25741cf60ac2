"""Regular-k point-to-point benchmark: every iteration, rank r receives
from r-1..r-k and sends to r+1..r+k (mod W) in one batch_isend_irecv.

    python3 benchmarks/p2p_regular_k_bench.py --backend mooncake-cpu -g 4 -k 2 --tensor-bytes 4M

Latency of an iteration is the slowest rank's. Prints lat_mean_us lat_p50_us
lat_p95_us lat_p99_us rank_bidir_GBps (2*k*bytes/mean) cluster_bidir_GBps
(rank_bidir * W) wrong (elements that differ from what was sent, over all
iterations and ranks; -c 0 skips the check).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
from pgbench import DTYPES, parse_size  # noqa: E402


def run(rank: int, world: int, args) -> None:
    os.environ.update(MASTER_ADDR=args.master_addr, MASTER_PORT=str(args.master_port))
    if args.backend.startswith("mooncake"):
        from mooncake import pg  # noqa: F401
    if args.device == "cuda":
        from mooncake._gpu_placement import gpu_of_rank  # noqa: PLC0415

        device = torch.device("cuda", gpu_of_rank(rank))
        torch.cuda.set_device(device)  # before the group, and for synchronize() below
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend, rank=rank, world_size=world)
    dtype = DTYPES[args.dtype]
    count = max(1, args.tensor_bytes // torch.empty(0, dtype=dtype).element_size())
    fill = lambda src, it: ((torch.arange(count) + src * 131 + it) % 113).to(dtype).to(device)  # noqa: E731
    k = args.k
    sends = [fill(rank, 0) for _ in range(k)]
    recvs = [torch.empty(count, dtype=dtype, device=device) for _ in range(k)]
    lat, wrong = [], 0
    for it in range(args.warmup_iters + args.iters):
        if args.check:
            for s in sends:
                s.copy_(fill(rank, it))
        ops = [dist.P2POp(dist.irecv, recvs[j], (rank - 1 - j) % world) for j in range(k)]
        ops += [dist.P2POp(dist.isend, sends[j], (rank + 1 + j) % world) for j in range(k)]
        dist.barrier()
        clock = time.process_time if args.cputime else time.perf_counter
        t0 = clock()
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        if args.device == "cuda":
            torch.cuda.synchronize()
        t = torch.tensor([clock() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if it >= args.warmup_iters:
            lat.append(float(t) * 1e6)
            if args.check:
                wrong += sum(int((recvs[j] != fill((rank - 1 - j) % world, it)).sum()) for j in range(k))
    w = torch.tensor([wrong], device=device)
    dist.all_reduce(w)
    if rank == 0:
        lat_t = torch.tensor(lat)
        mean = float(lat_t.mean())
        q = lambda p: float(torch.quantile(lat_t, p))  # noqa: E731
        bidir = 2 * k * count * torch.empty(0, dtype=dtype).element_size() / (mean * 1e-6) / 1e9
        print(f"# backend={args.backend} world={world} k={k} bytes={args.tensor_bytes} dtype={args.dtype} iters={args.iters}")
        print(f"{'lat_mean_us':>12} {'lat_p50_us':>11} {'lat_p95_us':>11} {'lat_p99_us':>11} {'rank_bidir_GBps':>16} "
              f"{'cluster_bidir_GBps':>19} {'wrong':>6}")
        print(f"{mean:>12.1f} {q(0.5):>11.1f} {q(0.95):>11.1f} {q(0.99):>11.1f} {bidir:>16.3f} {bidir * world:>19.3f} "
              f"{int(w) if args.check else 'N/A':>6}")
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="mooncake" if torch.cuda.is_available() else "mooncake-cpu",
                   choices=["mooncake", "mooncake-cpu", "nccl", "gloo"])
    p.add_argument("--device", choices=["cuda", "cpu"])
    p.add_argument("-g", "--nprocs", type=int, default=1)
    p.add_argument("--dtype", default="float", choices=sorted(DTYPES))
    p.add_argument("--tensor-bytes", type=parse_size, default=parse_size("32M"))
    p.add_argument("-k", type=int, default=1)
    p.add_argument("-w", "--warmup-iters", type=int, default=10)
    p.add_argument("-n", "--iters", type=int, default=50)
    p.add_argument("-c", "--check", type=int, default=1)
    p.add_argument("-C", "--cputime", action="store_true")
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29500)
    args = p.parse_args()
    args.device = args.device or ("cpu" if args.backend in ("mooncake-cpu", "gloo") else "cuda")
    if "RANK" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        if not 1 <= args.k < world:
            p.error(f"-k must satisfy 1 <= k < world size ({world})")
        run(int(os.environ["RANK"]), world, args)
    else:
        if not 1 <= args.k < args.nprocs:
            p.error(f"-k must satisfy 1 <= k < -g ({args.nprocs})")
        mp.spawn(run, args=(args.nprocs, args), nprocs=args.nprocs, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
