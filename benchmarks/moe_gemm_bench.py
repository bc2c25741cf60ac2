"""The expert compute of one rank at the seed's config (issue 22: E = 16
experts, top-8, T = 128 tokens per rank, H = 8192, I = 2048, bf16), in one
process on one device, for the world sizes R it emulates:

- "blocks": what the layer's expert-major path runs on balanced experts,
  ``mooncake.moe_ep.experts.swiglu_expert_blocks`` (GEMM w13 -> SwiGLU in
  float32 -> GEMM w2, bf16 in and out, float32 accumulation) as two batched
  matmuls over the per-expert blocks of rows as they arrived, [L, largest
  count, H];
- "grouped": the layer's ``swiglu_experts`` on rows sorted by expert, with the
  counts on the host: the same batched matmuls after padding the rows into
  blocks (and gathering them back) when the experts are balanced, else the
  grouped form below;
- "grouped_mm": that grouped form, ``grouped_swiglu_experts`` (``torch._grouped_mm``
  where this torch takes it, else its per-expert fallback: the log names which);
- "loop": the per-expert loop of today, ``mooncake.moe.MoEEpLayer.expert``
  called once per local expert (float32 matmuls, weights converted on every
  call, one bf16 rounding at the end), as MoEEpLayer.forward does;
- "mm": the bound, torch's plain bf16 ``torch.mm`` of the same FLOPs, one
  [rows, H] x [H, 2I] and one [rows, I] x [I, H] over all the rank's rows;
- "bmm": ``torch.bmm`` with the per-expert shapes (L experts of rows / L rows
  each, their own weights): the same weight bytes as the grouped GEMM. At few
  rows per expert the GEMMs are bound by reading the weights, which "mm"
  (one weight for all rows) does not pay; this row shows that part.

Routing, as tests/python/ep/test_moe_ep.py and moe_ep_bench.py make it: the
R * T tokens of R ranks (seed 1000 + rank), softmax top-k over E experts.
Rank 0 holds experts 0 .. E/R - 1 and receives every pick of them (about
T * k rows in all, R * T * k / E per expert); its rows, sorted by expert, are
what every implementation computes. The weights are moe_ep_bench's (seed 7,
scaled by 1/sqrt(fan_in)).

Timing: CUDA events around each call, on the current stream (host clock on
CPU); median and p90 over --iters calls after --warmup. Nothing in the timed
calls reads device values on the host, except the fallback's counts.tolist()
when torch._grouped_mm is unavailable. TFLOP/s counts the GEMMs only,
2 * rows * H * 2I + 2 * rows * I * H (SwiGLU excluded); ratio_to_bound is
TFLOP/s over mm's (the issue's bar: the layer's compute >= 0.5).

Before timing, the grouped result is checked against the loop's: within
3e-2 of the loop's max abs value (plus 3e-2 relative); otherwise the run
stops.

    PYTHONPATH=python python3 benchmarks/moe_gemm_bench.py --csv docs/benchmarks/moe_gemm_cuda.csv
    python3 benchmarks/plot_moe_gemm.py docs/benchmarks/moe_gemm_cuda.csv docs/benchmarks/moe_gemm_cuda.png
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types

import torch

from bench_support import write_csv
from moe_ep_bench import full_weights, rank_inputs
from mooncake.moe_ep.experts import grouped_swiglu_experts, swiglu_expert_blocks, swiglu_experts


def _log(msg: str) -> None:
    print(f"[moe_gemm_bench] {msg}", file=sys.stderr, flush=True)


def _loop_expert():
    """MoEEpLayer.expert, unbound: it only reads w13, w2 and intermediate_size
    from the layer, so a namespace with those runs its own code."""
    from mooncake.moe import MoEEpLayer  # noqa: PLC0415 - needs mooncake.pg built

    return MoEEpLayer.expert


def per_expert_loop(expert, layer, rows, counts_list, out):
    """The old layer's compute: one expert at a time over its slice of rows."""
    start = 0
    for le, n in enumerate(counts_list):
        if n:
            out[start:start + n] = expert(layer, le, rows[start:start + n])
        start += n
    return out


def rank0_rows(args, world, device):
    """Rank 0's received rows at world `world`: [n, H] bf16 sorted by local
    expert, and the rows per local expert (a device tensor and a host list)."""
    local = args.experts // world
    parts = [rank_inputs(args, r, device) for r in range(world)]
    x = torch.cat([p[0] for p in parts])
    ids = torch.cat([p[1] for p in parts])
    token, lane = torch.nonzero(ids < local, as_tuple=True)
    expert = ids[token, lane]
    order = torch.sort(expert, stable=True).indices
    counts = torch.bincount(expert, minlength=local)
    return x[token[order]].contiguous(), counts, counts.tolist()


def grouped_path(rows, w13, counts) -> str:
    """Which path the layer's _grouped takes for these shapes (it falls back silently)."""
    try:
        torch._grouped_mm(rows, w13.transpose(1, 2), offs=torch.cumsum(counts, 0).to(torch.int32))
        return "torch._grouped_mm"
    except (AttributeError, RuntimeError, NotImplementedError) as err:
        return f"per-expert fallback ({type(err).__name__}: {str(err).splitlines()[0]})"


def time_calls(fn, device, warmup, iters) -> list[float]:
    """Milliseconds of each of `iters` calls after `warmup`."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)  # read the events only after every call
        return [start.elapsed_time(end) for start, end in events]
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return samples


def run_world(world, args, device, w13_full, w2_full, expert):
    H, I = args.hidden, args.intermediate
    local = args.experts // world
    w13, w2 = w13_full[:local].contiguous(), w2_full[:local].contiguous()
    rows, counts, counts_list = rank0_rows(args, world, device)
    n = rows.size(0)
    _log(f"world {world}: rank 0 holds {local} experts, {n} rows "
         f"({min(counts_list)}-{max(counts_list)} per expert); grouped GEMM by {grouped_path(rows, w13, counts)}")

    layer = types.SimpleNamespace(w13=w13, w2=w2, intermediate_size=I)
    loop_out = rows.new_empty(n, H)
    grouped = swiglu_experts(rows, counts, w13, w2, host_counts=counts_list)
    looped = per_expert_loop(expert, layer, rows, counts_list, loop_out).clone()
    scale = float(looped.float().abs().max())
    err = float((grouped.float() - looped.float()).abs().max())
    if not torch.allclose(grouped.float(), looped.float(), rtol=3e-2, atol=3e-2 * scale):
        raise SystemExit(f"world {world}: the grouped compute differs from the per-expert loop: max abs error "
                         f"{err:.4g} against max abs value {scale:.4g} (rtol = atol = 3e-2 of it)")
    _log(f"world {world}: grouped vs loop max abs error {err:.4g} (max abs value {scale:.4g})")

    # The bound's operands: the same rows, one weight per GEMM, in nn.Linear's
    # layout (out x in, transposed), as the experts' weights are.
    a1, b1 = rows, w13[0].t()
    a2, b2 = torch.randn(n, I, device=device).to(torch.bfloat16), w2[0].t()
    # bmm with the per-expert shapes: equal rows per expert (rows // L), L weights.
    m = max(n // local, 1)
    c1 = torch.randn(local, m, H, device=device).to(torch.bfloat16)
    c2 = torch.randn(local, m, I, device=device).to(torch.bfloat16)
    d1, d2 = w13.transpose(1, 2), w2.transpose(1, 2)

    # The expert-major layout's blocks: each expert's rows, then whatever lies past its count.
    blocks = torch.zeros(local, max(counts_list), H, dtype=torch.bfloat16, device=device)
    start = 0
    for e, c in enumerate(counts_list):
        blocks[e, :c] = rows[start:start + c]
        start += c
    from_blocks = swiglu_expert_blocks(blocks, w13, w2)
    flat = torch.cat([from_blocks[e, :c] for e, c in enumerate(counts_list)])
    if not torch.allclose(flat.float(), looped.float(), rtol=3e-2, atol=3e-2 * scale):
        raise SystemExit(f"world {world}: the blocks compute differs from the per-expert loop")

    impls = (("blocks", sum(counts_list), lambda: swiglu_expert_blocks(blocks, w13, w2)),
             ("grouped", n, lambda: swiglu_experts(rows, counts, w13, w2, host_counts=counts_list)),
             ("grouped_mm", n, lambda: grouped_swiglu_experts(rows, counts, w13, w2)),
             ("loop", n, lambda: per_expert_loop(expert, layer, rows, counts_list, loop_out)),
             ("mm", n, lambda: (torch.mm(a1, b1), torch.mm(a2, b2))),
             ("bmm", m * local, lambda: (torch.bmm(c1, d1), torch.bmm(c2, d2))))
    out = []
    for name, n_rows, fn in impls:
        samples = sorted(time_calls(fn, device, args.warmup, args.iters))
        median = statistics.median(samples)
        flops = 2 * n_rows * H * 2 * I + 2 * n_rows * I * H
        out.append(dict(world=world, tokens_per_rank=args.tokens, experts=args.experts, local_experts=local,
                        topk=args.topk, hidden=H, intermediate=I, rows_per_rank=n_rows, impl=name,
                        median_ms=round(median, 4), p90_ms=round(samples[int(0.9 * (len(samples) - 1))], 4),
                        tflops=round(flops / (median * 1e-3) / 1e12, 3)))
    bound = next(row["tflops"] for row in out if row["impl"] == "mm")
    for row in out:
        row["ratio_to_bound"] = round(row["tflops"] / bound, 3)
    return out


def print_table(rows):
    print(f"{'world':>5} {'rows':>6} {'impl':>10} {'median ms':>10} {'p90 ms':>9} {'TFLOP/s':>9} {'/ mm':>6}")
    for r in rows:
        print(f"{r['world']:>5} {r['rows_per_rank']:>6} {r['impl']:>10} {r['median_ms']:>10.4f} {r['p90_ms']:>9.4f} "
              f"{r['tflops']:>9.3f} {r['ratio_to_bound']:>6.3f}")
    for world in dict.fromkeys(r["world"] for r in rows):
        ms = {r["impl"]: r for r in rows if r["world"] == world}
        for impl in ("blocks", "grouped"):
            ratio = ms[impl]["ratio_to_bound"]
            print(f"world {world}: {impl} at {ratio:.2f} of torch.mm ({'meets' if ratio >= 0.5 else 'below'} the 0.5 "
                  f"bar), {ratio / ms['bmm']['ratio_to_bound']:.2f} of bmm, "
                  f"{ms['grouped_mm']['median_ms'] / ms[impl]['median_ms']:.2f}x torch._grouped_mm, "
                  f"{ms['loop']['median_ms'] / ms[impl]['median_ms']:.1f}x the per-expert loop")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4], help="world sizes R to emulate")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per rank (T)")
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--csv")
    args = ap.parse_args()
    for world in args.worlds:
        if args.experts % world:
            ap.error(f"--experts {args.experts} is not a multiple of world {world}")
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    try:
        expert = _loop_expert()
    except ImportError as err:
        raise SystemExit(f"mooncake.moe (the per-expert loop) does not import: {err}; build mooncake.pg first")
    w13, w2 = full_weights(args, device)
    _log(f"{device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'host'}), torch "
         f"{torch.__version__}; E={args.experts}, top-{args.topk}, T={args.tokens}, H={args.hidden}, "
         f"I={args.intermediate}")
    rows = []
    for world in args.worlds:
        rows += run_world(world, args, device, w13, w2, expert)
    print_table(rows)
    write_csv(rows, args.csv)


if __name__ == "__main__":
    main()
