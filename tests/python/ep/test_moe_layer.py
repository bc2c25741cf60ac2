"""mooncake.moe.MoEEpLayer over 1 and 3 ranks against the dense MoE that one
process computes from all experts' weights (every rank rebuilds all weights
and all inputs from shared seeds). The dense side runs each token through
each picked expert on its own, so only float32 summation order and the final
bf16 rounding differ: results agree within two bf16 units (rtol 2^-7).
With FP8 dispatch the dense side uses the same FP8 rounding of the tokens."""

import pytest
import torch
import torch.distributed as dist

from _ep_refs import Case, fp8_roundtrip, inputs_of
from _ep_rounds import RANK_ENV
from _harness import World

pytestmark = pytest.mark.timeout(120)

INTERMEDIATE = 96


def _all_weights(case: Case, world: int):
    g = torch.Generator().manual_seed(case.seed + 17)
    E = case.experts(world)
    w13 = (torch.randn(E, 2 * INTERMEDIATE, case.hidden, generator=g) * 0.08).to(torch.bfloat16)
    w2 = (torch.randn(E, case.hidden, INTERMEDIATE, generator=g) * 0.08).to(torch.bfloat16)
    return w13, w2


def _dense_moe(x, topk_idx, topk_weights, w13, w2):
    out = torch.zeros(x.shape, dtype=torch.bfloat16)
    for t in range(x.size(0)):
        acc = torch.zeros(x.size(1), dtype=torch.float32)
        for k in range(topk_idx.size(1)):
            e = int(topk_idx[t, k])
            if e < 0:
                continue
            h = w13[e].float() @ x[t].float()
            y = w2[e].float() @ (torch.nn.functional.silu(h[:INTERMEDIATE]) * h[INTERMEDIATE:])
            acc += topk_weights[t, k] * y.to(torch.bfloat16).float()
        out[t] = acc.to(torch.bfloat16)
    return out


def _layer_round(ctx, case: Case):
    from mooncake.mooncake_ep_buffer import Buffer
    from mooncake.moe import MoEEpLayer

    world, rank = ctx.size, ctx.rank
    buffer = Buffer(dist.group.WORLD)
    layer = MoEEpLayer(buffer, case.experts(world), case.hidden, INTERMEDIATE, case.tokens,
                       use_fp8_dispatch=case.fp8)
    w13, w2 = _all_weights(case, world)
    L = case.experts_per_rank
    layer.w13.copy_(w13[rank * L:(rank + 1) * L])
    layer.w2.copy_(w2[rank * L:(rank + 1) * L])
    mine = inputs_of(case, rank, world)
    got = layer(mine.x, mine.topk_idx, mine.topk_weights)
    seen = fp8_roundtrip(mine.x)[0].to(torch.bfloat16) if case.fp8 else mine.x
    want = _dense_moe(seen, mine.topk_idx, mine.topk_weights, w13, w2)
    scale = float(want.float().abs().max().clamp_min(1e-3))
    torch.testing.assert_close(got.float(), want.float(), rtol=2.0 ** -7, atol=2.0 ** -7 * scale)
    return tuple(got.shape), layer.active_ranks.tolist()


@pytest.mark.parametrize("world_size", [1, 3])
def test_moe_layer_matches_the_dense_moe(world_size):
    with World(world_size, gloo=False, env=RANK_ENV) as world:
        for fp8 in (False, True):
            case = Case(hidden=256, experts_per_rank=4, num_topk=3, tokens=10, masked=0.1, fp8=fp8, seed=11)
            seen = world.run(_layer_round, case, timeout=90)
            for rank, (shape, active) in enumerate(seen):
                assert shape == (case.tokens_of(rank, world_size), case.hidden), (fp8, rank)
                assert active == [1] * world_size, (fp8, rank)
