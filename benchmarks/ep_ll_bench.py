"""EP dispatch and combine in DeepEP's low-latency benchmark style, on CUDA:
the Buffer's fast path (CUDA IPC kernels), called eagerly and replayed from
CUDA graphs, its collective path, and a plain device-to-device copy of the
same bytes as the bound, in one run.

Every rank times its own calls with CUDA events (a barrier before each
call, so the ranks start together; the L2 cache flushed with a 256 MiB
write, as DeepEP does). Bytes follow DeepEP's accounting: per non-masked
(token, expert) selection, FP8 dispatch moves H + H/128*4 + 16 bytes and
BF16 combine 2H. A row gives, for one path and phase, the mean over ranks of
each rank's average, min and max microseconds, and per-rank GB/s from the
average; host_us is the time the Python call took on the host (an eager
call whose time is well above its graph row's is bound by the host). The graph rows
("ipc-graph") time replays of one dispatch and one combine captured in two
CUDA graphs, which is how DeepEP's low-latency kernels are meant to run:
no Python and no launch on the host. The copy bound times copy_ of a buffer
of the dispatch's (then the combine's) bytes on the rank's own GPU.

    PYTHONPATH=python python3 benchmarks/ep_ll_bench.py --worlds 1 2 4 --csv docs/benchmarks/ep_ll.csv

Several ranks on one GPU time-share it unless MPS runs (nvidia-cuda-mps-control -d):
label the run with --label (e.g. "mps" / "time-sliced"). Rank r runs on GPU r % G
(G: MOONCAKE_TEST_GPUS, default every visible GPU; the "gpus" column says how many were
used); where ranks are spread over GPUs, a "peer-copy" bound (the same bytes copied into
the next GPU) is measured too.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from bench_support import run_ranks, write_csv

# DeepEP's low-latency test shape: 128 tokens per rank, hidden 7168, 288 experts, top-8.
TOKENS, HIDDEN, EXPERTS, TOPK = 128, 7168, 288, 8
FLUSH_BYTES = 256 << 20


class EventTimer:
    """Samples of one operation, timed with CUDA events after an L2 flush
    (`flush`, a 256 MiB buffer shared by every timer of a rank) and a
    barrier; the first `warmup` calls are not recorded."""

    def __init__(self, flush, warmup):
        self.flush = flush
        self.warmup = warmup
        self.samples = []
        self.host_samples = []

    def time(self, fn):
        self.flush.zero_()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        host_start = time.perf_counter()
        result = fn()
        host_us = (time.perf_counter() - host_start) * 1e6
        end.record()
        end.synchronize()
        if self.warmup > 0:
            self.warmup -= 1
        else:
            self.samples.append(start.elapsed_time(end) * 1e3)  # microseconds
            self.host_samples.append(host_us)
        return result


def _rank_main(rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from mooncake import pg  # noqa: F401 - registers the backends
    from mooncake._gpu_placement import gpu_of_rank, gpus_used
    from mooncake.mooncake_ep_buffer import Buffer

    torch.cuda.set_device(gpu_of_rank(rank))
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("mooncake", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16).to(device)
    topk = torch.randn(TOKENS, EXPERTS, generator=g).topk(TOPK, dim=1).indices
    topk[torch.rand(topk.shape, generator=g) < args.masked] = -1
    topk = topk.to(device)
    weights = torch.rand(TOKENS, TOPK, generator=g).to(device)
    active = torch.ones(world, dtype=torch.int32, device=device)
    selections = int((topk >= 0).sum())
    dispatch_bytes = selections * (HIDDEN + HIDDEN // 128 * 4 + 16)
    combine_bytes = selections * 2 * HIDDEN
    rows = []
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=device)  # the L2 flush of every timing
    paths = [("ipc", Buffer(group))]
    if not args.skip_collective:
        paths.append(("collective", Buffer(group, disable_p2p=True)))
    for name, buffer in paths:
        if buffer.path != name:
            raise RuntimeError(f"rank {rank}: wanted the {name} path, got {buffer.path} ({buffer.path_reason})")
        iters = args.iters if name == "ipc" else args.collective_iters
        dispatch_t, combine_t = EventTimer(flush, args.warmup), EventTimer(flush, args.warmup)
        for _ in range(args.warmup + iters):
            recv_x, count, handle, _, _ = dispatch_t.time(
                lambda: buffer.dispatch(x, topk, active, TOKENS, EXPERTS, -1, use_fp8=True))
            y = recv_x[0].to(torch.bfloat16)  # the "experts": identity of the FP8 values
            combine_t.time(lambda: buffer.combine(y, topk, weights, active, -1, handle))
        if buffer.path != name:  # the fast path sets up at its first dispatch and may fall back
            raise RuntimeError(f"rank {rank}: the {name} path fell back to {buffer.path} ({buffer.path_reason})")
        rows.append((name, "dispatch", dispatch_t, dispatch_bytes))
        rows.append((name, "combine", combine_t, combine_bytes))
        if name == "ipc":
            rows += _graph_rows(buffer, x, topk, weights, active, flush, args, dispatch_bytes, combine_bytes)
            if args.profile:
                _profile(rank, buffer, x, topk, weights, active)
    # The bound: the same bytes copied device to device on this rank's GPU;
    # and when the ranks are spread over GPUs, copied into the next GPU (over
    # NVLink), the bound that matters there. Decided alike on every rank (each
    # timing meets the others at a barrier).
    spread = gpus_used(world) > 1
    next_gpu = torch.device("cuda", gpu_of_rank(rank + 1))  # another GPU whenever more than one is used
    bounds = [("d2d-copy", device)] + ([("peer-copy", next_gpu)] if spread else [])
    for bound, target in bounds:
        for phase, nbytes in (("dispatch", dispatch_bytes), ("combine", combine_bytes)):
            src = torch.empty(nbytes, dtype=torch.uint8, device=device)
            dst = torch.empty(nbytes, dtype=torch.uint8, device=target)
            timer = EventTimer(flush, args.warmup)
            for _ in range(args.warmup + args.iters):
                timer.time(lambda: dst.copy_(src))
            rows.append((bound, phase, timer, nbytes))
    queue.put((rank, [(path, phase, t.samples, t.host_samples, nbytes) for path, phase, t, nbytes in rows]))
    dist.barrier()
    dist.destroy_process_group()


def _graph_rows(buffer, x, topk, weights, active, flush, args, dispatch_bytes, combine_bytes):
    """The fast path replayed from CUDA graphs: one graph holds a dispatch,
    another a combine of fixed expert outputs (any rows of the right shape:
    combine's time does not depend on their values); replays are timed like
    eager calls. Every rank replays the same graphs equally often, so the call
    numbers the kernels keep on the device stay in step."""
    recv_x, _, handle, _, _ = buffer.dispatch(x, topk, active, TOKENS, EXPERTS, -1, use_fp8=True)
    y = recv_x[0].to(torch.bfloat16)
    buffer.combine(y, topk, weights, active, -1, handle)
    torch.cuda.synchronize()
    dispatch_graph, combine_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(dispatch_graph):
        _, _, graph_handle, _, _ = buffer.dispatch(x, topk, active, TOKENS, EXPERTS, -1, use_fp8=True)
    with torch.cuda.graph(combine_graph):
        buffer.combine(y, topk, weights, active, -1, graph_handle)
    dispatch_t, combine_t = EventTimer(flush, args.warmup), EventTimer(flush, args.warmup)
    for _ in range(args.warmup + args.iters):
        dispatch_t.time(dispatch_graph.replay)
        combine_t.time(combine_graph.replay)
    return [("ipc-graph", "dispatch", dispatch_t, dispatch_bytes), ("ipc-graph", "combine", combine_t, combine_bytes)]


def _profile(rank, buffer, x, topk, weights, active):
    """Where the time of a fast-path call goes: GPU kernels and host time, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            recv_x, _, handle, _, _ = buffer.dispatch(x, topk, active, TOKENS, EXPERTS, -1, use_fp8=True)
            y = recv_x[0].to(torch.bfloat16)
            buffer.combine(y, topk, weights, active, -1, handle)
        torch.cuda.synchronize()
    if rank == 0:
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15), file=sys.stderr)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12), file=sys.stderr)


def _run_world(world, args):
    from mooncake._gpu_placement import placement  # noqa: PLC0415

    per_rank = run_ranks(_rank_main, world, args, args.timeout)
    gpus = placement(world)
    out = []
    for i, (path, phase, _, _, _) in enumerate(per_rank[0]):
        avg = statistics.mean(statistics.mean(per_rank[r][i][2]) for r in range(world))
        host = statistics.mean(statistics.mean(per_rank[r][i][3]) for r in range(world))
        nbytes = statistics.mean(per_rank[r][i][4] for r in range(world))
        out.append(dict(label=args.label, world=world, gpus=gpus, tokens=TOKENS, hidden=HIDDEN, experts=EXPERTS, topk=TOPK,
                        path=path, phase=phase, avg_us=round(avg, 1),
                        min_us=round(statistics.mean(min(per_rank[r][i][2]) for r in range(world)), 1),
                        max_us=round(statistics.mean(max(per_rank[r][i][2]) for r in range(world)), 1),
                        host_us=round(host, 1),
                        bytes_per_rank=int(nbytes), gbps_per_rank=round(nbytes / avg / 1e3, 2)))
    return out


def _ratios(results):
    """Per world: fast path vs collective path and vs the copy bound, dispatch + combine."""
    lines = []
    for world in sorted({r["world"] for r in results}):
        total = {}
        for r in results:
            if r["world"] == world:
                total[r["path"]] = total.get(r["path"], 0.0) + r["avg_us"]
        for fast in ("ipc", "ipc-graph"):
            line = f"world {world}: {fast} {total[fast]:.1f} us (dispatch + combine)"
            if "collective" in total:
                line += f", {total['collective'] / total[fast]:.1f}x faster than the collective path"
            line += f", {total[fast] / total['d2d-copy']:.2f}x the d2d copy bound"
            if "peer-copy" in total:
                line += f", {total[fast] / total['peer-copy']:.2f}x the peer-GPU copy bound"
            lines.append(line)
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--collective-iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--masked", type=float, default=0.0, help="fraction of top-k entries set to -1")
    ap.add_argument("--skip-collective", action="store_true")
    ap.add_argument("--label", default="")
    ap.add_argument("--profile", action="store_true", help="print rank 0's torch.profiler tables of the fast path")
    ap.add_argument("--timeout", type=float, default=500)
    ap.add_argument("--csv")
    ap.add_argument("--append", action="store_true", help="append to --csv instead of replacing it")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ep_ll_bench: needs a CUDA GPU (the fast path and the copy bound run on it)")
    results = []
    for world in args.worlds:
        results += _run_world(world, args)
    write_csv(results, args.csv, args.append)
    for line in _ratios(results):
        print(line)


if __name__ == "__main__":
    main()
