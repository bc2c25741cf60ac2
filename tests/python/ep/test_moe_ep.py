"""mooncake.moe_ep.MoEEp in its three layouts against a single-process dense
MoE built from the full weights (the correctness walk of the FlashInfer
design, scaled down for CPU): weights identical on every rank (fixed seed,
scaled by 1/sqrt(fan_in)), tokens and routing per rank (seed 1000 + rank,
softmax top-k weights, some picks -1), each rank's output within rtol = atol
= 3e-2 of the reference, at worlds 1-4 (ranks > 0 hold experts at an offset)."""

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from _ep_rounds import RANK_ENV
from _harness import World

pytestmark = pytest.mark.timeout(240)

@dataclass(frozen=True)
class Shape:
    experts: int
    topk: int
    tokens: int  # per rank (rank r sends tokens - r)
    hidden: int
    intermediate: int


CPU_SHAPE = Shape(experts=12, topk=4, tokens=8, hidden=256, intermediate=128)
# The design's configuration (issue 22), run on the GPU.
SEED_SHAPE = Shape(experts=16, topk=8, tokens=128, hidden=8192, intermediate=2048)


def _weights(shape: Shape):
    g = torch.Generator().manual_seed(7)
    E, H, I = shape.experts, shape.hidden, shape.intermediate
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(torch.bfloat16)
    return w13, w2


def _inputs(shape: Shape, rank, balanced=False):
    g = torch.Generator().manual_seed(1000 + rank)
    n = shape.tokens - rank  # ranks send different numbers of tokens
    x = torch.randn(n, shape.hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(n, shape.experts, generator=g)
    weights, ids = torch.softmax(logits, dim=1).topk(shape.topk, dim=1)
    if balanced:  # every expert gets about as many picks (the experts then run as batched matmuls)
        ids = (torch.arange(n * shape.topk).view(n, shape.topk) + rank * shape.topk) % shape.experts
    else:
        ids[torch.rand(n, shape.topk, generator=g) < 0.15] = -1
    return x, ids, weights.to(torch.float32)


def _dense(x, ids, weights, w13, w2):
    """Each token through each picked expert, in float32 (on the device of the weights)."""
    intermediate = w2.size(2)
    out = torch.zeros(x.shape, dtype=torch.float32, device=w13.device)
    for t in range(x.size(0)):
        for k in range(ids.size(1)):
            e = int(ids[t, k])
            if e < 0:
                continue
            h = w13[e].float() @ x[t].float()
            out[t] += weights[t, k] * (w2[e].float() @ (torch.nn.functional.silu(h[:intermediate]) * h[intermediate:]))
    return out.to(torch.bfloat16)


def _layouts(ctx, shape: Shape = CPU_SHAPE, balanced=False, device="cpu"):
    from mooncake.moe_ep import Algorithm, EpBootstrap, ExpertWeights, FleetConfig, Layout, MoEEp

    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    w13, w2 = (w.to(dev) for w in _weights(shape))
    L = shape.experts // ctx.size
    mine = ExpertWeights(w13[ctx.rank * L:(ctx.rank + 1) * L].clone(), w2[ctx.rank * L:(ctx.rank + 1) * L].clone())
    x, ids, weights = (t.to(dev) for t in _inputs(shape, ctx.rank, balanced))
    want = _dense(x, ids, weights, w13, w2)
    worst = {}
    for algorithm, layout in ((Algorithm.LOW_LATENCY, Layout.EXPERT_MAJOR), (Algorithm.LOW_LATENCY, Layout.RANK_MAJOR),
                              (Algorithm.HIGH_THROUGHPUT, Layout.FLAT)):
        fleet = FleetConfig(num_experts=shape.experts, max_tokens_per_rank=shape.tokens, hidden=shape.hidden,
                            intermediate=shape.intermediate, num_topk=shape.topk, algorithm=algorithm, layout=layout)
        layer = MoEEp(EpBootstrap(dist.group.WORLD), fleet, mine, enable_timing=True)
        got = layer.forward(x, ids, weights)
        assert got.dtype == torch.bfloat16 and got.shape == x.shape, (layout, got.shape)
        torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2, msg=lambda m: f"rank {ctx.rank}, {layout}: {m}")
        assert set(layer.last_timings_ms) == {"dispatch", "compute", "combine"}
        assert all(v >= 0 for v in layer.last_timings_ms.values())
        worst[layout.name] = float((got.float() - want.float()).abs().max())
        layer.destroy()
    return worst


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_layout_matches_the_dense_moe(world):
    with World(world, gloo=False, env=RANK_ENV) as w:
        worst = w.run(_layouts, timeout=200)
    assert len(worst) == world and all(len(v) == 3 for v in worst)


@pytest.mark.parametrize("world", [1, 2])
def test_balanced_experts_match_the_dense_moe(world):
    with World(world, gloo=False, env=RANK_ENV) as w:
        worst = w.run(_layouts, CPU_SHAPE, True, timeout=200)
    assert len(worst) == world and all(len(v) == 3 for v in worst)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: the design's configuration on CUDA tensors over the 'mooncake' "
                           "backend (CI has no GPU)")
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_design_configuration_on_the_gpu_matches_the_dense_moe(world):
    """E = 16, top-8, 128 tokens per rank, hidden 8192, intermediate 2048, every
    layout, ranks sharing the GPUs round-robin (world 3: 16 experts do not split
    over 3 ranks, so 15 experts there)."""
    shape = SEED_SHAPE if SEED_SHAPE.experts % world == 0 else Shape(15, 8, 128, 8192, 2048)
    with World(world, gloo=False, env=RANK_ENV, backend="mooncake") as w:
        worst = w.run(_layouts, shape, False, "cuda", timeout=280)
    assert len(worst) == world and all(len(v) == 3 for v in worst)


def test_config_errors_name_the_field():
    from mooncake.moe_ep import Algorithm, FleetConfig, Layout

    with pytest.raises(ValueError, match="HIGH_THROUGHPUT offers FLAT"):
        FleetConfig(12, 8, 256, 128, algorithm=Algorithm.HIGH_THROUGHPUT, layout=Layout.RANK_MAJOR).check(2)
    with pytest.raises(ValueError, match="num_experts: must be a multiple"):
        FleetConfig(13, 8, 256, 128).check(2)
    with pytest.raises(ValueError, match="use_fp8_dispatch"):
        FleetConfig(12, 8, 256, 128, layout=Layout.RANK_MAJOR, use_fp8_dispatch=True).check(2)
    from mooncake.moe_ep import available_backends

    assert available_backends()["HIGH_THROUGHPUT/FLAT"] == "mooncake_elastic_buffer.ElasticBuffer"


def test_the_batched_form_of_the_experts_matches_the_per_expert_matmuls():
    """The batched form (rows padded to the largest expert, two batched
    matmuls) and the grouped form against one float32-accumulated matmul per
    expert, with an expert that got no rows; padding rows that hold NaN leave
    the real rows alone; and when the batched form is chosen."""
    from mooncake.moe_ep.experts import (grouped_swiglu_experts, padded_rows_per_expert, swiglu_expert_blocks,
                                         swiglu_experts)

    g = torch.Generator().manual_seed(7)
    hidden, inter = 64, 32
    counts = torch.tensor([3, 0, 5, 4])
    rows = torch.randn(int(counts.sum()), hidden, generator=g).to(torch.bfloat16)
    w13 = (torch.randn(4, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(4, hidden, inter, generator=g) / inter ** 0.5).to(torch.bfloat16)
    want, start = [], 0
    for e, n in enumerate(counts.tolist()):
        x = rows[start:start + n].float()
        gate, up = (x @ w13[e].float().t()).to(torch.bfloat16).float().split(inter, dim=1)
        act = (torch.nn.functional.silu(gate) * up).to(torch.bfloat16)
        want.append((act.float() @ w2[e].float().t()).to(torch.bfloat16))
        start += n
    want = torch.cat(want)
    tolerance = dict(rtol=2.0 ** -7, atol=2.0 ** -7 * float(want.abs().max()))
    # host_counts [3, 0, 5, 4] pad 12 rows to 20: past the limit, so both calls below differ in form.
    torch.testing.assert_close(swiglu_experts(rows, counts, w13, w2).float(), want.float(), **tolerance)
    torch.testing.assert_close(grouped_swiglu_experts(rows, counts, w13, w2).float(), want.float(), **tolerance)
    blocks = torch.full((4, 5, hidden), float("nan"), dtype=torch.bfloat16)
    start = 0
    for e, n in enumerate(counts.tolist()):
        blocks[e, :n] = rows[start:start + n]
        start += n
    got = swiglu_expert_blocks(blocks, w13, w2)
    got_rows = torch.cat([got[e, :n] for e, n in enumerate(counts.tolist())])
    torch.testing.assert_close(got_rows.float(), want.float(), **tolerance)
    balanced = torch.tensor([4, 5, 4, 4])
    rows17 = torch.randn(17, hidden, generator=g).to(torch.bfloat16)
    torch.testing.assert_close(swiglu_experts(rows17, balanced, w13, w2, host_counts=balanced.tolist()).float(),
                               grouped_swiglu_experts(rows17, balanced, w13, w2).float(), rtol=2.0 ** -7, atol=0.02)
    assert padded_rows_per_expert([4, 5, 4, 4]) == 5  # 20 padded rows for 17
    assert padded_rows_per_expert([3, 0, 5, 4]) is None  # 20 padded rows for 12: the grouped kernel
    assert padded_rows_per_expert([0, 0]) is None and padded_rows_per_expert([]) is None
