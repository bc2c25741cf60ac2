"""The membership survives the loss of global rank 0's process, which hosts
the coordinator (docs/process-group.md, "Failures": coordinator failover).

The job's store must survive too: here a standalone TCPStore in the test
process (as torchrun's agent store would be), with every rank a client
(TORCHELASTIC_USE_AGENT_STORE). Rank 0 is SIGKILLed right after a
collective; the survivors' next collective completes over them with a hint
naming seat 0 and the new view in place, as when any other rank dies; the
one after is clean; then a replacement of rank 0 joins through the new
coordinator and is activated again.
"""

import datetime
import os
import signal

import pytest
import torch
import torch.distributed as dist

from _elastic import Job, lose_a_rank_between_collectives, poll, replacement_joins
from _harness import HOST

pytestmark = pytest.mark.timeout(120)

USABLE_WITHIN = 3.0  # seconds from the death to the survivors' completed collective


def _world():
    return dist.group.WORLD


def _survivor_or_victim(ctx):
    lose_a_rank_between_collectives(ctx, 0, leave=lambda: os.kill(os.getpid(), signal.SIGKILL))
    ctx.signal(f"degraded{ctx.rank}")
    if ctx.events.get("no replacement") is not None:
        return
    # A replacement of rank 0 joins through the new coordinator.
    if ctx.rank == 1:
        poll(lambda: ctx.pg.get_peer_state(_world(), [0])[0], timeout=30)
        response = ctx.pg.recover_ranks(_world(), [0])
        ctx.say(("recover", str(response.status), response.reject_reason))
    else:
        poll(lambda: ctx.pg.get_active_ranks(_world()).tolist()[0] == 1, timeout=30)
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    ctx.say(("full", t.item(), ctx.pg.get_active_ranks(_world()).tolist()))


def test_the_survivors_go_on_when_rank_0_and_its_coordinator_are_killed():
    world = 4
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}
    with Job(event_names=[f"degraded{r}" for r in range(1, world)], env=env) as job:
        store = dist.TCPStore(HOST, job.port, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=60))
        procs = [job.start(_survivor_or_victim, r, world) for r in range(world)]
        procs[0].join(30)
        assert not procs[0].is_alive() and procs[0].exitcode == -signal.SIGKILL, procs[0].exitcode
        for r in range(1, world):
            assert job.events[f"degraded{r}"].wait(30), r
        job.start(replacement_joins, 0, world, spec=(world, True))
        got = job.collect(world, timeout=60)
        del store
    _check_survivors(got, world)
    for r in range(1, world):
        assert got[r][0][-1] == ("full", 10.0, [1, 1, 1, 1]), got[r][0]
    assert got[1][0][3] == ("recover", "ProposalStatus.Applied", ""), got[1][0]
    assert got[0][0] == [("before join", 4), ("full", 10.0, [1, 1, 1, 1])], got[0][0]


def _check_survivors(got, world):
    for r in range(1, world):
        said = got[r][0]
        assert said[0][:2] == ("before", 10.0), said
        seen = said[1]
        # As when any other rank dies: the collective completes over the
        # survivors, naming seat 0, with the new view in place.
        assert seen["value"] == [9.0], (r, seen)
        assert seen["hint"] == [1, 0, 0, 0], (r, seen)
        assert seen["local_success"] is False, (r, seen)
        assert seen["mask"] == [0, 1, 1, 1], (r, seen)
        assert seen["world"] == 4, (r, seen)
        assert seen["took"] < USABLE_WITHIN, (r, seen)
        tag, value, ok, epoch = said[2]
        assert (tag, value, ok) == ("after", [3.0] * 3, True), said
        assert epoch > said[0][2]
    print("failover figures: survivors' Work after the kill of rank 0 took",
          ", ".join(f"{got[r][0][1]['took']:.3f} s" for r in range(1, world)))


def test_the_survivors_go_on_even_when_the_store_died_with_rank_0():
    # The default rendezvous: rank 0's process hosts the TCPStore. The
    # survivors go on without it (nothing is read from the store after the
    # failure); no new process could find them, so no replacement here.
    world = 4
    with Job(event_names=[f"degraded{r}" for r in range(1, world)] + ["no replacement"]) as job:
        procs = [job.start(_survivor_or_victim, r, world) for r in range(world)]
        procs[0].join(30)
        assert not procs[0].is_alive() and procs[0].exitcode == -signal.SIGKILL, procs[0].exitcode
        got = job.collect(world - 1, timeout=60)
    _check_survivors(got, world)
