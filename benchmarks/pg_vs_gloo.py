"""mooncake-cpu against Gloo, in the same processes and the same run.

For each world size, operation and message size, both backends run the same
collective on the same tensors (alternating backend per size, after warm-up);
the time per operation is the mean over iterations of the slowest rank.
Prints a table with the ratio mooncake/gloo (< 1 means mooncake is faster)
and writes a CSV; benchmarks/plot_pg.py turns it into a picture.

    PYTHONPATH=python python3 benchmarks/pg_vs_gloo.py --world 2 4 --csv docs/benchmarks/pg_cpu.csv
"""

from __future__ import annotations

import argparse
import csv
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OPS = ["all_reduce", "all_gather", "broadcast", "all_to_all", "reduce_scatter"]
SIZES = [64 << (2 * i) for i in range(10)]  # 64 B .. 16 MiB


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _iters(nbytes: int, budget_s: float) -> int:
    # Enough repetitions to average out scheduling noise, bounded in time.
    return max(5, min(400, int(budget_s / max(nbytes / 1e9, 20e-6))))


def _make(op: str, nbytes: int, world: int):
    n = max(1, nbytes // 4)
    if op == "all_reduce":
        t = torch.ones(n)
        return lambda g: dist.all_reduce(t, group=g)
    if op == "broadcast":
        t = torch.ones(n)
        return lambda g: dist.broadcast(t, group_src=0, group=g)
    if op == "all_gather":
        inp, out = torch.ones(n), torch.empty(n * world)
        return lambda g: dist.all_gather_into_tensor(out, inp, group=g)
    if op == "reduce_scatter":
        n = max(world, n - n % world)
        inp, out = torch.ones(n), torch.empty(n // world)
        return lambda g: dist.reduce_scatter_tensor(out, inp, group=g)
    if op == "all_to_all":
        n = max(world, n - n % world)
        inp, out = torch.ones(n), torch.empty(n)
        return lambda g: dist.all_to_all_single(out, inp, group=g)
    raise ValueError(op)


def _time(fn, group, iters: int, max_group) -> float:
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(iters):
        fn(group)
    elapsed = torch.tensor([(time.perf_counter() - start) / iters])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=max_group)
    return float(elapsed)


def _worker(rank: int, world: int, port: int, ops, sizes, budget_s: float, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from mooncake import pg  # noqa: F401  (registers mooncake-cpu)

    dist.init_process_group("mooncake-cpu", rank=rank, world_size=world)
    gloo = dist.new_group(backend="gloo")
    mooncake = dist.group.WORLD
    for op in ops:
        for nbytes in sizes:
            fn = _make(op, nbytes, world)
            iters = _iters(nbytes, budget_s)
            for g in (mooncake, gloo):  # warm up both
                for _ in range(3):
                    fn(g)
            t_mc = _time(fn, mooncake, iters, gloo)
            t_gloo = _time(fn, gloo, iters, gloo)
            if rank == 0:
                queue.put((world, op, nbytes, t_mc, t_gloo))
    dist.destroy_process_group()
    if rank == 0:
        queue.put(None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--ops", nargs="+", default=OPS, choices=OPS)
    parser.add_argument("--max-bytes", type=int, default=16 << 20)
    parser.add_argument("--budget", type=float, default=0.05, help="seconds of work per size and backend (approx.)")
    parser.add_argument("--csv", help="write results here")
    args = parser.parse_args()
    sizes = [s for s in SIZES if s <= args.max_bytes]
    rows = []
    print(f"{'world':>5} {'op':>15} {'bytes':>10} {'mooncake us':>12} {'gloo us':>12} {'ratio':>7}")
    for world in args.world:
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, args.ops, sizes, args.budget, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        while (item := queue.get(timeout=900)) is not None:
            w, op, nbytes, t_mc, t_gloo = item
            rows.append(item)
            print(f"{w:>5} {op:>15} {nbytes:>10} {t_mc * 1e6:>12.1f} {t_gloo * 1e6:>12.1f} {t_mc / t_gloo:>7.2f}",
                  flush=True)
        for p in procs:
            p.join(timeout=60)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["world", "op", "bytes", "mooncake_us", "gloo_us", "ratio"])
            for world, op, nbytes, t_mc, t_gloo in rows:
                w.writerow([world, op, nbytes, f"{t_mc * 1e6:.2f}", f"{t_gloo * 1e6:.2f}", f"{t_mc / t_gloo:.3f}"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
