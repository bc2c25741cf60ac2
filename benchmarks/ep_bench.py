"""Latency of the EP Buffer's collective path (mooncake.mooncake_ep_buffer),
dispatch and combine, next to the reference's fallback design run on the same
group: all_gather of every rank's padded tokens and top-k in dispatch, and an
all_reduce of a [R * T, H] bf16 buffer in combine (what the reference does when
it has no fast path; reference/ep.md §1.9). Also ElasticBuffer
(mooncake.mooncake_elastic_buffer) at the same shapes, fresh and cached
dispatch and combine (bf16), and the copy bound: one local copy of the bytes
its dispatch delivers to this rank (``copy-bound``, called eagerly; and
``copy-bound-graph``, replayed from a CUDA graph as the IPC path's
``elastic-ipc-graph`` rows are; each world's run prints those rows' ratios
to both bounds). Each rank times its own calls after a
barrier; a row reports, over iterations, the median and p90 of the slowest
rank (the critical path), and the median from the last rank's start to the
last rank's end (``from_last_start_ms``: without the barrier's skew).

    PYTHONPATH=python python3 benchmarks/ep_bench.py --worlds 1 2 4 --csv docs/benchmarks/ep_cpu.csv

On CUDA (one or more GPUs, ranks round-robin): add ``--device cuda`` (backend "mooncake").
There the Buffer takes its CUDA IPC fast path when every rank is on one host
(rank 0 prints the path on stderr), and ElasticBuffer its collective path.
Several ranks on one GPU time-share it unless MPS runs: name the run with
``--label`` (the "mode" column) and add runs to one file with ``--append``:

    PYTHONPATH=python python3 benchmarks/ep_bench.py --device cuda --worlds 1 2 4 --label time-sliced --csv docs/benchmarks/ep_cuda.csv

With a build configured with ``-DMOONCAKE_EP_TRACE=ON``, ``--trace`` also
prints every rank's steps inside the IPC path's dispatch (replayed from a
graph): where its device time goes, rank by rank.
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

from bench_support import run_ranks, sweep_worlds, write_csv

SHAPES = [  # (tokens per rank T, hidden H, experts E, top-k)
    (16, 1024, 32, 4),
    (128, 2048, 32, 8),
]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class AllGatherBaseline:
    """The reference fallback's design, written for this benchmark (vectorised,
    where the reference loops in Python): every rank gathers every rank's
    padded tokens, picks its own rows into the packed layout; combine scatters
    weighted rows into a [R * T, H] bf16 buffer that is all_reduced."""

    def __init__(self, group, T, H, E):
        self.group, self.T, self.H, self.E = group, T, H, E
        self.R = group.size()
        self.L = E // self.R

    def dispatch(self, x, topk_idx):
        R, T, H, L = self.R, self.T, self.H, self.L
        n, k = topk_idx.shape
        px = torch.zeros(T, H, dtype=x.dtype, device=x.device)
        px[:n] = x
        pt = torch.full((T, k), -1, dtype=torch.int64, device=x.device)
        pt[:n] = topk_idx
        all_x = torch.empty(R * T, H, dtype=x.dtype, device=x.device)
        all_t = torch.empty(R * T, k, dtype=torch.int64, device=x.device)
        dist.all_gather_into_tensor(all_x, px, group=self.group)
        dist.all_gather_into_tensor(all_t, pt, group=self.group)
        first = self.group.rank() * L
        mine = (all_t >= first) & (all_t < first + L)
        rows, picks = torch.nonzero(mine, as_tuple=True)  # by (source, token, slot)
        # The API's packed layout: per local expert, rows by (source, token).
        local = all_t[rows, picks] - first
        order = torch.sort(local, stable=True).indices
        rows, picks, local = rows[order], picks[order], local[order]
        per_expert = torch.bincount(local, minlength=L)
        pos = torch.arange(local.numel(), device=x.device) - (torch.cumsum(per_expert, 0) - per_expert)[local]
        packed = torch.empty(L, R * T, H, dtype=x.dtype, device=x.device)
        packed[local, pos] = all_x[rows]
        return packed, (rows, picks, local, pos, all_t)

    def combine(self, y, handle, topk_weights):
        rows, picks, local, pos, all_t = handle
        R, T, H = self.R, self.T, self.H
        n = topk_weights.size(0)
        pw = torch.zeros(T, all_t.size(1), dtype=torch.float32, device=y.device)
        pw[:n] = topk_weights
        all_w = torch.empty(R * T, all_t.size(1), dtype=torch.float32, device=y.device)
        dist.all_gather_into_tensor(all_w, pw, group=self.group)
        buf = torch.zeros(R * T, H, dtype=torch.bfloat16, device=y.device)
        buf.index_add_(0, rows, (y[local, pos].float() * all_w[rows, picks].unsqueeze(1)).to(torch.bfloat16))
        dist.all_reduce(buf, group=self.group)
        me = self.group.rank()
        return buf[me * T:me * T + n]


def _rank_main(rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # more ranks than cores: one intra-op thread each
    from mooncake import pg  # noqa: F401
    from mooncake.mooncake_elastic_buffer import ElasticBuffer
    from mooncake.mooncake_ep_buffer import Buffer

    device = torch.device("cpu")
    backend = "mooncake-cpu"
    if args.device == "cuda":
        from mooncake._gpu_placement import gpu_of_rank  # noqa: PLC0415

        torch.cuda.set_device(gpu_of_rank(rank))
        device = torch.device("cuda", torch.cuda.current_device())
        backend = "mooncake"
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    group = dist.group.WORLD
    shapes = [tuple(s) for s in args.shape] if args.shape else SHAPES
    buffer = None if args.elastic_only else Buffer(group)
    elastic = ElasticBuffer(group)
    # Sized at construction, as the reference's buffer is: on one host with CUDA, the IPC path.
    sized = ElasticBuffer(group, num_max_tokens_per_rank=max(s[0] for s in shapes), hidden=max(s[1] for s in shapes),
                          num_topk=max(s[3] for s in shapes))
    if rank == 0:
        print(f"[ep_bench] world {world}: Buffer path {buffer.path if buffer else '-'} "
              f"({buffer.path_reason if buffer else 'not run'}); ElasticBuffer path "
              f"{elastic.path}; sized ElasticBuffer path {sized.path} ({sized.path_reason})", file=sys.stderr,
              flush=True)
    rows = []
    for T, H, E, K in shapes:
        if E % world:
            continue
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(device)
        topk = torch.randn(T, E, generator=g).topk(K, dim=1).indices.to(device)
        weights = torch.rand(T, K, generator=g).to(device)
        active = torch.ones(world, dtype=torch.int32, device=device)
        L = E // world
        baseline = AllGatherBaseline(group, T, H, E)
        for fp8 in (False, True) if buffer is not None else ():
            times = {"dispatch": [], "combine": [], "agreement": []}
            base = {"dispatch": [], "combine": []}
            for it in range(args.warmup + args.iters):
                dist.barrier()
                t0 = time.perf_counter()
                recv_x, count, handle, _, _ = buffer.dispatch(x, topk, active, T, E, -1, use_fp8=fp8)
                _sync(device)
                t1 = time.perf_counter()
                y = recv_x[0].to(torch.bfloat16) if fp8 else recv_x  # the "expert": identity
                dist.barrier()
                t2 = time.perf_counter()
                buffer.combine(y, topk, weights, active, -1, handle)
                _sync(device)
                t3 = time.perf_counter()
                # The agreement alone (one call's worth; keeps call numbers in step on every rank).
                dist.barrier()
                t4 = time.perf_counter()
                buffer._connection.begin_call(active, -1)
                t5 = time.perf_counter()
                if not fp8:
                    dist.barrier()
                    t6 = time.perf_counter()
                    packed, bh = baseline.dispatch(x, topk)
                    _sync(device)
                    t7 = time.perf_counter()
                    dist.barrier()
                    t8 = time.perf_counter()
                    baseline.combine(packed, bh, weights)
                    _sync(device)
                    t9 = time.perf_counter()
                if it >= args.warmup:
                    times["dispatch"].append((t0, t1))
                    times["combine"].append((t2, t3))
                    times["agreement"].append((t4, t5))
                    if not fp8:
                        base["dispatch"].append((t6, t7))
                        base["combine"].append((t8, t9))
            for impl, table in (("buffer", times), ("allgather-baseline", base)):
                for phase, samples in table.items():
                    if samples:
                        rows.append((T, H, E, K, "fp8" if fp8 else "bf16", impl, phase, samples))
        for impl, phase, samples in _time_elastic(elastic, x, topk, weights, E, T, device, args):
            rows.append((T, H, E, K, "bf16", impl, phase, samples))
        if sized.path == "ipc":
            for impl, phase, samples in _time_elastic(sized, x, topk, weights, E, T, device, args, "elastic-ipc"):
                if impl != "copy-bound":
                    rows.append((T, H, E, K, "bf16", impl, phase, samples))
            for impl, phase, samples in _time_graphs(sized, x, topk, weights, E, T, args):
                rows.append((T, H, E, K, "bf16", impl, phase, samples))
            if args.profile:
                _profile(sized, x, topk, weights, E, T, rank, world)
            if args.trace:
                _trace_steps(sized, x, topk, weights, E, T, rank, world)
    queue.put((rank, rows))
    dist.barrier()
    dist.destroy_process_group()


def _time_elastic(elastic, x, topk, weights, E, T, device, args, label="elastic"):
    """ElasticBuffer: fresh dispatch, cached dispatch, combine; and the copy
    bound (a local copy of the rows the dispatch delivered here)."""
    times = {(label, "dispatch"): [], (label, "dispatch-cached"): [], (label, "combine"): [],
             ("copy-bound", "dispatch"): [], ("copy-bound", "combine"): []}
    for it in range(args.warmup + args.iters):
        dist.barrier()
        t0 = time.perf_counter()
        recv_x, _, _, handle, _ = elastic.dispatch(x, topk_idx=topk, topk_weights=weights, num_experts=E,
                                                   num_max_tokens_per_rank=T)
        _sync(device)
        t1 = time.perf_counter()
        dist.barrier()
        t2 = time.perf_counter()
        elastic.dispatch(x, handle=handle)
        _sync(device)
        t3 = time.perf_counter()
        dist.barrier()
        t4 = time.perf_counter()
        elastic.combine(recv_x, handle)  # the "expert": identity
        _sync(device)
        t5 = time.perf_counter()
        dist.barrier()
        copy = torch.empty_like(recv_x)
        t6 = time.perf_counter()
        copy.copy_(recv_x)
        _sync(device)
        t7 = time.perf_counter()
        if it >= args.warmup:
            # Combine moves the same rows back: the same copy bounds it.
            for key, stamps in zip(times, ((t0, t1), (t2, t3), (t4, t5), (t6, t7), (t6, t7))):
                times[key].append(stamps)
    return [(impl, phase, samples) for (impl, phase), samples in times.items()]


def capture_graphs(elastic, x, topk, weights, E, T):
    """The IPC path's dispatch (do_cpu_sync=False, outputs at capacity) and
    combine, each captured in a CUDA graph (after one eager call of each):
    (dispatch graph, combine graph)."""
    def dispatch():
        return elastic.dispatch(x, topk_idx=topk, topk_weights=weights, num_experts=E, num_max_tokens_per_rank=T,
                                do_cpu_sync=False)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        recv_x, _, _, handle, _ = dispatch()
        elastic.combine(recv_x, handle)
        # The warm-up's output goes first: it holds an output slot, which the captured
        # dispatch then keeps (mooncake/_ep_elastic/output_slots.py).
        del recv_x, handle
        dispatch_graph, combine_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(dispatch_graph, stream=side):
            recv_x, _, _, handle, _ = dispatch()
        with torch.cuda.graph(combine_graph, stream=side):
            elastic.combine(recv_x, handle)
    torch.cuda.current_stream().wait_stream(side)
    return dispatch_graph, combine_graph


def _copy_graph(elastic, x, topk, weights, E, T):
    """The copy bound as the graphs are timed: one copy of the rows a
    dispatch delivers to this rank (a synchronised dispatch's ``recv_x``,
    cut to the rows received), captured in a CUDA graph. Collective (it
    dispatches once). Returns the graph and the tensors it reads and writes."""
    recv_x, _, _, _, _ = elastic.dispatch(x, topk_idx=topk, topk_weights=weights, num_experts=E,
                                          num_max_tokens_per_rank=T)
    source = recv_x.clone()
    del recv_x  # it may hold an output slot (mooncake/_ep_elastic/output_slots.py)
    target = torch.empty_like(source)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        target.copy_(source)
        with torch.cuda.graph(graph, stream=side):
            target.copy_(source)
    torch.cuda.current_stream().wait_stream(side)
    return graph, (source, target)


def _time_graphs(elastic, x, topk, weights, E, T, args):
    """The IPC path's dispatch and combine replayed from CUDA graphs
    (capture_graphs): the kernels' time without Python or launches; and the
    copy bound replayed the same way (``copy-bound-graph``, for dispatch and
    combine alike, as ``copy-bound`` is). Rows of (impl, phase, samples)."""
    copy_graph, copy_tensors = _copy_graph(elastic, x, topk, weights, E, T)
    dispatch_graph, combine_graph = capture_graphs(elastic, x, topk, weights, E, T)
    graphs = (("elastic-ipc-graph", "dispatch", dispatch_graph), ("elastic-ipc-graph", "combine", combine_graph),
              ("copy-bound-graph", "dispatch", copy_graph))
    times = {(impl, phase): [] for impl, phase, _ in graphs}
    for it in range(args.warmup + args.iters):
        for impl, phase, graph in graphs:
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            if it >= args.warmup:
                times[(impl, phase)].append((t0, time.perf_counter()))
    del copy_tensors  # held until the last replay of the copy
    copies = times[("copy-bound-graph", "dispatch")]
    return [(impl, phase, samples) for (impl, phase), samples in times.items()] + [
        ("copy-bound-graph", "combine", copies)]


def _profile(elastic, x, topk, weights, E, T, rank, world, calls=5):
    """Rank 0 prints where the device time of the IPC path's dispatch
    (without host synchronisation) and combine goes: the torch profiler's
    kernels by total device time over ``calls`` calls."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    def step():
        recv_x, _, _, handle, _ = elastic.dispatch(x, topk_idx=topk, topk_weights=weights, num_experts=E,
                                                   num_max_tokens_per_rank=T, do_cpu_sync=False)
        elastic.combine(recv_x, handle)

    step()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    dist.barrier()
    if rank == 0:
        print(f"[ep_bench] profile, world {world}, T={T} H={x.size(1)} E={E} k={topk.size(1)}, {calls} calls of "
              "dispatch (do_cpu_sync=False) + combine:", file=sys.stderr)
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=30), file=sys.stderr, flush=True)
        try:
            _print_last_call_timeline(prof)
        except Exception as e:  # noqa: BLE001 (a profiler without device events: the table above stands)
            print(f"[ep_bench] no kernel timeline: {e}", file=sys.stderr)


def trace_replays(graph, replays, before_replay=lambda: None):
    """The stamps (mooncake/ep/cuda/trace.h) of ``replays`` replays of
    ``graph``, each from a synchronised device, cleared before and read
    after it: a list, per replay, of (first, last) per point. Exits with
    the reason where the build does not stamp."""
    from mooncake import _ep_ipc  # noqa: PLC0415

    if not _ep_ipc.trace_enabled():
        raise SystemExit("[ep] --trace needs a build with -DMOONCAKE_EP_TRACE=ON")
    runs = []
    for _ in range(replays):
        torch.cuda.synchronize()
        _ep_ipc.trace_reset()
        before_replay()
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        runs.append(_ep_ipc.trace_read())
    return runs


def step_table(names, every):
    """``every``: per rank, trace_replays' list; ``names``: the points'
    (mooncake._ep_ipc.trace_points()). Per point: its name and, per rank,
    the medians over the replays of its first and last block's stamp in µs
    after the replay's first stamp on any rank (None where no block of that
    rank reached it)."""
    unreached = 2**64 - 1
    replays = len(every[0])
    origins = [min(first for runs in every for first, _ in runs[i]) for i in range(replays)]
    table = []
    for p, name in enumerate(names):
        cells = []
        for runs in every:
            reached = [(runs[i][p][0] - origins[i], runs[i][p][1] - origins[i]) for i in range(replays)
                       if runs[i][p][0] != unreached]
            cells.append((statistics.median(f for f, _ in reached) / 1e3, statistics.median(la for _, la in reached) / 1e3)
                         if reached else None)
        table.append((name, cells))
    return table


def format_steps(table):
    """step_table's rows as lines: the name, then each rank's first and last block, ``|`` between ranks."""
    return [f"{name:14s} " + " | ".join(f"{c[0]:7.2f} {c[1]:7.2f}" if c else f"{'-':>7s} {'-':>7s}" for c in cells)
            for name, cells in table]


def _trace_steps(elastic, x, topk, weights, E, T, rank, world, replays=20):
    """Every rank's steps inside the dispatch's kernels, replayed from a
    graph (a build with MOONCAKE_EP_TRACE=ON): rank 0 prints step_table's
    rows (the ranks share the GPU's global timer when they share a GPU)."""
    dispatch_graph, _ = capture_graphs(elastic, x, topk, weights, E, T)
    runs = trace_replays(dispatch_graph, replays, before_replay=dist.barrier)
    every = [None] * world
    dist.all_gather_object(every, runs)
    if rank != 0:
        return
    print(f"[ep_bench] world {world}, T={T}: dispatch steps, us after the first stamp (median of {replays}); "
          "per rank: first block, last block", file=sys.stderr)
    from mooncake import _ep_ipc  # noqa: PLC0415

    for line in format_steps(step_table(_ep_ipc.trace_points(), every)):
        print(f"[ep_bench]   {line}", file=sys.stderr, flush=True)


def _print_last_call_timeline(prof):
    """The last dispatch + combine as launches in device order: start (µs
    after the call's first kernel) and duration. One kernel name covers an
    operation's send, wait and copy/reduce launches; this tells them apart,
    and shows the gaps and the time spent waiting for peers."""
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and e.time_range.elapsed_us() > 0),
                     key=lambda e: e.time_range.start)
    starts = [i for i, e in enumerate(kernels) if "sendTileKernel" in e.name]
    if not starts:
        return
    last = kernels[starts[-1]:]
    t0 = last[0].time_range.start
    print("[ep_bench] the last call's kernels in device order: start_us duration_us name", file=sys.stderr)
    for e in last:
        print(f"  {e.time_range.start - t0:9.1f} {e.time_range.elapsed_us():9.1f}  {e.name[:90]}", file=sys.stderr)
    sys.stderr.flush()


def _run_world(world, args):
    """Per row, over iterations: the slowest rank's own time (median and p90),
    and the time from the last rank's start to the last rank's end (median;
    every rank's stamps are of one clock, perf_counter's CLOCK_MONOTONIC, as
    the ranks share a host). The second leaves out how far apart the barrier
    let the ranks go, which the first counts in a call that waits for its
    peers (a rank that starts early waits for the late one's rows) and not in
    one that does not (the copy bound)."""
    per_rank = run_ranks(_rank_main, world, args, args.timeout)
    out = []
    for i, (T, H, E, K, dtype, impl, phase, _) in enumerate(per_rank[0]):
        stamps = [[per_rank[r][i][7][it] for r in range(world)] for it in range(args.iters)]
        slowest = sorted(max(end - start for start, end in ranks) for ranks in stamps)
        from_last_start = [max(end for _, end in ranks) - max(start for start, _ in ranks) for ranks in stamps]
        out.append(dict(world=world, tokens=T, hidden=H, experts=E, topk=K, dtype=dtype, impl=impl, phase=phase,
                        median_ms=round(statistics.median(slowest) * 1e3, 3),
                        p90_ms=round(slowest[int(0.9 * (len(slowest) - 1))] * 1e3, 3), mode=args.label,
                        from_last_start_ms=round(statistics.median(from_last_start) * 1e3, 3)))
    for world_, mode, (T, H, E, K), phase, bound, ratio in graph_ratios(out):
        print(f"[ep_bench] world {world_} ({mode}), T={T} H={H} E={E} k={K}: {phase} from a graph / {bound} = "
              f"{ratio:.2f}x", file=sys.stderr, flush=True)
    return out


def graph_ratios(rows):
    """The IPC path's calls replayed from graphs (``elastic-ipc-graph``)
    against each copy bound of the same world, mode, shape and phase in
    ``rows`` (``_run_world``'s), by median: (world, mode, (T, H, E, K),
    phase, bound, ratio), bounds that were not measured left out."""
    median = {(r["world"], r["mode"], r["tokens"], r["hidden"], r["experts"], r["topk"], r["impl"], r["phase"]):
              r["median_ms"] for r in rows}
    ratios = []
    for (world, mode, T, H, E, K, impl, phase), ms in median.items():
        if impl != "elastic-ipc-graph":
            continue
        for bound in ("copy-bound", "copy-bound-graph"):
            bound_ms = median.get((world, mode, T, H, E, K, bound, phase))
            if bound_ms:
                ratios.append((world, mode, (T, H, E, K), phase, bound, ms / bound_ms))
    return ratios


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--label", default="-", help="the run's mode column (e.g. time-sliced, mps)")
    ap.add_argument("--shape", type=int, nargs=4, action="append", metavar=("T", "H", "E", "K"),
                    help="tokens per rank, hidden, experts, top-k (repeatable; default: the two shapes above)")
    ap.add_argument("--elastic-only", action="store_true", help="only the ElasticBuffer rows (large shapes, where "
                    "the Buffer's per-expert region would not fit)")
    ap.add_argument("--profile", action="store_true", help="rank 0 prints the IPC path's kernels by device time "
                    "(torch profiler) after each shape")
    ap.add_argument("--trace", action="store_true", help="rank 0 prints every rank's steps inside the IPC path's "
                    "dispatch, replayed from a graph (a build with -DMOONCAKE_EP_TRACE=ON)")
    ap.add_argument("--csv")
    ap.add_argument("--append", action="store_true", help="add to --csv instead of overwriting it")
    args = ap.parse_args()
    write_csv(sweep_worlds("ep_bench", _run_world, args), args.csv, append=args.append)


if __name__ == "__main__":
    main()
