"""Bad input: each mistake raises at once, on the calling rank, an exception
that names the argument and the rule; nothing is sent, so the Buffer and the
other ranks carry on (a correct round follows every batch of mistakes).
Also: handles of an unrelated dispatch, of another Buffer, or from before
update_ep_member(); a buffer too small for the shapes; the loading rule of
mooncake.ep."""

import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

from _ep_refs import Case, inputs_of
from _ep_rounds import RANK_ENV, buffer_of, run_round
from _harness import World, assert_errors, errors_of

pytestmark = pytest.mark.timeout(120)

T, H, E = 8, 256, 4


def _dispatch_mistakes(ctx):
    buf = buffer_of(ctx)
    W = ctx.size
    x = torch.randn(3, H).to(torch.bfloat16)
    topk = torch.tensor([[0, 1], [2, -1], [3, 0]], dtype=torch.int64)
    ones = torch.ones(W, dtype=torch.int32)

    def call(**kw):
        args = dict(x=x, topk_idx=topk, active_ranks=ones, num_max_dispatch_tokens_per_rank=T, num_experts=E,
                    timeout_us=-1, use_fp8=False)
        args.update(kw)
        return lambda: buf.dispatch(**args)

    out = errors_of({
        "x float32": call(x=x.float()),
        "x 3-D": call(x=x.view(3, 1, H)),
        "x non-contiguous": call(x=torch.randn(H, 3).to(torch.bfloat16).t()),
        "x hidden 200": call(x=torch.randn(3, 200).to(torch.bfloat16)),
        "x not a tensor": call(x=[[1.0] * H]),
        "topk int32": call(topk_idx=topk.int()),
        "topk 1-D": call(topk_idx=topk[:, 0]),
        "topk rows": call(topk_idx=topk[:2]),
        "topk too large": call(topk_idx=torch.tensor([[0, 1], [2, E], [3, 0]])),
        "topk below -1": call(topk_idx=torch.tensor([[0, 1], [2, -2], [3, 0]])),
        "topk twice": call(topk_idx=torch.tensor([[0, 1], [2, 2], [3, 0]])),
        "experts not multiple": call(num_experts=W * 2 + 1) if W > 1 else call(num_experts=0),
        "too many tokens": call(num_max_dispatch_tokens_per_rank=2),
        "timeout -2": call(timeout_us=-2),
        "timeout float": call(timeout_us=1.5),
        "async and hook": call(async_finish=True, return_recv_hook=True),
        "active_ranks int64": call(active_ranks=torch.ones(W, dtype=torch.int64)),
        "weights float64": call(topk_weights=torch.ones(3, 2, dtype=torch.float64)),
        "weights shape": call(topk_weights=torch.ones(3, 1)),
    })
    # The reference's optional topk_weights (read on XPU only) is accepted.
    call(topk_weights=torch.ones(3, 2))()
    # The Buffer is unharmed: a full round still works.
    run_round(ctx, Case(hidden=128, experts_per_rank=2, num_topk=2, tokens=4))
    return out


def test_dispatch_rejects_bad_input_naming_the_argument_and_the_rule():
    with World(2, gloo=False, env=RANK_ENV) as world:
        seen = world.run(_dispatch_mistakes, timeout=60)
    want = {
        "x float32": ("TypeError", "x: must be a 2-D contiguous bfloat16"),
        "x 3-D": ("TypeError", "x: must be a 2-D contiguous bfloat16"),
        "x non-contiguous": ("TypeError", "non-contiguous"),
        "x hidden 200": ("ValueError", "x: hidden (x.size(1) = 200) must be a positive multiple of 128"),
        "x not a tensor": ("TypeError", "x: must be"),
        "topk int32": ("TypeError", "topk_idx: must be a 2-D int64"),
        "topk 1-D": ("TypeError", "topk_idx: must be a 2-D int64"),
        "topk rows": ("ValueError", "topk_idx: must have one row per token of x (3), got 2"),
        "topk too large": ("ValueError", f"topk_idx: entries must lie in [-1, num_experts) = [-1, {E}); found {E}"),
        "topk below -1": ("ValueError", "found -2"),
        "topk twice": ("ValueError", "token 1 picks [2, 2]"),
        "experts not multiple": ("ValueError", "num_experts: must be a multiple of the number of ranks (2), got 5"),
        "too many tokens": ("ValueError", "x: has 3 tokens, more than num_max_dispatch_tokens_per_rank=2"),
        "timeout -2": ("ValueError", "timeout_us: must be -1 (no timeout) or >= 0"),
        "timeout float": ("TypeError", "timeout_us: must be an int"),
        "async and hook": ("ValueError", "async_finish and return_recv_hook"),
        "active_ranks int64": ("TypeError", "active_ranks: must be a 1-D contiguous int32"),
        "weights float64": ("TypeError", "topk_weights: must be None or a contiguous float32 tensor"),
        "weights shape": ("TypeError", "shaped like topk_idx [3, 2]"),
    }
    assert_errors(seen, want)


def _handle_mistakes(ctx):
    W = ctx.size
    buf = buffer_of(ctx)
    other = buffer_of(ctx, "other")
    case = Case(hidden=H, experts_per_rank=E // W, num_topk=2, tokens=T)
    mine = inputs_of(case, ctx.rank, W)
    ones = torch.ones(W, dtype=torch.int32)
    L, slots = E // W, W * T
    y = torch.zeros(L, slots, H, dtype=torch.bfloat16)

    def dispatch(topk_idx=mine.topk_idx, on=buf):
        return on.dispatch(mine.x, topk_idx, ones, T, E, -1, use_fp8=False)

    _, _, handle, _, _ = dispatch()
    flipped = torch.flip(mine.topk_idx, dims=[1]) if mine.topk_idx.numel() else mine.topk_idx
    _, _, handle_b, _, _ = dispatch(flipped)
    _, _, other_handle, _, _ = dispatch(on=other)

    def combine(**kw):
        args = dict(x=y, topk_idx=mine.topk_idx, topk_weights=mine.topk_weights, active_ranks=ones, timeout_us=-1,
                    handle=handle)
        args.update(kw)
        return lambda: buf.combine(**args)

    out = errors_of({
        "unrelated handle": combine(handle=handle_b),
        "other buffer's handle": combine(handle=other_handle),
        "not a handle": combine(handle=tuple(handle)),
        "x wrong shape": combine(x=y[:, :-1]),
        "x float32": combine(x=y.float()),
        "weights float64": combine(topk_weights=mine.topk_weights.double()),
        "weights shape": combine(topk_weights=mine.topk_weights[:, :1]),
        "out shape": combine(out=torch.empty(1, H, dtype=torch.bfloat16)),
        "zero_copy without buffer": combine(zero_copy=True),
    })
    # Combines of the three dispatches, in the same order everywhere, work.
    for h, topk in ((handle, mine.topk_idx), (handle_b, flipped)):
        buf.combine(y, topk, mine.topk_weights, ones, -1, h)
    other.combine(y, mine.topk_idx, mine.topk_weights, ones, -1, other_handle)
    buf.update_ep_member()
    out["stale handle"] = errors_of({"c": combine()})["c"]
    out["stale next buffer"] = errors_of({"c": lambda: buf.get_next_combine_buffer(handle)})["c"]
    run_round(ctx, Case(hidden=128, experts_per_rank=2, num_topk=2, tokens=4))
    return out


def test_combine_rejects_unrelated_foreign_and_stale_handles():
    with World(2, gloo=False, env=RANK_ENV) as world:
        seen = world.run(_handle_mistakes, timeout=60)
    want = {
        "unrelated handle": ("ValueError", "handle: belongs to a dispatch with other topk_idx"),
        "other buffer's handle": ("ValueError", "handle: belongs to a dispatch of another Buffer"),
        "not a handle": ("TypeError", "handle: must be the handle returned by this Buffer's dispatch"),
        "x wrong shape": ("TypeError", "x: must be a bfloat16 tensor of shape [2, 16, 256]"),
        "x float32": ("TypeError", "x: must be a bfloat16 tensor"),
        "weights float64": ("TypeError", "topk_weights: must be a float32 tensor shaped like topk_idx"),
        "weights shape": ("TypeError", "topk_weights: must be a float32 tensor shaped like topk_idx"),
        "out shape": ("TypeError", "out: must be a contiguous bfloat16 tensor of shape"),
        "zero_copy without buffer": ("ValueError", "zero_copy: True needs the buffer of get_next_combine_buffer"),
        "stale handle": ("ValueError", "handle: comes from a dispatch before update_ep_member()"),
        "stale next buffer": ("ValueError", "update_ep_member()"),
    }
    assert_errors(seen, want)


def _too_small(ctx):
    from mooncake.mooncake_ep_buffer import Buffer

    need = Buffer.get_ep_buffer_size_hint(T, H, ctx.size, E)
    small = Buffer(dist.group.WORLD, need - 1)
    exact = Buffer(dist.group.WORLD, need)
    x = torch.randn(2, H).to(torch.bfloat16)
    topk = torch.tensor([[0, 1], [2, 3]])
    ones = torch.ones(ctx.size, dtype=torch.int32)
    out = errors_of({
        "small": lambda: small.dispatch(x, topk, ones, T, E, -1, use_fp8=False),
        "negative": lambda: Buffer(dist.group.WORLD, -1),
        "not a group": lambda: Buffer("WORLD", 0),
    })
    recv_x, count, _, _, _ = exact.dispatch(x, topk, ones, T, E, -1, use_fp8=False)
    out["exact"] = int(count.sum())
    # An active_ranks of the wrong length (the reference's own test passes one)
    # is replaced by a fresh mask, with a warning, and the call works.
    wrong = torch.full((5,), 7, dtype=torch.int32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, count, _, _, _ = exact.dispatch(x, topk, wrong, T, E, -1, use_fp8=False)
    out["wrong length"] = (int(count.sum()), wrong.tolist(), [str(w.message) for w in caught])
    out["need"] = need
    return out


def test_a_buffer_too_small_for_the_shapes_is_refused_with_the_size_it_needs():
    with World(2, gloo=False, env=RANK_ENV) as world:
        seen = world.run(_too_small, timeout=60)
    need = 16 * E + 4 * E * T * (32 + 2 * H)  # the reference's formula
    for rank, out in enumerate(seen):
        assert out["need"] == need
        kind, message = out["small"]
        assert kind == "ValueError" and f"has {need - 1} bytes" in message and f"need {need}" in message \
            and "num_ep_buffer_bytes" in message, (rank, message)
        assert out["negative"][0] == "ValueError" and "num_ep_buffer_bytes: must be >= 0" in out["negative"][1]
        assert out["not a group"][0] == "TypeError" and "group:" in out["not a group"][1]
        assert out["exact"] == 4  # both ranks' 2 tokens with 2 picks each, 4 rows per rank in all
        count, untouched, messages = out["wrong length"]
        assert count == 4 and untouched == [7] * 5
        assert any("active_ranks: has 5 entries, not num_ranks=2" in m for m in messages), messages


def test_size_hint_matches_the_reference_examples():
    from mooncake.mooncake_ep_buffer import Buffer
    from mooncake import ep

    assert Buffer.get_ep_buffer_size_hint(128, 7168, 8, 288) == 2_118_652_416
    assert Buffer.get_ep_buffer_size_hint(256, 2048, 8, 288) == 1_217_401_344
    assert ep.get_ep_buffer_size_hint(1024, 7168, 8, 256) == 15_065_944_064


def test_the_reference_buffers_static_helpers():
    from mooncake.mooncake_ep_buffer import Buffer

    # The reference's 0.3.14 wheel gives 2118652480 for (128, 7168, 8 ranks, 288 experts = 36 per rank).
    assert Buffer.get_low_latency_buffer_size_hint(128, 7168, 8, 288) == 2118652480
    assert Buffer.get_rdma_size_hint(128, 7168, 8, 288) == 2118652480
    with pytest.raises(ValueError, match="num_experts: must divide evenly across num_ranks=8"):
        Buffer.get_low_latency_buffer_size_hint(128, 7168, 8, 100)
    elastic = Buffer.create_elastic(rank=0)  # its own rules: test_ep_elastic_mode.py
    assert isinstance(elastic, Buffer) and elastic.runtime is None
    event = Buffer.capture()
    event.current_stream_wait()  # a no-op without CUDA, a stream wait with it


def _destroyed(ctx):
    from mooncake.mooncake_ep_buffer import Buffer

    buf = Buffer(dist.group.WORLD)
    x = torch.randn(2, H).to(torch.bfloat16)
    topk = torch.tensor([[0, 1], [2, 3]])
    ones = torch.ones(ctx.size, dtype=torch.int32)
    recv_x, count, handle, _, _ = buf.dispatch(x, topk, ones, T, E, -1, use_fp8=False)
    buf.destroy()
    buf.destroy()  # a second one does nothing
    weights = torch.ones(2, 2)
    out = errors_of({
        "dispatch": lambda: buf.dispatch(x, topk, ones, T, E, -1, use_fp8=False),
        "combine": lambda: buf.combine(recv_x, topk, weights, ones, -1, handle),
        "update_ep_member": buf.update_ep_member,
    })
    # A new Buffer works on the same group.
    _, count, _, _, _ = Buffer(dist.group.WORLD).dispatch(x, topk, ones, T, E, -1, use_fp8=False)
    out["new buffer"] = int(count.sum())
    return out


def test_a_destroyed_buffer_refuses_calls_and_a_new_one_works():
    with World(2, gloo=False, env=RANK_ENV) as world:
        seen = world.run(_destroyed, timeout=60)
    for rank, out in enumerate(seen):
        for call in ("dispatch", "combine", "update_ep_member"):
            kind, message = out[call]
            assert kind == "RuntimeError" and f"Buffer.{call}: this Buffer was destroyed" in message, (rank, call,
                                                                                                    message)
        assert out["new buffer"] == 4, (rank, out["new buffer"])


def _runtime_of(ctx):
    buf = buffer_of(ctx)
    return type(buf.runtime).__name__, buf.path


def test_buffer_runtime_is_the_path_object():
    with World(2, gloo=False, env=RANK_ENV) as world:
        assert world.run(_runtime_of, timeout=60) == [("_Connection", "collective")] * 2


def test_mooncake_ep_loading_rule():
    import mooncake.ep as ep

    assert ep.MAX_QP_COUNT == 256
    assert callable(ep.get_active_ranks)  # mooncake.pg's names are re-exported, as in the reference
    assert ep.DEVICE_TYPE == "cuda"
    if not ep.HAS_NATIVE_RUNTIME:
        with pytest.raises(AttributeError, match="native EP runtime"):
            ep.Buffer  # noqa: B018
        with pytest.raises(ImportError):
            from mooncake.ep import ElasticBuffer  # noqa: F401
        # Absent like any other name to hasattr and getattr with a default.
        assert not hasattr(ep, "ElasticBuffer")
        assert getattr(ep, "Buffer", "absent") == "absent"
    with pytest.raises(AttributeError):
        ep.no_such_name  # noqa: B018
    assert getattr(ep, "no_such_name", None) is None


def test_mooncake_ep_event_handle_has_the_native_contract():
    import torch

    import mooncake.ep as ep

    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA device"):
            ep.EventHandle()
        return
    # Work queued on a side stream, an event after it, the default stream made
    # to wait: a copy queued on the default stream then sees the side stream's result.
    side = torch.cuda.Stream()
    x = torch.zeros(1 << 20, device="cuda")
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        x.fill_(3.0)
    event = ep.EventHandle(side.cuda_stream)
    event.current_stream_wait(0)
    y = x.clone()  # on the default stream, after the wait
    event.synchronize()
    assert torch.equal(y, torch.full_like(x, 3.0))
    with pytest.raises(ValueError, match="stream_ptr"):
        ep.EventHandle(-1)


@pytest.mark.parametrize("module", ["mooncake.ep", "mooncake.mooncake_ep_buffer", "mooncake.moe"])
def test_modules_without_a_build_for_the_running_torch_say_so(module):
    """The version-suffix rule: with a torch the PG was not built against, every
    EP module fails to import with the PG loader's message, not an obscure error."""
    code = f"import torch; torch.__version__ = '9.9.9'; import {module}"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "ImportError: Mooncake PG was not built against torch==9.9.9" in proc.stderr, proc.stderr[-2000:]
