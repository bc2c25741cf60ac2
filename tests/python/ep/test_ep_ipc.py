"""The CUDA IPC fast path of Buffer (``buffer.path == "ipc"``,
docs/ep-kernels.md), with 1, 2 or 4 processes sharing one GPU:

- it gives the collective path's results bit for bit, at DeepEP's shape
  (128 tokens per rank, hidden 7168, 288 experts, top-8, FP8 dispatch, BF16
  combine) and others (the collective path is itself checked against the
  dense MoE in test_ep_grid.py / test_ep_cuda.py, which also run the fast
  path against the dense references);
- a late rank is masked by the others within the timeout, a dead rank
  without any timeout, and later calls are right;
- a captured CUDA graph replays with new inputs; two dispatches may be in
  flight with return_recv_hook; update_ep_member() rebuilds the peer tables;
  ``_use_fallback`` switches paths.

Skipped without a GPU (CI has none)."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from _ep_refs import Case, expected_combine, expert_fn, inputs_of
from _ep_rounds import RANK_ENV, buffer_of, check_dispatch, run_round
from _harness import World

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU: the fast path is GPU kernels over CUDA IPC (CI has no GPU)"),
]


def _world(size):
    return World(size, gloo=False, env=RANK_ENV, backend="mooncake")  # the harness picks the GPU


def _expert_outputs(recv_x, recv_count, rank, fp8):
    """expert_fn of every received row, vectorised (the same float32 operations
    row by row); rows past each count are 0."""
    if fp8:
        data, scales = recv_x
        rows = (data.float() * scales.repeat_interleave(128, dim=2)).to(torch.bfloat16)
    else:
        rows = recv_x
    L, slots = rows.shape[:2]
    experts = torch.arange(rank * L, (rank + 1) * L, device=rows.device)
    scale = (1.0 + 0.125 * experts.float()).view(L, 1, 1)
    shift = (0.25 * (experts % 3).float()).view(L, 1, 1)
    y = (rows.float() * scale - shift).to(torch.bfloat16)
    valid = torch.arange(slots, device=rows.device).view(1, slots) < recv_count.view(L, 1)
    return y * valid.unsqueeze(2)


# ---------------------------------------------------------------------------
# The two paths agree bit for bit

# (tokens per rank, hidden, experts per rank at world 1 ... as a total, top-k, masked fraction, fp8)
DEEPEP = dict(tokens=128, hidden=7168, experts=288, topk=8, masked=0.0)
SHAPES = [
    dict(DEEPEP, fp8=True),
    dict(DEEPEP, fp8=False),
    dict(tokens=16, hidden=256, experts=24, topk=3, masked=0.2, fp8=True),
    dict(tokens=40, hidden=2048, experts=8, topk=2, masked=0.0, fp8=False),
    dict(tokens=5, hidden=128, experts=48, topk=9, masked=0.3, fp8=False),
]


def _inputs(shape, rank, world, seed, device):
    g = torch.Generator().manual_seed(seed * 131 + rank)
    n = shape["tokens"] - (rank * shape["tokens"]) // (2 * world)  # ranks send different counts
    x = torch.randn(n, shape["hidden"], generator=g).to(torch.bfloat16)
    topk = torch.randn(n, shape["experts"], generator=g).topk(shape["topk"], dim=1).indices
    topk[torch.rand(topk.shape, generator=g) < shape["masked"]] = -1
    weights = torch.rand(topk.shape, generator=g)
    return x.to(device), topk.to(device), weights.to(device)


def _run(buffer, shape, x, topk, weights, device):
    world = buffer.group_size
    mask = torch.ones(world, dtype=torch.int32, device=device)
    recv_x, count, handle, _, _ = buffer.dispatch(x, topk, mask, shape["tokens"], shape["experts"], 30_000_000,
                                                  use_fp8=shape["fp8"])
    y = _expert_outputs(recv_x, count, buffer.rank, shape["fp8"])
    out, _, _ = buffer.combine(y, topk, weights, mask, 30_000_000, handle)
    torch.cuda.synchronize()
    got = {"count": count, "src_info": handle[0], "layout_range": handle[1], "out": out, "mask": mask}
    if shape["fp8"]:
        got["data"], got["scales"] = recv_x[0].view(torch.uint8), recv_x[1]
    else:
        got["data"] = recv_x
    return {k: v.cpu() for k, v in got.items()}


def _both_paths_agree(ctx, shapes):
    from mooncake.mooncake_ep_buffer import Buffer  # noqa: PLC0415

    device = torch.device("cuda", torch.cuda.current_device())
    fast = Buffer(dist.group.WORLD)
    slow = Buffer(dist.group.WORLD, disable_p2p=True)
    assert fast.path == "ipc", f"rank {ctx.rank}: fast path not chosen: {fast.path_reason}"
    assert slow.path == "collective" and "disable_p2p" in slow.path_reason, slow.path_reason
    for i, shape in enumerate(shapes):
        x, topk, weights = _inputs(shape, ctx.rank, ctx.size, i, device)
        a = _run(fast, shape, x, topk, weights, device)
        b = _run(slow, shape, x, topk, weights, device)
        where = f"rank {ctx.rank} of {ctx.size}, shape {shape}"
        assert a["mask"].tolist() == [1] * ctx.size, where
        for key in ("count", "src_info", "layout_range"):
            assert torch.equal(a[key], b[key]), f"{where}: {key} differs between the paths"
        for le, n in enumerate(a["count"].tolist()):
            assert torch.equal(a["data"][le, :n], b["data"][le, :n]), f"{where}: rows of local expert {le}"
            if shape["fp8"]:
                assert torch.equal(a["scales"][le, :n], b["scales"][le, :n]), f"{where}: scales of expert {le}"
        assert torch.equal(a["out"], b["out"]), \
            f"{where}: combine differs by up to {float((a['out'].float() - b['out'].float()).abs().max())}"
        assert int(a["count"].sum()) > 0 or ctx.size == 0, where
        # Setting up at the first dispatch may fall back (e.g. GPUs without peer access):
        # then this would compare the collective path with itself.
        assert fast.path == "ipc", f"{where}: the fast path fell back: {fast.path_reason}"
    return len(shapes)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_fast_path_gives_the_collective_paths_bits(world_size):
    with _world(world_size) as world:
        assert world.run(_both_paths_agree, SHAPES, timeout=240) == [len(SHAPES)] * world_size


def _destroyed_at_different_times(ctx, shape):
    """destroy() closes the fast path at once on every rank, though the ranks
    come to it at different times; without it the garbage collector closed it
    on one rank while the others went on, and that rank waited the attach
    timeout (60 s) for them."""
    from mooncake.mooncake_ep_buffer import Buffer  # noqa: PLC0415

    device = torch.device("cuda", torch.cuda.current_device())
    x, topk, weights = _inputs(shape, ctx.rank, ctx.size, 0, device)
    buffer = Buffer(dist.group.WORLD)
    assert buffer.path == "ipc", buffer.path_reason
    before = _run(buffer, shape, x, topk, weights, device)
    time.sleep(0.3 * ctx.rank)
    start = time.monotonic()
    buffer.destroy()
    closed_in = time.monotonic() - start
    del buffer
    again = Buffer(dist.group.WORLD)
    assert again.path == "ipc", again.path_reason
    after = _run(again, shape, x, topk, weights, device)
    again.destroy()
    assert torch.equal(before["out"], after["out"]), f"rank {ctx.rank}: a new Buffer combines differently"
    return closed_in


def test_destroy_closes_the_fast_path_on_every_rank_without_waiting_for_a_timeout():
    with _world(2) as world:
        closed_in = world.run(_destroyed_at_different_times, SHAPES[2], timeout=120)
    assert max(closed_in) < 10, f"destroy() took {closed_in} s (the attach timeout is 60 s)"


# ---------------------------------------------------------------------------
# Ranks that do not take part

# The same sizes in every round: a dispatch with new sizes sets the fast path
# up again, with every rank (a dead one makes that fall back to the collective path).
CASE = Case(hidden=256, experts_per_rank=3, num_topk=4, tokens=6, masked=0.1)
CASE_FP8 = Case(hidden=256, experts_per_rank=3, num_topk=4, tokens=6, fp8=True, seed=7)


def _late_rank(ctx, late, stall_s, timeout_us):
    buffer = buffer_of(ctx)
    assert buffer.path == "ipc", buffer.path_reason
    # The first dispatch with given sizes sets the fast path up, with every
    # rank (as constructing a DeepEP Buffer does): not the call to be late for.
    run_round(ctx, CASE, device="cuda", timeout_us=-1)
    dist.barrier()
    world = ctx.size
    everyone = [1] * world
    without = [0 if r == late else 1 for r in range(world)]
    alone = [1 if r == late else 0 for r in range(world)]
    out = {}
    start = time.monotonic()
    if ctx.rank == late:
        # The others sent their rows before giving up on it: its dispatch
        # finds everything. In combine nobody answers it (they masked it).
        time.sleep(stall_s)
        start = time.monotonic()
        run_round(ctx, CASE, timeout_us=timeout_us, device="cuda", expect_active=everyone, expect_after_combine=alone)
    else:
        run_round(ctx, CASE, timeout_us=timeout_us, device="cuda", expect_active=without)
    out["first_round_s"] = time.monotonic() - start
    # Everyone re-activated by every caller, no timeout: all take part again.
    run_round(ctx, CASE_FP8, active=everyone, timeout_us=-1, device="cuda", expect_active=everyone)
    return out


def test_late_rank_is_masked_within_the_timeout_and_rejoins():
    timeout_us = 1_000_000
    with _world(3) as world:
        out = world.run(_late_rank, 2, 3.0, timeout_us, timeout=120)
    for r in (0, 1):
        took = out[r]["first_round_s"]
        assert 1.0 <= took < 4.0, f"rank {r}: the round with the late rank took {took:.2f} s"
    assert out[2]["first_round_s"] < 4.0, out[2]


def _dies_before_dispatch(ctx, victim):
    buffer_of(ctx)
    run_round(ctx, CASE, device="cuda", timeout_us=-1)  # sets the fast path up, with every rank
    dist.barrier()  # every rank's earlier work has run: the victim dies between calls
    if ctx.rank == victim:
        os._exit(17)
    expect = [0 if r == victim else 1 for r in range(ctx.size)]
    start = time.monotonic()
    # No timeout: the kernels learn of the exit from the process watchdog.
    run_round(ctx, CASE, timeout_us=-1, device="cuda", expect_active=expect)
    elapsed = time.monotonic() - start
    run_round(ctx, CASE_FP8, active=expect, timeout_us=-1, device="cuda", expect_active=expect)
    return elapsed


def test_dead_rank_is_masked_without_a_timeout():
    with _world(3) as world:
        elapsed = world.run(_dies_before_dispatch, 1, allow_dead=(1,), timeout=90)
    assert elapsed[1] is None
    for r in (0, 2):
        assert elapsed[r] < 5.0, f"rank {r} took {elapsed[r]:.2f} s to give up on the dead rank"


def _gone_before_the_first_call(ctx, victim):
    buffer = buffer_of(ctx)
    dist.barrier()  # the Buffer exists everywhere; its fast path is set up at the first dispatch
    if ctx.rank == victim:
        os._exit(17)
    expect = [0 if r == victim else 1 for r in range(ctx.size)]
    start = time.monotonic()
    run_round(ctx, CASE, timeout_us=5_000_000, device="cuda", expect_active=expect)
    first = time.monotonic() - start
    run_round(ctx, CASE_FP8, active=expect, timeout_us=-1, device="cuda", expect_active=expect)
    return first, buffer.path


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_gone_before_the_first_call_is_left_out_and_the_fast_path_kept(world_size):
    # Issue 19 §1: the fast path's setup stops waiting for a rank once the
    # membership knows it is gone (or at the call's timeout), and the
    # survivors keep the fast path among themselves with it masked.
    with _world(world_size) as world:
        out = world.run(_gone_before_the_first_call, 1, allow_dead=(1,), timeout=120)
    assert out[1] is None
    for r in [r for r in range(world_size) if r != 1]:
        first, path = out[r]
        assert path == "ipc", f"rank {r} left the fast path: {path}"
        assert first < 5.0, f"rank {r}: the first call took {first:.2f} s"


# ---------------------------------------------------------------------------
# CUDA graphs, calls in flight, membership updates, switching paths

GRAPH_CASE = Case(hidden=512, experts_per_rank=4, num_topk=3, tokens=12, masked=0.1)


def _graph_replays(ctx, seeds):
    world, rank = ctx.size, ctx.rank
    device = torch.device("cuda", torch.cuda.current_device())
    buffer = buffer_of(ctx)
    first = inputs_of(GRAPH_CASE, rank, world)
    x, topk, weights = first.x.to(device), first.topk_idx.to(device), first.topk_weights.to(device)
    mask = torch.ones(world, dtype=torch.int32, device=device)
    T, E = GRAPH_CASE.tokens, GRAPH_CASE.experts(world)

    def step():
        recv_x, count, handle, _, _ = buffer.dispatch(x, topk, mask, T, E, 10_000_000, use_fp8=False)
        y = _expert_outputs(recv_x, count, rank, False)
        out, _, _ = buffer.combine(y, topk, weights, mask, 10_000_000, handle)
        return count, out

    step()  # warm-up: sets up the fast path's buffers (not capturable)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        count, out = step()
    checked = 0
    for seed in seeds:
        case = Case(**{**GRAPH_CASE.__dict__, "seed": seed})
        new = inputs_of(case, rank, world)
        x.copy_(new.x)
        topk.copy_(new.topk_idx)
        weights.copy_(new.topk_weights)
        graph.replay()
        torch.cuda.synchronize()
        want = expected_combine(case, world, rank, [1] * world)
        assert torch.equal(out.cpu(), want), f"rank {rank}: replay with seed {seed}: combine differs"
        assert mask.tolist() == [1] * world
        checked += 1
    return checked


def test_captured_graph_replays_with_new_inputs():
    seeds = [11, 12, 13, 14, 15]
    with _world(2) as world:
        assert world.run(_graph_replays, seeds, timeout=120) == [len(seeds)] * 2


def _two_in_flight_then_update(ctx):
    world, rank = ctx.size, ctx.rank
    device = torch.device("cuda", torch.cuda.current_device())
    buffer = buffer_of(ctx)
    cases = [Case(hidden=256, experts_per_rank=2, num_topk=2, tokens=7, seed=21),
             Case(hidden=256, experts_per_rank=2, num_topk=2, tokens=7, fp8=True, seed=22)]
    inputs = [inputs_of(c, rank, world) for c in cases]
    mask = torch.ones(world, dtype=torch.int32, device=device)
    calls = []
    for case, mine in zip(cases, inputs):  # both sent before either is received
        calls.append(buffer.dispatch(mine.x.to(device), mine.topk_idx.to(device), mask, case.tokens,
                                     case.experts(world), -1, use_fp8=case.fp8, return_recv_hook=True))
    outs = []
    for (recv_x, count, handle, _, hook) in calls:
        hook()
    for case, mine, (recv_x, count, handle, _, _) in zip(cases, inputs, calls):
        check_dispatch(case, world, rank, [1] * world, recv_x, count, handle)
        y = _expert_outputs(recv_x, count, rank, case.fp8)
        outs.append(buffer.combine(y, mine.topk_idx.to(device), mine.topk_weights.to(device), mask, -1, handle,
                                   return_recv_hook=True))
    for _, _, hook in outs:
        hook()
    for case, (out, _, _) in zip(cases, outs):
        want, got = expected_combine(case, world, rank, [1] * world), out.cpu()
        if case.fp8:  # the same FP8 rounding as the reference; only bf16 rounding may differ
            scale = float(want.float().abs().max().clamp_min(1))
            torch.testing.assert_close(got.float(), want.float(), rtol=2.0 ** -7, atol=2.0 ** -7 * scale)
        else:
            assert torch.equal(got, want), f"rank {rank}: combine of {case}"
    # Membership update: the peer tables are rebuilt; the fast path goes on.
    buffer.update_ep_member()
    assert buffer.path == "ipc", buffer.path_reason
    run_round(ctx, CASE, device="cuda", timeout_us=-1)
    # The reference's switch: the collective path on demand, and back.
    buffer._use_fallback = True
    assert buffer.path == "collective" and buffer._use_fallback
    run_round(ctx, CASE_FP8, device="cuda", timeout_us=-1)
    buffer._use_fallback = False
    assert buffer.path == "ipc"
    run_round(ctx, CASE_FP8, device="cuda", timeout_us=-1)
    # Bad input names the rule: tensors must be on the GPU for the fast path.
    mine = inputs_of(CASE, rank, world)
    with pytest.raises(ValueError, match="x: this Buffer runs the CUDA IPC fast path"):
        buffer.dispatch(mine.x, mine.topk_idx, None, CASE.tokens, CASE.experts(world), -1)
    return True


def test_two_dispatches_in_flight_membership_update_and_path_switch():
    with _world(2) as world:
        assert world.run(_two_in_flight_then_update, timeout=120) == [True, True]


# ---------------------------------------------------------------------------
# Profiler rows: DeepEP's and the reference's benchmark helper (bench_kineto)
# asserts that exactly one row of the profiler's table names each operation.

def _profiler_rows(ctx, shape):
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    from mooncake.mooncake_ep_buffer import Buffer  # noqa: PLC0415

    device = torch.device("cuda", torch.cuda.current_device())
    buffer = Buffer(dist.group.WORLD)
    x, topk, weights = _inputs(shape, ctx.rank, ctx.size, 0, device)
    _run(buffer, shape, x, topk, weights, device)  # sets the fast path up outside the profile
    assert buffer.path == "ipc", buffer.path_reason
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            _run(buffer, shape, x, topk, weights, device)
    lines = prof.key_averages().table(sort_by="cuda_time_total", max_name_column_width=100).split("\n")
    return {name: [line.split("  ")[0] for line in lines if name in line] for name in ("dispatch", "combine")}


def test_the_profiler_shows_one_row_per_operation_name():
    with _world(2) as world:
        for rank, rows in enumerate(world.run(_profiler_rows, dict(SHAPES[2]), timeout=120)):
            for name, matching in rows.items():
                assert len(matching) == 1, f"rank {rank}: rows naming {name!r}: {matching}"
