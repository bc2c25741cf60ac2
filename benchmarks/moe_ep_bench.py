"""Latency of mooncake.moe_ep.MoEEp forward (dispatch -> grouped-GEMM SwiGLU
experts -> combine) in its three layouts, next to a dense single-process MoE
of the same shape on the same GPU as the peer (the same math in plain torch:
picks sorted by expert, two grouped GEMMs, SwiGLU in float32, a weighted sum
in float32; no communication).

Every rank holds the full weights (a fixed seed, scaled by 1/sqrt(fan_in)),
keeps its own experts for the layer, and makes its own tokens and softmax
top-k routing (seed 1000 + rank, every pick a real expert). Each forward
comes after a barrier; a row reports, over iterations, the median and p90 of
the slowest rank: "forward" is the host's wall time of the call up to a CUDA
synchronisation, "dispatch" / "compute" / "combine" are the layer's
``last_timings_ms`` (CUDA events on its stream; host clock on CPU). The
output of the last forward is checked once, on every rank, against the dense
MoE of that rank's tokens (bf16, the peer) and against a float32 reference;
the worst rank's max abs error is in the CSV.

The peer ("dense" rows, one process alone on the GPU after the worlds ran)
is timed like the layer, up to a synchronisation after each call, on the
tokens of all R ranks together (R * T: the work of the whole world) for R = 1
and each world size; its "world" column is that R.

    PYTHONPATH=python python3 benchmarks/moe_ep_bench.py --worlds 1 2 4 --label time-sliced --csv docs/benchmarks/moe_ep_cuda.csv

Ranks run on GPU r % G (python/mooncake/_gpu_placement.py; G from
MOONCAKE_TEST_GPUS, else every visible GPU). Several ranks on one GPU
time-share it unless MPS runs (nvidia-cuda-mps-control -d): name the run with
--label and add runs to one file with --append. ``--device cpu`` (mooncake-cpu,
small shapes) is a smoke test of the script itself.
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

LAYOUTS = (("LOW_LATENCY", "EXPERT_MAJOR"), ("LOW_LATENCY", "RANK_MAJOR"), ("HIGH_THROUGHPUT", "FLAT"))


def _log(msg: str) -> None:
    print(f"[moe_ep_bench] {msg}", file=sys.stderr, flush=True)


def _device(args, rank: int) -> torch.device:
    if args.device == "cuda":
        from mooncake._gpu_placement import gpu_of_rank  # noqa: PLC0415

        torch.cuda.set_device(gpu_of_rank(rank))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def full_weights(args, device):
    """w13 [E, 2I, H], w2 [E, H, I] bf16, the same in every process (seed 7 on the device)."""
    E, H, I = args.experts, args.hidden, args.intermediate
    g = torch.Generator(device=device).manual_seed(7)
    w13 = (torch.randn(E, 2 * I, H, generator=g, device=device) / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g, device=device) / I ** 0.5).to(torch.bfloat16)
    return w13, w2


def rank_inputs(args, rank, device):
    """Rank `rank`'s T tokens [T, H] bf16, top-k ids [T, k] (global, none -1), softmax weights [T, k] float32."""
    g = torch.Generator(device=device).manual_seed(1000 + rank)
    x = torch.randn(args.tokens, args.hidden, generator=g, device=device).to(torch.bfloat16)
    logits = torch.randn(args.tokens, args.experts, generator=g, device=device)
    weights, ids = torch.softmax(logits, dim=1).topk(args.topk, dim=1)
    return x, ids, weights.to(torch.float32)


def _grouped(rows, weights, offsets, counts):
    """rows [n, K] sorted by group, weights [G, N, K], offsets (int32 cumsum of counts) -> [n, N] bf16."""
    if hasattr(torch, "_grouped_mm") and rows.size(0):
        try:
            return torch._grouped_mm(rows, weights.transpose(1, 2), offs=offsets)
        except (RuntimeError, NotImplementedError):
            pass
    out = rows.new_empty(rows.size(0), weights.size(1))
    start = 0
    for g, n in enumerate(counts.tolist()):
        out[start:start + n] = rows[start:start + n] @ weights[g].t()
        start += n
    return out


def dense_moe(x, ids, weights, w13, w2):
    """The peer: every token through its k experts in one process, bf16 GEMMs
    (float32 accumulation), SwiGLU and the weighted sum in float32. Every pick
    must be a real expert (no -1): nothing here waits for the device."""
    E, I = w13.size(0), w2.size(2)
    n, k = ids.shape
    expert = ids.reshape(-1)
    order = torch.sort(expert, stable=True).indices
    token = order // k
    counts = torch.bincount(expert, minlength=E)
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    gate_up = _grouped(x[token], w13, offsets, counts)
    gate, up = gate_up.float().split(I, dim=1)
    y = _grouped((torch.nn.functional.silu(gate) * up).to(torch.bfloat16), w2, offsets, counts)
    out = torch.zeros(n, x.size(1), dtype=torch.float32, device=x.device)
    out.index_add_(0, token, y.float() * weights.reshape(-1)[order].unsqueeze(1))
    return out.to(torch.bfloat16)


def reference_fp32(x, ids, weights, w13, w2):
    """The same MoE in float32 throughout, one expert at a time (the check)."""
    I = w2.size(2)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w13.size(0)):
        token, lane = torch.nonzero(ids == e, as_tuple=True)
        if token.numel() == 0:
            continue
        h = x[token].float() @ w13[e].float().t()
        y = (torch.nn.functional.silu(h[:, :I]) * h[:, I:]) @ w2[e].float().t()
        out.index_add_(0, token, y * weights[token, lane].unsqueeze(1))
    return out


def _max_err(got, want) -> float:
    return float((got.float() - want.float()).abs().max())


def _rank_main(rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from mooncake import pg  # noqa: F401
    from mooncake.moe_ep import Algorithm, EpBootstrap, ExpertWeights, FleetConfig, Layout, MoEEp

    device = _device(args, rank)
    backend = "mooncake" if device.type == "cuda" else "mooncake-cpu"
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    group = dist.group.WORLD
    w13, w2 = full_weights(args, device)
    L = args.experts // world
    mine = ExpertWeights(w13[rank * L:(rank + 1) * L].clone(), w2[rank * L:(rank + 1) * L].clone())
    x, ids, weights = rank_inputs(args, rank, device)
    want_dense = dense_moe(x, ids, weights, w13, w2)
    want_fp32 = reference_fp32(x, ids, weights, w13, w2)
    rows = []
    begun = time.perf_counter()
    for algorithm, layout in LAYOUTS:
        fleet = FleetConfig(num_experts=args.experts, max_tokens_per_rank=args.tokens, hidden=args.hidden,
                            intermediate=args.intermediate, num_topk=args.topk, algorithm=Algorithm[algorithm],
                            layout=Layout[layout])
        layer = MoEEp(EpBootstrap(group), fleet, mine, enable_timing=True)
        if rank == 0:
            transport = layer.transport
            _log(f"world {world}, {layout}: {type(transport).__name__}, path {transport.path}")
        samples = {"dispatch": [], "compute": [], "combine": [], "forward": []}
        out = None
        for it in range(args.warmup + args.iters):
            dist.barrier()
            t0 = time.perf_counter()
            out = layer.forward(x, ids, weights)
            _sync(device)
            t1 = time.perf_counter()
            if it >= args.warmup:
                for phase, ms in layer.last_timings_ms.items():
                    samples[phase].append(ms / 1e3)
                samples["forward"].append(t1 - t0)
        errors = (_max_err(out, want_dense), _max_err(out, want_fp32))
        if rank == 0:
            _log(f"world {world}, {layout}: {args.warmup + args.iters} forwards done at "
                 f"{time.perf_counter() - begun:.1f} s")
        layer.destroy()  # collective: its Buffer's fast path closes on every rank together
        rows.append((layout, samples, errors))
    queue.put((rank, rows))
    dist.barrier()
    dist.destroy_process_group()


def _dense_main(rank, world, port, args, queue):
    """The peer, alone in its process: the dense MoE on one rank's tokens and on each world's."""
    del world, port
    torch.set_num_threads(1)
    device = _device(args, rank)
    w13, w2 = full_weights(args, device)
    grouped = "torch._grouped_mm"
    try:
        a = torch.randn(32, args.hidden, device=device).to(torch.bfloat16)
        torch._grouped_mm(a, w13[:2].transpose(1, 2), offs=torch.tensor([16, 32], dtype=torch.int32, device=device))
    except (AttributeError, RuntimeError, NotImplementedError) as err:
        grouped = f"per-expert matmul ({type(err).__name__}: {str(err).splitlines()[0]})"
    _log(f"dense peer on {device}: grouped GEMM by {grouped}")
    out = []
    for ranks in sorted({1, *args.worlds}):
        parts = [rank_inputs(args, r, device) for r in range(ranks)]
        x, ids, weights = (torch.cat([p[i] for p in parts]) for i in range(3))
        samples = []
        for it in range(args.warmup + args.iters):
            _sync(device)
            t0 = time.perf_counter()
            got = dense_moe(x, ids, weights, w13, w2)
            _sync(device)
            if it >= args.warmup:
                samples.append(time.perf_counter() - t0)
        out.append((ranks, samples, _max_err(got, reference_fp32(x, ids, weights, w13, w2))))
    queue.put((rank, out))


def _stats(samples):
    samples = sorted(samples)
    return dict(median_ms=round(statistics.median(samples) * 1e3, 3),
                p90_ms=round(samples[int(0.9 * (len(samples) - 1))] * 1e3, 3))


def _shape(args, world, tokens_total):
    return dict(world=world, mode=args.label, tokens_per_rank=args.tokens, tokens_total=tokens_total,
                hidden=args.hidden, intermediate=args.intermediate, experts=args.experts, topk=args.topk)


def _run_world(world, args):
    per_rank = run_ranks(_rank_main, world, args, args.timeout)
    out = []
    for i, (layout, samples, _) in enumerate(per_rank[0]):
        err_dense = max(per_rank[r][i][2][0] for r in range(world))
        err_fp32 = max(per_rank[r][i][2][1] for r in range(world))
        _log(f"world {world}, {layout}: max abs error vs the dense MoE {err_dense:.4g}, vs float32 {err_fp32:.4g}")
        for phase in samples:
            slowest = [max(per_rank[r][i][1][phase][it] for r in range(world)) for it in range(args.iters)]
            out.append(dict(**_shape(args, world, world * args.tokens), impl=f"moe_ep {layout}", phase=phase,
                            **_stats(slowest), err_vs_dense=round(err_dense, 5), err_vs_fp32=round(err_fp32, 5)))
    return out


def _run_dense(args):
    out = []
    for ranks, samples, err in run_ranks(_dense_main, 1, args, args.timeout)[0]:
        _log(f"dense peer, {ranks * args.tokens} tokens: max abs error vs float32 {err:.4g}")
        out.append(dict(**_shape(args, ranks, ranks * args.tokens), impl="dense", phase="forward", **_stats(samples),
                        err_vs_dense=0.0, err_vs_fp32=round(err, 5)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--tokens", type=int, default=128, help="tokens per rank (T)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--no-dense", action="store_true", help="skip the dense peer (e.g. in an --append run)")
    ap.add_argument("--label", default="-", help="the run's mode column (e.g. time-sliced, mps)")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--csv")
    ap.add_argument("--append", action="store_true", help="add to --csv instead of overwriting it")
    args = ap.parse_args()
    results = sweep_worlds("moe_ep_bench", _run_world, args)
    if not args.no_dense:
        results += _run_dense(args)
    write_csv(results, args.csv, append=args.append)


if __name__ == "__main__":
    main()
