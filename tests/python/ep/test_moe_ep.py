"""mooncake.moe_ep.MoEEp in its three layouts against a single-process dense
MoE built from the full weights (the correctness walk of the FlashInfer
design, scaled down for CPU): weights identical on every rank (fixed seed,
scaled by 1/sqrt(fan_in)), tokens and routing per rank (seed 1000 + rank,
softmax top-k weights, some picks -1), each rank's output within rtol = atol
= 3e-2 of the reference, at worlds 1-4 (ranks > 0 hold experts at an offset)."""

import pytest
import torch
import torch.distributed as dist

from _ep_rounds import RANK_ENV
from _harness import World

pytestmark = pytest.mark.timeout(240)

E, TOPK, TOKENS, HIDDEN, INTERMEDIATE = 12, 4, 8, 256, 128


def _weights():
    g = torch.Generator().manual_seed(7)
    w13 = (torch.randn(E, 2 * INTERMEDIATE, HIDDEN, generator=g) / HIDDEN ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, HIDDEN, INTERMEDIATE, generator=g) / INTERMEDIATE ** 0.5).to(torch.bfloat16)
    return w13, w2


def _inputs(rank):
    g = torch.Generator().manual_seed(1000 + rank)
    n = TOKENS - rank  # ranks send different numbers of tokens
    x = torch.randn(n, HIDDEN, generator=g).to(torch.bfloat16)
    logits = torch.randn(n, E, generator=g)
    weights, ids = torch.softmax(logits, dim=1).topk(TOPK, dim=1)
    ids[torch.rand(n, TOPK, generator=g) < 0.15] = -1
    return x, ids, weights.to(torch.float32)


def _dense(x, ids, weights, w13, w2):
    """Each token through each picked expert, in float32."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.size(0)):
        for k in range(ids.size(1)):
            e = int(ids[t, k])
            if e < 0:
                continue
            h = w13[e].float() @ x[t].float()
            out[t] += weights[t, k] * (w2[e].float() @ (torch.nn.functional.silu(h[:INTERMEDIATE]) * h[INTERMEDIATE:]))
    return out.to(torch.bfloat16)


def _layouts(ctx):
    from mooncake.moe_ep import Algorithm, EpBootstrap, ExpertWeights, FleetConfig, Layout, MoEEp

    w13, w2 = _weights()
    L = E // ctx.size
    mine = ExpertWeights(w13[ctx.rank * L:(ctx.rank + 1) * L].clone(), w2[ctx.rank * L:(ctx.rank + 1) * L].clone())
    x, ids, weights = _inputs(ctx.rank)
    want = _dense(x, ids, weights, w13, w2)
    worst = {}
    for algorithm, layout in ((Algorithm.LOW_LATENCY, Layout.EXPERT_MAJOR), (Algorithm.LOW_LATENCY, Layout.RANK_MAJOR),
                              (Algorithm.HIGH_THROUGHPUT, Layout.FLAT)):
        fleet = FleetConfig(num_experts=E, max_tokens_per_rank=TOKENS, hidden=HIDDEN, intermediate=INTERMEDIATE,
                            num_topk=TOPK, algorithm=algorithm, layout=layout)
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
