"""Failures: a rank that dies, a rank that stalls past the timeout, ranks
that issue mismatched collectives.

- A rank that dies or stalls: the survivors' collective completes over the
  survivors (quickly, or at the timeout), with the failure hint naming the
  rank and local_success False; the rank is deactivated (default failure
  mode), later calls work without it, and a stalled rank that comes back
  finds itself inactive and fails at once. test_elastic.py has the recovery.
- Mismatched collectives are a program error: every rank gets an error, the
  membership is left alone, and that group stays failed (later calls raise
  at once) while other groups are unaffected."""

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

from _harness import World, free_port, run_world, outcome

pytestmark = pytest.mark.timeout(120)

FAST = 3.0  # seconds: "quickly" for a dead peer (detection polls every ~20 ms)
AT_ONCE = 0.5  # seconds: a call on a group that already failed




def _later_calls(group=None):
    """Each kind of call on a group: how it ends and how long it takes."""
    out = {}
    out["all_reduce"] = outcome(lambda: dist.all_reduce(torch.ones(4), group=group))
    out["broadcast"] = outcome(lambda: dist.broadcast(torch.ones(4), src=0, group=group))
    out["barrier"] = outcome(lambda: dist.barrier(group=group))
    ws = dist.get_world_size(group)
    out["all_gather_into_tensor"] = outcome(
        lambda: dist.all_gather_into_tensor(torch.empty(4 * ws), torch.ones(4), group=group))
    out["async all_reduce"] = outcome(lambda: dist.all_reduce(torch.ones(4), group=group, async_op=True).wait())
    return out


def assert_fail_at_once(later, where):
    for name, (kind, message, elapsed) in later.items():
        assert kind == "DistBackendError", f"{where}: later {name} gave {kind}: {message}"
        assert elapsed < AT_ONCE, f"{where}: later {name} took {elapsed:.3f} s"


def assert_all_work(later, where):
    for name, (kind, message, elapsed) in later.items():
        assert kind == "ok", f"{where}: later {name} gave {kind}: {message}"


# ---------------------------------------------------------------------------
# A rank that dies


def _die_before_collective(ctx, victim):
    dist.barrier()
    if ctx.rank == victim:
        time.sleep(0.3)  # the survivor is waiting in the collective by now
        os._exit(17)
    t = torch.full((1000,), float(ctx.rank + 1))
    work = dist.all_reduce(t, async_op=True)
    res = {"wait": outcome(work.wait)}
    res["value"] = t[:2].tolist()
    res["hint"] = ctx.pg.get_failed_ranks_hint(work).tolist()
    res["local_success"] = ctx.pg.get_local_success(work)
    res["completed"] = work.is_completed()
    res["future"] = outcome(lambda: work.get_future().wait())
    res["mask"] = ctx.pg.get_active_ranks(dist.group.WORLD).tolist()
    res["later"] = _later_calls()
    # Point-to-point with the dead (now inactive) rank fails at once, by its
    # hint: wait() returns (the reference's contract for P2P).
    for name, post in (("recv", lambda: dist.irecv(torch.empty(3), src=victim)),
                       ("send", lambda: dist.isend(torch.ones(3), dst=victim))):
        start = time.monotonic()
        work = post()
        kind = outcome(work.wait)[0]
        res[name] = (kind, ctx.pg.get_failed_ranks_hint(work).tolist(), ctx.pg.get_local_success(work),
                     time.monotonic() - start)
    return res


def test_dead_rank_the_collective_completes_over_the_survivors():
    res = run_world(_die_before_collective, 2, 1, allow_dead=(1,), gloo=False)
    assert res[1] is None
    r = res[0]
    kind, value, elapsed = r["wait"]
    assert kind == "ok", (kind, value)
    assert elapsed < FAST, f"the dead rank was handled after {elapsed:.2f} s"
    assert r["value"] == [1.0, 1.0], "only the survivor contributed"
    assert r["hint"] == [0, 1], "the failure hint names the dead rank"
    assert r["local_success"] is False and r["completed"] is True
    assert r["future"][0] == "ok", r["future"]
    assert r["mask"] == [1, 0], "the dead rank is deactivated before the Work completes"
    assert_all_work(r["later"], "rank 0")
    for name in ("recv", "send"):
        kind, hint, local_success, elapsed = r[name]
        assert (kind, hint, local_success) == ("ok", [0, 1], False), (name, kind, hint, local_success)
        assert elapsed < AT_ONCE, (name, elapsed)


def _die_with_a_late_survivor(ctx):
    # World of 3: rank 1 dies while rank 0 waits in the collective; rank 2
    # calls it 1 s later, after the view without rank 1 is in place.
    dist.barrier()
    if ctx.rank == 1:
        time.sleep(0.3)  # rank 0 is waiting in the collective by now
        os._exit(17)
    time.sleep(0.0 if ctx.rank == 0 else 1.3)
    t = torch.full((10,), float(ctx.rank + 1))
    work = dist.all_reduce(t, async_op=True)
    res = {"wait": outcome(work.wait), "value": t[0].item()}
    res["hint"] = ctx.pg.get_failed_ranks_hint(work).tolist()
    res["later"] = _later_calls()
    return res


@pytest.fixture(scope="module")
def late_survivor():
    return run_world(_die_with_a_late_survivor, 3, allow_dead=(1,), gloo=False)


def test_dead_rank_every_survivor_completes(late_survivor):
    for rank in (0, 2):
        r = late_survivor[rank]
        kind, value, elapsed = r["wait"]
        assert kind == "ok", (rank, kind, value)
        assert r["value"] == 4.0, (rank, r["value"])  # 1 + 3: rank 1 left out
        assert elapsed < FAST, (rank, elapsed)
        assert_all_work(r["later"], f"rank {rank}")
    assert late_survivor[0]["hint"] == [0, 1, 0], "the rank that saw the death names it in the hint"


def test_late_survivor_finds_the_view_already_changed(late_survivor):
    # Rank 2 came after the reconciliation: its collective ran on the new
    # view at once, so it saw no failure itself.
    assert late_survivor[2]["hint"] == [0, 0, 0], late_survivor[2]["hint"]


def _die_while_waiting_on_a_slow_rank(ctx):
    # World of 3: rank 2 dies; rank 1 is alive but busy for 2 s; rank 0 waits.
    dist.barrier()
    if ctx.rank == 2:
        os._exit(17)
    time.sleep(2.0 if ctx.rank == 1 else 0.3)
    t = torch.ones(10)
    return outcome(lambda: dist.all_reduce(t)), t[0].item()


def test_dead_rank_noticed_while_another_rank_is_late():
    res = run_world(_die_while_waiting_on_a_slow_rank, 3, allow_dead=(2,), gloo=False)
    for rank in (0, 1):
        (kind, message, elapsed), value = res[rank]
        assert kind == "ok" and value == 2.0, (rank, kind, message, value)
    (_, _, elapsed), _ = res[0]
    assert elapsed < 2.0 + FAST, f"rank 0 finished after {elapsed:.2f} s"


# ---------------------------------------------------------------------------
# A stalled rank, mismatched collectives (no one dies: one world serves)


@pytest.fixture(scope="module")
def world2():
    w = World(2, gloo=False)
    yield w
    w.close()


def _stall_with_init_timeout(ctx, port):
    # A fresh WORLD with a 2 s timeout (the ranks are all up: rendezvous is quick).
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("mooncake-cpu", rank=ctx.rank, world_size=ctx.size,
                            timeout=datetime.timedelta(seconds=2))
    dist.barrier()
    if ctx.rank == 1:
        time.sleep(3.0)
    t = torch.full((10,), float(ctx.rank + 1))
    work = dist.all_reduce(t, async_op=True)
    res = {"wait": outcome(work.wait), "hint": ctx.pg.get_failed_ranks_hint(work).tolist(), "value": t[0].item()}
    res["later"] = _later_calls()
    return res


def _stall_with_collective_timeout(ctx):
    # set_collective_timeout_us applies to the groups created after it (here with torch's timeout at 30 s).
    ctx.pg.set_collective_timeout_us(1_000_000)
    try:
        grp = dist.new_group(timeout=datetime.timedelta(seconds=30))
    finally:
        ctx.pg.set_collective_timeout_us(300_000_000)
    dist.barrier(group=grp)
    if ctx.rank == 1:
        time.sleep(2.5)
    t = torch.full((10,), float(ctx.rank + 1))
    work = dist.all_reduce(t, group=grp, async_op=True)
    res = {"wait": outcome(work.wait), "hint": ctx.pg.get_failed_ranks_hint(work).tolist(), "value": t[0].item()}
    res["later"] = _later_calls(grp)
    t = torch.full((2,), float(ctx.rank))
    dist.all_reduce(t)  # WORLD is another group: rank 1 is still active there
    res["world"] = t.tolist()
    return res


def _check_stall(res, timeout):
    # Rank 0 gives up on rank 1 at the deadline and completes without it.
    kind, value, elapsed = res[0]["wait"]
    assert kind == "ok", (kind, value)
    assert res[0]["value"] == 1.0, "rank 1 left out"
    assert timeout * 0.9 <= elapsed <= timeout + 1.5, f"rank 0 finished after {elapsed:.2f} s (timeout {timeout} s)"
    assert res[0]["hint"] == [0, 1]
    assert_all_work(res[0]["later"], "rank 0")
    # The stalled rank, when it finally calls, finds itself deactivated.
    kind, message, elapsed = res[1]["wait"]
    assert kind == "DistBackendError" and "not active" in message and elapsed < AT_ONCE, (kind, message, elapsed)
    assert_fail_at_once(res[1]["later"], "rank 1")


def test_stalled_rank_hits_the_init_process_group_timeout():
    res = run_world(_stall_with_init_timeout, 2, free_port(), gloo=False)
    _check_stall(res, 2.0)


def test_stalled_rank_hits_set_collective_timeout_us(world2):
    res = world2.run(_stall_with_collective_timeout)
    _check_stall(res, 1.0)
    assert [r["world"] for r in res] == [[1.0, 1.0]] * 2


MISMATCHES = {
    "sizes": lambda r, g: dist.all_reduce(torch.ones(10 + r), group=g),
    "dtypes": lambda r, g: dist.all_reduce(torch.ones(10, dtype=torch.float32 if r == 0 else torch.int32), group=g),
    "reduce ops": lambda r, g: dist.all_reduce(torch.ones(10), op=dist.ReduceOp.SUM if r == 0 else dist.ReduceOp.MAX,
                                               group=g),
    "operations": lambda r, g: (dist.all_reduce(torch.ones(10), group=g) if r == 0
                                else dist.broadcast(torch.ones(10), src=0, group=g)),
    "roots": lambda r, g: dist.broadcast(torch.ones(10), src=r, group=g),
    "large sizes": lambda r, g: dist.all_reduce(torch.ones((3 << 20) + r), group=g),
    "all_gather sizes": lambda r, g: dist.all_gather_into_tensor(torch.empty(2 * (5 + r)), torch.ones(5 + r), group=g),
    "barrier vs all_reduce": lambda r, g: dist.barrier(group=g) if r == 0 else dist.all_reduce(torch.ones(1), group=g),
}


def _mismatch(ctx, name):
    grp = dist.new_group()  # a fresh arena: the failure stays in it
    res = {"call": outcome(lambda: MISMATCHES[name](ctx.rank, grp))}
    res["later"] = _later_calls(grp)
    t = torch.full((2,), float(ctx.rank))
    dist.all_reduce(t)
    res["world"] = t.tolist()
    return res


@pytest.mark.parametrize("name", list(MISMATCHES))
def test_mismatched_collectives_fail_on_every_rank(world2, name):
    res = world2.run(_mismatch, name)
    for rank, r in enumerate(res):
        kind, message, elapsed = r["call"]
        assert kind == "DistBackendError", f"rank {rank}: mismatched {name} gave {kind}: {message}"
        assert "different collective" in message, message
        assert elapsed < FAST, elapsed
        assert_fail_at_once(r["later"], f"rank {rank}")
        assert r["world"] == [1.0, 1.0], "another group is not affected"


def _a2a_mismatch(ctx):
    grp = dist.new_group()
    # Rank 0 sends 2 elements to rank 1, but rank 1 expects 3 from rank 0 (and
    # rank 1 sends 3 where rank 0 expects 2): the pair disagrees on sizes.
    if ctx.rank == 0:
        out = torch.full((4,), -1.0)
        call = outcome(lambda: dist.all_to_all_single(out, torch.arange(4.0), [2, 2], [2, 2], group=grp))
    else:
        out = torch.full((6,), -1.0)
        call = outcome(lambda: dist.all_to_all_single(out, torch.arange(6.0) + 100, [3, 3], [3, 3], group=grp))
    return call[:2], out.tolist()


def test_mismatched_all_to_all_single_splits_fail(world2):
    res = world2.run(_a2a_mismatch)
    for rank, (call, out) in enumerate(res):
        assert call[0] == "DistBackendError", f"rank {rank}: no error; received {out}"


def _one_rank_bad_input(ctx):
    grp = dist.new_group()
    if ctx.rank == 0:
        # Rank 0's output has the wrong size: it raises at once, queues nothing, and moves on.
        bad = outcome(lambda: dist.all_gather_into_tensor(torch.empty(5), torch.ones(2), group=grp))
        nxt = outcome(lambda: dist.all_reduce(torch.ones(3), group=grp))
        return bad, nxt
    good = outcome(lambda: dist.all_gather_into_tensor(torch.empty(4), torch.ones(2), group=grp))
    return good, None


def test_bad_input_on_one_rank_gives_an_error_not_a_hang(world2):
    res = world2.run(_one_rank_bad_input)
    bad, nxt = res[0]
    assert bad[0] == "ValueError" and "output_tensor" in bad[1], bad
    # Rank 0's next collective meets rank 1's all_gather: both fail instead of hanging.
    assert nxt[0] == "DistBackendError" and nxt[2] < FAST, nxt
    good, _ = res[1]
    assert good[0] == "DistBackendError" and good[2] < FAST, good
