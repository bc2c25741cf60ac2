"""The test harness itself: per-rank results and exceptions come back, and a
rank that does not answer in time gets the whole world killed and the call
failed (instead of a hung test run)."""

import time

import pytest

from _harness import World, WorldError

pytestmark = pytest.mark.timeout(60)


def _echo(ctx, value):
    return (ctx.rank, ctx.size, value)


def _raise_on_rank0(ctx):
    if ctx.rank == 0:
        raise ValueError("rank zero says no")
    return "fine"


def _hang_on_rank1(ctx):
    if ctx.rank == 1:
        time.sleep(120)
    return "done"


def test_results_exceptions_and_hard_timeout():
    world = World(2, gloo=False)
    try:
        assert world.run(_echo, "x") == [(0, 2, "x"), (1, 2, "x")]
        with pytest.raises(WorldError, match=r"rank 0: ValueError: rank zero says no"):
            world.run(_raise_on_rank0)
        assert world.run(_echo, 5) == [(0, 2, 5), (1, 2, 5)]  # still usable

        start = time.monotonic()
        with pytest.raises(WorldError, match=r"ranks \[1\] did not answer within 2"):
            world.run(_hang_on_rank1, timeout=2)
        assert time.monotonic() - start < 10
        assert world.dead and not any(p.is_alive() for p in world.procs), "the world was killed"
        with pytest.raises(WorldError, match="killed"):
            world.run(_echo, 1)
    finally:
        world.kill()
