"""nccl-tests style benchmark for torch.distributed backends: mooncake,
mooncake-cpu, nccl, gloo.

    python3 benchmarks/pgbench.py --collective all_reduce --backend mooncake-cpu -g 4 -b 8 -e 16M -f 4

Launches -g processes on 127.0.0.1 (or runs as one rank when RANK is set,
e.g. under torchrun). For each size it prints, for out-of-place and in-place
runs: time(us), algbw(GB/s) = bytes / 1e9 / time, busbw(GB/s) = algbw times
the nccl-tests factor (2(n-1)/n all_reduce; (n-1)/n all_gather,
reduce_scatter, alltoall; 1 broadcast, sendrecv), and #wrong (elements that
differ from the expected result, summed over ranks; -c 0 skips the check).
Sizes (-b, -e) are the bytes of the whole message, as in nccl-tests and the
reference: for all_gather the gathered output (each rank sends 1/n of it).

With --bound (CUDA), each size also gets the time of one device-to-device
copy and of one copy into another rank's memory, measured in the same run:
with every rank on one GPU, into another process's buffer through CUDA IPC
("ipc"); with ranks spread over GPUs, into the next GPU ("peer"); and the
ratio of that copy's time to the collective's, the fraction of the bound it
reaches (docs/benchmarks/pg_cuda.md). With -G N the calls of each size are
captured in one CUDA graph, replayed N times: the GPU side without the host's
launch cost.

    python3 benchmarks/pgbench.py --collective all_reduce --backend mooncake -g 2 -b 4K -e 256M -f 4 --bound

The reference's flags: --backend follows --device when absent (cuda:
mooncake, cpu: mooncake-cpu); -d all sweeps every dtype; -C/--report_cputime,
-S/--report_timestamps; -J/--output_file PATH writes the rows as JSON (one
object per size, dtype and placement). Under torchrun, LOCAL_RANK names each
rank's GPU; MOONCAKE_PGTEST_DEVICE_FILTERS (comma-separated device names)
goes to pg.set_device_filter before the group is made. The reference's
command line (PYTHONPATH=mooncake-pg python mooncake-pg/benchmark/pgbench.py
...) runs this file too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVES = ["all_reduce", "all_gather", "broadcast", "reduce_scatter", "alltoall", "sendrecv"]
DTYPES = {
    "int8": torch.int8, "uint8": torch.uint8, "int32": torch.int32, "uint32": torch.uint32, "int64": torch.int64,
    "uint64": torch.uint64, "half": torch.float16, "float": torch.float32, "double": torch.float64,
    "bfloat16": torch.bfloat16, "f8e4m3": torch.float8_e4m3fn, "f8e5m2": torch.float8_e5m2,
}
OPS = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "max": dist.ReduceOp.MAX,
       "min": dist.ReduceOp.MIN, "avg": dist.ReduceOp.SUM}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)\s*([KMGT]?)B?", text.strip().upper())
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (e.g. 64, 16K, 32M, 1G)")
    return int(m.group(1)) * 1024 ** " KMGT".index(m.group(2) or " ")


def bus_factor(coll: str, n: int) -> float:
    if coll == "all_reduce":
        return 2 * (n - 1) / n
    if coll in ("all_gather", "reduce_scatter", "alltoall"):
        return (n - 1) / n
    return 1.0


def sizes(args) -> list[int]:
    out, s = [], args.minbytes
    while s <= args.maxbytes:
        out.append(s)
        s = s * args.stepfactor if args.stepfactor > 1 else s + args.stepbytes
    return out


class Case:
    """Buffers and expected results of one collective at one size."""

    def __init__(self, args, nbytes: int, rank: int, world: int, device, inplace: bool):
        self.args, self.rank, self.world, self.inplace = args, rank, world, inplace
        dtype = DTYPES[args.datatype]
        esize = torch.empty(0, dtype=dtype).element_size()
        count = max(1, nbytes // esize)
        if args.collective == "all_gather":
            # The size is the gathered output, as in nccl-tests and the reference:
            # each rank sends its share, aligned down to 16 bytes.
            align = max(1, 16 // esize)
            share = count // world
            count = max(align, share - share % align)
        elif args.collective in ("reduce_scatter", "alltoall"):
            # nccl-tests align these to 16 bytes per rank
            align = max(1, 16 // esize) * world
            count = max(align, count - count % align)
        self.count, self.dtype, self.device = count, dtype, device
        base = (torch.arange(count) % 7 + 1 + rank).to(torch.float32)
        mk = lambda t: t.to(dtype).to(device)  # noqa: E731
        c = args.collective
        if c == "all_reduce" or c == "broadcast":
            self.send = mk(base)
            self.recv = self.send if inplace else None
        elif c == "all_gather":
            self.recv = torch.empty(count * world, dtype=dtype, device=device)
            self.send = self.recv.narrow(0, rank * count, count) if inplace else mk(base)
            if inplace:
                self.send.copy_(mk(base))
        elif c == "reduce_scatter":
            self.send = mk(base)
            self.recv = torch.empty(count // world, dtype=dtype, device=device)
        elif c == "alltoall":
            self.send = mk(base)
            self.recv = torch.empty(count, dtype=dtype, device=device)
        elif c == "sendrecv":
            self.send = mk(base)
            self.recv = torch.empty(count, dtype=dtype, device=device)

    def run(self, group=None):
        a, c = self.args, self.args.collective
        if c == "all_reduce":
            # torch's all_reduce works in place: both columns time the same call
            dist.all_reduce(self.send, op=OPS[a.op], group=group)
        elif c == "broadcast":
            dist.broadcast(self.send, src=a.root, group=group)
        elif c == "all_gather":
            dist.all_gather_into_tensor(self.recv, self.send, group=group)
        elif c == "reduce_scatter":
            dist.reduce_scatter_tensor(self.recv, self.send, op=OPS[a.op], group=group)
        elif c == "alltoall":
            dist.all_to_all_single(self.recv, self.send, group=group)
        elif c == "sendrecv":
            peer_to, peer_from = (self.rank + 1) % self.world, (self.rank - 1) % self.world
            ops = [dist.P2POp(dist.isend, self.send, peer_to), dist.P2POp(dist.irecv, self.recv, peer_from)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()

    def wrong(self) -> int:
        """Elements that differ from the closed-form result of one run."""
        a, c, W, r = self.args, self.args.collective, self.world, self.rank
        f = lambda x: x.to(self.dtype).to(torch.float64)  # noqa: E731
        idx = torch.arange(self.count) % 7 + 1
        if c == "all_reduce":
            vals = torch.stack([f((idx + q).to(torch.float32)) for q in range(W)])
            exp = {"sum": vals.sum(0), "prod": vals.prod(0), "max": vals.max(0).values,
                   "min": vals.min(0).values, "avg": vals.sum(0)}[a.op]
            got = self.send.cpu().to(torch.float64)
            exp = exp.to(self.dtype).to(torch.float64)
        elif c == "broadcast":
            got, exp = self.send.cpu().to(torch.float64), f((idx + a.root).to(torch.float32))
        elif c == "all_gather":
            got = self.recv.cpu().to(torch.float64)
            exp = torch.cat([f((idx + q).to(torch.float32)) for q in range(W)])
        elif c == "reduce_scatter":
            n = self.count // W
            vals = torch.stack([f((idx + q).to(torch.float32)) for q in range(W)])
            exp = vals.sum(0)[r * n:(r + 1) * n].to(self.dtype).to(torch.float64)
            got = self.recv.cpu().to(torch.float64)
        elif c == "alltoall":
            n = self.count // W
            exp = torch.cat([f((idx + q).to(torch.float32))[r * n:(r + 1) * n] for q in range(W)])
            got = self.recv.cpu().to(torch.float64)
        else:  # sendrecv
            got, exp = self.recv.cpu().to(torch.float64), f((idx + (r - 1) % W).to(torch.float32))
        return int((got != exp).sum())


def capture(case: Case, calls: int) -> torch.cuda.CUDAGraph:
    """`calls` runs of the collective captured in one CUDA graph (as nccl-tests
    -G does): replaying it times the GPU side without the host's launch cost.
    The warm-up runs before it have set up the backend's resources."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            case.run()
    graph.replay()  # the first replay uploads the graph
    torch.cuda.synchronize()
    return graph


def profile_calls(case: Case, calls: int) -> None:
    """Where the host time of `calls` eager calls goes (torch.profiler: the
    CUDA runtime and driver calls each makes, with their host time), printed
    by rank 0; every rank runs the calls."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(calls):
            case.run()
        host = (time.perf_counter() - t0) / calls
        torch.cuda.synchronize()
    if case.rank == 0:
        print(f"# profile of {calls} calls of {case.count * case.send.element_size()} B: "
              f"{host * 1e6:.1f} us of host time per call (under the profiler)", file=sys.stderr)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20), file=sys.stderr)


def timed_copy(dst: torch.Tensor, src: torch.Tensor, iters: int) -> float:
    """Seconds per `dst.copy_(src)`, back to back, after one untimed copy."""

    def sync() -> None:
        torch.cuda.synchronize(src.device)
        torch.cuda.synchronize(dst.device)

    dst.copy_(src)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync()
    return (time.perf_counter() - t0) / iters


def copy_bounds(nbytes: int, rank: int, world: int, device, iters: int) -> tuple[float, float]:
    """Seconds for one copy of `nbytes` (the bound beside a collective of that
    size): a device-to-device copy inside one process, and a copy into another
    rank's GPU memory: with every rank on one GPU, into another process's
    buffer through CUDA IPC (rank 1 writes into rank 0's); with ranks spread
    over GPUs, from rank 0's GPU into rank 1's (peer copy over the GPUs' link:
    the bound at world 2; at larger worlds a reference for one link only).
    nan with one rank. Only one process copies at a time, as a bound should."""
    from torch.multiprocessing.reductions import reduce_tensor

    from mooncake._gpu_placement import gpu_of_rank, gpus_used  # noqa: PLC0415

    src = torch.empty(max(1, nbytes), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    if gpus_used(world) > 1:  # spread: "peer" in the header
        local = peer = 0.0
        if rank == 0:
            remote = torch.empty_like(src, device=torch.device("cuda", gpu_of_rank(1)))
            local = timed_copy(dst, src, iters)
            peer = timed_copy(remote, src, iters)
            del remote
        t = torch.tensor([local, peer], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return float(t[0]), float(t[1])

    local = timed_copy(dst, src, iters) if rank == 0 else 0.0
    ipc = float("nan")
    if world > 1:
        handle = [reduce_tensor(dst) if rank == 0 else None]
        dist.broadcast_object_list(handle, src=0)
        dist.barrier()
        if rank == 1:
            rebuild, rebuild_args = handle[0]
            peer = rebuild(*rebuild_args)
            ipc = timed_copy(peer, src, iters)
            del peer
        dist.barrier()
    t = torch.tensor([local if rank == 0 else 0.0, ipc if rank == 1 else 0.0], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t[0]), float(t[1]) if world > 1 else float("nan")


def bench(args, rank: int, world: int, rows: list) -> None:
    where = ""
    if args.device == "cuda":
        from mooncake._gpu_placement import gpu_of_rank, gpus_used, placement  # noqa: PLC0415

        local = os.environ.get("LOCAL_RANK")  # torchrun's: this rank's GPU
        device = torch.device("cuda", int(local) if local is not None else gpu_of_rank(rank))
        torch.cuda.set_device(device)
        where = f" on {placement(world)}"
        bound_name = "peer" if gpus_used(world) > 1 else "ipc"  # copy_bounds' second bound
    else:
        device = torch.device("cpu")
    if rank == 0:
        print(f"# pgbench: {args.collective} backend={args.backend} world={world}{where} dtype={args.datatype} "
              f"op={args.op} iters={args.iters} warmup={args.warmup_iters}"
              + (f" cudagraph={args.cudagraph}" if args.cudagraph else ""))
        print(f"#{'':>10} {'':>12} {'':>8} {'':>6} {'':>5}   {'out-of-place':^34}   {'in-place':^34}")
        print(f"#{'size(B)':>10} {'count':>12} {'type':>8} {'redop':>6} {'root':>5}   "
              f"{'time(us)':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>7}   {'time(us)':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>7}"
              + (f"   {'d2d(us)':>9} {bound_name + '(us)':>9} {bound_name + '/time':>8}" if args.bound else ""))
    stat = {0: None, 1: torch.sum, 2: torch.min, 3: torch.max}[args.average]
    for nbytes in sizes(args):
        cols = []
        secs_out = float("nan")
        row = {"collective": args.collective, "backend": args.backend, "world": world, "bytes": nbytes,
               "dtype": args.datatype, "op": args.op, "root": args.root}
        for inplace in (False, True):
            if inplace and args.collective in ("alltoall", "sendrecv"):
                cols.append(f"{'N/A':>9} {'N/A':>7} {'N/A':>7} {'N/A':>7}")
                continue
            case = Case(args, nbytes, rank, world, device, inplace)
            for _ in range(args.warmup_iters):
                case.run()
            wrong = 0
            if args.check:
                case = Case(args, nbytes, rank, world, device, inplace)
                case.run()
                if args.device == "cuda":
                    torch.cuda.synchronize()
                wrong = case.wrong()
            calls = args.iters * args.agg_iters
            if args.profile and not inplace and nbytes == args.minbytes:
                profile_calls(case, calls)
            graph = capture(case, calls) if args.cudagraph else None
            dist.barrier()
            clock = time.process_time if args.report_cputime else time.perf_counter
            t0 = clock()
            if graph is not None:
                for _ in range(args.cudagraph):
                    graph.replay()
                calls *= args.cudagraph
            else:
                for _ in range(calls):
                    case.run()
            if args.device == "cuda":
                torch.cuda.synchronize()
            t = torch.tensor([(clock() - t0) / calls], dtype=torch.float64)
            w = torch.tensor([wrong], dtype=torch.int64)
            if args.device == "cuda":
                t, w = t.cuda(), w.cuda()
            dist.all_reduce(w)
            if stat is torch.sum:
                dist.all_reduce(t)
                t /= world
            elif stat is torch.min:
                dist.all_reduce(t, op=dist.ReduceOp.MIN)
            elif stat is torch.max:
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
            secs = float(t)
            if not inplace:
                secs_out = secs
            moved = case.count * case.send.element_size() * (world if args.collective == "all_gather" else 1)
            algbw = moved / 1e9 / secs
            cols.append(f"{secs * 1e6:>9.1f} {algbw:>7.2f} {algbw * bus_factor(args.collective, world):>7.2f} "
                        f"{int(w) if args.check else 'N/A':>7}")
            row["in-place" if inplace else "out-of-place"] = {
                "time_us": secs * 1e6, "algbw_GBps": algbw, "busbw_GBps": algbw * bus_factor(args.collective, world),
                "wrong": int(w) if args.check else None}
        bound = ""
        if args.bound:
            d2d, ipc = copy_bounds(nbytes, rank, world, device, args.iters)
            bound = f"   {d2d * 1e6:>9.1f} {ipc * 1e6:>9.1f} {ipc / secs_out:>8.3f}"
        if rank == 0:
            case = Case(args, nbytes, rank, world, torch.device("cpu"), False)
            stamp = time.strftime("%H:%M:%S ") if args.report_timestamps else ""
            row["count"] = case.count
            if args.report_timestamps:
                row["timestamp"] = time.time()
            rows.append(row)
            print(f" {stamp}{case.count * case.send.element_size():>10} {case.count:>12} {args.datatype:>8} {args.op:>6} "
                  f"{args.root:>5}   {cols[0]}   {cols[1]}{bound}", flush=True)


def worker(rank: int, world: int, args) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    if args.backend.startswith("mooncake"):
        from mooncake import pg  # noqa: PLC0415  (registers the backends)

        filters = os.environ.get("MOONCAKE_PGTEST_DEVICE_FILTERS", "")
        if filters.strip():
            pg.set_device_filter([f.strip() for f in filters.split(",") if f.strip()])
    dist.init_process_group(args.backend, rank=rank, world_size=world)
    rows: list = []
    try:
        for dtype in (DTYPES if args.datatype == "all" else [args.datatype]):
            try:
                bench(argparse.Namespace(**{**vars(args), "datatype": dtype}), rank, world, rows)
            except TypeError as e:  # a dtype the backend does not reduce: every rank refuses it alike
                if args.datatype != "all":
                    raise
                if rank == 0:
                    print(f"# -d all: {dtype} skipped: {str(e).splitlines()[0]}", flush=True)
    finally:
        dist.destroy_process_group()
    if rank == 0 and args.output_file:
        with open(args.output_file, "w") as f:
            json.dump(rows, f, indent=1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--collective", required=True, choices=COLLECTIVES)
    p.add_argument("--backend", choices=["mooncake", "mooncake-cpu", "nccl", "gloo"],
                   help="default: from --device (cuda: mooncake, cpu: mooncake-cpu), else mooncake where CUDA is")
    p.add_argument("--device", choices=["cuda", "cpu"])
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("32M"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("32M"))
    p.add_argument("-i", "--stepbytes", type=parse_size, default=parse_size("1M"))
    p.add_argument("-f", "--stepfactor", type=int, default=1)
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-w", "--warmup_iters", type=int, default=1)
    p.add_argument("-m", "--agg_iters", type=int, default=1)
    p.add_argument("-c", "--check", type=int, default=1)
    p.add_argument("-a", "--average", type=int, default=1, choices=[0, 1, 2, 3])
    p.add_argument("-C", "--report_cputime", "--cputime", action="store_true",
                   help="report process CPU time instead of wall time")
    p.add_argument("-S", "--report_timestamps", "--timestamps", action="store_true")
    p.add_argument("-d", "--datatype", default="float", choices=sorted(DTYPES) + ["all"],
                   help="'all' sweeps every dtype")
    p.add_argument("-o", "--op", default="sum", choices=sorted(OPS))
    p.add_argument("-r", "--root", type=int, default=0)
    p.add_argument("-g", "--ngpus", type=int, default=1, help="processes to launch")
    p.add_argument("-t", "--nthreads", type=int, default=1)
    p.add_argument("-J", "--output_file", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("-G", "--cudagraph", type=int, default=0,
                   help="CUDA: capture the -n x -m calls in one graph and time this many replays of it "
                        "(the GPU side alone, as nccl-tests -G)")
    p.add_argument("--profile", action="store_true",
                   help="CUDA: profile the eager calls of the smallest size (host time per CUDA call, to stderr)")
    p.add_argument("--bound", action="store_true",
                   help="CUDA: also time one device copy and one copy into another rank's memory of each size "
                        "(the bounds: through CUDA IPC with ranks sharing a GPU, into the next GPU with ranks "
                        "spread), and print bound/time")
    args = p.parse_args()
    if args.nthreads != 1:
        p.error("-t must be 1: one rank per process")
    if args.backend is None:
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        args.backend = "mooncake" if device == "cuda" else "mooncake-cpu"
    args.device = args.device or ("cpu" if args.backend in ("mooncake-cpu", "gloo") else "cuda")
    if (args.backend in ("mooncake-cpu", "gloo")) != (args.device == "cpu"):
        p.error(f"backend {args.backend} does not run on device {args.device}")
    if args.cudagraph and args.device != "cuda":
        p.error("-G captures CUDA graphs: it needs --device cuda")
    if args.bound and args.device != "cuda":
        p.error("--bound measures device copies: it needs --device cuda")
    if args.op == "avg":
        print("# note: avg is measured as SUM (divide by world size afterwards), as nccl-tests does", file=sys.stderr)
    if "RANK" in os.environ:
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args.port = s.getsockname()[1]
        mp.spawn(worker, args=(args.ngpus, args), nprocs=args.ngpus, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
