"""Point-to-point on ``mooncake-cpu``: send/recv/isend/irecv/batch_isend_irecv,
checked against the sent bytes and, for the dtypes gloo takes, against gloo
doing the same exchange. Also tags, ordering, messages larger than the
receive pool, size mismatches and the P2P timeout.

(P2P failures with a dead peer are in test_failures.py.)
"""

import time

import pytest
import torch
import torch.distributed as dist

from _harness import World, outcome
from _refs import GLOO_DTYPES, MOVE_DTYPES, assert_same_bits, dtype_id, make

pytestmark = pytest.mark.timeout(120)

W = 3
SHORT_P2P_TIMEOUT_US = 1_000_000


@pytest.fixture(scope="module")
def world():
    w = World(W)
    yield w
    w.close()


def _group_with_short_p2p_timeout(ctx):
    """A new group over all ranks whose P2P gives up after 1 s without progress
    (the setting is read when a group is created)."""
    ctx.pg.set_p2p_timeout_us(SHORT_P2P_TIMEOUT_US)
    try:
        return dist.new_group()
    finally:
        ctx.pg.set_p2p_timeout_us(30_000_000)




# ---------------------------------------------------------------------------


def _ring_rank(ctx, dtype):
    W, r = ctx.size, ctx.rank
    nxt, prv = (r + 1) % W, (r - 1) % W
    checks = 0
    for n in (1, 1237):
        data = [make(dtype, (n,), ctx.seed("p2p", str(dtype), n, s), "bits") for s in range(W)]
        # isend / irecv around the ring.
        got = torch.empty(n, dtype=dtype)
        works = [dist.isend(data[r], nxt), dist.irecv(got, prv)]
        for w in works:
            w.wait()
            assert w.is_completed()
        assert_same_bits(got, data[prv], f"isend/irecv {dtype} n={n} rank={r}")
        # Blocking send/recv along a chain 0 -> 1 -> ... -> W-1 (each forwards what it got).
        buf = data[0].clone() if r == 0 else torch.empty(n, dtype=dtype)
        if r > 0:
            dist.recv(buf, r - 1)
        if r < W - 1:
            dist.send(buf, r + 1)
        assert_same_bits(buf, data[0], f"send/recv chain {dtype} n={n} rank={r}")
        if dtype in GLOO_DTYPES and not dtype.is_complex:
            ref = torch.empty(n, dtype=dtype)
            works = [dist.isend(data[r], nxt, group=ctx.gloo), dist.irecv(ref, prv, group=ctx.gloo)]
            for w in works:
                w.wait()
            assert_same_bits(got, ref, f"isend/irecv {dtype} n={n} rank={r} (vs gloo)")
        checks += 1
    return checks


@pytest.mark.parametrize("dtype", MOVE_DTYPES, ids=dtype_id)
def test_send_recv_every_dtype(world, dtype):
    assert all(world.run(_ring_rank, dtype))


def _batch_rank(ctx):
    W, r = ctx.size, ctx.rank
    nxt, prv = (r + 1) % W, (r - 1) % W
    data = [make(torch.float32, (4, 301), ctx.seed("batch", s), "sum") for s in range(W)]
    results = {}
    for name, grp in (("mooncake", None), ("gloo", ctx.gloo)):
        from_prev = torch.empty(4, 301)
        from_next = torch.empty(4, 301)
        # Both directions at once, receives listed before sends on odd ranks.
        ops = [
            dist.P2POp(dist.isend, data[r], nxt, group=grp),
            dist.P2POp(dist.isend, data[r] * 2, prv, group=grp),
            dist.P2POp(dist.irecv, from_prev, prv, group=grp),
            dist.P2POp(dist.irecv, from_next, nxt, group=grp),
        ]
        if r % 2:
            ops.reverse()
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        results[name] = (from_prev, from_next)
    assert_same_bits(results["mooncake"][0], data[prv], "batch_isend_irecv from the previous rank")
    assert_same_bits(results["mooncake"][1], data[nxt] * 2, "batch_isend_irecv from the next rank")
    for i in range(2):
        assert_same_bits(results["mooncake"][i], results["gloo"][i], f"batch_isend_irecv [{i}] (vs gloo)")
    return 1


def test_batch_isend_irecv_both_directions(world):
    assert all(world.run(_batch_rank))


def _large_rank(ctx):
    # 20 MiB each way between every pair at once: larger than the 8 MiB
    # receive pool, so messages go through chunk by chunk, in both directions.
    W, r = ctx.size, ctx.rank
    n = 5 << 20  # float32 elements
    data = {(s, d): make(torch.float32, (n,), ctx.seed("big", s, d), "sum") for s in range(W) for d in range(W) if s != d}
    got = {s: torch.empty(n) for s in range(W) if s != r}
    works = []
    for d in range(W):
        if d != r:
            works.append(dist.isend(data[(r, d)], d))
            works.append(dist.irecv(got[d], d))
    for w in works:
        w.wait()
    for s, t in got.items():
        assert_same_bits(t, data[(s, r)], f"20 MiB from rank {s} to rank {r}")
    return 1


def test_messages_larger_than_the_pool(world):
    assert all(world.run(_large_rank, timeout=90))


def _tags_rank(ctx):
    r = ctx.rank
    if r == 0:
        # Tag 7, tag 9, tag 7, then 100 small tag-3 messages (more than the 64 credits of a lane).
        works = [
            dist.isend(torch.full((5,), 1.0), 1, tag=7),
            dist.isend(torch.full((6,), 2.0), 1, tag=9),
            dist.isend(torch.full((5,), 3.0), 1, tag=7),
        ]
        works += [dist.isend(torch.full((3,), float(i)), 1, tag=3) for i in range(100)]
        for w in works:
            w.wait()
        return "sent"
    if r == 1:
        a, b, c = torch.empty(6), torch.empty(5), torch.empty(5)
        works = [dist.irecv(a, 0, tag=9), dist.irecv(b, 0, tag=7), dist.irecv(c, 0, tag=7)]
        many = [torch.empty(3) for _ in range(100)]
        works += [dist.irecv(t, 0, tag=3) for t in many]
        for w in works:
            w.wait()
        return a.tolist(), b.tolist(), c.tolist(), [t[0].item() for t in many]
    return None


def test_tags_match_and_order_is_fifo_per_tag(world):
    res = world.run(_tags_rank)
    a, b, c, many = res[1]
    assert a == [2.0] * 6, "the tag-9 receive, posted first, gets the tag-9 message"
    assert b == [1.0] * 5 and c == [3.0] * 5, "tag-7 messages arrive in the order they were sent"
    assert many == [float(i) for i in range(100)]


def _tag_order_blocking_sender(ctx, backend):
    grp = ctx.gloo if backend == "gloo" else _group_with_short_p2p_timeout(ctx)

    def exchange():
        if ctx.rank == 0:
            dist.send(torch.full((3,), 1.0), 1, tag=1, group=grp)
            dist.send(torch.full((3,), 2.0), 1, tag=2, group=grp)
            return None
        if ctx.rank == 1:
            x, y = torch.empty(3), torch.empty(3)
            wy = dist.irecv(y, 0, tag=2, group=grp)
            wx = dist.irecv(x, 0, tag=1, group=grp)
            wy.wait()
            wx.wait()
            return x.tolist(), y.tolist()
        return None

    return outcome(exchange)


def test_receives_posted_out_of_tag_order_with_a_blocking_sender(world):
    gloo = world.run(_tag_order_blocking_sender, "gloo")
    assert gloo[1][:2] == ("ok", ([1.0] * 3, [2.0] * 3)), gloo  # the reference works
    res = world.run(_tag_order_blocking_sender, "mooncake")
    for rank in (0, 1):
        assert res[rank][0] == "ok", f"rank {rank}: {res[rank][0]}: {res[rank][1]}"
    assert res[1][1] == ([1.0] * 3, [2.0] * 3)


def _mismatch_rank(ctx, sent, expected):
    grp = dist.new_group()  # a mismatch fails only that pair, but keep other tests apart
    r = ctx.rank
    out = {}
    if r == 0:
        out["mismatch"] = outcome(lambda: dist.send(torch.ones(sent), 1, group=grp))
        out["next"] = outcome(lambda: dist.send(torch.full((7,), 5.0), 1, group=grp))
    elif r == 1:
        out["mismatch"] = outcome(lambda: dist.recv(torch.empty(expected), 0, group=grp))
        buf = torch.empty(7)
        out["next"] = outcome(lambda: (dist.recv(buf, 0, group=grp), buf.tolist())[1])
    t = torch.full((2,), float(r))
    dist.all_reduce(t, group=grp)
    out["all_reduce"] = t.tolist()
    return out


@pytest.mark.parametrize("sent, expected", [(10, 12), (12, 10), (3 << 20, 2 << 20)], ids=["short", "long", "multi-chunk"])
def test_size_mismatch_fails_that_pair_only(world, sent, expected):
    res = world.run(_mismatch_rank, sent, expected)
    for rank in (0, 1):
        kind, message, elapsed = res[rank]["mismatch"]
        assert kind == "DistBackendError", (rank, kind, message)
        assert "size mismatch" in message and f"rank {1 - rank}" in message, message
        assert elapsed < 5, elapsed
        assert res[rank]["next"][0] == "ok", res[rank]["next"]
    assert res[1]["next"][1] == [5.0] * 7
    for r in res:
        assert r["all_reduce"] == [3.0, 3.0]


def _zero_bytes_rank(ctx):
    r = ctx.rank
    if r == 0:
        dist.send(torch.empty(0), 1)
        dist.send(torch.empty(0, 4, dtype=torch.int64), 1, tag=5)
    elif r == 1:
        dist.recv(torch.empty(0), 0)
        dist.recv(torch.empty(0, 4, dtype=torch.int64), 0, tag=5)
    # The lane is still in step afterwards.
    if r == 0:
        dist.send(torch.arange(4.0), 1)
        return None
    if r == 1:
        t = torch.empty(4)
        dist.recv(t, 0)
        return t.tolist()
    return None


def test_zero_byte_messages(world):
    assert world.run(_zero_bytes_rank)[1] == [0.0, 1.0, 2.0, 3.0]


def _zero_vs_nonzero_rank(ctx):
    grp = _group_with_short_p2p_timeout(ctx)
    r = ctx.rank
    if r == 0:
        # An empty message, then a 3-element one.
        first = outcome(lambda: dist.send(torch.empty(0), 1, group=grp))
        second = outcome(lambda: dist.send(torch.full((3,), 9.0), 1, group=grp))
        return first[:2], second[:2]
    if r == 1:
        # Receives a 3-element message where the sender's first message is empty.
        a, b = torch.full((3,), -1.0), torch.empty(0)
        first = outcome(lambda: (dist.recv(a, 0, group=grp), a.tolist())[1])
        second = outcome(lambda: dist.recv(b, 0, group=grp))
        return first[:2], second[:2]
    return None


def test_zero_byte_send_against_nonempty_recv_is_a_size_mismatch(world):
    res = world.run(_zero_vs_nonzero_rank)
    first_send, first_recv = res[0][0], res[1][0]
    assert first_send[0] == "DistBackendError" and first_recv[0] == "DistBackendError", (
        f"send of 0 bytes: {first_send}; matching receive of 12 bytes: {first_recv}"
    )


def _noncontig_rank(ctx):
    r = ctx.rank
    src = torch.arange(60.0).reshape(6, 10)
    if r == 0:
        dist.send(src.t(), 1)  # (10, 6), non-contiguous
        dist.send(src[:, ::3], 2)  # (6, 4), strided
        return None
    if r == 1:
        dst = torch.empty(6, 10).t()
        dist.recv(dst, 0)
        return dst.tolist() == src.t().tolist()
    dst = torch.empty(4, 6).t()  # (6, 4), non-contiguous
    dist.recv(dst, 0)
    return dst.tolist() == src[:, ::3].tolist()


def test_non_contiguous_send_and_recv(world):
    res = world.run(_noncontig_rank)
    assert res[1] is True and res[2] is True


def _subgroup_rank(ctx):
    r = ctx.rank
    sub = dist.new_group([1, 2])
    out = None
    if r == 1:
        dist.send(torch.full((4,), 11.0), group=sub, group_dst=1)
        t = torch.empty(4)
        dist.recv(t, group=sub, group_src=1)
        out = t.tolist()
    elif r == 2:
        t = torch.empty(4)
        dist.recv(t, src=1, group=sub)  # the global rank works too
        dist.send(t * 2, dst=1, group=sub)
        out = t.tolist()
    return out


def test_subgroup_p2p_with_group_ranks(world):
    res = world.run(_subgroup_rank)
    assert res[2] == [11.0] * 4 and res[1] == [22.0] * 4


def _interleave_rank(ctx):
    # P2P in flight while collectives run on the same group.
    W, r = ctx.size, ctx.rank
    got = torch.empty(1000)
    recv = dist.irecv(got, (r - 1) % W)
    t = torch.full((10,), float(r))
    dist.all_reduce(t)
    send = dist.isend(torch.full((1000,), float(r)), (r + 1) % W)
    dist.barrier()
    send.wait()
    recv.wait()
    assert torch.equal(got, torch.full((1000,), float((r - 1) % W)))
    assert torch.equal(t, torch.full((10,), float(W * (W - 1) / 2)))
    return 1


def test_p2p_alongside_collectives(world):
    assert all(world.run(_interleave_rank))


def _p2p_timeout_rank(ctx):
    grp = _group_with_short_p2p_timeout(ctx)
    r = ctx.rank
    out = {}
    if r == 0:
        # Nobody sends to rank 0 on this group. A P2P failure is reported by
        # the Work's hint (wait() returns), as the reference's.
        def reported(post):
            start = time.monotonic()
            work = post()
            kind = outcome(work.wait)[0]
            return kind, ctx.pg.get_failed_ranks_hint(work).tolist(), ctx.pg.get_local_success(work), \
                time.monotonic() - start
        out["recv"] = reported(lambda: dist.irecv(torch.empty(3), 1, group=grp))
        # The lanes to rank 1 are closed now: the next message fails at once.
        out["again"] = reported(lambda: dist.isend(torch.empty(3), 1, group=grp))
    dist.barrier()  # on WORLD, after rank 0 is done
    t = torch.full((2,), float(r))
    dist.all_reduce(t, group=grp)  # the group's collectives are not affected
    out["all_reduce"] = t.tolist()
    return out


def test_p2p_timeout(world):
    res = world.run(_p2p_timeout_rank)
    only_rank_1 = [1 if q == 1 else 0 for q in range(len(res))]
    kind, hint, local_success, elapsed = res[0]["recv"]
    assert (kind, hint, local_success) == ("ok", only_rank_1, False), (kind, hint, local_success)
    assert 0.8 <= elapsed <= 4.0, elapsed
    kind, hint, local_success, elapsed = res[0]["again"]
    assert (kind, hint, local_success) == ("ok", only_rank_1, False) and elapsed < 0.5, (kind, hint, elapsed)
    for r in res:
        assert r["all_reduce"] == [3.0, 3.0]
