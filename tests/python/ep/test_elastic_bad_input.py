"""ElasticBuffer's bad input: each mistake raises at once, on the calling
rank, an exception that names the argument and the rule; nothing is sent, so
the buffer and the other ranks carry on (a checked round follows). Also:
handles of another buffer or from before update_ep_member(), calls whose
shape differs between ranks (the same error on every rank), a buffer too
small for the shapes, the constructor's rules, and the transport agreement
over a real group."""

import pytest
import torch

from _elastic_refs import ElasticCase
from _elastic_rounds import elastic_buffer_of, run_elastic_round
from _ep_refs import Case
from _ep_rounds import RANK_ENV
from _harness import World, assert_errors, errors_of

pytestmark = pytest.mark.timeout(120)

T, H, E = 8, 256, 4
GOOD = ElasticCase(Case(hidden=128, experts_per_rank=2, num_topk=2, tokens=4))


def _dispatch_mistakes(ctx):
    buf = elastic_buffer_of(ctx)
    x = torch.randn(3, H).to(torch.bfloat16)
    topk = torch.tensor([[0, 1], [2, -1], [3, 0]], dtype=torch.int64)
    weights = torch.ones(3, 2)
    fp8 = x.to(torch.float8_e4m3fn)

    def call(**kw):
        args = dict(x=x, topk_idx=topk, topk_weights=weights, num_experts=E, num_max_tokens_per_rank=T)
        args.update(kw)
        return lambda: buf.dispatch(**args)

    _, _, _, handle, _ = buf.dispatch(x, topk_idx=topk, num_experts=E, num_max_tokens_per_rank=T)
    out = errors_of({
        "x float32": call(x=x.float()),
        "x non-contiguous": call(x=torch.randn(H, 3).to(torch.bfloat16).t()),
        "x empty hidden": call(x=torch.empty(3, 0, dtype=torch.bfloat16)),
        "fp8 scales shape": call(x=(fp8, torch.ones(3, 1))),
        "fp8 scales dtype": call(x=(fp8, torch.ones(3, 2, dtype=torch.float64))),
        "fp8 triple": call(x=(fp8, torch.ones(3, 2), None)),
        "topk int32": call(topk_idx=topk.int()),
        "topk rows": call(topk_idx=topk[:2]),
        "topk k=0": call(topk_idx=torch.empty(3, 0, dtype=torch.int64), topk_weights=None),
        "topk too large": call(topk_idx=torch.tensor([[0, 1], [2, E], [3, 0]])),
        "topk twice": call(topk_idx=torch.tensor([[0, 1], [2, 2], [3, 0]])),
        "weights float64": call(topk_weights=weights.double()),
        "experts not multiple": call(num_experts=5),
        "too many tokens": call(num_max_tokens_per_rank=2),
        "alignment 0": call(expert_alignment=0),
        "num_sms 0": call(num_sms=0),
        "no topk": call(topk_idx=None),
        "cached with topk": lambda: buf.dispatch(x, topk_idx=topk, handle=handle),
        "cached expand": lambda: buf.dispatch(x, handle=handle, do_expand=True),
        "cached other shape": lambda: buf.dispatch(x[:2], handle=handle),
    })
    run_elastic_round(ctx, GOOD)  # unharmed
    return out


def test_dispatch_rejects_bad_input_naming_the_argument_and_the_rule():
    with World(2, gloo=False, env=RANK_ENV) as world:
        seen = world.run(_dispatch_mistakes, timeout=60)
    want = {
        "x float32": ("TypeError", "x: must be a 2-D contiguous bfloat16 tensor"),
        "x non-contiguous": ("TypeError", "non-contiguous"),
        "x empty hidden": ("ValueError", "x: hidden (x.size(1)) must be positive"),
        "fp8 scales shape": ("TypeError", "x[1]: must be float32 or int32 scales [num_tokens, ceil(hidden / 128)]"),
        "fp8 scales dtype": ("TypeError", "x[1]: must be float32 or int32"),
        "fp8 triple": ("TypeError", "x: a tuple must be (x_fp8, scales)"),
        "topk int32": ("TypeError", "topk_idx: must be a 2-D int64"),
        "topk rows": ("ValueError", "topk_idx: must have one row per token of x (3), got 2"),
        "topk k=0": ("ValueError", "topk_idx: num_topk (topk_idx.size(1)) must be positive"),
        "topk too large": ("ValueError", f"topk_idx: entries must lie in [-1, num_experts) = [-1, {E}); found {E}"),
        "topk twice": ("ValueError", "token 1 picks [2, 2]"),
        "weights float64": ("TypeError", "topk_weights: must be None or a float32 tensor"),
        "experts not multiple": ("ValueError", "num_experts: must be a multiple of the number of ranks (2), got 5"),
        "too many tokens": ("ValueError", "x: has 3 tokens, more than num_max_tokens_per_rank=2"),
        "alignment 0": ("ValueError", "expert_alignment: must be >= 1"),
        "num_sms 0": ("ValueError", "num_sms: must be >= 1"),
        "no topk": ("ValueError", "topk_idx: required without a handle"),
        "cached with topk": ("ValueError", "topk_idx, topk_weights: must be None with a handle"),
        "cached expand": ("ValueError", "do_expand: the handle comes from a non-expanded dispatch"),
        "cached other shape": ("ValueError", "x: a cached dispatch needs x shaped like the handle's dispatch"),
    }
    assert_errors(seen, want)


def _handle_and_state_mistakes(ctx):
    from mooncake.mooncake_elastic_buffer import ElasticBuffer

    buf = elastic_buffer_of(ctx)
    other = elastic_buffer_of(ctx, "other")
    x = torch.randn(3, H).to(torch.bfloat16)
    topk = torch.tensor([[0, 1], [2, -1], [3, 0]], dtype=torch.int64)
    _, _, _, handle, _ = buf.dispatch(x, topk_idx=topk, num_experts=E, num_max_tokens_per_rank=T)
    _, _, _, other_handle, _ = other.dispatch(x, topk_idx=topk, num_experts=E, num_max_tokens_per_rank=T)
    rows = handle.native_handle.num_recv
    y = torch.zeros(rows, H, dtype=torch.bfloat16)
    out = errors_of({
        "other buffer's handle": lambda: buf.combine(y, other_handle),
        "not a handle": lambda: buf.combine(y, (1, 2)),
        "x hidden": lambda: buf.combine(torch.zeros(rows, H // 2, dtype=torch.bfloat16), handle),
        "x too few rows": lambda: buf.combine(torch.zeros(rows - 1, H, dtype=torch.bfloat16), handle),
        "x float32": lambda: buf.combine(y.float(), handle),
        "weights shape": lambda: buf.combine(y, handle, topk_weights=torch.ones(3, 1)),
        # Ranks calling with different shapes: the same error on every rank, nothing moves.
        "tokens per rank differ": lambda: buf.dispatch(x, topk_idx=topk, num_experts=E,
                                                       num_max_tokens_per_rank=T + ctx.rank),
        "small num_bytes": lambda: ElasticBuffer(_world(), num_bytes=1000).dispatch(
            x, topk_idx=topk, num_experts=E, num_max_tokens_per_rank=T),
        "multiple reduction off": lambda: ElasticBuffer(_world(), allow_multiple_reduction=False),
        "bad transport": lambda: ElasticBuffer(_world(), transport="tcp"),
        "nccl transport": lambda: ElasticBuffer(_world(), transport="nccl"),
        "different transports": lambda: ElasticBuffer(_world(), transport="ibgda" if ctx.rank else "auto"),
    })
    buf.combine(y, handle)
    other.combine(y, other_handle)
    buf.update_ep_member()
    out["stale handle"] = errors_of({"c": lambda: buf.combine(y, handle)})["c"]
    run_elastic_round(ctx, GOOD)
    other.destroy()
    out["destroyed"] = errors_of({"c": lambda: other.dispatch(x, topk_idx=topk, num_experts=E)})["c"]
    return out, buf.transport, buf.path


def _world():
    import torch.distributed as dist

    return dist.group.WORLD


def test_handles_shapes_constructor_and_transport_rules():
    with World(2, gloo=False, env=RANK_ENV) as world:
        seen = world.run(_handle_and_state_mistakes, timeout=90)
    want = {
        "other buffer's handle": ("ValueError", "handle: comes from another ElasticBuffer"),
        "not a handle": ("TypeError", "handle: must be the EPHandle"),
        "x hidden": ("ValueError", f"x: hidden must be the dispatch's ({H})"),
        "x too few rows": ("ValueError", "rows the dispatch delivered"),
        "x float32": ("TypeError", "x: must be a 2-D contiguous bfloat16"),
        "weights shape": ("TypeError", "topk_weights: must be None or float32 weights of the received rows"),
        "tokens per rank differ": ("ValueError", f"num_max_tokens_per_rank: every rank must dispatch with the same "
                                                 f"value; rank by rank: [{T}, {T + 1}]"),
        "small num_bytes": ("ValueError", "num_bytes: the buffer has 1000 bytes"),
        "multiple reduction off": ("NotImplementedError", "allow_multiple_reduction"),
        "bad transport": ("ValueError", "transport: must be one of"),
        # No rank is ready: an unsized buffer on a CPU group, and (in CI) no NCCL transport in the build.
        "nccl transport": ("RuntimeError", "ranks [0, 1] are not ready for it"),
        "different transports": ("RuntimeError", "'auto' by ranks [0]; 'ibgda' by ranks [1]"),
        "stale handle": ("ValueError", "from before update_ep_member()"),
        "destroyed": ("RuntimeError", "the buffer has been destroyed"),
    }
    assert [(chosen, path) for _, chosen, path in seen] == [("ibgda", "collective")] * 2
    assert_errors([errors for errors, _, _ in seen], want)


def _one_rank_refuses(ctx):
    """Rank 1 alone passes more tokens than num_max_tokens_per_rank: it gets its
    own error, rank 0 (already in the count exchange) an error naming rank 1,
    nobody's rows move, and the next call pairs correctly on both."""
    buf = elastic_buffer_of(ctx)
    tokens = 5 if ctx.rank == 1 else 3
    x = torch.randn(tokens, H).to(torch.bfloat16)
    topk = torch.zeros(tokens, 1, dtype=torch.int64)
    out = errors_of({"dispatch": lambda: buf.dispatch(x, topk_idx=topk, num_experts=E, num_max_tokens_per_rank=4)})
    run_elastic_round(ctx, GOOD)
    # The received weights go back to combine, as DeepEP V2's callers pass them.
    x = torch.randn(3, H).to(torch.bfloat16)
    recv_x, _, recv_w, handle, _ = buf.dispatch(x, topk_idx=torch.zeros(3, 1, dtype=torch.int64),
                                                topk_weights=torch.ones(3, 1), num_experts=E, num_max_tokens_per_rank=4)
    combined, _, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
    return out, combined.shape[0]


def test_a_mistake_on_one_rank_fails_every_rank_and_moves_nothing():
    with World(2, gloo=False, env=RANK_ENV) as world:
        (mine, rows0), (theirs, rows1) = world.run(_one_rank_refuses, timeout=60)
    assert mine["dispatch"][0] == "ValueError" and "ranks [1] refused their arguments" in mine["dispatch"][1], mine
    assert theirs["dispatch"][0] == "ValueError" and "num_max_tokens_per_rank=4" in theirs["dispatch"][1], theirs
    assert rows0 == rows1 == 3
