"""ElasticBuffer's IPC path (``_ep_elastic.ipc_rows``) on CPU: its layout,
handles, cached dispatch and combine, over a twin of the CUDA kernels made
from the group's collectives (``_elastic_rows_emulation``), against the
same dense references as the collective path (test_elastic_buffer.py), with
the layout's torch form and with the layout kernels' code built for the host
(_layout_emulation.py); and the device-side layout functions against the
host-side ones they mirror.
On a GPU the same grid runs over the kernels (test_elastic_cuda.py)."""

import pytest
import torch

from _elastic_refs import GRID
from _elastic_rounds import HELD_OUTPUT_SLOTS, elastic_buffer_of, run_elastic_grid
from _ep_rounds import RANK_ENV
from _harness import World

from mooncake._ep_elastic import layout, rows_layout

pytestmark = pytest.mark.timeout(240)

SIZES = {"num_max_tokens_per_rank": 7, "hidden": 7168, "num_topk": 9}


def _on_emulated_rows(ctx, kernels_library=None, output_slots=0, carry=False):
    """``kernels_library``: the layout kernels built for the host (_layout_emulation.py), None: the torch form;
    ``output_slots``: the emulated transport's (its payloads then arrive in them, as direct heads do);
    ``carry``: the dispatches carry their counts with the rows (no gather, no direct heads)."""
    from _elastic_rows_emulation import EmulatedRows
    from _layout_emulation import load
    from mooncake._ep_elastic.ipc_rows import IpcRowsPath, row_width
    from mooncake._ep_elastic.layout_kernels import KernelLayout

    buffer = elastic_buffer_of(ctx, "rows", **SIZES)
    rows = EmulatedRows(buffer.group, ctx.rank, ctx.size, SIZES["num_max_tokens_per_rank"],
                        row_width(SIZES["hidden"], SIZES["num_topk"]), output_slots)
    layout = KernelLayout(load(kernels_library)) if kernels_library is not None else None
    buffer.runtime = IpcRowsPath(ctx.rank, buffer._topology, buffer._generation, rows,
                                 SIZES["num_max_tokens_per_rank"], layout=layout, carry_counts=carry)
    done = [run_elastic_round_on(ctx, ec, expand, sync) for ec in GRID for expand in (False, True)
            for sync in (True, False)]
    return (done, buffer.path, rows.calls.count("dispatch"), rows.calls.count("combine"), rows.direct_calls,
            rows.follows_layout_send, rows.own_send_calls)


def run_elastic_round_on(ctx, ec, expand, sync):
    from _elastic_rounds import run_elastic_round

    return run_elastic_round(ctx, ec, expand=expand, cpu_sync=sync, buffer_name="rows")


def _check_grid(world, kernels_library=None, output_slots=0, carry=False):
    with World(world, gloo=False, env=RANK_ENV) as w:
        got = w.run(_on_emulated_rows, kernels_library, output_slots, carry, timeout=200)
    rounds = 2 * 2 * len(GRID)
    # Per round, all through the seam: a fresh dispatch (the counts' gather, then the rows; or
    # the rows alone, carrying the counts), a cached one, and two combines.
    fresh = 1 if carry else 2
    assert all(path == "ipc" and dispatches == (fresh + 1) * rounds and combines == 2 * rounds
               for _, path, dispatches, combines, *_ in got)
    assert any(sum(done) for done, *_ in got)
    # With slots, each round's first dispatch that is not expanded receives its payload in one
    # (the round drops its outputs before the next); none without, or when the counts are carried.
    payload_cases = sum(1 for ec in GRID if _payload_is_the_head(ec))
    assert [direct for *_, direct, _, _ in got] == [payload_cases * 2 if output_slots and not carry else 0] * world
    # Only the call right after the layout's send kernel may overlap it: a fresh dispatch's first
    # (the gather, or the rows carrying the counts); never its rows after a gather, nor a cached dispatch.
    one_round = [True] + [False] * fresh
    assert all(follows == one_round * rounds for *_, follows, _ in got)
    # The layout kernels' send hands the rows' call its inputs (a call of one tile here) when the counts
    # are carried and the payload is the rows' head: 4 rounds of each such case; the torch form never does.
    own = 4 * payload_cases if carry and kernels_library is not None else 0
    assert [own_send for *_, own_send in got] == [own] * world


def _payload_is_the_head(ec) -> bool:
    """Whether the case's payload travels as the rows' head (whole 16-byte vectors), which slots hold."""
    return ec.base.hidden * (1 if ec.fp8 else 2) % 16 == 0


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("output_slots", [0, 2])
def test_ipc_path_matches_the_dense_reference(world, output_slots):
    _check_grid(world, output_slots=output_slots)


@pytest.mark.parametrize("world", [1, 3])
def test_ipc_path_that_carries_its_counts_matches_the_dense_reference(world):
    # With slots offered too: a buffer that carries its counts never places heads in them.
    _check_grid(world, output_slots=2, carry=True)


@pytest.fixture(scope="module")
def layout_kernels_library(tmp_path_factory):
    from _layout_emulation import build, compiler_missing, library_in

    if compiler_missing():
        pytest.skip(compiler_missing())
    folder = tmp_path_factory.mktemp("layout_kernels")
    build(folder)
    return str(library_in(folder))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ipc_path_with_the_layout_kernels_matches_the_dense_reference(world, layout_kernels_library):
    """The same grid with the layout computed by the CUDA kernels' code, built for the host
    (test_elastic_layout_emulated.py): on a GPU, test_elastic_cuda.py runs it on the kernels."""
    _check_grid(world, layout_kernels_library)


@pytest.mark.parametrize("world", [1, 2])
def test_ipc_path_with_the_layout_kernels_that_carries_its_counts_matches_the_dense_reference(
        world, layout_kernels_library):
    _check_grid(world, layout_kernels_library, carry=True)


def _one_rank_refuses_on_emulated_rows(ctx, carry):
    """Rank 1 alone passes more tokens than the buffer holds: it meets the
    others' calls (join_refused) with as many of its own, so a good round
    after it pairs on both ranks."""
    from _elastic_rows_emulation import EmulatedRows
    from _harness import errors_of
    from mooncake._ep_elastic.ipc_rows import IpcRowsPath, row_width

    buffer = elastic_buffer_of(ctx, "rows", **SIZES)
    rows = EmulatedRows(buffer.group, ctx.rank, ctx.size, SIZES["num_max_tokens_per_rank"],
                        row_width(SIZES["hidden"], SIZES["num_topk"]))
    buffer.runtime = IpcRowsPath(ctx.rank, buffer._topology, buffer._generation, rows,
                                 SIZES["num_max_tokens_per_rank"], carry_counts=carry)
    tokens = SIZES["num_max_tokens_per_rank"] + (1 if ctx.rank == 1 else -2)
    x = torch.randn(tokens, 256).to(torch.bfloat16)
    topk = torch.zeros(tokens, 1, dtype=torch.int64)
    out = errors_of({"dispatch": lambda: buffer.dispatch(x, topk_idx=topk, num_experts=2 * ctx.size,
                                                         num_max_tokens_per_rank=SIZES["num_max_tokens_per_rank"])})
    calls = rows.calls.count("dispatch")
    received = run_elastic_round_on(ctx, GRID[0], False, True)
    return out, calls, received


@pytest.mark.parametrize("carry", [False, True])
def test_a_refusal_on_one_rank_meets_the_others_calls(carry):
    with World(2, gloo=False, env=RANK_ENV) as w:
        (mine, calls0, _), (theirs, calls1, _) = w.run(_one_rank_refuses_on_emulated_rows, carry, timeout=60)
    assert mine["dispatch"][0] == "ValueError" and "ranks [1] refused their arguments" in mine["dispatch"][1], mine
    assert theirs["dispatch"][0] == "ValueError" and "num_max_tokens_per_rank" in theirs["dispatch"][1], theirs
    # The same kernel calls on both ranks: the gather and the rows, or the rows carrying the counts.
    assert calls0 == calls1 == (1 if carry else 2)


def test_layout_kernels_read_the_counts_a_rows_call_carried(layout_kernels_library):
    """The layout kernels' receive side reads every rank's counts where the rows' call left them."""
    _check_grid(2, layout_kernels_library, carry=True)


def _random_local(rows: int, k: int, num_local: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    picks = torch.stack([torch.randperm(num_local * 2, generator=g)[:k] for _ in range(rows)])
    return torch.where(picks < num_local, picks, -1)  # about half of the lanes elsewhere


@pytest.mark.parametrize("alignment", [1, 3, 8])
def test_device_expansion_equals_the_host_one(alignment):
    local = _random_local(23, 4, 5, alignment)
    host = layout.expand(local, 5, alignment)
    dev = rows_layout.expand(local, 5, alignment)
    assert torch.equal(dev.slots, host.slots)
    assert dev.counts.tolist() == host.counts and dev.ends.tolist() == host.ends
    values = torch.arange(23 * 3, dtype=torch.float32).view(23, 3)
    placed = torch.zeros(23 * 4 + 5 * (alignment - 1), 3)
    placed[host.dst_row] = values[host.src_row]
    assert torch.equal(rows_layout.place_expanded(values, dev), placed)
    x = torch.randn(host.total, 16).to(torch.bfloat16)
    assert torch.equal(rows_layout.reduce_expanded(x, dev.slots), layout.reduce_expanded(x, host.slots))


def test_device_destination_slots_equal_the_host_ones():
    num_ranks, num_local = 4, 3
    g = torch.Generator().manual_seed(5)
    topk = torch.stack([torch.randperm(num_ranks * num_local, generator=g)[:4] for _ in range(9)])
    topk[2, 1] = topk[5, 0] = -1
    my_begin = torch.tensor([0, 5, 2, 11])
    from mooncake._ep_collective.routing import token_rows

    offer = token_rows(topk, num_ranks, num_local, torch.ones(num_ranks, dtype=torch.bool))
    host = layout.dst_slots(topk, num_local, offer.per_rank, offer.token, my_begin)
    by_dest = rows_layout.picks_by_destination(topk, num_local)
    dest = rows_layout.unique_destinations(by_dest)
    dev = rows_layout.dst_slots(by_dest, rows_layout.destination_table(dest, num_ranks), my_begin)
    assert torch.equal(dev, host)
    # Each token's destinations once, ascending, the rest -1.
    for t, picks in enumerate(topk.tolist()):
        want = sorted({p // num_local for p in picks if p >= 0})
        row = [d for d in dest[t].tolist() if d >= 0]
        assert row == want


@pytest.mark.parametrize("with_total", [False, True])
def test_the_host_summary_reads_what_the_gathered_table_and_ranges_say(with_total):
    """One copy for a synchronised dispatch (host_summary.read_summary)
    against Gathered.table(), the ranges' counts and the tensors themselves;
    rank 2 was not heard (count 0): its row holds garbage and reads as zeros."""
    from mooncake._ep_elastic.host_summary import read_summary
    from mooncake._ep_elastic.layout_kernels import Gathered

    num_ranks, n, facts_begin, width, capacity = 4, 11, 5, 48, 12
    g = torch.Generator().manual_seed(3)
    rows = torch.randint(0, 256, (capacity, width), generator=g, dtype=torch.int64).to(torch.uint8)
    begins, counts = [2, 0, 3, 1], [1, 1, 0, 1]  # rows arrive out of rank order; rank 2's row 3 is stale
    ranges_of = lambda b, c: torch.tensor([[(x << 32) | y for x, y in zip(b, c)]], dtype=torch.int64)  # noqa: E731
    gathered = Gathered(rows=rows, ranges=ranges_of(begins, counts), n=n)
    recv = ranges_of([0, 7, 7, 12], [7, 0, 5, 3])
    per_expert = torch.tensor([4, 0, 9], dtype=torch.int64)
    total = torch.tensor([17], dtype=torch.int64) if with_total else None
    mask = torch.tensor([1, 1, 0, 1], dtype=torch.int32)

    got = read_summary(gathered, facts_begin, recv, per_expert, total, mask)
    assert got.facts == gathered.table()[:, facts_begin:].tolist()
    assert got.facts[2] == [0] * (n - facts_begin)
    assert got.facts[0] == rows[2, 4 * facts_begin:4 * n].view(torch.int32).tolist()
    assert got.recv_count == [7, 0, 5, 3]
    assert got.per_expert == [4, 0, 9]
    assert got.total == (17 if with_total else None)
    assert got.mask == [1, 1, 0, 1]


def _beyond_the_ipc_sizes(ctx):
    from _elastic_refs import ElasticCase
    from _elastic_rounds import run_elastic_round
    from _ep_refs import Case

    _on_emulated_rows(ctx)
    buffer = elastic_buffer_of(ctx, "rows")
    rows = buffer.runtime.transport
    before = len(rows.calls)
    # More tokens per rank than the buffer was constructed for: the collective path takes it.
    n = run_elastic_round(ctx, ElasticCase(Case(hidden=128, experts_per_rank=2, num_topk=2, tokens=9)),
                          buffer_name="rows")
    return len(rows.calls) - before, n


def test_calls_beyond_the_constructed_sizes_take_the_collective_path():
    with World(2, gloo=False, env=RANK_ENV) as w:
        got = w.run(_beyond_the_ipc_sizes, timeout=200)
    assert [through_seam for through_seam, _ in got] == [0, 0]
    assert sum(n for _, n in got) > 0


def _one_rank_refuses(ctx):
    from _elastic_refs import ElasticCase
    from _elastic_rounds import run_elastic_round
    from _ep_refs import Case, inputs_of

    _on_emulated_rows(ctx)
    buffer = elastic_buffer_of(ctx, "rows")
    case = Case(hidden=128, experts_per_rank=2, num_topk=2, tokens=5)
    inp = inputs_of(case, ctx.rank, ctx.size)
    topk = inp.topk_idx.to(torch.int32) if ctx.rank == 1 else inp.topk_idx  # rank 1's is of the wrong dtype
    try:
        buffer.dispatch(inp.x, topk_idx=topk, num_experts=case.experts(ctx.size))
        raised = ("none", "")
    except (TypeError, ValueError) as err:
        raised = (type(err).__name__, str(err))
    # The next call pairs up on every rank and is right.
    n = run_elastic_round(ctx, ElasticCase(case), buffer_name="rows")
    return raised, n


def test_a_rank_refusing_its_arguments_fails_the_call_everywhere_and_the_next_pairs():
    with World(2, gloo=False, env=RANK_ENV) as w:
        got = w.run(_one_rank_refuses, timeout=200)
    (kind0, msg0), _ = got[0]
    (kind1, msg1), _ = got[1]
    assert kind0 == "ValueError" and "ranks [1] refused" in msg0, got[0]
    assert kind1 == "TypeError" and "topk_idx" in msg1, got[1]



def _outputs_held_across_dispatches(ctx):
    from _elastic_rounds import hold_outputs

    _on_emulated_rows(ctx, output_slots=2)
    rows = elastic_buffer_of(ctx, "rows").runtime.transport
    before = rows.direct_calls
    held = hold_outputs(ctx, "rows", "cpu")
    return held, rows.direct_calls - before


def test_output_slots_are_lent_to_one_output_at_a_time():
    """Two slots, outputs held: a third dispatch copies twice; a dropped output's slot serves the
    next; a view holds its slot; nothing a later dispatch writes reaches a held output."""
    with World(2, gloo=False, env=RANK_ENV) as w:
        got = w.run(_outputs_held_across_dispatches, timeout=200)
    assert got == [(HELD_OUTPUT_SLOTS, 3)] * 2


def test_output_slots_fill_their_memory_between_two_and_sixteen_unless_a_count_is_given(monkeypatch):
    from mooncake._ep_elastic.output_slots import AUTO_SLOTS_BYTES, OUTPUT_SLOTS_ENV, output_slots_setting

    big = 2 * 8192 * 2 * 7296  # R = 2, T = 8192, H = 7168 with top-8: about 240 MB a slot
    small = 8 * 128 * 2 * 7296  # R = 8, T = 128: about 15 MB
    for unset_or_auto in (None, " ", "auto"):
        if unset_or_auto is None:
            monkeypatch.delenv(OUTPUT_SLOTS_ENV, raising=False)
        else:
            monkeypatch.setenv(OUTPUT_SLOTS_ENV, unset_or_auto)
        assert output_slots_setting(big) == 2
        assert output_slots_setting(small) == 16
        assert output_slots_setting(AUTO_SLOTS_BYTES // 5) == 5
    monkeypatch.setenv(OUTPUT_SLOTS_ENV, "0")
    assert output_slots_setting(small) == 0
    monkeypatch.setenv(OUTPUT_SLOTS_ENV, "3")
    assert output_slots_setting(small) == 3
    monkeypatch.setenv(OUTPUT_SLOTS_ENV, "-1")
    with pytest.raises(ValueError, match=f"{OUTPUT_SLOTS_ENV}: must be an int >= 0"):
        output_slots_setting(small)


def test_a_buffer_carries_its_counts_up_to_the_limit_and_alone_at_any_size():
    from mooncake._ep_elastic.ipc_rows import carries_counts

    limit = 4 << 20
    assert carries_counts(limit, limit, 2) and not carries_counts(limit + 16, limit, 2)
    assert carries_counts(1000 * limit, limit, 1)  # no peer rows to place in output slots
    assert not any(carries_counts(16, 0, ranks) for ranks in (1, 2))  # 0: never
    assert not carries_counts(0, limit, 1)
