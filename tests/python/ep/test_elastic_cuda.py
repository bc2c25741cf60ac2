"""The ElasticBuffer grid on CUDA tensors over the ``mooncake`` CUDA backend,
with the same checks against the dense reference as the CPU tests
(test_elastic_buffer.py); ranks share the GPUs round-robin. Skipped without
a GPU."""

import pytest
import torch

from _elastic_refs import GRID
from _elastic_rounds import HELD_OUTPUT_SLOTS, dies_between_calls, elastic_buffer_of, run_elastic_grid
from _ep_rounds import RANK_ENV
from _harness import World

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU: these run the CPU tests' checks on CUDA tensors over the "
                              "'mooncake' CUDA backend (CI has no GPU)"),
]


def _grid_on_cuda(ctx):
    done = run_elastic_grid(ctx, GRID, device="cuda")
    buffer = elastic_buffer_of(ctx)
    return done, buffer.transport, buffer.path


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_elastic_grid_on_cuda(world_size):
    with World(world_size, gloo=False, env=RANK_ENV, backend="mooncake") as world:
        got = world.run(_grid_on_cuda, timeout=240)
    assert all((t, p) == ("ibgda", "collective") for _, t, p in got)  # no sizes given: the collective path
    assert any(sum(done) for done, _, _ in got)


def _with_slots(count: str | None, counts: str = "gathered") -> dict:
    """The ranks' environment with MOONCAKE_EP_ELASTIC_OUTPUT_SLOTS set ("0": none; None: unset,
    "auto"), and the dispatches' counts "carried" with the rows (MOONCAKE_EP_ELASTIC_CARRY_BYTES
    above these buffers' rows) or "gathered" before them (0: then the payloads go straight into
    the output slots, direct heads)."""
    from mooncake._ep_elastic.ipc_rows import CARRY_BYTES_ENV
    from mooncake._ep_elastic.output_slots import OUTPUT_SLOTS_ENV

    env = dict(RANK_ENV)
    if count is not None:
        env[OUTPUT_SLOTS_ENV] = count
    env[CARRY_BYTES_ENV] = str(4 << 20) if counts == "carried" else "0"
    return env


# Sized at construction for the grid's largest call: the IPC path.
IPC_SIZES = {"num_max_tokens_per_rank": 7, "hidden": 7168, "num_topk": 9}


def _grid_on_the_ipc_path(ctx):
    from _elastic_rounds import run_elastic_round

    buffer = elastic_buffer_of(ctx, "ipc", **IPC_SIZES)
    done = [run_elastic_round(ctx, ec, expand=expand, cpu_sync=sync, buffer_name="ipc", device="cuda")
            for ec in GRID for expand in (False, True) for sync in (True, False)]
    return done, buffer.path, buffer.path_reason


@pytest.mark.parametrize("world_size,output_slots,launches,counts", [
    (1, None, "one", "carried"), (2, None, "one", "carried"), (3, None, "one", "carried"),
    (2, None, "three", "carried"),
    (1, "0", "one", "gathered"), (2, "2", "one", "gathered"), (3, "2", "one", "gathered"),
    (2, "2", "three", "gathered"), (3, "0", "three", "gathered")])
def test_elastic_grid_on_the_ipc_path(world_size, output_slots, launches, counts):
    """The same checks over the CUDA IPC kernels, the layout on the GPU (the rows' call lays out
    what it copies): the counts carried by the rows' call, or gathered before it; then, with
    output slots, the payloads placed straight into them (direct heads). The grid's calls are
    small enough for one launch each; "three" turns that off (MOONCAKE_EP_ONE_LAUNCH=0), as for
    larger calls."""
    env = _with_slots(output_slots, counts)
    if launches == "three":
        env["MOONCAKE_EP_ONE_LAUNCH"] = "0"
    with World(world_size, gloo=False, env=env, backend="mooncake") as world:
        got = world.run(_grid_on_the_ipc_path, timeout=240)
    assert all(path == "ipc" for _, path, _ in got), [reason for *_, reason in got]
    assert any(sum(done) for done, _, _ in got)


# Calls of up to 96 tokens: one launch each, whose grid gets more send blocks than the send needs
# (wholeCallChunks: 6 per rank instead of 3 at worlds 2 and 3, some of them without a token), and
# whose copy blocks then lay out the rows; against the same dense reference as the grid.
WIDE_SIZES = {"num_max_tokens_per_rank": 96, "hidden": 512, "num_topk": 4}


def _wide_calls_on_the_ipc_path(ctx):
    from _ep_refs import Case
    from _elastic_refs import ElasticCase
    from _elastic_rounds import run_elastic_round

    cases = [ElasticCase(Case(hidden=512, experts_per_rank=4, num_topk=4, tokens=96, masked=0.1)),
             ElasticCase(Case(hidden=512, experts_per_rank=2, num_topk=4, tokens=90, masked=0.3), alignment=4,
                         fp8=True)]
    buffer = elastic_buffer_of(ctx, "wide", **WIDE_SIZES)
    done = [run_elastic_round(ctx, ec, expand=expand, cpu_sync=sync, buffer_name="wide", device="cuda")
            for ec in cases for expand in (False, True) for sync in (True, False)]
    return done, buffer.path, buffer.path_reason


@pytest.mark.parametrize("world_size,counts", [(2, "carried"), (3, "carried"), (2, "gathered")])
def test_elastic_calls_on_a_widened_one_launch_grid(world_size, counts):
    with World(world_size, gloo=False, env=_with_slots(None, counts), backend="mooncake") as world:
        got = world.run(_wide_calls_on_the_ipc_path, timeout=240)
    assert all(path == "ipc" for _, path, _ in got), [reason for *_, reason in got]
    assert all(sum(done) > 0 for done, _, _ in got)


def _captured_round(ctx):
    """Dispatch (do_cpu_sync=False) and combine captured in a CUDA graph,
    replayed on new inputs written in place: the same bits as the eager calls."""
    from dataclasses import replace

    from _ep_refs import Case, inputs_of

    T, H, k, L = 64, 512, 4, 4
    world, rank = ctx.size, ctx.rank
    buffer = elastic_buffer_of(ctx, "graph", num_max_tokens_per_rank=T, hidden=H, num_topk=k)
    E = L * world
    case = Case(hidden=H, experts_per_rank=L, num_topk=k, tokens=T, masked=0.1)
    first, second = inputs_of(case, rank, world), inputs_of(replace(case, seed=7), rank, world)
    x = first.x.cuda()
    topk_idx, weights = first.topk_idx.cuda(), first.topk_weights.cuda()

    def step():
        recv_x, recv_idx, recv_w, handle, _ = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights,
                                                              num_experts=E, do_cpu_sync=False)
        y = (recv_x.float() * (rank + 2)).to(torch.bfloat16)
        out, _, _ = buffer.combine(y, handle)
        return recv_x, recv_idx, recv_w, out

    def eager_on(inp):
        x.copy_(inp.x.cuda())
        topk_idx.copy_(inp.topk_idx.cuda())
        weights.copy_(inp.topk_weights.cuda())
        return [t.clone() for t in step()]

    want_second = eager_on(second)
    want_first = eager_on(first)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up on the capturing stream
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            static = step()
    torch.cuda.current_stream().wait_stream(side)
    x.copy_(second.x.cuda())
    topk_idx.copy_(second.topk_idx.cuda())
    weights.copy_(second.topk_weights.cuda())
    graph.replay()
    torch.cuda.synchronize()
    same = all(torch.equal(a, b) for a, b in zip(static, want_second))
    differs_from_first = not torch.equal(static[3], want_first[3])
    # The captured output's slot stays the graph's after the tensor is dropped: eager outputs
    # never land there (each replay writes it again).
    captured_at = static[0].data_ptr()
    del static
    held = [step()[0] for _ in range(2)]
    graph_slot_kept = all(r.data_ptr() != captured_at for r in held)
    return buffer.path, same, differs_from_first, graph_slot_kept


@pytest.mark.parametrize("counts", ["carried", "gathered"])
def test_elastic_dispatch_and_combine_replay_from_a_cuda_graph(counts):
    with World(2, gloo=False, env=_with_slots("2", counts), backend="mooncake") as world:
        got = world.run(_captured_round, timeout=240)
    assert got == [("ipc", True, True, True)] * 2


def _outputs_held_on_the_kernels(ctx):
    from _elastic_rounds import hold_outputs

    buffer = elastic_buffer_of(ctx, "ipc", **IPC_SIZES)
    return buffer.path, hold_outputs(ctx, "ipc", "cuda")


def test_output_slots_on_the_kernels():
    """Outputs kept across dispatches (test_elastic_ipc_rows.py's case on the kernels): the
    payloads placed straight into output slots, the two-copy way when none is free, and no
    held output written by a later dispatch, with two slots."""
    with World(2, gloo=False, env=_with_slots("2"), backend="mooncake") as world:
        got = world.run(_outputs_held_on_the_kernels, timeout=240)
    assert got == [("ipc", HELD_OUTPUT_SLOTS)] * 2


def _output_outlives_the_buffer(ctx):
    from _elastic_refs import ElasticCase, received
    from _elastic_rounds import _check_rows, _inputs
    from _ep_refs import Case, inputs_of

    from mooncake.mooncake_elastic_buffer import ElasticBuffer

    buffer = ElasticBuffer(None, num_max_tokens_per_rank=8, hidden=512, num_topk=2, explicitly_destroy=True)
    ec = ElasticCase(Case(hidden=512, experts_per_rank=2, num_topk=2, tokens=8))
    world, rank = ctx.size, ctx.rank
    inp = inputs_of(ec.base, rank, world)
    recv_x, *_ = buffer.dispatch(_inputs(ec, rank, world).cuda(), topk_idx=inp.topk_idx.cuda(),
                                 num_experts=ec.base.experts(world), do_cpu_sync=False)
    in_slot = buffer.runtime.transport.slots.held == 1
    buffer.destroy()
    # Memory freed with the group would be handed out again here and overwritten.
    scratch = [torch.full((64 << 20,), 0x77, dtype=torch.uint8, device="cuda") for _ in range(4)]
    torch.cuda.synchronize()
    positions = [(j, s, t) for j, (s, t, _, _) in enumerate(received(ec, world, rank))]
    _check_rows(ec, world, rank, recv_x.cpu(), positions, False, f"rank {rank}: after destroy()")
    del scratch
    return in_slot


def test_an_output_in_a_slot_outlives_the_buffer():
    with World(2, gloo=False, env=_with_slots("2"), backend="mooncake") as world:
        got = world.run(_output_outlives_the_buffer, timeout=240)
    assert got == [True] * 2


def test_a_dead_rank_fails_the_ipc_path_call_on_every_survivor():
    """A rank that dies between calls: the survivors' next dispatch raises,
    naming update_ep_member(), within the kernels' bound (the process
    watchdog tells them at once), and the buffer refuses calls after it."""
    with World(3, gloo=False, env=RANK_ENV, backend="mooncake") as world:
        got = world.run(dies_between_calls, 1, allow_dead=(1,), timeout=120)
    assert got[1] is None
    for r in (0, 2):
        path, outcomes = got[r]
        assert path == "ipc", got[r]
        for kind, message, took in outcomes:
            assert kind == "RuntimeError" and "update_ep_member" in message, (r, outcomes)
            assert took < 10.0, f"rank {r} took {took:.1f} s"
