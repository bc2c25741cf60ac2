"""ElasticBuffer's ``"nccl"`` transport on GPUs: the grid against the dense
reference, the same bits as the collective path, and a dead rank bounded.

NCCL refuses two ranks on one GPU, so these need a GPU per rank (two at
least) and NCCL >= 2.30.4 loaded in the process (torch 2.11 loads 2.28.9:
preload the wheel's, ``LD_PRELOAD=.../nvidia/nccl/lib/libnccl.so.2`` of
``nvidia-nccl-cu13==2.32.6``; docs/ep-elastic.md). Written to run on such a
machine (issue 18); they have not run yet."""

import pytest
import torch

from _elastic_refs import GRID
from _elastic_rounds import dies_between_calls, elastic_buffer_of, run_elastic_round
from _ep_rounds import RANK_ENV
from _harness import World


def _why_not() -> str:
    if torch.cuda.device_count() < 2:
        return (f"needs 2 GPUs or more ({torch.cuda.device_count()} here): NCCL refuses two ranks on one GPU "
                "(CI has none)")
    from mooncake._ep_elastic import nccl_support

    return nccl_support.problem()


WHY_NOT = _why_not()
pytestmark = [pytest.mark.timeout(300), pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "-")]
# One rank per GPU, at most 4.
WORLD = min(4, torch.cuda.device_count())
SIZES = {"num_max_tokens_per_rank": 7, "hidden": 7168, "num_topk": 9}  # the grid's largest call


def _grid_on_nccl(ctx):
    buffer = elastic_buffer_of(ctx, "nccl", transport="nccl", **SIZES)
    done = [run_elastic_round(ctx, ec, expand=expand, cpu_sync=sync, buffer_name="nccl", device="cuda")
            for ec in GRID for expand in (False, True) for sync in (True, False)]
    return done, buffer.transport, buffer.path, buffer.path_reason


def test_elastic_grid_on_the_nccl_transport():
    """Every output against the dense reference (_elastic_rounds' checks)."""
    with World(WORLD, gloo=False, env=RANK_ENV, backend="mooncake") as world:
        got = world.run(_grid_on_nccl, timeout=240)
    assert all((t, p) == ("nccl", "nccl") for _, t, p, _ in got), [why for *_, why in got]
    assert any(sum(done) for done, *_ in got)


def _nccl_against_collective(ctx):
    from _elastic_refs import ElasticCase
    from _ep_refs import Case, inputs_of

    nccl = elastic_buffer_of(ctx, "nccl", transport="nccl", **SIZES)
    collective = elastic_buffer_of(ctx, "collective", transport="ibgda")  # unsized: the collective path
    same = []
    for ec in (ElasticCase(Case(hidden=7168, experts_per_rank=3, num_topk=9, tokens=7, seed=s)) for s in (1, 2)):
        inp = inputs_of(ec.base, ctx.rank, ctx.size)
        x, idx, w = inp.x.cuda(), inp.topk_idx.cuda(), inp.topk_weights.cuda()
        outs = []
        for buf in (nccl, collective):
            recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                                               num_experts=ec.base.experts_per_rank * ctx.size)
            combined, _, _ = buf.combine((recv_x.float() * 1.5).to(torch.bfloat16), handle)
            outs.append((recv_x, recv_idx, recv_w, handle.recv_src_metadata, combined))
        same.append(all(torch.equal(a, b) for a, b in zip(*outs)))
    return nccl.path, collective.path, same


def test_the_nccl_transport_gives_the_collective_paths_bits():
    with World(WORLD, gloo=False, env=RANK_ENV, backend="mooncake") as world:
        got = world.run(_nccl_against_collective, timeout=240)
    assert got == [("nccl", "collective", [True, True])] * WORLD


def test_a_dead_rank_is_bounded_by_the_gpu_timeout():
    """No process watchdog here (NCCL has none to feed the kernels): the
    survivors' kernels give the dead rank up at num_gpu_timeout_secs (5 s),
    the call raises naming update_ep_member(), and later calls are refused."""
    victim = WORLD - 1
    with World(WORLD, gloo=False, env=RANK_ENV, backend="mooncake") as world:
        got = world.run(dies_between_calls, victim, allow_dead=(victim,), timeout=120, transport="nccl")
    assert got[victim] is None
    for r in range(WORLD - 1):
        path, outcomes = got[r]
        assert path == "nccl", got[r]
        for kind, message, took in outcomes:
            assert kind == "RuntimeError" and "update_ep_member" in message, (r, outcomes)
            assert took < 15.0, f"rank {r} took {took:.1f} s"
