"""Every collective of ``mooncake-cpu`` on real processes, world sizes 1-4.

Each rank rebuilds every rank's input from a seed and computes the expected
result itself (see _refs.py); where gloo supports the dtype and operation,
the same call on a gloo group over the same ranks must give the same result.
One world per world size serves the whole module (module-scoped fixture), so
the cost of starting ranks is paid four times.
"""

import time
import warnings

import pytest
import torch
import torch.distributed as dist

from _harness import World
from _refs import (
    COMPLEX_DTYPES,
    GLOO_DTYPES,
    MOVE_DTYPES,
    REDUCE_DTYPES,
    assert_reduced,
    assert_same_bits,
    dtype_id,
    gloo_reduces,
    integer_valued,
    make,
    ops_for,
    purpose_for,
    reduce_op,
    reduce_ref,
)

pytestmark = pytest.mark.timeout(180)

WORLD_SIZES = [1, 2, 3, 4]
SIZES = [1, 1237]
# Just above the one-shot limit (64 KiB): the two-step reduction path.
MEDIUM_BYTES = 64 * 1024 + 4099


def medium(dtype):
    return MEDIUM_BYTES // dtype.itemsize + 1
BIG = 4 << 20  # float32 elements: 16 MiB


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def world(request):
    w = World(request.param)
    yield w
    w.close()


def run_all(world, fn, *args, timeout=90.0):
    """Runs fn on every rank; each returns how many checks it made."""
    counts = world.run(fn, *args, timeout=timeout)
    assert all(c > 0 for c in counts), counts
    return counts


def zeros(n, dtype):
    return torch.zeros(n * dtype.itemsize, dtype=torch.uint8).view(dtype)


def inputs_of(ctx, dtype, shape, purpose, *key):
    """Every rank's input for the check named by `key` (same on all ranks)."""
    return [make(dtype, shape, ctx.seed(*key, r), purpose) for r in range(ctx.size)]


# ---------------------------------------------------------------------------
# all_reduce


def _all_reduce_rank(ctx, dtype, sizes):
    checks = 0
    for op in ops_for(dtype):
        # The two-step (large message) path for two operations per dtype.
        for n in sizes + ([medium(dtype)] if op in ("SUM", "MAX") else []):
            what = f"all_reduce {op} {dtype} n={n} world={ctx.size} rank={ctx.rank}"
            inputs = inputs_of(ctx, dtype, n, purpose_for(op), "ar", str(dtype), op, n)
            t = inputs[ctx.rank].clone()
            dist.all_reduce(t, op=reduce_op(op))
            assert_reduced(t, reduce_ref(inputs, op), what)
            if gloo_reduces(dtype, op):
                g = inputs[ctx.rank].clone()
                dist.all_reduce(g, op=reduce_op(op), group=ctx.gloo)
                assert_reduced(t, g, what + " (vs gloo)")
            checks += 1
    return checks


@pytest.mark.parametrize("dtype", REDUCE_DTYPES + COMPLEX_DTYPES, ids=dtype_id)
def test_all_reduce(world, dtype):
    run_all(world, _all_reduce_rank, dtype, SIZES)


def _nan_rank(ctx):
    checks = 0
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        for n in (5, medium(dtype)) if dtype == torch.float16 else (5,):
            t = (torch.arange(n, dtype=torch.float32) % 1000).to(dtype) + ctx.rank
            if ctx.rank == ctx.size - 1:
                t[3] = float("nan")
            for op in ("MIN", "MAX", "SUM"):
                x = t.clone()
                dist.all_reduce(x, op=reduce_op(op))
                assert torch.isnan(x[3]), f"{op} {dtype}: NaN on rank {ctx.size - 1} did not propagate: {x[3]}"
                assert not torch.isnan(x[:3]).any() and not torch.isnan(x[4:]).any(), f"{op} {dtype}: stray NaN"
                checks += 1
    return checks


def test_all_reduce_nan_propagates(world):
    run_all(world, _nan_rank)


def _half_rounding_rank(ctx):
    # 2048 + 1 + 1 + 1 in float16 (spacing 2 above 2048): accumulating in half
    # precision loses every +1 (2048 + 1 rounds back to 2048); accumulating in
    # float32 and rounding once gives round(2048 + W - 1). Same for bfloat16 at 256.
    checks = 0
    for dtype, base in ((torch.float16, 2048.0), (torch.bfloat16, 256.0)):
        for n in (1, medium(dtype)):
            t = torch.full((n,), base if ctx.rank == 0 else 1.0, dtype=dtype)
            dist.all_reduce(t)
            expected = torch.tensor(base + ctx.size - 1, dtype=torch.float64).to(dtype)
            assert torch.equal(t, expected.expand(n)), (
                f"{dtype} SUM of {base} and {ctx.size - 1} ones: got {t[0].item()}, expected {expected.item()} "
                "(float32 accumulation, rounded once)"
            )
            t = torch.full((n,), base if ctx.rank == 0 else 1.0, dtype=dtype)
            dist.all_reduce(t, op=dist.ReduceOp.AVG)
            expected = torch.tensor((base + ctx.size - 1) / ctx.size, dtype=torch.float32).to(dtype)
            assert torch.equal(t, expected.expand(n)), f"{dtype} AVG: got {t[0].item()}, expected {expected.item()}"
            checks += 1
    return checks


def test_half_precision_sums_round_once(world):
    run_all(world, _half_rounding_rank)


# ---------------------------------------------------------------------------
# broadcast / reduce


def _broadcast_rank(ctx, dtype):
    checks = 0
    for n in SIZES:
        for root in range(ctx.size):
            what = f"broadcast {dtype} n={n} src={root} rank={ctx.rank}"
            inputs = inputs_of(ctx, dtype, (n,), "bits", "bc", str(dtype), n, root)
            t = inputs[ctx.rank].clone()
            dist.broadcast(t, src=root)
            assert_same_bits(t, inputs[root], what)
            if dtype in GLOO_DTYPES:
                g = inputs[ctx.rank].clone()
                dist.broadcast(g, src=root, group=ctx.gloo)
                assert_same_bits(t, g, what + " (vs gloo)")
            checks += 1
    return checks


@pytest.mark.parametrize("dtype", MOVE_DTYPES, ids=dtype_id)
def test_broadcast(world, dtype):
    run_all(world, _broadcast_rank, dtype)


def _reduce_rank(ctx, dtype):
    checks = 0
    for i, op in enumerate(ops_for(dtype)):
        for n in SIZES:
            dst = (i + n) % ctx.size
            what = f"reduce {op} {dtype} n={n} dst={dst} rank={ctx.rank}"
            inputs = inputs_of(ctx, dtype, n, purpose_for(op), "red", str(dtype), op, n)
            t = inputs[ctx.rank].clone()
            dist.reduce(t, dst=dst, op=reduce_op(op))
            if ctx.rank == dst:
                assert_reduced(t, reduce_ref(inputs, op), what)
                if gloo_reduces(dtype, op):
                    g = inputs[ctx.rank].clone()
                    dist.reduce(g, dst=dst, op=reduce_op(op), group=ctx.gloo)
                    assert_reduced(t, g, what + " (vs gloo)")
            elif gloo_reduces(dtype, op):
                dist.reduce(inputs[ctx.rank].clone(), dst=dst, op=reduce_op(op), group=ctx.gloo)
            checks += 1
    return checks


@pytest.mark.parametrize("dtype", REDUCE_DTYPES + COMPLEX_DTYPES, ids=dtype_id)
def test_reduce(world, dtype):
    run_all(world, _reduce_rank, dtype)


# ---------------------------------------------------------------------------
# all_gather (list) / all_gather_into_tensor


def _all_gather_rank(ctx, dtype):
    checks = 0
    W, r = ctx.size, ctx.rank
    for n in SIZES:
        what = f"all_gather {dtype} n={n} rank={r}"
        inputs = inputs_of(ctx, dtype, (n,), "bits", "ag", str(dtype), n)
        outs = [torch.empty(n, dtype=dtype) for _ in range(W)]
        dist.all_gather(outs, inputs[r])
        for s in range(W):
            assert_same_bits(outs[s], inputs[s], f"{what}: block from rank {s}")
        if dtype in GLOO_DTYPES:
            ref = [torch.empty(n, dtype=dtype) for _ in range(W)]
            dist.all_gather(ref, inputs[r], group=ctx.gloo)
            for s in range(W):
                assert_same_bits(outs[s], ref[s], f"{what}: block {s} (vs gloo)")
        # In place: the input is this rank's own entry of the output list.
        outs = [zeros(n, dtype) for _ in range(W)]
        outs[r].copy_(inputs[r])
        dist.all_gather(outs, outs[r])
        for s in range(W):
            assert_same_bits(outs[s], inputs[s], f"{what} (in place): block from rank {s}")
        checks += 1
    return checks


@pytest.mark.parametrize("dtype", MOVE_DTYPES, ids=dtype_id)
def test_all_gather(world, dtype):
    run_all(world, _all_gather_rank, dtype)


def _all_gather_into_tensor_rank(ctx, dtype):
    checks = 0
    W, r = ctx.size, ctx.rank
    for n in SIZES:
        what = f"all_gather_into_tensor {dtype} n={n} rank={r}"
        inputs = inputs_of(ctx, dtype, (2, n), "bits", "agt", str(dtype), n)
        expected = torch.stack(inputs)  # (W, 2, n)
        flat = torch.empty(W * 2 * n, dtype=dtype)
        dist.all_gather_into_tensor(flat, inputs[r])
        assert_same_bits(flat, expected.reshape(-1), what + " (flat output)")
        stacked = torch.empty(W, 2, n, dtype=dtype)
        dist.all_gather_into_tensor(stacked, inputs[r])
        assert_same_bits(stacked, expected, what + " (stacked output)")
        if dtype in GLOO_DTYPES:
            ref = torch.empty(W * 2 * n, dtype=dtype)
            dist.all_gather_into_tensor(ref, inputs[r].reshape(-1), group=ctx.gloo)
            assert_same_bits(flat, ref, what + " (vs gloo)")
        # In place: the input is this rank's chunk of the output (as FSDP does).
        out = zeros(W * 2 * n, dtype)
        chunk = out[r * 2 * n : (r + 1) * 2 * n]
        chunk.copy_(inputs[r].reshape(-1))
        dist.all_gather_into_tensor(out, chunk)
        assert_same_bits(out, expected.reshape(-1), what + " (in place)")
        checks += 1
    return checks


@pytest.mark.parametrize("dtype", MOVE_DTYPES, ids=dtype_id)
def test_all_gather_into_tensor(world, dtype):
    run_all(world, _all_gather_into_tensor_rank, dtype)


# ---------------------------------------------------------------------------
# reduce_scatter (list) / reduce_scatter_tensor


def _reduce_scatter_rank(ctx, dtype):
    checks = 0
    W, r = ctx.size, ctx.rank
    for op in ops_for(dtype):
        for n in SIZES:
            what = f"reduce_scatter {op} {dtype} n={n} rank={r}"
            # inputs[s] is rank s's whole input: W blocks of n.
            inputs = inputs_of(ctx, dtype, (W * n,), purpose_for(op), "rs", str(dtype), op, n)
            expected = reduce_ref([x[r * n : (r + 1) * n] for x in inputs], op)
            mine = inputs[r]

            out = torch.empty(n, dtype=dtype)
            dist.reduce_scatter(out, list(mine.clone().split(n)), op=reduce_op(op))
            assert_reduced(out, expected, what + " (list)")

            # The input list's own entry as the output (in place).
            parts = list(mine.clone().split(n))
            dist.reduce_scatter(parts[r], parts, op=reduce_op(op))
            assert_reduced(parts[r], expected, what + " (list, in place)")

            out_t = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(out_t, mine.clone(), op=reduce_op(op))
            assert_reduced(out_t, expected, what + " (tensor)")

            # The output is this rank's chunk of the input.
            buf = mine.clone()
            chunk = buf[r * n : (r + 1) * n]
            dist.reduce_scatter_tensor(chunk, buf, op=reduce_op(op))
            assert_reduced(chunk, expected, what + " (tensor, in place)")

            if gloo_reduces(dtype, op) and op != "AVG":
                ref = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_tensor(ref, mine.clone(), op=reduce_op(op), group=ctx.gloo)
                assert_reduced(out_t, ref, what + " (vs gloo)")
            checks += 1
    return checks


@pytest.mark.parametrize("dtype", REDUCE_DTYPES + COMPLEX_DTYPES, ids=dtype_id)
def test_reduce_scatter(world, dtype):
    run_all(world, _reduce_scatter_rank, dtype)


# ---------------------------------------------------------------------------
# all_to_all (list) / all_to_all_single


def _all_to_all_rank(ctx, dtype):
    W, r = ctx.size, ctx.rank
    # Rank s sends (s + d) % 3 + n elements to rank d: uneven tensor sizes.
    checks = 0
    for n in (0, 1237):
        def count(s, d):
            return (s + d) % 3 + n

        sent = {s: [make(dtype, count(s, d), ctx.seed("a2a", str(dtype), n, s, d), "bits") for d in range(W)]
                for s in range(W)}
        outs = [torch.empty(count(s, r), dtype=dtype) for s in range(W)]
        dist.all_to_all(outs, sent[r])
        for s in range(W):
            assert_same_bits(outs[s], sent[s][r], f"all_to_all {dtype} n={n} rank={r}: block from rank {s}")
        checks += 1
    return checks


@pytest.mark.parametrize("dtype", MOVE_DTYPES, ids=dtype_id)
def test_all_to_all(world, dtype):
    run_all(world, _all_to_all_rank, dtype)


def _a2a_single_check(ctx, dtype, splits, cols, key, gloo=True):
    """all_to_all_single where rank s sends splits(s, d) rows of `cols` to d."""
    W, r = ctx.size, ctx.rank
    inputs = [make(dtype, (sum(splits(s, d) for d in range(W)), cols), ctx.seed("a2as", key, s), "bits")
              for s in range(W)]

    def block(s, d):  # rows of rank s's input that go to d
        start = sum(splits(s, q) for q in range(d))
        return inputs[s][start : start + splits(s, d)]

    in_splits = [splits(r, d) for d in range(W)]
    out_splits = [splits(s, r) for s in range(W)]
    expected = torch.cat([block(s, r) for s in range(W)])
    out = torch.empty(sum(out_splits), cols, dtype=dtype)
    even = len(set(in_splits)) == 1 and len(set(out_splits)) == 1
    if even and in_splits[0] == out_splits[0]:
        dist.all_to_all_single(out, inputs[r])
    else:
        dist.all_to_all_single(out, inputs[r], output_split_sizes=out_splits, input_split_sizes=in_splits)
    what = f"all_to_all_single {dtype} {key} rank={r} in_splits={in_splits} out_splits={out_splits}"
    assert_same_bits(out, expected, what)
    if gloo and dtype in GLOO_DTYPES:
        ref = torch.empty_like(out)
        dist.all_to_all_single(ref, inputs[r], output_split_sizes=out_splits, input_split_sizes=in_splits,
                               group=ctx.gloo)
        assert_same_bits(out, ref, what + " (vs gloo)")


def _all_to_all_single_rank(ctx, dtype):
    checks = 0
    for rows in (1, 1237):
        _a2a_single_check(ctx, dtype, lambda s, d, rows=rows: rows, 1, f"even{rows}")
        checks += 1
    # Uneven, some zero: rank s sends (s + 2d) % 3 rows of 5 to d.
    _a2a_single_check(ctx, dtype, lambda s, d: (s + 2 * d) % 3, 5, "uneven")
    # Uneven and larger, 1-D rows.
    _a2a_single_check(ctx, dtype, lambda s, d: 1237 * (1 + (s * 3 + d) % 4), 1, "uneven-large")
    return checks + 2


@pytest.mark.parametrize("dtype", MOVE_DTYPES, ids=dtype_id)
def test_all_to_all_single(world, dtype):
    run_all(world, _all_to_all_single_rank, dtype)


# ---------------------------------------------------------------------------
# gather / scatter


def _gather_scatter_rank(ctx, dtype):
    W, r = ctx.size, ctx.rank
    checks = 0
    for n in SIZES:
        for root in range(W):
            what = f"{dtype} n={n} root={root} rank={r}"
            inputs = inputs_of(ctx, dtype, (n,), "bits", "ga", str(dtype), n, root)
            lst = [torch.empty(n, dtype=dtype) for _ in range(W)] if r == root else None
            dist.gather(inputs[r], lst, dst=root)
            if r == root:
                for s in range(W):
                    assert_same_bits(lst[s], inputs[s], f"gather {what}: block from rank {s}")
            # gloo's gather and scatter take no complex tensors (torch does not view them as real there).
            if dtype in GLOO_DTYPES and not dtype.is_complex:
                ref = [torch.empty(n, dtype=dtype) for _ in range(W)] if r == root else None
                dist.gather(inputs[r], ref, dst=root, group=ctx.gloo)
                if r == root:
                    for s in range(W):
                        assert_same_bits(lst[s], ref[s], f"gather {what}: block {s} (vs gloo)")

            pieces = [make(dtype, (n,), ctx.seed("sc", str(dtype), n, root, d), "bits") for d in range(W)]
            out = torch.empty(n, dtype=dtype)
            dist.scatter(out, pieces if r == root else None, src=root)
            assert_same_bits(out, pieces[r], f"scatter {what}")
            if dtype in GLOO_DTYPES and not dtype.is_complex:
                ref = torch.empty(n, dtype=dtype)
                dist.scatter(ref, pieces if r == root else None, src=root, group=ctx.gloo)
                assert_same_bits(out, ref, f"scatter {what} (vs gloo)")
            # In place on the root: its own scatter_list entry is the output.
            own = [p.clone() for p in pieces]
            target = own[r] if r == root else torch.empty(n, dtype=dtype)
            dist.scatter(target, own if r == root else None, src=root)
            assert_same_bits(target, pieces[r], f"scatter {what} (root's entry as output)")
            checks += 1
    return checks


@pytest.mark.parametrize("dtype", MOVE_DTYPES, ids=dtype_id)
def test_gather_scatter(world, dtype):
    run_all(world, _gather_scatter_rank, dtype)


# ---------------------------------------------------------------------------
# barrier, objects


def _barrier_rank(ctx):
    # One rank arrives 0.15 s late each round; nobody may leave a barrier
    # before the last rank entered it.
    entered_late = []
    left = []
    for i in range(2):
        if ctx.rank == (ctx.size - 1 + i) % ctx.size:
            time.sleep(0.15)
        t_in = time.time()
        dist.barrier()
        left.append(time.time())
        entered_late.append(t_in)
    return {"in": entered_late, "out": left}


def test_barrier_waits_for_every_rank(world):
    res = world.run(_barrier_rank)
    for i in range(2):
        last_in = max(r["in"][i] for r in res)
        for rank, r in enumerate(res):
            assert r["out"][i] >= last_in - 0.005, (
                f"round {i}: rank {rank} left the barrier {last_in - r['out'][i]:.3f} s before the last rank entered"
            )


def _objects_rank(ctx):
    W, r = ctx.size, ctx.rank
    mine = {"rank": r, "payload": list(range(r * 3)), "text": "é" * r}
    out = [None] * W
    dist.all_gather_object(out, mine)
    assert out == [{"rank": s, "payload": list(range(s * 3)), "text": "é" * s} for s in range(W)], out

    for src in range(W):
        objs = [f"from {src}", {"k": [src] * 5}] if r == src else [None, None]
        dist.broadcast_object_list(objs, src=src)
        assert objs == [f"from {src}", {"k": [src] * 5}], objs

    dst = W - 1
    got = [None] * W if r == dst else None
    dist.gather_object(("g", r), got, dst=dst)
    if r == dst:
        assert got == [("g", s) for s in range(W)], got

    recv = [None]
    dist.scatter_object_list(recv, [("s", d, "x" * d) for d in range(W)] if r == 0 else None, src=0)
    assert recv == [("s", r, "x" * r)], recv
    return 4


def test_object_collectives(world):
    run_all(world, _objects_rank)


# ---------------------------------------------------------------------------
# async Works, coalesced calls


def _async_rank(ctx):
    W, r = ctx.size, ctx.rank
    f32 = torch.float32
    ins = inputs_of(ctx, f32, (1237,), "sum", "async")
    big = inputs_of(ctx, f32, (W * 300,), "sum", "async-big")
    works = {}

    ar = ins[r].clone()
    works["all_reduce"] = dist.all_reduce(ar, async_op=True)
    bc = ins[r].clone()
    works["broadcast"] = dist.broadcast(bc, src=W - 1, async_op=True)
    agt = torch.empty(W * 1237, dtype=f32)
    works["all_gather_into_tensor"] = dist.all_gather_into_tensor(agt, ins[r], async_op=True)
    ag = [torch.empty(1237, dtype=f32) for _ in range(W)]
    works["all_gather"] = dist.all_gather(ag, ins[r], async_op=True)
    rst = torch.empty(300, dtype=f32)
    works["reduce_scatter_tensor"] = dist.reduce_scatter_tensor(rst, big[r].clone(), async_op=True)
    a2a = torch.empty(W * 300, dtype=f32)
    works["all_to_all_single"] = dist.all_to_all_single(a2a, big[r], async_op=True)
    red = ins[r].clone()
    works["reduce"] = dist.reduce(red, dst=0, async_op=True)
    gl = [torch.empty(1237, dtype=f32) for _ in range(W)] if r == 0 else None
    works["gather"] = dist.gather(ins[r], gl, dst=0, async_op=True)
    sc = torch.empty(300, dtype=f32)
    works["scatter"] = dist.scatter(sc, list(big[0].split(300)) if r == 0 else None, src=0, async_op=True)
    works["barrier"] = dist.barrier(async_op=True)
    # Many in flight at once.
    many = [torch.full((7,), float(r * 100 + i)) for i in range(20)]
    many_works = [dist.all_reduce(t, async_op=True) for t in many]

    # Wait in reverse order of issue, alternating wait() and the future.
    for i, (name, w) in enumerate(reversed(list(works.items()))):
        if i % 2:
            w.wait()
        else:
            value = w.get_future().wait()
            assert isinstance(value, list), (name, type(value))
        assert w.is_completed(), name
        assert ctx.pg.get_local_success(w), name
        assert ctx.pg.get_failed_ranks_hint(w).tolist() == [0] * W, name
    for w in reversed(many_works):
        w.wait()

    assert_reduced(ar, reduce_ref(ins, "SUM"), "async all_reduce")
    value = works["all_reduce"].get_future().value()
    assert len(value) == 1 and value[0].data_ptr() == ar.data_ptr(), "future of all_reduce holds its tensor"
    assert_same_bits(bc, ins[W - 1], "async broadcast")
    assert_same_bits(agt, torch.cat(ins), "async all_gather_into_tensor")
    for s in range(W):
        assert_same_bits(ag[s], ins[s], f"async all_gather block {s}")
    assert_reduced(rst, reduce_ref([x[r * 300 : (r + 1) * 300] for x in big], "SUM"), "async reduce_scatter_tensor")
    assert_same_bits(a2a, torch.cat([x[r * 300 : (r + 1) * 300] for x in big]), "async all_to_all_single")
    if r == 0:
        assert_reduced(red, reduce_ref(ins, "SUM"), "async reduce")
        for s in range(W):
            assert_same_bits(gl[s], ins[s], f"async gather block {s}")
    assert_same_bits(sc, big[0][r * 300 : (r + 1) * 300], "async scatter")
    for i, t in enumerate(many):
        expected = float(sum(s * 100 + i for s in range(W)))
        assert torch.equal(t, torch.full((7,), expected)), (i, t)

    # A future callback sees the completed result.
    t = torch.full((3,), float(r + 1))
    fut = dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0].sum().item())
    assert fut.wait() == 3 * W * (W + 1) / 2
    return len(works) + len(many)


def test_async_works(world):
    run_all(world, _async_rank)


def _coalesced_rank(ctx):
    from torch.distributed.distributed_c10d import _coalescing_manager

    W, r = ctx.size, ctx.rank
    dtypes = [torch.float32, torch.int64, torch.bfloat16, torch.uint8]
    ins = {dt: inputs_of(ctx, dt, (37 + i,), "sum", "coal", str(dt)) for i, dt in enumerate(dtypes)}

    ts = [ins[dt][r].clone() for dt in dtypes]
    with _coalescing_manager(async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t)
    cm.wait()
    for t, dt in zip(ts, dtypes):
        assert_reduced(t, reduce_ref(ins[dt], "SUM"), f"coalesced all_reduce {dt}")

    outs = [torch.empty(W * (37 + i), dtype=dt) for i, dt in enumerate(dtypes)]
    with _coalescing_manager(async_ops=True) as cm:
        for o, dt in zip(outs, dtypes):
            dist.all_gather_into_tensor(o, ins[dt][r])
    cm.wait()
    for o, dt in zip(outs, dtypes):
        assert_same_bits(o, torch.cat(ins[dt]), f"coalesced all_gather_into_tensor {dt}")

    rs_in = {dt: inputs_of(ctx, dt, (W * (5 + i),), "sum", "coal-rs", str(dt)) for i, dt in enumerate(dtypes)}
    outs = [torch.empty(5 + i, dtype=dt) for i, dt in enumerate(dtypes)]
    with _coalescing_manager(async_ops=True) as cm:
        for o, dt in zip(outs, dtypes):
            dist.reduce_scatter_tensor(o, rs_in[dt][r].clone())
    cm.wait()
    for i, (o, dt) in enumerate(zip(outs, dtypes)):
        n = 5 + i
        expected = reduce_ref([x[r * n : (r + 1) * n] for x in rs_in[dt]], "SUM")
        assert_reduced(o, expected, f"coalesced reduce_scatter_tensor {dt}")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ts = [ins[torch.float32][r].clone(), ins[torch.float32][r][:5].clone() * 2]
        dist.all_reduce_coalesced(ts, op=dist.ReduceOp.MAX)
        assert_reduced(ts[0], reduce_ref(ins[torch.float32], "MAX"), "all_reduce_coalesced[0]")
        assert_reduced(ts[1], reduce_ref([x[:5] * 2 for x in ins[torch.float32]], "MAX"), "all_reduce_coalesced[1]")

        # torch requires one dtype across the inputs here.
        a, b = ins[torch.int64][r], ins[torch.int64][r][:9] * 3
        out_lists = [[torch.empty_like(a) for _ in range(W)], [torch.empty_like(b) for _ in range(W)]]
        dist.all_gather_coalesced(out_lists, [a, b])
        for s in range(W):
            assert_same_bits(out_lists[0][s], ins[torch.int64][s], f"all_gather_coalesced[0] block {s}")
            assert_same_bits(out_lists[1][s], ins[torch.int64][s][:9] * 3, f"all_gather_coalesced[1] block {s}")
    return 5


def test_coalesced(world):
    run_all(world, _coalesced_rank)


# ---------------------------------------------------------------------------
# Non-contiguous tensors


def _noncontig_rank(ctx):
    W, r = ctx.size, ctx.rank
    f32 = torch.float32
    base = inputs_of(ctx, f32, (37, 11), "sum", "nc")  # transposes are (11, 37), non-contiguous

    t = base[r].clone().t()
    assert not t.is_contiguous()
    dist.all_reduce(t)
    assert_reduced(t, reduce_ref([x.t() for x in base], "SUM"), "all_reduce on a transposed tensor")

    t = base[r].clone().t()
    dist.broadcast(t, src=W - 1)
    assert_same_bits(t, base[W - 1].t(), "broadcast into a transposed tensor")

    t = base[r].clone().t()
    dist.reduce(t, dst=0, op=dist.ReduceOp.MAX)
    if r == 0:
        assert_reduced(t, reduce_ref([x.t() for x in base], "MAX"), "reduce into a transposed tensor")

    # all_gather_into_tensor: transposed input; output a transposed (non-contiguous) view.
    out = torch.empty(37, W * 11).t()  # (W*11, 37), non-contiguous
    dist.all_gather_into_tensor(out, base[r].t())
    assert_same_bits(out, torch.cat([x.t() for x in base]), "all_gather_into_tensor, non-contiguous in/out")

    outs = [torch.empty(37, 11).t() for _ in range(W)]
    dist.all_gather(outs, base[r].t())
    for s in range(W):
        assert_same_bits(outs[s], base[s].t(), f"all_gather into transposed tensors, block {s}")

    # reduce_scatter_tensor: input (W*11, 37) non-contiguous; output (11, 37) non-contiguous.
    rs_in = inputs_of(ctx, f32, (37, W * 11), "sum", "nc-rs")
    out = torch.empty(37, 11).t()
    dist.reduce_scatter_tensor(out, rs_in[r].t())
    expected = reduce_ref([x.t()[r * 11 : (r + 1) * 11] for x in rs_in], "SUM")
    assert_reduced(out, expected, "reduce_scatter_tensor, non-contiguous in/out")

    outs = torch.empty(37, 11).t()
    dist.reduce_scatter(outs, list(rs_in[r].t().split(11)), op=dist.ReduceOp.SUM)
    assert_reduced(outs, expected, "reduce_scatter list, non-contiguous in/out")

    # all_to_all_single: rows of a transposed tensor.
    a2a_in = inputs_of(ctx, f32, (5, W * 3), "bits", "nc-a2a")
    out = torch.empty(5, W * 3).t()
    dist.all_to_all_single(out, a2a_in[r].t())
    expected = torch.cat([x.t()[r * 3 : (r + 1) * 3] for x in a2a_in])
    assert_same_bits(out, expected, "all_to_all_single, non-contiguous in/out")

    lst = [torch.empty(37, 11).t() for _ in range(W)] if r == 0 else None
    dist.gather(base[r].t(), lst, dst=0)
    if r == 0:
        for s in range(W):
            assert_same_bits(lst[s], base[s].t(), f"gather non-contiguous, block {s}")
    out = torch.empty(37, 11).t()
    dist.scatter(out, [x.t() for x in base] if r == 0 else None, src=0)
    assert_same_bits(out, base[r].t(), "scatter into a transposed tensor")

    outs = [torch.empty(37, 11).t() for _ in range(W)]
    # Rank r sends the same (transposed) tensor to every peer.
    dist.all_to_all(outs, [base[r].t()] * W)
    for s in range(W):
        assert_same_bits(outs[s], base[s].t(), f"all_to_all non-contiguous, block {s}")
    return 10


def test_non_contiguous(world):
    run_all(world, _noncontig_rank)


# ---------------------------------------------------------------------------
# Large messages (several shared-memory rounds) and empty ones


def _large_rank(ctx, which):
    W, r = ctx.size, ctx.rank
    ins = [integer_valued(BIG, ctx.seed("big", which, s)) for s in range(W)]
    x = ins[r]
    if which == "all_reduce":
        t = x.clone()
        dist.all_reduce(t)
        g = x.clone()
        dist.all_reduce(g, group=ctx.gloo)
        expected = reduce_ref(ins, "SUM")
        assert_reduced(t, expected, "16 MiB all_reduce", exact=True)
        assert_reduced(t, g, "16 MiB all_reduce (vs gloo)", exact=True)
    elif which == "all_gather_into_tensor":
        out = torch.empty(W * BIG)
        dist.all_gather_into_tensor(out, x)
        assert_same_bits(out, torch.cat(ins), "16 MiB all_gather_into_tensor")
        ref = torch.empty(W * BIG)
        dist.all_gather_into_tensor(ref, x, group=ctx.gloo)
        assert_same_bits(out, ref, "16 MiB all_gather_into_tensor (vs gloo)")
    elif which == "reduce_scatter_tensor":
        n = BIG // W
        out = torch.empty(n)
        dist.reduce_scatter_tensor(out, x.clone())
        expected = reduce_ref([y[r * n : (r + 1) * n] for y in ins], "SUM")
        assert_reduced(out, expected, "16 MiB reduce_scatter_tensor", exact=True)
        ref = torch.empty(n)
        dist.reduce_scatter_tensor(ref, x.clone(), group=ctx.gloo)
        assert_reduced(out, ref, "16 MiB reduce_scatter_tensor (vs gloo)", exact=True)
    elif which == "broadcast":
        t = x.clone()
        dist.broadcast(t, src=W - 1)
        assert_same_bits(t, ins[W - 1], "16 MiB broadcast")
        g = x.clone()
        dist.broadcast(g, src=W - 1, group=ctx.gloo)
        assert_same_bits(t, g, "16 MiB broadcast (vs gloo)")
    elif which == "all_to_all_single":
        _a2a_single_check(ctx, torch.float32, lambda s, d: BIG // W, 1, "16MiB-even")
        # Uneven, blocks from 0.6 MB to 4.8 MB: several rounds, peers finishing at different rounds.
        _a2a_single_check(ctx, torch.float32, lambda s, d: 150_001 * (1 + (s + 3 * d) % 8), 1, "uneven-MB")
    return 1


@pytest.mark.parametrize(
    "which", ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "all_to_all_single"]
)
def test_16mib_float32(world, which):
    if world.size not in (2, 4):
        pytest.skip("16 MiB messages run at world sizes 2 and 4")
    run_all(world, _large_rank, which, timeout=120)


def _large_half_rank(ctx):
    # bfloat16 over several 4 MiB rounds with an odd count that W=3 does not divide.
    W, r = ctx.size, ctx.rank
    n = 3_000_001
    ins = [make(torch.bfloat16, n, ctx.seed("bf16-big", s), "sum") for s in range(W)]
    t = ins[r].clone()
    dist.all_reduce(t)
    assert_reduced(t, reduce_ref(ins, "SUM"), "bf16 multi-round all_reduce")
    m = 1_000_003
    rs_ins = [make(torch.bfloat16, W * m, ctx.seed("bf16-rs", s), "sum") for s in range(W)]
    out = torch.empty(m, dtype=torch.bfloat16)
    dist.reduce_scatter_tensor(out, rs_ins[r])
    assert_reduced(out, reduce_ref([x[r * m : (r + 1) * m] for x in rs_ins], "SUM"), "bf16 multi-round reduce_scatter")
    return 2


def test_multi_round_bfloat16(world):
    if world.size != 3:
        pytest.skip("runs at world size 3 (segments that do not divide evenly)")
    run_all(world, _large_half_rank, timeout=120)


def _empty_rank(ctx):
    W = ctx.size
    e = torch.empty(0)
    dist.all_reduce(e)
    dist.broadcast(e, src=0)
    out = torch.empty(0)
    dist.all_gather_into_tensor(out, e)
    dist.reduce_scatter_tensor(torch.empty(0), torch.empty(0))
    dist.all_to_all_single(torch.empty(0), torch.empty(0))
    outs = [torch.empty(0) for _ in range(W)]
    dist.all_gather(outs, e)
    assert out.numel() == 0 and all(o.numel() == 0 for o in outs)
    # The group still works.
    t = torch.full((3,), float(ctx.rank))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(W * (W - 1) / 2))), t
    return 1


def test_empty_tensors(world):
    run_all(world, _empty_rank)
