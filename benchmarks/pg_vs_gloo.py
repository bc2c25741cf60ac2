"""mooncake-cpu against Gloo, in the same processes and the same run.

For each world size, operation and message size, both backends run the same
collective on the same tensors (alternating backend per size, after warm-up);
the time per operation is the mean over iterations of the slowest rank.
Prints a table with the ratio mooncake/gloo (< 1 means mooncake is faster)
and writes a CSV; benchmarks/plot_pg.py turns it into a picture.

    PYTHONPATH=python python3 benchmarks/pg_vs_gloo.py --world 2 4 --csv docs/benchmarks/pg_cpu.csv

With --hosts H the ranks are split into H blocks, each started in its own
user + pid namespace (unshare -Urp), which the transfer engine treats as a
separate host: mooncake-cpu then runs its cross-host path (shared memory
inside each block, the transfer engine's tcp between blocks), Gloo its usual
tcp everywhere.

    PYTHONPATH=python python3 benchmarks/pg_vs_gloo.py --world 4 --hosts 2 --csv docs/benchmarks/pg_cpu_2hosts.csv

With --netns (as root) each block is a network namespace of its own with its
own address, joined to the others by veth pairs through a bridge
(mooncake/_virtual_hosts.py), and --rate shapes every host's link in both
directions with tc tbf: real separate hosts on a network of that bandwidth.
No set_host_ip is needed: the backend picks the address on the route to
MASTER_ADDR (host 0's address).

    PYTHONPATH=python python3 benchmarks/pg_vs_gloo.py --world 2 4 --hosts 2 --netns --rate 10gbit \
        --csv docs/benchmarks/pg_cpu_netns.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import socket
import subprocess
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


def _worker(rank: int, world: int, master: str, port: int, ops, sizes, budget_s: float, queue) -> None:
    os.environ.update(MASTER_ADDR=master, MASTER_PORT=str(port))
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


def _spawn(ranks, world: int, port: int, args, sizes, master: str = "127.0.0.1"):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, master, port, args.ops, sizes, args.budget, queue))
             for r in ranks]
    for p in procs:
        p.start()
    return procs, queue


def _relay(args, sizes) -> int:
    """Inside one host's namespace: run its ranks, print rank 0's rows."""
    ranks = [int(r) for r in args.ranks.split(",")]
    procs, queue = _spawn(ranks, args.world[0], args.port, args, sizes, args.master)
    if 0 in ranks:
        while (item := queue.get(timeout=900)) is not None:
            print("ROW " + json.dumps(item), flush=True)
    for p in procs:
        p.join(timeout=900)
    return 0


def _rows_across_hosts(world: int, hosts: int, args, sizes, virtual_hosts=None):
    """Starts each block of ranks as its own host (a user+pid namespace, or a
    network namespace of `virtual_hosts`) and yields rank 0's rows."""
    port = _free_port()
    master = virtual_hosts.address(0) if virtual_hosts else "127.0.0.1"
    blocks = [list(range(world))[h * world // hosts:(h + 1) * world // hosts] for h in range(hosts)]
    common = ["--world", str(world), "--port", str(port), "--master", master, "--budget", str(args.budget),
              "--max-bytes", str(args.max_bytes), "--ops", *args.ops]

    def host(h, argv):
        if virtual_hosts:
            return virtual_hosts.command(h, argv)
        return ["unshare", "-Urp", "--fork", "--kill-child", *argv]

    procs = [subprocess.Popen(host(h, [sys.executable, os.path.abspath(__file__), "--ranks", ",".join(map(str, b)),
                                       *common]), stdout=subprocess.PIPE, text=True)
             for h, b in enumerate(blocks)]
    for line in procs[0].stdout:
        if line.startswith("ROW "):
            yield tuple(json.loads(line[4:]))
    for p in procs:
        p.wait(timeout=900)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--hosts", type=int, default=1, help="split the ranks over this many namespace hosts")
    parser.add_argument("--ranks", help=argparse.SUPPRESS)  # internal: the ranks of one namespace host
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--master", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--netns", action="store_true", help="hosts are network namespaces over veth (root)")
    parser.add_argument("--rate", help="with --netns: every host link shaped to this tc rate, e.g. 10gbit")
    parser.add_argument("--ops", nargs="+", default=OPS, choices=OPS)
    parser.add_argument("--max-bytes", type=int, default=16 << 20)
    parser.add_argument("--budget", type=float, default=0.05, help="seconds of work per size and backend (approx.)")
    parser.add_argument("--csv", help="write results here")
    args = parser.parse_args()
    sizes = [s for s in SIZES if s <= args.max_bytes]
    if args.ranks is not None:
        return _relay(args, sizes)
    rows = []
    virtual_hosts = None
    # A SIGTERM (a timeout) unwinds like an error, so the hosts are removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    if args.netns:
        from mooncake._virtual_hosts import VirtualHosts, unavailable

        if args.hosts < 2:
            parser.error("--netns needs --hosts >= 2")
        if (why := unavailable()) is not None:
            parser.error(f"--netns: {why}")
        virtual_hosts = VirtualHosts(args.hosts, rate=args.rate).__enter__()
        print(f"ranks split over {args.hosts} hosts (network namespaces, link {args.rate or 'unshaped'})")
    elif args.hosts > 1:
        print(f"ranks split over {args.hosts} hosts (user+pid namespaces)")
    try:
        _run(args, sizes, rows, virtual_hosts)
    finally:
        if virtual_hosts:
            virtual_hosts.close()
    _write_csv(args, rows)
    return 0


def _run(args, sizes, rows, virtual_hosts) -> None:
    print(f"{'world':>5} {'op':>15} {'bytes':>10} {'mooncake us':>12} {'gloo us':>12} {'ratio':>7}")
    for world in args.world:
        if args.hosts > 1:
            items = _rows_across_hosts(world, args.hosts, args, sizes, virtual_hosts)
        else:
            procs, queue = _spawn(range(world), world, _free_port(), args, sizes)
            items = iter(lambda: queue.get(timeout=900), None)
        for item in items:
            w, op, nbytes, t_mc, t_gloo = item
            rows.append(item)
            print(f"{w:>5} {op:>15} {nbytes:>10} {t_mc * 1e6:>12.1f} {t_gloo * 1e6:>12.1f} {t_mc / t_gloo:>7.2f}",
                  flush=True)
        if args.hosts == 1:
            for p in procs:
                p.join(timeout=60)


def _write_csv(args, rows) -> None:
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["world", "op", "bytes", "mooncake_us", "gloo_us", "ratio"])
            for world, op, nbytes, t_mc, t_gloo in rows:
                w.writerow([world, op, nbytes, f"{t_mc * 1e6:.2f}", f"{t_gloo * 1e6:.2f}", f"{t_mc / t_gloo:.3f}"])


if __name__ == "__main__":
    sys.exit(main())
