"""update_ep_member() after the group's membership changed: a rank dies, the
survivors carry on with it masked, a replacement process takes its seat
(join_group / recover_ranks), the survivors call update_ep_member() while the
replacement builds a fresh Buffer, and then everyone, the newcomer
included, gets correct results again (the scenario of the reference's
test_mooncake_ep, with a real replacement)."""

from dataclasses import dataclass

import pytest
import torch.distributed as dist

from _elastic import Job, die, poll, run_with_a_replacement
from _ep_refs import Case
from _ep_rounds import RANK_ENV, buffer_of, run_round

pytestmark = pytest.mark.timeout(120)

WORLD = 3
VICTIM = 1
CASE = Case(hidden=256, experts_per_rank=2, num_topk=3, tokens=5, masked=0.1, seed=5)
CASE_FP8 = Case(hidden=128, experts_per_rank=2, num_topk=2, tokens=4, fp8=True, seed=6)


@dataclass
class _Rank:  # what the rounds need of a rank
    rank: int
    size: int


def _survivor(ctx):
    me = _Rank(ctx.rank, ctx.world)
    buffer = buffer_of(me)
    run_round(me, CASE)
    if ctx.rank == VICTIM:
        die()
    without = [0 if r == VICTIM else 1 for r in range(WORLD)]
    run_round(me, CASE, expect_active=without)  # the group drops the dead rank; nobody waits for it
    ctx.say("degraded")
    ctx.signal("degraded")
    poll(lambda: ctx.pg.get_peer_state(dist.group.WORLD, [VICTIM])[0], timeout=60)
    ctx.pg.recover_ranks(dist.group.WORLD, [VICTIM])
    buffer.update_ep_member()
    run_round(me, CASE, active=[1] * WORLD)
    run_round(me, CASE_FP8)
    ctx.say("full")


def _replacement(ctx):
    me = _Rank(ctx.rank, ctx.world)
    ctx.pg.join_group(dist.group.WORLD)
    buffer_of(me)  # collective: meets the survivors' update_ep_member()
    run_round(me, CASE, active=[1] * WORLD)
    run_round(me, CASE_FP8)
    ctx.say("full")


def test_replacement_rank_takes_part_after_update_ep_member():
    with Job(event_names=["degraded"], env=RANK_ENV) as job:
        got = run_with_a_replacement(job, _survivor, _replacement, WORLD, VICTIM, after_event="degraded", timeout=90)
    for r in range(WORLD):
        said = got[r][0]
        assert said == (["full"] if r == VICTIM else ["degraded", "full"]), (r, said)
