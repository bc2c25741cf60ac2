"""Where one rank's eager ElasticBuffer dispatch spends its host time: the
medians of eager calls (fresh with and without ``do_cpu_sync``, cached,
combine), each from launch to ``torch.cuda.synchronize()``, then a cProfile of
the fresh dispatch's Python (by own time) and the torch profiler's host
operators (by self CPU time). World 1 on the IPC path; ep_bench.py times
several ranks, ep_graph_probe.py the graphs.

    PYTHONPATH=python python3 benchmarks/ep_eager_probe.py 128 4096 256 8
"""

import cProfile
import io
import pstats
import sys

import torch
import torch.distributed as dist


def main():
    # benchmarks/, the script's folder
    from ep_graph_probe import median_us, one_rank_buffer, shape_arguments  # noqa: PLC0415

    ap = shape_arguments(__doc__, 29534)
    ap.add_argument("--rows", type=int, default=25, help="rows of each profile table")
    args = ap.parse_args()
    T, E = args.tokens, args.experts
    buffer, x, topk, weights = one_rank_buffer(args, "ep_eager_probe")

    def fresh(sync=True):
        return buffer.dispatch(x, topk_idx=topk, topk_weights=weights, num_experts=E, num_max_tokens_per_rank=T,
                               do_cpu_sync=sync)

    recv_x, _, _, handle, _ = fresh()
    for _ in range(5):
        fresh()
        fresh(False)
        buffer.dispatch(x, handle=handle)
        buffer.combine(recv_x, handle)
    for name, fn in (("dispatch, do_cpu_sync=True", fresh), ("dispatch, do_cpu_sync=False", lambda: fresh(False)),
                     ("dispatch, cached", lambda: buffer.dispatch(x, handle=handle)),
                     ("combine", lambda: buffer.combine(recv_x, handle))):
        print(f"[ep_eager_probe] {name}: median {median_us(fn):.1f} us", file=sys.stderr)

    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(50):
        fresh()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.rows)
    print("[ep_eager_probe] cProfile, 50 fresh dispatches (do_cpu_sync=True), by own time:", file=sys.stderr)
    print(out.getvalue(), file=sys.stderr)

    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            fresh()
        torch.cuda.synchronize()
    print("[ep_eager_probe] torch profiler, 20 fresh dispatches (do_cpu_sync=True), by self CPU time:", file=sys.stderr)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows), file=sys.stderr, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
