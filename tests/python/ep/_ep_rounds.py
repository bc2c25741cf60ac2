"""What a rank does in the EP tests: one round of dispatch -> mock experts ->
combine on a Buffer, checked against the dense references of _ep_refs.

Runs inside spawned ranks (no pytest here). Failed checks raise
AssertionError with the case, the rank and what differed; the harness
carries it back to the test.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from _ep_refs import Case, expected_combine, expected_rows, expert_fn, fp8_roundtrip, fp8_tolerance, inputs_of

_BUFFERS: dict = {}

# Environment of the test ranks: one intra-op thread each. The ranks outnumber
# the CI machine's cores, and several spinning OpenMP pools per core slow
# plain tensor arithmetic down by orders of magnitude.
RANK_ENV = {"OMP_NUM_THREADS": "1"}


def buffer_of(ctx, name: str = "default", num_bytes: int = 0, disable_p2p: bool = False):
    """One Buffer per process and name (constructing one is collective: every
    rank asks for the same names in the same order)."""
    from mooncake.mooncake_ep_buffer import Buffer  # noqa: PLC0415

    if name not in _BUFFERS:
        _BUFFERS[name] = Buffer(dist.group.WORLD, num_bytes, disable_p2p=disable_p2p)
    return _BUFFERS[name]


def _device(kind: str) -> torch.device:
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def dequantized(recv_x, le: int, n: int) -> torch.Tensor:
    data, scales = recv_x
    rows = data[le, :n].float().view(n, -1, 128) * scales[le, :n].unsqueeze(-1)
    return rows.view(n, -1)


def check_dispatch(case: Case, world: int, rank: int, active: list[int], recv_x, recv_count, handle) -> None:
    where = f"rank {rank} of {world}, {case}"
    src_info, layout_range, tokens, hidden, experts = handle
    assert (tokens, hidden, experts) == (case.tokens, case.hidden, case.experts(world)), where
    L, slots = case.experts_per_rank, world * case.tokens
    rows = expected_rows(case, world, rank, active)
    sources = {s: inputs_of(case, s, world).x for s in range(world)}
    recv_count, src_info, layout_range = recv_count.cpu(), src_info.cpu(), layout_range.cpu()
    if case.fp8:
        data, scales = recv_x
        assert data.dtype == torch.float8_e4m3fn and tuple(data.shape) == (L, slots, hidden), where
        assert scales.dtype == torch.float32 and tuple(scales.shape) == (L, slots, hidden // 128), where
        recv_x = (data.cpu(), scales.cpu())
    else:
        assert recv_x.dtype == torch.bfloat16 and tuple(recv_x.shape) == (L, slots, hidden), where
        recv_x = recv_x.cpu()
    assert recv_count.dtype == torch.int32 and tuple(recv_count.shape) == (L,), where
    assert src_info.dtype == torch.int32 and tuple(src_info.shape) == (L, slots), where
    assert layout_range.dtype == torch.int64 and tuple(layout_range.shape) == (L, world), where
    for le in range(L):
        want = rows[rank * L + le]
        n = len(want)
        assert int(recv_count[le]) == n, f"{where}: local expert {le} received {int(recv_count[le])} rows, want {n}"
        assert src_info[le, :n].tolist() == [t for _, t in want], f"{where}: src_info of local expert {le}"
        assert bool((src_info[le, n:] == -1).all()), f"{where}: src_info past the count must be -1"
        begin = 0
        for s in range(world):
            count = sum(1 for src, _ in want if src == s)
            got = int(layout_range[le, s])
            assert (got >> 32, got & 0xFFFFFFFF) == (begin, count), \
                f"{where}: layout_range[{le}, {s}] = (begin {got >> 32}, count {got & 0xFFFFFFFF}), " \
                f"want ({begin}, {count})"
            begin += count
        if not n:
            continue
        sent = torch.stack([sources[s][t] for s, t in want])
        if case.fp8:
            _, want_scales = fp8_roundtrip(sent)
            got_scales = recv_x[1][le, :n]
            assert torch.allclose(got_scales, want_scales, rtol=2.0 ** -23, atol=0), \
                f"{where}: FP8 scales of expert {le}"
            err = (dequantized(recv_x, le, n) - sent.float()).abs()
            bound = fp8_tolerance(sent, want_scales)
            assert bool((err <= bound).all()), \
                f"{where}: FP8 rows of expert {le} off by up to {float((err - bound).max())} past the bound"
        else:
            assert torch.equal(recv_x[le, :n], sent), f"{where}: rows of local expert {le} differ from the tokens sent"


def run_round(ctx, case: Case, *, active=None, timeout_us: int = -1, device: str = "cpu", expect_active=None,
              expect_after_combine=None, buffer_name: str = "default"):
    """One checked round; returns the active mask after dispatch and after
    combine (``expect_active`` for both, unless ``expect_after_combine`` says
    otherwise for combine)."""
    world, rank = ctx.size, ctx.rank
    dev = _device(device)
    buffer = buffer_of(ctx, buffer_name)
    mine = inputs_of(case, rank, world)
    x, topk_idx, topk_weights = mine.x.to(dev), mine.topk_idx.to(dev), mine.topk_weights.to(dev)
    mask = torch.ones(world, dtype=torch.int32, device=dev) if active is None else \
        torch.tensor(active, dtype=torch.int32, device=dev)
    async_finish, with_hook = case.mode == "async", case.mode == "hook"
    recv_x, recv_count, handle, event, hook = buffer.dispatch(
        x, topk_idx, mask, case.tokens, case.experts(world), timeout_us, use_fp8=case.fp8,
        async_finish=async_finish, return_recv_hook=with_hook)
    assert (hook is not None) == with_hook, f"rank {rank}: hook {hook!r} with return_recv_hook={with_hook}"
    if with_hook:
        hook()
    event.current_stream_wait()
    after_dispatch = mask.tolist()
    expect = expect_active if expect_active is not None else (active or [1] * world)
    assert after_dispatch == expect, f"rank {rank}: active_ranks after dispatch {after_dispatch}, want {expect}"
    check_dispatch(case, world, rank, expect, recv_x, recv_count, handle)

    # Mock experts; rows past each count are NaN, so reading one would show.
    L, slots = case.experts_per_rank, world * case.tokens
    if case.zero_copy:
        outputs = buffer.get_next_combine_buffer(handle)
        assert tuple(outputs.shape) == (L, slots, case.hidden) and outputs.dtype == torch.bfloat16
        outputs.fill_(float("nan"))
        # combine must read the zero-copy buffer, not x: give it NaNs.
        x_arg = torch.full((L, slots, case.hidden), float("nan"), dtype=torch.bfloat16, device=dev)
    else:
        outputs = torch.full((L, slots, case.hidden), float("nan"), dtype=torch.bfloat16, device=dev)
        x_arg = outputs
    run_experts(case, rank, recv_x, recv_count, outputs)
    combined, event, hook = buffer.combine(x_arg, topk_idx, topk_weights, mask, timeout_us, handle,
                                           zero_copy=case.zero_copy, async_finish=async_finish,
                                           return_recv_hook=with_hook)
    if with_hook:
        hook()
    event.current_stream_wait()
    after_combine = mask.tolist()
    if expect_after_combine is not None:
        expect = expect_after_combine
    assert after_combine == expect, f"rank {rank}: active_ranks after combine {after_combine}, want {expect}"
    check_combine(case, world, rank, expect, combined)
    return after_dispatch, after_combine


def run_experts(case: Case, rank: int, recv_x, recv_count, outputs: torch.Tensor) -> None:
    """The mock experts of this rank on what it received, into ``outputs`` [L, R * T, hidden]."""
    L = case.experts_per_rank
    counts = recv_count.tolist()
    for le in range(L):
        n = counts[le]
        if n:
            rows = dequantized(recv_x, le, n).to(torch.bfloat16) if case.fp8 else recv_x[le, :n]
            outputs[le, :n] = expert_fn(rank * L + le, rows)


def check_combine(case: Case, world: int, rank: int, active: list[int], combined: torch.Tensor) -> None:
    """combine's output against the dense MoE over the ``active`` ranks."""
    want = expected_combine(case, world, rank, active)
    got = combined.cpu()
    where = f"rank {rank} of {world}, {case}"
    assert got.dtype == torch.bfloat16 and tuple(got.shape) == tuple(want.shape), where
    assert not bool(got.isnan().any()), f"{where}: NaN in combine output"
    if case.fp8:
        # Same FP8 rounding of the tokens as the reference; only bf16 rounding may differ.
        scale = float(want.float().abs().max().clamp_min(1)) if want.numel() else 1.0
        torch.testing.assert_close(got.float(), want.float(), rtol=2.0 ** -7, atol=2.0 ** -7 * scale,
                                   msg=lambda m: f"{where}: {m}")
    else:
        assert torch.equal(got, want), f"{where}: combine differs from the dense MoE by up to " \
                                       f"{float((got.float() - want.float()).abs().max())}"


# Grid rounds use a finite timeout: when one rank fails a check and stops,
# the others then fail within seconds instead of waiting for it forever.
GRID_TIMEOUT_US = 30_000_000


def run_grid(ctx, cases, device: str = "cpu"):
    for case in cases:
        run_round(ctx, case, device=device, timeout_us=GRID_TIMEOUT_US)
    return len(cases)
