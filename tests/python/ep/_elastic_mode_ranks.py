"""Rank programs of the elastic-mode Buffer tests (``Buffer.create_elastic``):
processes with no process group, meeting in a TCPStore the test process
serves, as the reference's elastic users do. Each program reports through a
queue; the test side (``spawn``/``collect``) bounds every wait and kills
what is left, so a hang fails.

Spawned ranks import this module, so it must not import pytest.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import time
import traceback

import torch

from _ep_refs import Case, inputs_of
from _ep_rounds import RANK_ENV, check_combine, check_dispatch, run_experts

HOST = "127.0.0.1"
CTX = mp.get_context("spawn")


# ---------------------------------------------------------------- test side
def spawn(program, ranks, port, *args, results=None):
    """Starts ``program(rank, port, results, *args)`` for each rank; returns (processes, queue)."""
    results = results if results is not None else CTX.Queue()
    procs = []
    for rank in ranks:
        p = CTX.Process(target=_main, args=(program, rank, port, results, args), daemon=True,
                        name=f"elastic-rank{rank}")
        p.start()
        procs.append(p)
    return procs, results


def collect(results, count: int, timeout: float, procs) -> dict:
    """``count`` reports as {(rank, label): value}; raises AssertionError
    with what came on a rank's error or at the deadline (killing every process)."""
    got = {}
    deadline = time.monotonic() + timeout
    while len(got) < count:
        try:
            rank, label, status, value = results.get(timeout=max(0.05, deadline - time.monotonic()))
        except queue_mod.Empty:
            kill(procs)
            raise AssertionError(f"only {sorted(got)} of {count} reports came within {timeout} s") from None
        if status == "err":
            kill(procs)
            raise AssertionError(f"rank {rank} ({label}) failed:\n{value}")
        got[(rank, label)] = value
    return got


def kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)


# ---------------------------------------------------------------- rank side
def _main(program, rank, port, results, args):
    os.environ.update(RANK_ENV)
    try:
        program(rank, port, results, *args)
    except BaseException:  # noqa: BLE001 - everything goes back to the test
        results.put((rank, "error", "err", traceback.format_exc()))
    results.close()
    results.join_thread()
    os._exit(0)


def elastic_buffer(rank: int, port: int, capacity: int, case: Case, timeout_ms: int = 20_000, **kwargs):
    """A Buffer.create_elastic sized by the reference's hint for ``case`` at ``capacity``."""
    import torch.distributed as dist  # noqa: PLC0415

    from mooncake.mooncake_ep_buffer import Buffer  # noqa: PLC0415

    if torch.cuda.is_available():  # the Buffer takes the current device (ranks share the GPUs round-robin)
        from mooncake._gpu_placement import gpu_of_rank  # noqa: PLC0415

        torch.cuda.set_device(gpu_of_rank(rank))
    store = dist.TCPStore(HOST, port, is_master=False, wait_for_workers=False)
    buffer = Buffer.create_elastic(rank=rank, tcp_store_group=store, timeout_ms=timeout_ms, **kwargs)
    size = Buffer.get_low_latency_buffer_size_hint(case.tokens, case.hidden, capacity,
                                                   case.experts_per_rank * capacity)
    buffer.update_memory_buffers(capacity, case.experts_per_rank, size)
    return buffer


def elastic_round(buffer, case: Case, world: int, rank: int, active: list[int], num_experts: int | None = None):
    """One dispatch -> mock experts -> combine, checked against the dense MoE
    of ``world`` ranks (inputs as _ep_refs makes them) over the ``active`` ones."""
    mine = inputs_of(case, rank, world)
    dev = buffer._active_ranks.device
    x, topk_idx, topk_weights = mine.x.to(dev), mine.topk_idx.to(dev), mine.topk_weights.to(dev)
    async_finish, with_hook = case.mode == "async", case.mode == "hook"
    recv_x, recv_count, handle, event, hook = buffer.dispatch(
        x, topk_idx, case.tokens, num_experts, use_fp8=case.fp8, async_finish=async_finish,
        return_recv_hook=with_hook)
    assert len(handle) == 4, f"rank {rank}: the elastic handle has 4 items, got {len(handle)}"
    assert (hook is not None) == with_hook
    if with_hook:
        hook()
    event.current_stream_wait()
    check_dispatch(case, world, rank, active, recv_x, recv_count, (*handle, case.experts(world)))
    slots = world * case.tokens
    outputs = torch.full((case.experts_per_rank, slots, case.hidden), float("nan"), dtype=torch.bfloat16, device=dev)
    run_experts(case, rank, recv_x, recv_count, outputs)
    combined, event, hook = buffer.combine(outputs, topk_idx, topk_weights, handle, async_finish=async_finish,
                                           return_recv_hook=with_hook)
    if with_hook:
        hook()
    event.current_stream_wait()
    check_combine(case, world, rank, active, combined)
    return buffer._active_ranks.tolist()


def masks_of(buffer) -> list[int]:
    """query_mask_buffer's answer: 1 = masked."""
    status = torch.full((buffer.group_size,), -1, dtype=torch.int32, device=buffer._active_ranks.device)
    buffer.query_mask_buffer(status)
    return status.tolist()


# ------------------------------------------------------------------ programs
def grid_program(rank: int, port: int, results, procs: int, capacity: int, cases: list[Case], explicit: bool):
    """``procs`` ranks of a ``capacity`` connect to each other and run the
    cases: with ``explicit``, num_experts covers the whole capacity (the
    ranks past ``procs`` are masked), else the default (the active bound)."""
    world = capacity if explicit else procs
    active = [1 if r < procs else 0 for r in range(world)]
    buffer = elastic_buffer(rank, port, capacity, cases[0])
    buffer.connect_ranks([r for r in range(procs) if r != rank])
    for case in cases:
        size = type(buffer).get_low_latency_buffer_size_hint(case.tokens, case.hidden, capacity,
                                                             case.experts_per_rank * capacity)
        assert size <= buffer.num_rdma_bytes, "the grid's first case must be its largest"
        assert case.experts_per_rank == cases[0].experts_per_rank
        elastic_round(buffer, case, world, rank, active, case.experts(world) if explicit else None)
    results.put((rank, "rounds", "ok", len(cases)))


def replacement_program(rank: int, port: int, results, capacity: int, case: Case, victim: int, replacement: bool):
    """Round 1 with every rank; the victim exits; round 2 without it (found
    gone, not waited out: the timeout is 20 s); then (survivors) disconnect
    it and connect the replacement, which runs round 3 with them."""
    everyone = [r for r in range(capacity) if r != rank]
    buffer = elastic_buffer(rank, port, capacity, case)
    buffer.connect_ranks(everyone)
    full = [1] * capacity
    if not replacement:
        elastic_round(buffer, case, capacity, rank, full)
        if rank == victim:
            os._exit(0)  # gone without a word, as a crash
        start = time.monotonic()
        without = [0 if r == victim else 1 for r in range(capacity)]
        after = elastic_round(buffer, case, capacity, rank, without, num_experts=case.experts(capacity))
        results.put((rank, "without", "ok", (after, masks_of(buffer), time.monotonic() - start)))
        # The default num_experts follows the active ranks (the reference's rule): the dead
        # highest rank's experts fall outside the bound, and picks of them count for nothing.
        mine = inputs_of(case, rank, capacity)
        recv_x, _, handle, _, _ = buffer.dispatch(mine.x.to(buffer._active_ranks.device),
                                                  mine.topk_idx.to(buffer._active_ranks.device), case.tokens,
                                                  use_fp8=False)
        outputs = torch.zeros_like(recv_x)
        combined, _, _ = buffer.combine(outputs, mine.topk_idx.to(recv_x.device),
                                        mine.topk_weights.to(recv_x.device), handle)
        results.put((rank, "default_bound", "ok", (tuple(recv_x.shape), bool(combined.eq(0).all()))))
        buffer.disconnect_ranks([victim])
        buffer.connect_ranks([victim])
    after = elastic_round(buffer, case, capacity, rank, full)
    results.put((rank, "replaced", "ok", (after, masks_of(buffer))))


def masking_program(rank: int, port: int, results, capacity: int, case: Case):
    """Every rank masks rank 2 (update_mask_buffer) and runs a round without
    it while rank 2 runs alone; then all unmask and run together. Rank 1
    connects rank 2 inactive first (activate=False), as the reference allows."""
    buffer = elastic_buffer(rank, port, capacity, case)
    others = [r for r in range(capacity) if r != rank]
    if rank == 1:
        buffer.connect_ranks([0])
        buffer.connect_ranks([2], activate=False)
        results.put((rank, "inactive_connect", "ok", masks_of(buffer)))
    else:
        buffer.connect_ranks(others)
    if rank == 2:
        for r in others:
            buffer.update_mask_buffer(r, True)
        elastic_round(buffer, case, capacity, rank, [0, 0, 1], num_experts=case.experts(capacity))
    else:
        buffer.update_mask_buffer(2, True)
        elastic_round(buffer, case, capacity, rank, [1, 1, 0], num_experts=case.experts(capacity))
    results.put((rank, "masked", "ok", masks_of(buffer)))
    buffer.clean_mask_buffer()
    elastic_round(buffer, case, capacity, rank, [1, 1, 1])
    results.put((rank, "cleaned", "ok", masks_of(buffer)))


def barrier_program(rank: int, port: int, results, capacity: int, late: int, timeout_ms: int):
    """Rank ``late`` stays alive but comes to the barrier only after the
    others gave up on it: they mask it at their timeout and go on."""
    case = Case(hidden=128, experts_per_rank=1, num_topk=1, tokens=1)
    buffer = elastic_buffer(rank, port, capacity, case, timeout_ms=timeout_ms)
    buffer.connect_ranks([r for r in range(capacity) if r != rank])
    buffer.barrier()  # all present
    if rank == late:
        time.sleep(3 * timeout_ms / 1000)
        # The others dropped it and told it: it does not wait for its own timeout.
        start = time.monotonic()
        buffer.barrier()
        results.put((rank, "barrier", "ok", (masks_of(buffer), time.monotonic() - start)))
        return
    start = time.monotonic()
    buffer.barrier()
    took = time.monotonic() - start
    # A rank dropped after a failure stays out until it is connected afresh.
    buffer.clean_mask_buffer()
    try:
        buffer.update_mask_buffer(late, False)
        refused = ""
    except ValueError as err:
        refused = str(err)
    results.put((rank, "barrier", "ok", (masks_of(buffer), took, refused)))
