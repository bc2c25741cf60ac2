"""A few large calls of one backend across network-namespace hosts, timed
per operation: the quick look behind docs/benchmarks/pg_cpu_netns.md's
"Where the time went" table (pg_vs_gloo.py is the full, side-by-side sweep).

    PYTHONPATH=python python3 benchmarks/cross_host_calls.py --backend mooncake-cpu --bytes 16777216 \\
        --rate 10gbit --ops all_reduce all_gather broadcast send_recv

Ranks are spread evenly over --hosts network namespaces (root only); rank 0
prints one line per operation: milliseconds per call and GB/s of the
tensor's size.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

OPS = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv", "late_recv"]

# late_recv: rank 1 computes (a busy wait) before each receive, so every
# message is sent before its receive is posted; rank 1's time per call less
# the busy wait is what a receive posted late costs.
LATE_RECV_BUSY_S = 300e-6


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _rank(args) -> None:
    import torch
    import torch.distributed as dist

    from mooncake import pg  # noqa: F401  (registers the mooncake backends)

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    n = args.bytes // 4
    t, out = torch.ones(n), torch.ones(n * world)
    a2a = torch.ones(n * world)
    calls = {
        "all_reduce": lambda: dist.all_reduce(t),
        "all_gather": lambda: dist.all_gather_into_tensor(out, t),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(t, out),  # --bytes per rank's output block
        "all_to_all": lambda: dist.all_to_all_single(out, a2a),  # --bytes per block (one per rank)
        "broadcast": lambda: dist.broadcast(t, 0),
        "send_recv": lambda: dist.send(t, 1) if rank == 0 else dist.recv(t, 0) if rank == 1 else None,
        "late_recv": lambda: dist.isend(t, 1) if rank == 0 else (_busy(LATE_RECV_BUSY_S), dist.recv(t, 0))
        if rank == 1 else None,
    }
    for op in args.ops:
        pending = []
        for _ in range(3):
            pending.append(calls[op]())
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.iters):
            pending.append(calls[op]())
        each = (time.perf_counter() - start) / args.iters
        if op == "late_recv":
            for w in pending:
                if w is not None and not isinstance(w, tuple):
                    w.wait()
            if rank == 1:
                late = each - LATE_RECV_BUSY_S
                print(f"{op} {args.bytes} B: {late * 1e6:.1f} us per receive beyond the busy wait", flush=True)
            dist.barrier()
        elif rank == 0:
            print(f"{op} {args.bytes} B: {each * 1e3:.3f} ms, {args.bytes / each / 1e9:.3f} GB/s", flush=True)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="mooncake-cpu")
    parser.add_argument("--bytes", type=int, default=16 << 20)
    parser.add_argument("--ops", nargs="+", default=OPS, choices=OPS)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--rate", help="every host link shaped to this tc rate, e.g. 10gbit")
    parser.add_argument("--rank-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_process:
        _rank(args)
        return 0
    from mooncake._virtual_hosts import VirtualHosts, unavailable

    if (why := unavailable()) is not None:
        parser.error(why)
    argv = [sys.executable, os.path.abspath(__file__), "--rank-process", "--backend", args.backend, "--bytes",
            str(args.bytes), "--iters", str(args.iters), "--ops", *args.ops]
    with VirtualHosts(args.hosts, rate=args.rate) as hosts:
        procs = []
        for r in range(args.world):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(args.world), MASTER_ADDR=hosts.address(0),
                       MASTER_PORT="29512")
            procs.append(subprocess.Popen(hosts.command(r * args.hosts // args.world, argv), env=env))
        return max(p.wait(timeout=600) for p in procs)


if __name__ == "__main__":
    sys.exit(main())
