"""ElasticBuffer's fixed membership under failure: a rank that dies makes
the survivors' dispatch fail with a clear error (never a hang, never wrong
rows), the buffer refuses calls until update_ep_member(), and after a
replacement has taken the seat (join_group / recover_ranks) the survivors'
update_ep_member() and the replacement's new ElasticBuffer meet, old handles
are refused, and every rank gets correct results again (the seed's call
sequence)."""

import time

import pytest
import torch.distributed as dist

from _elastic import Job, die, poll, run_with_a_replacement
from _elastic_refs import ElasticCase
from _elastic_rounds import elastic_buffer_of, run_elastic_round
from _ep_refs import Case
from _ep_rounds import RANK_ENV

pytestmark = pytest.mark.timeout(150)

WORLD = 3
VICTIM = 1
CASE = ElasticCase(Case(hidden=256, experts_per_rank=3, num_topk=3, tokens=5, masked=0.1, seed=11))
CASE_FP8 = ElasticCase(Case(hidden=128, experts_per_rank=2, num_topk=2, tokens=4, seed=12), fp8=True, alignment=2)


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    for k, v in RANK_ENV.items():
        monkeypatch.setenv(k, v)


def _error_of(call) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        call()
    except Exception as err:  # noqa: BLE001 - the test reports what was raised
        return type(err).__name__, str(err), time.monotonic() - start
    return "none", "", time.monotonic() - start


def _survivor(ctx):
    me = _Rank(ctx.rank, ctx.world)
    buffer = elastic_buffer_of(me, num_gpu_timeout_secs=20)
    run_elastic_round(me, CASE)
    _, _, _, old_handle, _ = buffer.dispatch(*_first_inputs(me))
    old_y = _combine_input(old_handle)
    buffer.combine(old_y, old_handle)
    dist.barrier()
    if ctx.rank == VICTIM:
        die()
    ctx.say(_error_of(lambda: run_elastic_round(me, CASE)))  # the failure: a clear error, bounded
    ctx.say(_error_of(lambda: buffer.dispatch(*_first_inputs(me))))  # refused until update_ep_member()
    ctx.say(_error_of(buffer.update_ep_member))  # the seat is not recovered yet
    ctx.signal("degraded")
    poll(lambda: ctx.pg.get_peer_state(dist.group.WORLD, [VICTIM])[0], timeout=60)
    ctx.pg.recover_ranks(dist.group.WORLD, [VICTIM])
    buffer.update_ep_member()
    ctx.say(_error_of(lambda: buffer.combine(old_y, old_handle)))  # a handle from before: refused
    run_elastic_round(me, CASE)
    run_elastic_round(me, CASE_FP8, expand=True)
    ctx.say("full")


def _replacement(ctx):
    me = _Rank(ctx.rank, ctx.world)
    ctx.pg.join_group(dist.group.WORLD)
    elastic_buffer_of(me, num_gpu_timeout_secs=20)  # collective: meets the survivors' update_ep_member()
    run_elastic_round(me, CASE)
    run_elastic_round(me, CASE_FP8, expand=True)
    ctx.say("full")


class _Rank:
    def __init__(self, rank, size):
        self.rank, self.size = rank, size


def _first_inputs(me):
    from _ep_refs import inputs_of

    inp = inputs_of(CASE.base, me.rank, me.size)
    return inp.x, inp.topk_idx, inp.topk_weights, CASE.base.experts(me.size), CASE.base.tokens


def _combine_input(handle):
    import torch

    rows = handle.native_handle.num_recv
    return torch.zeros(max(rows, 1), CASE.base.hidden, dtype=torch.bfloat16)


def test_a_dead_rank_fails_the_call_and_a_replacement_restores_the_buffer():
    with Job(event_names=["degraded"], env=RANK_ENV) as job:
        got = run_with_a_replacement(job, _survivor, _replacement, WORLD, VICTIM, after_event="degraded", timeout=120)
    assert got[VICTIM][0] == ["full"]
    for r in (0, 2):
        failed, refused, early_update, stale, full = got[r][0]
        assert failed[0] == "RuntimeError" and "update_ep_member" in failed[1], (r, failed)
        assert failed[2] < 15.0, f"rank {r} took {failed[2]:.1f} s to report the dead rank"
        assert refused[0] == "RuntimeError" and "update_ep_member" in refused[1], (r, refused)
        assert early_update[0] == "RuntimeError" and str(VICTIM) in early_update[1], (r, early_update)
        assert stale[0] == "ValueError" and "update_ep_member" in stale[1], (r, stale)
        assert full == "full"
