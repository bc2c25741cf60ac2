"""Backend ``"mooncake"`` on CUDA tensors, several ranks sharing one GPU.

Every rank rebuilds every rank's input from a seed and computes the expected
result on the CPU (see _refs.py). Covered: every collective on the CUDA IPC
plane (active seats 0..n-1 of one host) and on the staged path (operations
and layouts the plane does not take, P2P), integer sums and products past
the dtype's range (wrapping, as torch's own arithmetic), stream semantics (ordering after
prior work on the current stream, async work waited on another stream), a
CUDA graph capture replayed with new inputs, and a rank killed during a
collective (the survivors' Work fails with a hint naming it, and their next
collectives are correct over the survivors, holes included).

Skipped, with the reason, where there is no GPU or the build has no CUDA
backend. Run on the GPU host:

    PYTHONPATH=python python3 -m pytest -q tests/python/pg/test_cuda.py
"""

import os
import time

import pytest
import torch
import torch.distributed as dist

from _harness import World
from _refs import assert_reduced, assert_same_bits, integer_valued, make, reduce_op, reduce_ref


def _cuda_backend_built() -> bool:
    try:
        from mooncake import pg
    except ImportError:
        return False
    return bool(getattr(pg, "SUPPORT_CUDA", False))


pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
    pytest.mark.skipif(not _cuda_backend_built(), reason="mooncake.pg was built without the CUDA backend"),
]

# Small (one step), just above the one-shot limit (256 KiB: reduce-scatter +
# all-gather), and several pipeline rounds of the 64 MiB staging halves.
SIZES = [1, 1237, 70_001]
LARGE = 20_000_003  # float32: 80 MB, two rounds of the 32 MiB halves
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
# A CUDA IPC plane that cannot be opened raises instead of staging quietly:
# the IPC-plane tests must not pass on the staged path (the staged tests stage
# by the operation's kind, which this does not affect).
REQUIRE_IPC = {"MOONCAKE_PG_REQUIRE_CUDA_IPC": "1"}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def world(request):
    w = World(request.param, backend="mooncake", gloo=False, start_timeout=120, init_timeout_s=60, env=REQUIRE_IPC)
    yield w
    w.close()


def inputs_of(ctx, dtype, n, *tag, purpose="sum"):
    return [make(dtype, (n,), ctx.seed(*tag, q), purpose) for q in range(ctx.size)]


def _collectives_rank(ctx, dtype):
    dev = torch.device("cuda", torch.cuda.current_device())
    checks = 0
    for n in SIZES + ([LARGE] if dtype == torch.float32 else []):
        for op in ("SUM", "MAX", "AVG") if dtype.is_floating_point else ("SUM", "MIN", "BXOR"):
            what = f"all_reduce {op} {dtype} n={n} rank={ctx.rank}"
            purpose = {"SUM": "sum", "AVG": "sum"}.get(op, "minmax")
            if n == LARGE:
                ins = [integer_valued((n,), ctx.seed("ar", q), dtype, bound=100) for q in range(ctx.size)]
            else:
                ins = inputs_of(ctx, dtype, n, "ar", str(dtype), op, purpose=purpose)
            t = ins[ctx.rank].to(dev)
            dist.all_reduce(t, op=reduce_op(op))
            assert_reduced(t.cpu(), reduce_ref(ins, op), what)
            checks += 1
            if n == LARGE:
                break
        ins = inputs_of(ctx, dtype, n, "bc", str(dtype))
        for root in range(ctx.size):
            t = ins[ctx.rank].to(dev)
            dist.broadcast(t, src=root)
            assert_same_bits(t.cpu(), ins[root], f"broadcast root={root} {dtype} n={n}")
        t = ins[ctx.rank].to(dev)
        dist.reduce(t, dst=ctx.size - 1)
        if ctx.rank == ctx.size - 1:
            assert_reduced(t.cpu(), reduce_ref(ins, "SUM"), f"reduce {dtype} n={n}")
        out = torch.empty(n * ctx.size, dtype=dtype, device=dev)
        dist.all_gather_into_tensor(out, ins[ctx.rank].to(dev))
        assert_same_bits(out.cpu(), torch.cat(ins), f"all_gather_into_tensor {dtype} n={n}")
        lst = [torch.empty(n, dtype=dtype, device=dev) for _ in range(ctx.size)]
        dist.all_gather(lst, ins[ctx.rank].to(dev))
        for q in range(ctx.size):
            assert_same_bits(lst[q].cpu(), ins[q], f"all_gather[{q}] {dtype} n={n}")
        big = inputs_of(ctx, dtype, n * ctx.size, "rs", str(dtype))
        out = torch.empty(n, dtype=dtype, device=dev)
        dist.reduce_scatter_tensor(out, big[ctx.rank].to(dev))
        expect = reduce_ref(big, "SUM")[ctx.rank * n:(ctx.rank + 1) * n]
        assert_reduced(out.cpu(), expect, f"reduce_scatter_tensor {dtype} n={n}")
        out = torch.empty(n, dtype=dtype, device=dev)
        dist.reduce_scatter(out, list(big[ctx.rank].to(dev).chunk(ctx.size)))
        assert_reduced(out.cpu(), expect, f"reduce_scatter {dtype} n={n}")
        # Uneven all_to_all_single: rank r sends (r + q) % 3 + 1 rows of n/8+1 to q.
        row = n // 8 + 1
        splits = [[(r + q) % 3 + 1 for q in range(ctx.size)] for r in range(ctx.size)]
        sends = [make(dtype, (sum(splits[r]), row), ctx.seed("a2a", str(dtype), n, r)) for r in range(ctx.size)]
        recv_rows = [splits[q][ctx.rank] for q in range(ctx.size)]
        out = torch.empty(sum(recv_rows), row, dtype=dtype, device=dev)
        dist.all_to_all_single(out, sends[ctx.rank].to(dev), recv_rows, splits[ctx.rank])
        expect = torch.cat([sends[q][sum(splits[q][: ctx.rank]):sum(splits[q][: ctx.rank + 1])] for q in range(ctx.size)])
        assert_same_bits(out.cpu(), expect, f"all_to_all_single {dtype} n={n}")
        checks += 8
    return checks


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_collectives_on_the_ipc_plane(world, dtype):
    assert all(c > 0 for c in world.run(_collectives_rank, dtype, timeout=240))


def _wrapping_inputs(dtype, n, rank, op):
    """Rank `rank`'s input: for SUM, values within a few of the top (even
    elements) or the bottom (odd ones) of `dtype`'s range, so that any two
    ranks' sum overflows; for PRODUCT, values just above the square root of
    the top, so that any two ranks' product does."""
    info = torch.iinfo(dtype)
    i = torch.arange(n, dtype=torch.int64)
    offset = (i * 7 + rank * 3) % 5
    if op == "SUM":
        values = torch.where(i % 2 == 0, info.max - offset, info.min + offset)
    else:
        root = int(info.max**0.5) + 1
        values = root + offset
    return values.to(dtype)


def _integer_wrapping_rank(ctx):
    """Integer SUM and PRODUCT all_reduce past the dtype's range: torch (and
    Gloo) wrap around, and so must the CUDA fold; on the fused small path
    (one step) and on the reduce-scatter + all-gather path."""
    dev = torch.device("cuda", torch.cuda.current_device())
    checks = 0
    for dtype in (torch.int8, torch.int32, torch.int64):
        for n in (SIZES[1], SIZES[2]):
            for op in ("SUM", "PRODUCT"):
                ins = [_wrapping_inputs(dtype, n, q, op) for q in range(ctx.size)]
                # torch's own elementwise + and * on the CPU, which wrap.
                expect = ins[0].clone()
                for other in ins[1:]:
                    expect = expect + other if op == "SUM" else expect * other
                t = ins[ctx.rank].to(dev)
                dist.all_reduce(t, op=reduce_op(op))
                assert_same_bits(t.cpu(), expect, f"all_reduce {op} {dtype} n={n} past the range, rank={ctx.rank}")
                checks += 1
    return checks


def test_integer_sums_and_products_wrap_as_torch_does(world):
    assert all(c > 0 for c in world.run(_integer_wrapping_rank, timeout=120))


def _staged_rank(ctx):
    """What the IPC plane does not take: list all_to_all, gather, scatter,
    coalesced all_gather, non-contiguous tensors."""
    dev = torch.device("cuda", torch.cuda.current_device())
    W, r = ctx.size, ctx.rank
    ins = inputs_of(ctx, torch.float32, 33, "st")
    # Non-contiguous: every other element of a (33, 2) tensor.
    base = torch.zeros(33, 2, device=dev)
    base[:, 0] = ins[r].to(dev)
    view = base[:, 0]
    assert not view.is_contiguous()
    dist.all_reduce(view)
    assert_reduced(view.cpu(), reduce_ref(ins, "SUM"), "all_reduce of a strided view")
    assert torch.equal(base[:, 1].cpu(), torch.zeros(33)), "all_reduce wrote outside the view"
    pieces = [make(torch.int32, (q + 2,), ctx.seed("a2a-list", r, q)) for q in range(W)]
    out = [torch.empty(r + 2, dtype=torch.int32, device=dev) for _ in range(W)]
    dist.all_to_all(out, [p.to(dev) for p in pieces])
    for q in range(W):
        assert_same_bits(out[q].cpu(), make(torch.int32, (r + 2,), ctx.seed("a2a-list", q, r)), f"all_to_all from {q}")
    root = W - 1
    gl = [torch.empty(33, device=dev) for _ in range(W)] if r == root else None
    dist.gather(ins[r].to(dev), gl, dst=root)
    if r == root:
        for q in range(W):
            assert_same_bits(gl[q].cpu(), ins[q], f"gather from {q}")
    sl = [make(torch.float32, (9,), ctx.seed("sc", q)).to(dev) for q in range(W)] if r == 0 else None
    got = torch.empty(9, device=dev)
    dist.scatter(got, sl, src=0)
    assert_same_bits(got.cpu(), make(torch.float32, (9,), ctx.seed("sc", r)), "scatter")
    return True


def test_staged_operations(world):
    assert all(world.run(_staged_rank, timeout=120))


def _p2p_rank(ctx):
    """Messages between ring neighbours arrive in order, and a receive on a
    side stream is ordered for the current stream by Work.wait()."""
    dev = torch.device("cuda", torch.cuda.current_device())
    W, r = ctx.size, ctx.rank
    nxt, prv = (r + 1) % W, (r - 1) % W
    msgs = 5
    for k in range(msgs):
        ops = [
            dist.P2POp(dist.isend, torch.full((1000 + k,), float(r * 100 + k), device=dev), nxt),
            dist.P2POp(dist.irecv, got := torch.empty(1000 + k, device=dev), prv),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        assert torch.equal(got.cpu(), torch.full((1000 + k,), float(prv * 100 + k))), f"message {k} from {prv}"
    if W >= 2:
        if r == 0:
            sends = [dist.isend(torch.full((4096,), float(k), device=dev), 1) for k in range(3)]
            for w in sends:
                w.wait()
        elif r == 1:
            bufs = [torch.empty(4096, device=dev) for _ in range(3)]
            works = [dist.irecv(b, 0) for b in bufs]
            for k, (w, b) in enumerate(zip(works, bufs)):
                w.wait()
                assert torch.equal(b.cpu(), torch.full((4096,), float(k))), f"isend/irecv order: message {k}"
    return True


def test_p2p(world):
    assert all(world.run(_p2p_rank, timeout=120))


def _stream_semantics_rank(ctx):
    dev = torch.device("cuda", torch.cuda.current_device())
    W = ctx.size
    n = 1 << 22
    # Prior work on the current stream (a long chain of kernels) must be
    # finished before the collective reads the tensor.
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        t = torch.zeros(n, device=dev)
        for _ in range(50):
            t.add_(1.0)
        work = dist.all_reduce(t, async_op=True)
    # Another stream waits for the result through Work.wait().
    work.wait()
    total = t.sum().item()
    assert total == float(50 * W * n), f"all_reduce after 50 adds on a side stream: sum {total}"
    # Host not blocked: launching 20 async all_reduces returns before they finish.
    ts = [torch.full((1 << 20,), float(ctx.rank + 1), device=dev) for _ in range(20)]
    works = [dist.all_reduce(x, async_op=True) for x in ts]
    for w in works:
        w.wait()
    torch.cuda.synchronize()
    expect = float(W * (W + 1) // 2)
    assert all(torch.all(x == expect).item() for x in ts), "async all_reduces"
    assert all(ctx.pg.get_local_success(w) for w in works)
    return True


def test_stream_semantics_and_async_work(world):
    assert all(world.run(_stream_semantics_rank, timeout=120))


def _barrier_rank(ctx):
    """dist.barrier() returns after the work each rank queued before it on
    its current stream has run (NCCL's and the reference's semantics): a
    slow kernel (about 0.1 s of GPU cycles), then a write, then the barrier;
    afterwards the stream is idle, without any synchronisation by the test.
    A barrier that met on the host alone would return with the kernel still
    running."""
    dev = torch.device("cuda", torch.cuda.current_device())
    flag = torch.zeros(1, device=dev)
    torch.cuda._sleep(int(2e8))
    flag.fill_(1.0)
    dist.barrier()
    idle = torch.cuda.current_stream().query()
    return idle, flag.item()


def test_barrier_waits_for_the_work_queued_before_it(world):
    results = world.run(_barrier_rank, timeout=120)
    assert all(idle and flag == 1.0 for idle, flag in results), results


def _graph_rank(ctx):
    dev = torch.device("cuda", torch.cuda.current_device())
    W, r = ctx.size, ctx.rank
    static = torch.zeros(100_000, device=dev)
    gathered = torch.empty(100_000 * W, device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        dist.all_reduce(static)  # warm up: the plane opens outside the capture
        dist.all_gather_into_tensor(gathered, static)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static.mul_(2.0)
        dist.all_reduce(static)
        dist.all_gather_into_tensor(gathered, static)
    for it in range(3):
        static.fill_(float(r + it))
        graph.replay()
        torch.cuda.synchronize()
        expect = sum(2.0 * (q + it) for q in range(W))
        assert torch.all(static == expect).item(), f"replay {it}: all_reduce gave {static[0].item()}, expected {expect}"
        assert torch.all(gathered == expect).item(), f"replay {it}: all_gather"
    return True


def test_cuda_graph_capture_and_replay(world):
    assert all(world.run(_graph_rank, timeout=120))


def _cpu_tensors_rank(ctx):
    """CPU tensors on a "mooncake" group go to the host backend (torch's
    object collectives rely on it)."""
    t = torch.full((10,), float(ctx.rank + 1))
    dist.all_reduce(t)
    objs = [{"from": ctx.rank}] if ctx.rank == 0 else [None]
    dist.broadcast_object_list(objs, src=0)
    return t[0].item(), objs[0]


def test_cpu_tensors_on_a_cuda_group(world):
    expect = float(world.size * (world.size + 1) // 2)
    for value, obj in world.run(_cpu_tensors_rank, timeout=60):
        assert value == expect and obj == {"from": 0}


def _bad_input_rank(ctx):
    errors = {}
    try:
        dist.all_reduce(torch.ones(3, device="cuda", dtype=torch.float8_e4m3fn))
    except Exception as e:  # noqa: BLE001
        errors["fp8"] = (type(e).__name__, str(e))
    try:
        dist.all_gather_into_tensor(torch.empty(3 * ctx.size, device="cuda"), torch.ones(3, device="cuda", dtype=torch.int32))
    except Exception as e:  # noqa: BLE001
        errors["dtype"] = (type(e).__name__, str(e))
    # The group is still usable after the rejected calls.
    t = torch.ones(3, device="cuda")
    dist.all_reduce(t)
    errors["after"] = t[0].item()
    return errors


def test_bad_input(world):
    for errors in world.run(_bad_input_rank, timeout=60):
        assert errors["fp8"][0] == "TypeError" and "float8" in errors["fp8"][1].lower(), errors
        assert errors["dtype"][0] == "TypeError" and "dtype" in errors["dtype"][1], errors
        assert errors["after"] == world.size


# ---------------------------------------------------------------------------
# A rank killed during a collective.


def _kill_rank(ctx, victim):
    dev = torch.device("cuda", torch.cuda.current_device())
    W, r = ctx.size, ctx.rank
    warm = torch.ones(1000, device=dev)
    dist.all_reduce(warm)
    torch.cuda.synchronize()
    if r == victim:
        time.sleep(0.5)
        os._exit(0)  # dies while the others wait in the collective
    t = torch.full((1 << 20,), float(r + 1), device=dev)
    work = dist.all_reduce(t, async_op=True)
    start = time.monotonic()
    ok = ctx.pg.get_local_success(work)
    hint = ctx.pg.get_failed_ranks_hint(work).tolist()
    waited = time.monotonic() - start
    # The survivors' next collectives run over the survivors.
    deadline = time.monotonic() + 20
    survivors = [q for q in range(W) if q != victim]
    while True:
        active = ctx.pg.get_active_ranks(dist.group.WORLD).tolist()
        if active[victim] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    x = torch.full((4096,), float(r + 1), device=dev)
    dist.all_reduce(x)
    y = torch.full((70_001,), float(r + 1), device=dev)
    dist.all_reduce(y)
    return {
        "mask_device": str(ctx.pg.get_active_ranks(dist.group.WORLD).device),
        "ok": ok,
        "hint": hint,
        "waited": waited,
        "active": active,
        "small": x[0].item(),
        "large_all": bool(torch.all(y == y[0]).item()),
        "large": y[0].item(),
        "expect": float(sum(q + 1 for q in survivors)),
    }


def _cuda_mask_options(rank, size):
    """The live mask in a CUDA tensor of the user's (the reference allows CPU or CUDA)."""
    from mooncake import pg

    return pg.MooncakeBackendOptions(torch.ones(size, dtype=torch.int32, device="cuda"))


@pytest.mark.parametrize("size,victim,options", [(2, 1, None), (3, 1, _cuda_mask_options)],
                         ids=["world2-last", "world3-hole-cuda-mask"])
def test_rank_killed_during_collective(size, victim, options):
    env = {"MOONCAKE_PG_HEARTBEAT_TIMEOUT_MS": "1000", **REQUIRE_IPC}
    with World(size, backend="mooncake", gloo=False, start_timeout=120, env=env, pg_options=options) as w:
        results = w.run(_kill_rank, victim, timeout=120, allow_dead=(victim,))
    for r, res in enumerate(results):
        if r == victim:
            continue
        assert res["ok"] is False, f"rank {r}: the failed collective reported local success"
        assert res["hint"][victim] == 1, f"rank {r}: hint {res['hint']} does not name rank {victim}"
        assert res["active"][victim] == 0, f"rank {r}: rank {victim} still active: {res['active']}"
        assert res["small"] == res["expect"], f"rank {r}: next all_reduce gave {res['small']}, expected {res['expect']}"
        assert res["large_all"] and res["large"] == res["expect"], f"rank {r}: large all_reduce {res['large']}"
        assert res["mask_device"].startswith("cuda" if options else "cpu"), res["mask_device"]
        assert res["waited"] < 30, f"rank {r}: the failure took {res['waited']:.1f} s to surface"


def _sized_for_the_survivors(ctx, victim):
    dev = torch.device("cuda", torch.cuda.current_device())
    r = ctx.rank

    def gather_and_scatter(w):
        gathered = torch.zeros(2 * w, device=dev)
        dist.all_gather_into_tensor(gathered, torch.full((2,), float(r), device=dev))
        scattered = torch.zeros(2, device=dev)
        dist.reduce_scatter_tensor(scattered, torch.arange(2.0 * w, device=dev) + 10 * r)
        return gathered.tolist(), scattered.tolist()

    full = gather_and_scatter(ctx.size)
    dist.barrier()
    if r == victim:
        os._exit(17)
    # At once, before this rank may have seen the death: sized for the survivors.
    return full, gather_and_scatter(ctx.size - 1)


def test_calls_sized_for_the_survivors_wait_for_the_settled_view():
    # Issue 19 §1 on CUDA tensors (the backend's own size checks): the last
    # seat dies; the survivors' calls sized for 2 wait for the view without
    # it and give the survivors' values.
    env = {"MOONCAKE_PG_HEARTBEAT_TIMEOUT_MS": "1000", **REQUIRE_IPC}
    with World(3, backend="mooncake", gloo=False, start_timeout=120, env=env) as w:
        results = w.run(_sized_for_the_survivors, 2, timeout=120, allow_dead=(2,))
    for r in (0, 1):
        full, after = results[r]
        assert full == ([0.0, 0.0, 1.0, 1.0, 2.0, 2.0], [3 * (2 * r + i) + 30.0 for i in range(2)]), (r, full)
        assert after == ([0.0, 0.0, 1.0, 1.0], [2 * (2 * r + i) + 10.0 for i in range(2)]), (r, after)
