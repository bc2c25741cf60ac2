"""One rank's ElasticBuffer IPC dispatch and combine, each captured in a CUDA
graph, replayed once inside the NVTX range "probe" and then timed: the
kernels of one call, for Nsight Compute, which profiles each node of a graph
(ep_bench.py times several ranks; its --profile sees eager launches only).

    PYTHONPATH=python python3 benchmarks/ep_graph_probe.py 128 4096 256 8
    PYTHONPATH=python ncu --nvtx --nvtx-include "probe/" --graph-profiling node --clock-control none \\
        --section SpeedOfLight --section LaunchStats --section WarpStateStats --csv --page details \\
        python3 benchmarks/ep_graph_probe.py 128 4096 256 8 > ncu.csv

World 1 only: ncu runs one kernel at a time, so the kernels of several ranks
that wait for each other would never meet. Prints the medians of 50 replays
of each graph (stderr).

    PYTHONPATH=python python3 benchmarks/ep_graph_probe.py 128 4096 256 8 --timeline

also records 20 replays of each graph with the CUDA profiler (CUPTI, through
torch.profiler: clocks and caches as in a real run, unlike ncu's defaults)
and prints each kernel's median time and the median gap before it: where a
call's time goes between its kernels and between their launches.

    cmake ... -DMOONCAKE_EP_TRACE=ON && ninja mooncake_ep_ipc_py
    PYTHONPATH=python python3 benchmarks/ep_graph_probe.py 128 4096 256 8 --trace

also prints where the time goes inside the dispatch's kernels: each step's
first and last block (mooncake/ep/cuda/trace.h), median µs after the
layout's first block began, over 20 replays. Only with a build that stamps
(the stamps' atomics cost a little: time the call without them)."""

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist


def shape_arguments(description: str, port: int) -> argparse.ArgumentParser:
    """The probes' command line: the call's shape and the group's port."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in ("tokens", "hidden", "experts", "topk"):
        ap.add_argument(name, type=int)
    ap.add_argument("--port", type=int, default=port)
    return ap


def one_rank_buffer(args, name: str):
    """A group of one rank on GPU 0, an ElasticBuffer sized for ``args``' shape,
    and a call's inputs: (buffer, x, topk_idx, topk_weights)."""
    T, H, E, K = args.tokens, args.hidden, args.experts, args.topk
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    from mooncake import pg  # noqa: F401, PLC0415 (registers the backend)
    from mooncake.mooncake_elastic_buffer import ElasticBuffer  # noqa: PLC0415

    torch.cuda.set_device(0)
    dist.init_process_group("mooncake", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    buffer = ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=T, hidden=H, num_topk=K)
    print(f"[{name}] path {buffer.path}", file=sys.stderr)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()
    topk = torch.randn(T, E, generator=g).topk(K, dim=1).indices.cuda()
    weights = torch.rand(T, K, generator=g).cuda()
    return buffer, x, topk, weights


def median_us(fn, calls=50) -> float:
    """The median of ``calls`` runs of ``fn``, each from a synchronised
    device to ``torch.cuda.synchronize()`` after it, in microseconds."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e6


def main():
    ap = shape_arguments(__doc__, 29533)
    ap.add_argument("--timeline", action="store_true", help="also each kernel's time and the gaps (torch.profiler)")
    ap.add_argument("--trace", action="store_true", help="also the dispatch's steps inside its kernels "
                    "(a build with MOONCAKE_EP_TRACE=ON)")
    args = ap.parse_args()
    from ep_bench import capture_graphs  # noqa: PLC0415 (benchmarks/, the script's folder)

    buffer, x, topk, weights = one_rank_buffer(args, "ep_graph_probe")
    E, T = args.experts, args.tokens
    dispatch_graph, combine_graph = capture_graphs(buffer, x, topk, weights, E, T)
    for _ in range(3):
        dispatch_graph.replay()
        combine_graph.replay()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("probe")
    dispatch_graph.replay()
    combine_graph.replay()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    for name, graph in (("dispatch", dispatch_graph), ("combine", combine_graph)):
        print(f"[ep_graph_probe] {name} from a graph: median {median_us(graph.replay):.1f} us", file=sys.stderr)
    if args.timeline:
        for name, graph in (("dispatch", dispatch_graph), ("combine", combine_graph)):
            print_timeline(name, graph)
    if args.trace:
        print_steps(dispatch_graph)
    dist.destroy_process_group()


def print_timeline(name, graph, replays=20):
    """Each kernel of `graph`'s replays (CUPTI's records, in order): its
    median time and the median gap since the previous kernel ended (the
    first kernel's gap: since the replay's host call)."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    if not kernels or len(kernels) % replays:
        print(f"[ep_graph_probe] {name}: {len(kernels)} kernel records for {replays} replays", file=sys.stderr)
        return
    per = len(kernels) // replays
    rows = []
    for i in range(per):
        runs = kernels[i::per]
        times = sorted(e.time_range.end - e.time_range.start for e in runs)
        gaps = sorted(runs[j].time_range.start - kernels[j * per + i - 1].time_range.end
                      for j in range(replays) if i > 0)
        rows.append((runs[0].name[:60], times[len(times) // 2], gaps[len(gaps) // 2] if gaps else float("nan")))
    spans = sorted(kernels[j * per + per - 1].time_range.end - kernels[j * per].time_range.start
                   for j in range(replays))
    print(f"[ep_graph_probe] {name} timeline (us, median of {replays}): first kernel start to last end "
          f"{spans[len(spans) // 2]:.1f}", file=sys.stderr)
    for kernel, took, gap in rows:
        print(f"[ep_graph_probe]   {took:7.1f}  (gap before {gap:5.1f})  {kernel}", file=sys.stderr)


def print_steps(graph, replays=20):
    """The dispatch's steps inside its kernels (mooncake/ep/cuda/trace.h):
    per point, the median over ``replays`` of its first and last block's
    stamp, in µs after the first stamp of the replay (the layout's first
    block)."""
    from ep_bench import format_steps, step_table, trace_replays  # noqa: PLC0415
    from mooncake import _ep_ipc  # noqa: PLC0415

    table = step_table(_ep_ipc.trace_points(), [trace_replays(graph, replays)])
    print(f"[ep_graph_probe] dispatch steps (us after the first stamp, median of {replays}): first block, last block",
          file=sys.stderr)
    for line in format_steps(table):
        print(f"[ep_graph_probe]   {line}", file=sys.stderr)


if __name__ == "__main__":
    main()
