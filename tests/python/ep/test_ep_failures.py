"""Ranks that do not take part: a dead rank, a rank that stalls past
``timeout_us``, a rank masked by the caller. The others return (never hang)
with it masked in ``active_ranks`` and correct results for everyone else;
the process group keeps working, and later calls are correct (also after
the caller re-activates the rank)."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from _ep_refs import Case, expected_combine, expert_fn, inputs_of
from _ep_rounds import RANK_ENV, buffer_of, check_dispatch, run_round
from _harness import World

pytestmark = pytest.mark.timeout(120)

CASE = Case(hidden=256, experts_per_rank=3, num_topk=4, tokens=6, masked=0.1)
CASE_FP8 = Case(hidden=128, experts_per_rank=2, num_topk=3, tokens=5, fp8=True, seed=7)
TIMEOUT_US = 1_000_000


def _without(world, rank):
    return [0 if r == rank else 1 for r in range(world)]


# ---------------------------------------------------------------------------
# A rank that dies


def _dies_before_dispatch(ctx, victim, timeout_us):
    buffer_of(ctx)  # collective: everyone constructs it first
    dist.barrier()
    if ctx.rank == victim:
        os._exit(17)
    expect = _without(ctx.size, victim)
    start = time.monotonic()
    run_round(ctx, CASE, timeout_us=timeout_us, expect_active=expect)
    elapsed = time.monotonic() - start
    # Later calls: the victim stays masked (the caller passes the mask on).
    run_round(ctx, CASE_FP8, active=expect, timeout_us=timeout_us, expect_active=expect)
    return elapsed


@pytest.mark.parametrize("timeout_us", [-1, 10_000_000], ids=["no-timeout", "timeout-10s"])
def test_dead_rank_is_masked_and_the_others_get_correct_results(timeout_us):
    """The process group reports the dead rank (about 40 ms after it dies), so
    the others stop waiting for it even without a timeout."""
    with World(3, gloo=False, env=RANK_ENV) as world:
        elapsed = world.run(_dies_before_dispatch, 1, timeout_us, allow_dead=(1,), timeout=60)
    assert elapsed[1] is None
    for r in (0, 2):  # well before the 10 s timeout: the group's own failure detection ended the wait
        assert elapsed[r] < 4.0, f"rank {r} took {elapsed[r]:.2f} s to give up on the dead rank"


def _dies_between_dispatch_and_combine(ctx, victim):
    """The reference's stale-data case: a normal round, then a dispatch with
    everyone, then the victim dies before combine. The survivors' combine
    must leave out the victim's experts (and never read old rows)."""
    world, rank = ctx.size, ctx.rank
    buffer = buffer_of(ctx)
    run_round(ctx, CASE_FP8)
    mine = inputs_of(CASE, rank, world)
    mask = torch.ones(world, dtype=torch.int32)
    recv_x, recv_count, handle, _, _ = buffer.dispatch(mine.x, mine.topk_idx, mask, CASE.tokens,
                                                       CASE.experts(world), -1, use_fp8=False)
    check_dispatch(CASE, world, rank, [1] * world, recv_x, recv_count, handle)
    L = CASE.experts_per_rank
    outputs = torch.full_like(recv_x, float("nan"))
    for le, n in enumerate(recv_count.tolist()):
        outputs[le, :n] = expert_fn(rank * L + le, recv_x[le, :n])
    dist.barrier()
    if rank == victim:
        os._exit(17)
    # The group's failure detection (about 40 ms) is what masks the victim; the
    # timeout only bounds the wait. It must leave room for the two survivors
    # to arrive at different moments on a loaded machine: a few milliseconds
    # would let one of them give up on the other.
    combined, _, _ = buffer.combine(outputs, mine.topk_idx, mine.topk_weights, mask, 2_000_000, handle)
    expect = _without(world, victim)
    assert mask.tolist() == expect, mask.tolist()
    assert not bool(combined.isnan().any())
    assert torch.equal(combined, expected_combine(CASE, world, rank, expect)), f"rank {rank}"
    run_round(ctx, CASE, active=expect, expect_active=expect)  # and later calls are right
    return True


def test_rank_dying_between_dispatch_and_combine_leaves_out_its_experts():
    with World(3, gloo=False, env=RANK_ENV) as world:
        assert world.run(_dies_between_dispatch_and_combine, 1, allow_dead=(1,), timeout=60) == [True, None, True]


# ---------------------------------------------------------------------------
# A rank that is alive but late


def _one_rank_late(ctx, late, stall_s, timeout_us):
    buffer_of(ctx)
    dist.barrier()
    world = ctx.size
    # The others give up on the late rank and mask it. The late rank arrives
    # after their decision: it masks them in turn and goes on alone (its own
    # tokens, its own experts), so each side sees the other as absent.
    expect = [1 if r == late else 0 for r in range(world)] if ctx.rank == late else _without(world, late)
    out = {}
    if ctx.rank == late:
        time.sleep(stall_s)
    start = time.monotonic()
    run_round(ctx, CASE, timeout_us=timeout_us, expect_active=expect)
    out["first_round_s"] = time.monotonic() - start
    # Later calls keep the split (the caller passes the masks on).
    run_round(ctx, CASE_FP8, active=expect, timeout_us=timeout_us, expect_active=expect)
    # The process group is intact for everyone, the late rank included.
    start = time.monotonic()
    dist.barrier()
    out["barrier_s"] = time.monotonic() - start
    # The caller re-activates everyone on every rank: all take part again.
    run_round(ctx, CASE, active=[1] * world, timeout_us=timeout_us, expect_active=[1] * world)
    run_round(ctx, CASE_FP8, timeout_us=-1, expect_active=[1] * world)
    return out


def test_late_rank_is_masked_after_the_timeout_and_rejoins_when_reactivated():
    stall_s = 3 * TIMEOUT_US / 1e6
    with World(3, gloo=False, env=RANK_ENV) as world:
        out = world.run(_one_rank_late, 2, stall_s, TIMEOUT_US, timeout=90)
    for r in (0, 1):
        took = out[r]["first_round_s"]
        assert TIMEOUT_US / 1e6 <= took < TIMEOUT_US / 1e6 + 3.0, f"rank {r}: first round took {took:.2f} s"
    # The late rank learns its fate at once: the decision is already there.
    assert out[2]["first_round_s"] < 2.0, out[2]


def _one_rank_early(ctx, early, timeout_us):
    """A rank that gives up too soon (tiny timeout, others busy elsewhere) must
    not knock out the others: they agree among themselves at the next level."""
    buffer_of(ctx)
    dist.barrier()
    world = ctx.size
    if ctx.rank == early:
        expect = [1 if r == early else 0 for r in range(world)]
        run_round(ctx, CASE, timeout_us=timeout_us, expect_active=expect)
    else:
        time.sleep(1.0)
        expect = _without(world, early)
        run_round(ctx, CASE, timeout_us=-1, expect_active=expect)
    dist.barrier()
    run_round(ctx, CASE_FP8, active=[1] * world, timeout_us=-1)
    return True


def test_a_rank_that_gives_up_early_does_not_knock_out_the_others():
    with World(3, gloo=False, env=RANK_ENV) as world:
        assert world.run(_one_rank_early, 0, 100_000, timeout=60) == [True] * 3


def _slow_rank_without_timeout(ctx, slow, stall_s):
    buffer_of(ctx)
    dist.barrier()
    if ctx.rank == slow:
        time.sleep(stall_s)
    start = time.monotonic()
    run_round(ctx, CASE, timeout_us=-1, expect_active=[1] * ctx.size)
    return time.monotonic() - start


def test_without_timeout_a_slow_rank_is_waited_for():
    with World(2, gloo=False, env=RANK_ENV) as world:
        took = world.run(_slow_rank_without_timeout, 1, 1.5, timeout=60)
    assert took[0] >= 1.3, took


# ---------------------------------------------------------------------------
# A rank the caller masks


def _caller_masks(ctx, masked):
    world = ctx.size
    mask = _without(world, masked)
    # Everyone, the masked rank included, passes the same mask: the masked
    # rank takes part in nothing; the others exchange among themselves.
    for case in (CASE, CASE_FP8, Case(hidden=128, experts_per_rank=4, num_topk=4, tokens=8, mode="hook",
                                       zero_copy=True, seed=3)):
        run_round(ctx, case, active=mask, timeout_us=TIMEOUT_US, expect_active=mask)
    run_round(ctx, CASE, timeout_us=TIMEOUT_US)  # all together again
    return True


@pytest.mark.parametrize("world_size, masked", [(3, 0), (4, 2)])
def test_rank_masked_by_the_caller_takes_no_part(world_size, masked):
    with World(world_size, gloo=False, env=RANK_ENV) as world:
        assert world.run(_caller_masks, masked, timeout=90) == [True] * world_size
