"""What a rank does in the ElasticBuffer tests: dispatch -> mock experts ->
combine, every output checked against the dense references of
_elastic_refs. Runs inside spawned ranks (no pytest here)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from _elastic_refs import ElasticCase, combined, expanded, fp8_inputs, rank_fn, received
from _ep_refs import expert_fn, inputs_of

_BUFFERS: dict = {}


def elastic_buffer_of(ctx, name: str = "default", **kwargs):
    """One ElasticBuffer per process and name (construction is collective)."""
    from mooncake.mooncake_elastic_buffer import ElasticBuffer  # noqa: PLC0415

    if name not in _BUFFERS:
        _BUFFERS[name] = ElasticBuffer(dist.group.WORLD, **kwargs)
    return _BUFFERS[name]


def _inputs(ec: ElasticCase, rank: int, world: int, second: bool = False):
    inp = inputs_of(ec.base, rank, world)
    if ec.fp8:
        data, scales = fp8_inputs(ec.base, rank, world)
        return (data, scales * 2) if second else (data, scales)
    return (inp.x.float() * -2 + 1).to(torch.bfloat16) if second else inp.x


def _source_row(ec, source, world, token, second):
    x = _inputs(ec, source, world, second)
    return (x[0] if ec.fp8 else x)[token].view(torch.uint8), (x[1][token] if ec.fp8 else None)


def _check_rows(ec, world, rank, recv_x, positions, second, where):
    """``positions``: (output row, source, token) triples."""
    data = recv_x[0] if ec.fp8 else recv_x
    for row, s, t in positions:
        want, want_scales = _source_row(ec, s, world, t, second)
        assert torch.equal(data[row].view(torch.uint8), want), f"{where}: row {row} (source {s}, token {t})"
        if ec.fp8:
            assert torch.equal(recv_x[1][row], want_scales), f"{where}: scales of row {row}"


def run_elastic_round(ctx, ec: ElasticCase, expand: bool = False, cpu_sync: bool = True, cached: bool = True,
                      buffer_name: str = "default", device: str = "cpu") -> int:
    """One checked round; returns the rows this rank received."""
    world, rank = ctx.size, ctx.rank
    case = ec.base
    T, E, L, k = case.tokens, case.experts(world), case.experts_per_rank, case.num_topk
    where = f"rank {rank} of {world}, {ec}, expand={expand}, cpu_sync={cpu_sync}"
    buffer = elastic_buffer_of(ctx, buffer_name)
    dev = torch.device(device)
    inp = inputs_of(case, rank, world)
    x = _inputs(ec, rank, world)
    x_dev = tuple(t.to(dev) for t in x) if ec.fp8 else x.to(dev)
    weights = inp.topk_weights.to(dev) if ec.weights else None
    recv_x, recv_idx, recv_w, handle, _ = buffer.dispatch(
        x_dev, topk_idx=inp.topk_idx.to(dev), topk_weights=weights, num_experts=E, num_max_tokens_per_rank=T,
        expert_alignment=ec.alignment, do_expand=expand, do_cpu_sync=cpu_sync)
    recv_x = tuple(t.cpu() for t in recv_x) if ec.fp8 else recv_x.cpu()
    recv_idx = recv_idx.cpu()
    meta = handle.recv_src_metadata.cpu()
    want = received(ec, world, rank)
    n = len(want)
    data = recv_x[0] if ec.fp8 else recv_x

    # The handle's counts.
    up = ec.scaleup or world
    per_index = [sum(1 for s, *_ in want if s % up == u) for u in range(up)]
    assert handle.psum_num_recv_tokens_per_scaleup_rank.tolist() == [sum(per_index[:u + 1]) for u in range(up)], where
    assert handle.num_recv_tokens == (n if cpu_sync else world * T), where
    assert meta[:n, 0].tolist() == [s * T + t for s, t, _, _ in want], f"{where}: metadata source column"
    assert meta[:n, 1].tolist() == [sum(le >= 0 for le in local) for _, _, local, _ in want], where
    assert recv_idx.dtype == torch.int64 and recv_idx.shape == (n if cpu_sync else world * T, k), where
    assert recv_idx[:n].tolist() == [local for _, _, local, _ in want], f"{where}: recv_topk_idx"
    assert bool((recv_idx[n:] == -1).all()) and bool((meta[n:] == -1).all()), f"{where}: rows past the count"
    if not expand:
        per_expert = [sum(1 for _, _, local, _ in want if e in local) for e in range(L)]
        assert data.shape[0] == (n if cpu_sync else world * T), where
        _check_rows(ec, world, rank, recv_x, [(j, s, t) for j, (s, t, _, _) in enumerate(want)], False, where)
        assert bool((data[n:].view(torch.uint8) == 0).all()), f"{where}: rows past the count must be zero"
        if ec.weights:
            assert torch.equal(recv_w[:n].cpu(), torch.tensor([w for *_, w in want], dtype=torch.float32)
                               .view(n, k)), f"{where}: recv_topk_weights"
        else:
            assert recv_w is None, where
        psum, run = [], 0
        for c in per_expert:
            run += c
            psum.append(run)
        assert handle.psum_num_recv_tokens_per_expert.tolist() == psum, where
        assert bool((meta[:n, 2:] == -1).all()), where
    else:
        blocks, total = expanded(ec, world, rank)
        per_expert = [len(members) for _, members in blocks]
        capacity = world * T * k + L * (ec.alignment - 1)
        assert data.shape[0] == (total if cpu_sync else capacity), where
        positions, filled = [], set()
        for begin, members in blocks:
            for i, (j, lane) in enumerate(members):
                s, t, _, w = want[j]
                positions.append((begin + i, s, t))
                filled.add(begin + i)
                assert int(meta[j, 2 + lane]) == begin + i, f"{where}: expanded slot of row {j} lane {lane}"
                if ec.weights:
                    assert float(recv_w[begin + i]) == w[lane], f"{where}: expanded weight {begin + i}"
        _check_rows(ec, world, rank, recv_x, positions, False, where)
        padding = [r for r in range(data.shape[0]) if r not in filled]
        assert bool((data[padding].view(torch.uint8) == 0).all()), f"{where}: padding rows must be zero"
        assert handle.psum_num_recv_tokens_per_expert.tolist() == [b + len(m) for b, m in blocks], where
    assert handle.num_recv_tokens_per_expert_list == (per_expert if cpu_sync else []), where

    # Where this rank's tokens landed.
    slots = handle.dst_buffer_slot_idx.cpu().tolist()
    for t, picks in enumerate(inp.topk_idx.tolist()):
        for j, e in enumerate(picks):
            if e < 0:
                assert slots[t][j] == -1, where
                continue
            at_dest = [(s, tt) for s, tt, _, _ in received(ec, world, e // L)]
            assert slots[t][j] == at_dest.index((rank, t)), f"{where}: dst_buffer_slot_idx[{t}, {j}]"

    # Combine, with never-read rows set to NaN.
    seen = data.float().to(torch.bfloat16)
    y = torch.full((seen.shape[0], seen.shape[1]), float("nan"), dtype=torch.bfloat16)
    if expand:
        for e, (begin, members) in enumerate(expanded(ec, world, rank)[0]):
            rows = slice(begin, begin + len(members))
            y[rows] = expert_fn(rank * L + e, seen[rows])
    else:
        y[:n] = rank_fn(rank, seen[:n])
    out, nothing, _ = buffer.combine(y.to(dev), handle)
    assert nothing is None, where
    assert torch.equal(out.cpu(), combined(ec, world, rank, expand)), f"{where}: combine"

    if cached:
        x2 = _inputs(ec, rank, world, second=True)
        x2_dev = tuple(t.to(dev) for t in x2) if ec.fp8 else x2.to(dev)
        recv2, idx2, w2, handle2, _ = buffer.dispatch(x2_dev, handle=handle)
        recv2 = tuple(t.cpu() for t in recv2) if ec.fp8 else recv2.cpu()
        assert w2 is None and torch.equal(idx2.cpu(), recv_idx), f"{where}: cached dispatch metadata"
        if expand:
            positions = [(b + i, want[j][0], want[j][1]) for b, m in expanded(ec, world, rank)[0]
                         for i, (j, _) in enumerate(m)]
        else:
            positions = [(j, s, t) for j, (s, t, _, _) in enumerate(want)]
        _check_rows(ec, world, rank, recv2, positions, True, f"{where}, cached")
        out2, _, _ = buffer.combine(y.to(dev), handle2)
        assert torch.equal(out2.cpu(), out.cpu()), f"{where}: combine after a cached dispatch"
    return n


def run_elastic_grid(ctx, cases, device: str = "cpu") -> list[int]:
    """Every case of ``cases`` expanded and not, with and without CPU sync, on one buffer."""
    return [run_elastic_round(ctx, ec, expand=expand, cpu_sync=sync, device=device)
            for ec in cases for expand in (False, True) for sync in (True, False)]


def dies_between_calls(ctx, victim, **buffer_kwargs):
    """A sized buffer (``buffer_kwargs`` added: e.g. the transport) runs one
    round; then rank ``victim`` exits and the others make two calls: the
    failure, then one refused until update_ep_member(). Returns the path and
    each call's (exception kind, message, seconds)."""
    import os
    import time

    import torch.distributed as dist
    from _elastic_refs import ElasticCase
    from _ep_refs import Case

    case = ElasticCase(Case(hidden=256, experts_per_rank=2, num_topk=2, tokens=6, seed=5))
    buffer = elastic_buffer_of(ctx, "death", num_max_tokens_per_rank=6, hidden=256, num_topk=2,
                               num_gpu_timeout_secs=5, **buffer_kwargs)
    run_elastic_round(ctx, case, buffer_name="death", device="cuda")
    dist.barrier()  # every rank's earlier work has run: the victim dies between calls
    if ctx.rank == victim:
        os._exit(17)
    outcomes = []
    for _ in range(2):  # the failure, then a call refused until update_ep_member()
        start = time.monotonic()
        try:
            run_elastic_round(ctx, case, buffer_name="death", device="cuda")
            outcomes.append(("none", "", time.monotonic() - start))
        except RuntimeError as err:
            outcomes.append(("RuntimeError", str(err), time.monotonic() - start))
    return buffer.path, outcomes


# What hold_outputs finds held after each step, with two output slots.
HELD_OUTPUT_SLOTS = [2, 2, 2, 2, 0]


def hold_outputs(ctx, buffer_name: str, device: str) -> list[int]:
    """Dispatches whose outputs are kept, on a buffer of the IPC path with two
    output slots: a and b take both; c finds none and copies twice; a is
    dropped and b is dropped but for a view, so d takes a's slot and e none.
    Every output is checked after all of them ran (a later dispatch never
    writes into a held one). Returns the slots held after each step."""
    from _elastic_refs import ElasticCase, received
    from _ep_refs import Case, inputs_of

    buffer = elastic_buffer_of(ctx, buffer_name)
    slots = buffer.runtime.transport.slots
    ec = ElasticCase(Case(hidden=256, experts_per_rank=2, num_topk=2, tokens=5))
    world, rank = ctx.size, ctx.rank
    inp = inputs_of(ec.base, rank, world)
    topk_idx = inp.topk_idx.to(device)
    positions = [(j, s, t) for j, (s, t, _, _) in enumerate(received(ec, world, rank))]

    def dispatch(second: bool):
        recv_x, *_ = buffer.dispatch(_inputs(ec, rank, world, second).to(device), topk_idx=topk_idx,
                                     num_experts=ec.base.experts(world), do_cpu_sync=False)
        return recv_x

    held = []
    a = dispatch(False)
    b = dispatch(True)
    held.append(slots.held)
    c = dispatch(False)
    held.append(slots.held)
    view = b[:2]
    del a, b
    d = dispatch(True)
    held.append(slots.held)
    e = dispatch(False)
    held.append(slots.held)
    where = f"rank {rank} of {world}"
    for out, second, name in ((c, False, "c (two copies)"), (d, True, "d (in a's slot)"), (e, False, "e")):
        _check_rows(ec, world, rank, out.cpu(), positions, second, f"{where}: {name}")
    _check_rows(ec, world, rank, view.cpu(), positions[:2], True, f"{where}: b's view")
    del view, c, d, e
    held.append(slots.held)
    return held
