"""Process groups of ``mooncake-cpu``: initialization, sub-groups, inference
topologies (TP/DP), re-initialization, ``MooncakeBackendOptions`` and the
``mooncake.pg`` helpers."""

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from _harness import World, free_port, run_world, errors_of

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def world4():
    w = World(4)
    yield w
    w.close()


def _tri(n):
    return n * (n - 1) / 2


# ---------------------------------------------------------------------------
# Initialization


def _init_facts(ctx):
    t = torch.full((3,), float(ctx.rank + 1))
    dist.all_reduce(t)
    return {
        "backend": dist.get_backend(),
        "group_type": type(dist.group.WORLD).__name__,
        "rank": dist.get_rank(),
        "size": dist.get_world_size(),
        "sum": t.tolist(),
    }


def test_init_without_pg_options(world4):
    # The harness calls init_process_group("mooncake-cpu", ...) without pg_options.
    for rank, facts in enumerate(world4.run(_init_facts)):
        assert facts == {
            "backend": "mooncake-cpu",
            "group_type": "MooncakeProcessGroup",
            "rank": rank,
            "size": 4,
            "sum": [10.0] * 3,
        }


def _single_rank(ctx):
    t = torch.arange(5.0)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    dist.broadcast(t, src=0)
    out = [torch.empty(5)]
    dist.all_gather(out, t)
    assert out[0].tolist() == t.tolist()
    o = torch.empty(5)
    dist.reduce_scatter_tensor(o, t)
    assert o.tolist() == t.tolist()
    o = torch.empty(5)
    dist.all_to_all_single(o, t)
    assert o.tolist() == t.tolist()
    dist.barrier()
    g = dist.new_group([0])
    dist.all_reduce(t, group=g)
    assert ctx.pg.get_active_ranks(dist.group.WORLD).tolist() == [1]
    objs = [None]
    dist.all_gather_object(objs, {"x": 1})
    assert objs == [{"x": 1}]
    return dist.get_world_size()


def test_world_size_one():
    assert run_world(_single_rank, 1) == [1]


# ---------------------------------------------------------------------------
# Sub-groups


def _even_odd(ctx):
    r = ctx.rank
    even = dist.new_group([0, 2])
    odd = dist.new_group([1, 3])
    mine = even if r % 2 == 0 else odd
    t = torch.full((4,), float(r + 1))
    dist.all_reduce(t, group=mine)
    members = dist.get_process_group_ranks(mine)
    group_sum = t.tolist()
    # Then the whole world again.
    w = torch.full((4,), float(r + 1))
    dist.all_reduce(w)
    return members, group_sum, w.tolist(), dist.get_backend(mine)


def test_even_odd_split_then_world(world4):
    for rank, (members, group_sum, world_sum, backend) in enumerate(world4.run(_even_odd)):
        expected_members = [0, 2] if rank % 2 == 0 else [1, 3]
        assert members == expected_members
        assert group_sum == [float(sum(m + 1 for m in expected_members))] * 4
        assert world_sum == [10.0] * 4
        assert backend == "mooncake-cpu"


def _subgroups(ctx):
    r = ctx.rank
    mine, all_groups = dist.new_subgroups(group_size=2)
    t = torch.full((3,), float(r + 1))
    dist.all_reduce(t, group=mine)
    enum_mine, _ = dist.new_subgroups_by_enumeration([[0, 3], [1, 2]])
    u = torch.full((3,), float(r + 1))
    dist.all_reduce(u, group=enum_mine)
    return dist.get_process_group_ranks(mine), len(all_groups), t.tolist(), dist.get_process_group_ranks(enum_mine), u.tolist()


def test_new_subgroups(world4):
    for rank, (ranks, count, total, enum_ranks, enum_total) in enumerate(world4.run(_subgroups)):
        assert count == 2
        assert ranks == ([0, 1] if rank < 2 else [2, 3])
        assert total == [float(sum(m + 1 for m in ranks))] * 3
        assert enum_ranks == ([0, 3] if rank in (0, 3) else [1, 2])
        assert enum_total == [5.0] * 3


def _local_sync_group(ctx):
    # Only the members call new_group.
    if ctx.rank >= 2:
        return None
    g = dist.new_group([0, 1], use_local_synchronization=True)
    t = torch.full((2,), float(ctx.rank + 1))
    dist.all_reduce(t, group=g)
    return t.tolist()


def test_group_created_by_its_members_only(world4):
    assert world4.run(_local_sync_group) == [[3.0, 3.0], [3.0, 3.0], None, None]


def _topology(ctx, tp_size):
    """Tensor-parallel groups of consecutive ranks, data-parallel groups of
    ranks with the same TP index; created in the same order on all ranks."""
    W, r = ctx.size, ctx.rank
    dp_size = W // tp_size
    tp_groups = [dist.new_group(list(range(i * tp_size, (i + 1) * tp_size))) for i in range(dp_size)]
    dp_groups = [dist.new_group(list(range(j, W, tp_size))) for j in range(tp_size)]
    tp, dp = tp_groups[r // tp_size], dp_groups[r % tp_size]
    tp_ranks, dp_ranks = dist.get_process_group_ranks(tp), dist.get_process_group_ranks(dp)
    x = torch.arange(6.0) + 100 * r

    def member_sum(ranks):
        return (torch.arange(6.0) * len(ranks) + 100 * sum(ranks)).tolist()

    t = x.clone()
    dist.all_reduce(t, group=tp)
    assert t.tolist() == member_sum(tp_ranks), ("TP all_reduce", t)
    t = x.clone()
    dist.all_reduce(t, group=dp)
    assert t.tolist() == member_sum(dp_ranks), ("DP all_reduce", t)

    # broadcast from the last TP member, by group rank (group_src) and by global rank (src).
    t = x.clone()
    dist.broadcast(t, group=tp, group_src=tp_size - 1)
    assert t.tolist() == (torch.arange(6.0) + 100 * tp_ranks[-1]).tolist(), ("TP broadcast group_src", t)
    t = x.clone()
    dist.broadcast(t, src=dp_ranks[0], group=dp)
    assert t.tolist() == (torch.arange(6.0) + 100 * dp_ranks[0]).tolist(), ("DP broadcast src", t)

    # reduce to group rank 1 of DP (group_dst).
    t = x.clone()
    dist.reduce(t, group=dp, group_dst=1)
    if r == dp_ranks[1]:
        assert t.tolist() == member_sum(dp_ranks), ("DP reduce group_dst", t)

    outs = [torch.empty(6) for _ in tp_ranks]
    dist.all_gather(outs, x, group=tp)
    assert [o.tolist() for o in outs] == [(torch.arange(6.0) + 100 * m).tolist() for m in tp_ranks]
    out = torch.empty(len(dp_ranks) * 6)
    dist.all_gather_into_tensor(out, x, group=dp)
    assert out.tolist() == torch.cat([torch.arange(6.0) + 100 * m for m in dp_ranks]).tolist()

    # gather / scatter with group ranks.
    lst = [torch.empty(6) for _ in tp_ranks] if r == tp_ranks[0] else None
    dist.gather(x, lst, group=tp, group_dst=0)
    if lst is not None:
        assert [o.tolist() for o in lst] == [(torch.arange(6.0) + 100 * m).tolist() for m in tp_ranks]
    o = torch.empty(2)
    pieces = [torch.full((2,), float(i)) for i in range(dp_size)] if r == dp_ranks[-1] else None
    dist.scatter(o, pieces, group=dp, group_src=dp_size - 1)
    assert o.tolist() == [float(dp_ranks.index(r))] * 2

    # The whole world still agrees afterwards.
    t = torch.full((2,), float(r))
    dist.all_reduce(t)
    assert t.tolist() == [_tri(W)] * 2
    return tp_ranks, dp_ranks


def test_inference_topology_tp2_dp2(world4):
    res = world4.run(_topology, 2)
    assert [tuple(map(tuple, x)) for x in res] == [
        ((0, 1), (0, 2)),
        ((0, 1), (1, 3)),
        ((2, 3), (0, 2)),
        ((2, 3), (1, 3)),
    ]


def test_inference_topology_tp4_dp2_on_8_ranks():
    res = run_world(_topology, 8, 4, gloo=False, start_timeout=90)
    assert [list(x) for x in res[5]] == [[4, 5, 6, 7], [1, 5]]


def _reinit(ctx, ports):
    """Destroys WORLD and initializes it again in the same processes: first
    with pg_options=None, then with MooncakeBackendOptions(6)."""
    from mooncake import pg

    results = []
    for port, options in zip(ports, [None, pg.MooncakeBackendOptions(6)]):
        dist.destroy_process_group()
        assert not dist.is_initialized()
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group(
            "mooncake-cpu", rank=ctx.rank, world_size=ctx.size, timeout=datetime.timedelta(seconds=30),
            pg_options=options,
        )
        t = torch.full((3,), float(ctx.rank + 1))
        dist.all_reduce(t)
        g = dist.new_group([1, 2])
        u = torch.full((3,), float(ctx.rank))
        if ctx.rank in (1, 2):
            dist.all_reduce(u, group=g)
        # Read before the barrier: once past it, the others may already be
        # leaving the group for the next round.
        active = pg.get_active_ranks(dist.group.WORLD).tolist()
        # Rank 0 hosts the store: it must not tear it down (next round) while
        # ranks 1 and 2 still set their group up through it.
        dist.barrier()
        results.append((t.tolist(), u.tolist(), active))
    return results


def test_destroy_world_and_reinit_in_the_same_processes():
    res = run_world(_reinit, 3, [free_port(), free_port()], gloo=False)
    for rank, rounds in enumerate(res):
        sub = [3.0 if rank else 0.0] * 3
        assert rounds == [
            ([6.0] * 3, sub, [1, 1, 1]),  # pg_options=None
            ([6.0] * 3, sub, [1, 1, 1, 0, 0, 0]),  # MooncakeBackendOptions(max_group_size=6)
        ], (rank, rounds)


# ---------------------------------------------------------------------------
# Helpers and options


def _helpers(ctx):
    pg = ctx.pg
    W = ctx.size
    out = {}
    world = dist.group.WORLD
    active = pg.get_active_ranks(world)
    out["active"] = (str(active.dtype), active.tolist())
    out["synced"] = pg.get_num_synced_ranks(world)
    out["epoch"] = pg.get_current_epoch(world)
    work = dist.all_reduce(torch.ones(3), async_op=True)
    work.wait()
    hint = pg.get_failed_ranks_hint(work)
    out["hint"] = (str(hint.dtype), hint.tolist())
    out["local_success"] = pg.get_local_success(work)
    sub = dist.new_group([0, 1])
    if ctx.rank < 2:
        out["sub_active"] = pg.get_active_ranks(sub).tolist()
        out["sub_synced"] = pg.get_num_synced_ranks(sub)
    # A gloo group or Work is not a Mooncake one.
    out["errors"] = errors_of({
        "get_active_ranks": lambda: pg.get_active_ranks(ctx.gloo),
        "get_num_synced_ranks": lambda: pg.get_num_synced_ranks(ctx.gloo),
        "get_current_epoch": lambda: pg.get_current_epoch(ctx.gloo),
    })
    # None is the default group, as in torch.distributed's calls.
    out["none_is_default"] = pg.get_active_ranks(None).tolist() == pg.get_active_ranks(dist.group.WORLD).tolist()
    gw = dist.all_reduce(torch.ones(3), group=ctx.gloo, async_op=True)
    gw.wait()
    out["gloo_hint"] = pg.get_failed_ranks_hint(gw)
    out["gloo_local_success"] = pg.get_local_success(gw)
    out["W"] = W
    return out


def test_module_helpers(world4):
    for rank, out in enumerate(world4.run(_helpers)):
        assert out["active"] == ("torch.int32", [1, 1, 1, 1])
        assert out["synced"] == 4
        assert out["epoch"] >= 1  # the founding view; epochs only increase
        assert out["hint"] == ("torch.int32", [0, 0, 0, 0])
        assert out["local_success"] is True
        if rank < 2:
            assert out["sub_active"] == [1, 1] and out["sub_synced"] == 2
        for name, (kind, message) in out["errors"].items():
            assert kind == "TypeError", (name, kind, message)
            assert "mooncake" in message, (name, message)
        assert out["errors"]["get_active_ranks"][1].count("gloo") >= 1
        assert out["gloo_hint"] is None
        assert out["none_is_default"]
        assert out["gloo_local_success"] is False


def test_backend_options_overloads():
    from mooncake import pg

    active = torch.zeros(8, dtype=torch.int32)
    for args in [
        (active,),
        (active, True),
        (active, False, 8),
        (8,),
        (8, True),
        (8, False, True, True),
        (8, False, True, False),
        (8, False, False, False),
    ]:
        assert isinstance(pg.MooncakeBackendOptions(*args), pg.MooncakeBackendOptions), args
    # keyword names
    pg.MooncakeBackendOptions(max_group_size=4, is_extension=False, auto_deactivate_on_failure=True,
                              auto_sync_on_failure=False)
    pg.MooncakeBackendOptions(active_ranks=active, is_extension=False, max_group_size=8)

    with pytest.raises(ValueError, match="auto_sync_on_failure requires auto_deactivate_on_failure=true"):
        pg.MooncakeBackendOptions(8, False, False, True)
    with pytest.raises(ValueError, match="active_ranks must be a contiguous int32 tensor"):
        pg.MooncakeBackendOptions(torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="active_ranks must be a contiguous int32 tensor"):
        pg.MooncakeBackendOptions(torch.zeros(8, 2, dtype=torch.int32).t()[0])
    with pytest.raises(ValueError, match="active_ranks must have at least max_group_size elements"):
        pg.MooncakeBackendOptions(torch.zeros(4, dtype=torch.int32), False, 8)
    with pytest.raises(TypeError):
        pg.MooncakeBackendOptions("eight")


def test_module_settings_validate_arguments():
    from mooncake import pg

    with pytest.raises(ValueError, match="host"):
        pg.set_host_ip("")
    with pytest.raises(ValueError, match="positive"):
        pg.set_collective_timeout_us(0)
    with pytest.raises(ValueError, match="negative"):
        pg.set_p2p_timeout_us(-1)
    # The reference's keyword names (`us`), checked through the same refusals.
    with pytest.raises(ValueError, match="positive"):
        pg.set_collective_timeout_us(us=0)
    with pytest.raises(ValueError, match="negative"):
        pg.set_p2p_timeout_us(us=-1)


def _group_options(ctx):
    from mooncake import pg

    r = ctx.rank
    out = {}
    g8 = dist.new_group(pg_options=pg.MooncakeBackendOptions(8))
    t = torch.full((2,), float(r))
    dist.all_reduce(t, group=g8)
    w = dist.all_reduce(torch.ones(1), group=g8, async_op=True)
    w.wait()
    out["max8"] = (pg.get_active_ranks(g8).tolist(), pg.get_num_synced_ranks(g8), t.tolist(),
                   pg.get_failed_ranks_hint(w).tolist())

    mirror = torch.zeros(6, dtype=torch.int32)
    gm = dist.new_group(pg_options=pg.MooncakeBackendOptions(mirror, False, 6))
    out["mirror"] = (mirror.tolist(), pg.get_active_ranks(gm).data_ptr() == mirror.data_ptr())

    ge = dist.new_group(pg_options=pg.MooncakeBackendOptions(4, False))
    gf = dist.new_group(pg_options=pg.MooncakeBackendOptions(4, False, False, False))
    for g in (ge, gf, gm):
        t = torch.full((2,), float(r))
        dist.all_reduce(t, group=g)
        assert t.tolist() == [6.0, 6.0]

    def refused(options):
        try:
            dist.new_group(pg_options=options)
            return ("no exception", "")
        except Exception as e:  # noqa: BLE001
            return (type(e).__name__, str(e))

    out["too_small"] = refused(pg.MooncakeBackendOptions(2))
    out["wrong_type"] = refused(5)
    t = torch.full((2,), float(r))
    dist.all_reduce(t)
    out["after"] = t.tolist()
    return out


def test_backend_options_on_groups(world4):
    for out in world4.run(_group_options):
        active, synced, total, hint = out["max8"]
        assert active == [1, 1, 1, 1, 0, 0, 0, 0] and synced == 4 and total == [6.0, 6.0]
        assert hint == [0] * 8, "the failure hint has one entry per seat (max_group_size)"
        assert out["mirror"] == ([1, 1, 1, 1, 0, 0], True), "the given active_ranks tensor is the group's mirror"
        kind, message = out["too_small"]
        assert kind == "ValueError" and "max_group_size" in message, out["too_small"]
        kind, message = out["wrong_type"]
        assert kind == "TypeError" and "pg_options" in message, out["wrong_type"]
        assert out["after"] == [6.0, 6.0]


def _short_active(ctx):
    from mooncake import pg

    result = errors_of({"new_group": lambda: dist.new_group(
        pg_options=pg.MooncakeBackendOptions(torch.zeros(2, dtype=torch.int32)))})["new_group"]
    t = torch.ones(2)
    dist.all_reduce(t)
    return result, t.tolist()


def test_active_ranks_shorter_than_the_group_is_refused(world4):
    for (kind, message), after in world4.run(_short_active):
        assert after == [4.0, 4.0]
        assert kind == "ValueError" and "active_ranks" in message, (kind, message)


def _cuda_backend(ctx):
    """A "mooncake" group: built, it forms without touching a GPU and takes
    CPU tensors (through its host backend); not built, it raises clearly."""
    box = {}
    result = errors_of({"new_group": lambda: box.setdefault("g", dist.new_group(backend="mooncake"))})["new_group"]
    on_group = None
    if "g" in box:
        u = torch.full((2,), float(ctx.rank))
        dist.all_reduce(u, group=box["g"])
        on_group = u.tolist()
    t = torch.ones(2)
    dist.all_reduce(t)
    return result, on_group, t.tolist(), bool(ctx.pg.SUPPORT_CUDA)


def test_cuda_backend_group(world4):
    for (kind, message), on_group, after, built in world4.run(_cuda_backend):
        if built:
            assert kind == "no exception", (kind, message)
            assert on_group == [6.0, 6.0], on_group
        else:
            assert kind == "RuntimeError" and "not built" in message, (kind, message)
        assert after == [4.0, 4.0]


def _settings_after_init(ctx):
    pg = ctx.pg
    out = {}
    for name, call in {
        "set_transfer_engine": lambda: pg.set_transfer_engine(None),
        "set_host_ip other": lambda: pg.set_host_ip("10.1.2.3"),
        "set_device_filter other": lambda: pg.set_device_filter(["mlx5_0"]),
    }.items():
        try:
            call()
            out[name] = ("no exception", "")
        except Exception as e:  # noqa: BLE001
            out[name] = (type(e).__name__, str(e))
    pg.set_host_ip("127.0.0.1")  # the current value: allowed
    pg.set_device_filter([])
    return out


def test_settings_fixed_once_a_group_exists(world4):
    for out in world4.run(_settings_after_init):
        for name, (kind, message) in out.items():
            assert kind == "RuntimeError", (name, kind, message)
            assert "group" in message, (name, message)


def test_membership_enums_and_response_types_match_the_reference():
    from mooncake import pg

    assert [(e.name, int(e)) for e in (pg.SyncAfterFailureStatus.Reconciled, pg.SyncAfterFailureStatus.NoPending,
                                       pg.SyncAfterFailureStatus.Rejected)] == [
        ("Reconciled", 0), ("NoPending", 1), ("Rejected", 2)]
    assert [(e.name, int(e)) for e in (pg.ProposalStatus.Rejected, pg.ProposalStatus.Applied,
                                       pg.ProposalStatus.AppliedWithDroppedRanks)] == [
        ("Rejected", 0), ("Applied", 1), ("AppliedWithDroppedRanks", 2)]
    assert pg.ViewUpdateStatus is pg.ProposalStatus
    assert not hasattr(pg, "Reconciled")  # no export_values, as in the reference
    for cls, fields in ((pg.SyncAfterFailureResponse, ("status", "reject_reason")),
                        (pg.ProposeViewUpdateResponse, ("status", "new_epoch", "dropped_ranks", "reject_reason"))):
        for f in fields:
            assert isinstance(getattr(cls, f), property), (cls, f)
