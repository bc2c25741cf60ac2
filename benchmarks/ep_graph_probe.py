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
of each graph (stderr)."""

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in ("tokens", "hidden", "experts", "topk"):
        ap.add_argument(name, type=int)
    ap.add_argument("--port", type=int, default=29533)
    args = ap.parse_args()
    T, H, E, K = args.tokens, args.hidden, args.experts, args.topk

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    from mooncake import pg  # noqa: F401, PLC0415 (registers the backend)
    from mooncake.mooncake_elastic_buffer import ElasticBuffer  # noqa: PLC0415

    from ep_bench import capture_graphs  # noqa: PLC0415 (benchmarks/, the script's folder)

    torch.cuda.set_device(0)
    dist.init_process_group("mooncake", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    buffer = ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=T, hidden=H, num_topk=K)
    print(f"[ep_graph_probe] path {buffer.path}", file=sys.stderr)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()
    topk = torch.randn(T, E, generator=g).topk(K, dim=1).indices.cuda()
    weights = torch.rand(T, K, generator=g).cuda()

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
        times = []
        for _ in range(50):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        times.sort()
        print(f"[ep_graph_probe] {name} from a graph: median {times[len(times) // 2] * 1e6:.1f} us", file=sys.stderr)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
