"""The checks of the IPC path's layout kernels (``layout_kernels.KernelLayout``,
mooncake-ep/src/elastic_layout.cu) against its torch form (``TorchLayout``,
``rows_layout``'s operations), bit for bit, on random inputs: every rank of
worlds of 1 to 3 ranks, k 1 to 9, ranks that receive nothing, FP8 scales and
not, weights and not, payloads sent as the head and in the tail. The rows a
rank receives are laid out here as the EP kernels deliver them (sources in
rank order, each in token order, garbage past the real rows), so no second
process is needed. Run on a GPU (test_elastic_layout_kernels.py) and on the
host over an emulation of CUDA (test_elastic_layout_emulated.py)."""

import torch

from mooncake._ep_elastic import rows_layout
from mooncake._ep_elastic.ipc_rows import ReceivedRows, RowFormat
from mooncake._ep_elastic.layout_kernels import TORCH, Gathered

FACT_COLUMNS = 3  # the counts' row carries the call's shape after the counts: any values


def inputs(gen, num_tokens, hidden, num_topk, num_experts, fp8, weights, empty_rank=None, num_local=1):
    """One rank's call: payload, scales, picks (some -1, some repeated ranks), weights."""
    if fp8:
        data = torch.randint(0, 256, (num_tokens, hidden), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)
        sf = torch.rand(num_tokens, -(-hidden // 128), generator=gen)
    else:
        data = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)
        sf = None
    topk = torch.randint(-1, num_experts, (num_tokens, num_topk), generator=gen)
    if empty_rank is not None:  # nothing goes to that rank
        on_it = (topk >= 0) & (topk // num_local == empty_rank)
        topk = torch.where(on_it, -1, topk)
    w = torch.randn(num_tokens, num_topk, generator=gen) if weights else None
    if w is not None and w.numel():
        w.view(-1)[0] = float("nan")  # a NaN's bits travel as they are
    return data, sf, topk, w


def on_device(device, t):
    return t.to(device) if t is not None else None


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def assert_same(name, got, want):
    assert (got is None) == (want is None), name
    if got is None:
        return
    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape, got.dtype, want.dtype)
    assert torch.equal(_bits(got).cpu(), _bits(want).cpu()), name


def defined_tail(tail, row: RowFormat, has_weights: bool):
    """The tail's bytes that carry values (torch's staging leaves the padding unwritten)."""
    keep = torch.zeros(tail.size(1), dtype=torch.bool)
    parts = [(0, row.payload + row.scales), (row.ids, row.weights)]
    if has_weights:
        parts.append((row.weights, row.bytes))
    for begin, end in parts:
        keep[max(begin - row.head, 0):max(end - row.head, 0)] = True
    return tail[:, keep.to(tail.device)]


def gathered_rows(table, gen):
    """``table`` ([R, n] int32) as the EP kernels deliver it: one row per source
    (16-byte rows), the sources in reverse order after a garbage row, garbage
    in the padding, so that only the ranges say where a source's row is. In
    worlds of 3, rank 1 was given up on (count 0: garbage where its row was)."""
    world, n = table.shape
    width = -(-4 * n // 16) * 16
    rows = torch.randint(0, 256, (world + 1, width), generator=gen, dtype=torch.uint8).to(table.device)
    begins = [world - s for s in range(world)]
    answered = [not (world == 3 and s == 1) for s in range(world)]
    for s, b in enumerate(begins):
        if answered[s]:
            rows[b, :4 * n] = table[s].contiguous().view(torch.uint8)
    ranges = torch.tensor([[(b << 32) | int(a) for b, a in zip(begins, answered)]], dtype=torch.int64,
                          device=table.device)
    return Gathered(rows=rows, ranges=ranges, n=n)


CASES = [
    # (world, tokens per rank, hidden, k, local experts, fp8, weights, an empty rank)
    (1, 37, 128, 1, 4, False, True, None),
    (1, 64, 100, 9, 3, False, False, None),  # payload 200 bytes: all in the tail
    (2, 50, 256, 8, 4, True, True, None),
    (2, 33, 136, 2, 1, False, True, 1),
    (3, 41, 384, 9, 2, True, False, 0),
    (3, 7, 7168, 9, 5, False, True, 2),
    (3, 0, 128, 4, 2, False, True, None),  # no tokens anywhere
    (2, 1030, 128, 6, 8, False, True, None),  # more than one tile of the send scan
    (3, 600, 128, 9, 3, False, True, 1),  # three tiles of 256 tokens (two where a rank sends fewer)
    (1, 20, 128, 4, 600, False, True, None),  # more local experts than a block's threads: runs of 3 in the psum
    (2, 40, 128, 32, 16, True, True, None),  # the most picks the kernels take
]


def check_case(case, kernels, device):
    """Every output of ``kernels`` (a KernelLayout) equals the torch form's for this case, on ``device``."""
    world, tokens_per_rank, hidden, num_topk, num_local, fp8, with_weights, empty_rank = case
    num_experts = world * num_local
    gen = torch.Generator().manual_seed(CASES.index(case))
    capacity = world * tokens_per_rank
    calls = []
    for source in range(world):
        num_tokens = tokens_per_rank - (source % 2) * (tokens_per_rank // 3)  # ranks send different numbers
        data, sf, topk, w = (on_device(device, t) for t in inputs(gen, num_tokens, hidden, num_topk, num_experts,
                                                                  fp8, with_weights, empty_rank, num_local))
        row = RowFormat.of(data, sf, num_topk)
        shape = torch.arange(FACT_COLUMNS, dtype=torch.int32, device=device) + 100 * source
        # The shape's first word is offered (an output slot) only while every rank is heard: odd
        # sources have given up on their last rank, even ones hear everyone.
        active = torch.ones(world, dtype=torch.int32, device=device)
        active[-1] = source % 2 == 0
        mine = kernels.send(data, sf, row, topk, w, num_local, world, shape, offer_word=world, active_ranks=active)
        ref = TORCH.send(data, sf, row, topk, w, num_local, world, shape, offer_word=world, active_ranks=active)
        assert_same("dest", mine.dest, ref.dest)
        assert_same("dest slots", mine.dest_slots, ref.dest_slots)
        assert_same("counts and shape", mine.counts_row, ref.counts_row)
        offered = int(mine.counts_row[0, 4 * world:4 * world + 4].view(torch.int32))
        assert offered == (100 * source if source % 2 == 0 else -1), f"source {source}: the offer word {offered}"
        assert_same("head", mine.head, ref.head)
        assert_same("tail", defined_tail(mine.tail, row, with_weights), defined_tail(ref.tail, row, with_weights))
        if mine.topk_copy is not None:  # the kernels' copy of the picks, made in the same launch
            assert_same("topk copy", mine.topk_copy, topk.to(torch.int64))
            assert topk.numel() == 0 or mine.topk_copy.data_ptr() != topk.data_ptr()
        calls.append((mine, ref, row))

    # Every rank's counts, then the call's shape, as the gather returns them.
    table = torch.stack([m.counts_row[0, :4 * (world + FACT_COLUMNS)].view(torch.int32) for m, _, _ in calls])
    gathered = gathered_rows(table, gen)
    for me in range(world):
        # The rows `me` receives: each source's rows that go to it, in token order; garbage past them.
        tails, tokens, counts = [], [], []
        for mine, _, row in calls:
            goes = (mine.dest == me).any(dim=1)
            tails.append(mine.tail[goes])
            tokens.append(torch.nonzero(goes).view(-1).to(torch.int32))
            counts.append(int(goes.sum()))
        row = calls[0][2]
        recv_tail = on_device(device, torch.randint(0, 256, (capacity, row.tail), generator=gen, dtype=torch.uint8))
        src_token = on_device(device, torch.randint(0, 1 << 30, (1, capacity), generator=gen, dtype=torch.int32))
        total = sum(counts)
        recv_tail[:total] = torch.cat(tails)
        src_token[0, :total] = torch.cat(tokens)
        begins = [sum(counts[:s]) for s in range(world)]
        ranges = torch.tensor([[(b << 32) | c for b, c in zip(begins, counts)]], dtype=torch.int64, device=device)
        head = torch.zeros(capacity, row.head, dtype=torch.uint8, device=device) if row.head else None
        received = ReceivedRows(row, head, recv_tail, capacity)
        mine, ref, _ = calls[me]  # the handle's slots are the receiving rank's own as a sender
        got = kernels.receive(mine, gathered, ranges, src_token, received, me, num_local, tokens_per_rank, with_weights)
        want = TORCH.receive(ref, gathered, ranges, src_token, received, me, num_local, tokens_per_rank, with_weights)
        for name in ("slots", "real", "local", "weights", "metadata", "per_expert", "expert_psum", "scaleup_psum"):
            assert_same(name, getattr(got, name), getattr(want, name))
        # The expansion (torch on both) reads the kernels' local picks: the same.
        for alignment in (1, 4):
            a = rows_layout.expand(got.local, num_local, alignment)
            b = rows_layout.expand(want.local, num_local, alignment)
            assert_same("expansion slots", a.slots, b.slots)
            assert_same("expansion ends", a.ends, b.ends)


def check_cached_rows(fp8, hidden, kernels, device):
    """The cached dispatch's rows: payload and scales only (no ids)."""
    gen = torch.Generator().manual_seed(7)
    data, sf, _, _ = (on_device(device, t) for t in inputs(gen, 19, hidden, 1, 4, fp8, False))
    row = RowFormat.of(data, sf, 0)
    head, tail = kernels.send_rows(data, sf, row)
    ref_head, ref_tail = TORCH.send_rows(data, sf, row)
    assert_same("head", head, ref_head)
    assert_same("tail", defined_tail(tail, row, False), defined_tail(ref_tail, row, False))


