"""``Buffer.create_elastic``, the reference's fixed-capacity Buffer that
joins no process group: ranks meet in a TCPStore served by this test
process, connect pairwise, and run dispatch -> mock experts -> combine
checked against the dense MoE of _ep_refs (every received row, the
combined tokens bit for bit in BF16). Also: a capacity larger than the ranks
present, a rank that crashes and its replacement, masks set by hand, a rank
that misses a barrier, the API's rules and bad input. Where CUDA is
available the Buffers take the current GPU (ranks share the GPUs
round-robin), so on a GPU host (scripts/gpu_tests.sh) the same tests run on
CUDA tensors, moved by CUDA IPC."""

import pytest
import torch
import torch.distributed as dist

from _elastic_mode_ranks import (HOST, barrier_program, collect, grid_program, kill, masking_program,
                                 replacement_program, spawn)
from _ep_refs import GRID, Case
from _harness import free_port
from mooncake.mooncake_ep_buffer import Buffer

pytestmark = pytest.mark.timeout(180)

# The grid's cases with one expert count (the buffer is sized once, for the first and largest).
ELASTIC_GRID = [
    Case(hidden=1024, experts_per_rank=8, num_topk=4, tokens=3, fp8=True, mode="hook"),
    Case(hidden=256, experts_per_rank=8, num_topk=3, tokens=9, mode="async"),
    Case(hidden=128, experts_per_rank=8, num_topk=2, tokens=5, masked=0.2),
    Case(hidden=512, experts_per_rank=8, num_topk=8, tokens=2, masked=0.3, fp8=True),
    Case(hidden=128, experts_per_rank=8, num_topk=6, tokens=12, masked=1.0),  # every pick masked
]


@pytest.fixture
def store_port():
    port = free_port()
    store = dist.TCPStore(HOST, port, is_master=True, wait_for_workers=False)
    yield port
    del store


def _run(program, ranks, port, count, *args, timeout=120):
    procs, results = spawn(program, ranks, port, *args)
    try:
        return collect(results, count, timeout, procs)
    finally:
        kill(procs)


@pytest.mark.parametrize("procs", [1, 2, 3])
def test_grid_against_the_dense_moe(store_port, procs):
    got = _run(grid_program, range(procs), store_port, procs, procs, procs, ELASTIC_GRID, False)
    assert got == {(r, "rounds"): len(ELASTIC_GRID) for r in range(procs)}


def test_a_capacity_larger_than_the_ranks_present(store_port):
    """Capacity 4, three ranks: num_experts over the whole capacity lays out
    four ranks' blocks, the absent rank's picks count for nothing."""
    got = _run(grid_program, range(3), store_port, 3, 3, 4, ELASTIC_GRID[1:3], True)
    assert got == {(r, "rounds"): 2 for r in range(3)}


def test_a_crashed_rank_is_masked_at_once_and_its_replacement_joins(store_port):
    case = Case(hidden=256, experts_per_rank=2, num_topk=3, tokens=6)
    capacity, victim = 3, 2
    procs, results = spawn(replacement_program, range(capacity), store_port, capacity, case, victim, False)
    try:
        early = collect(results, 2 * (capacity - 1), 90, procs)
        for r in range(capacity):
            if r == victim:
                continue
            after, masks, took = early[(r, "without")]
            assert after == [1, 1, 0] and masks == [0, 0, 1], (r, after, masks)
            # A dead peer is found by its engine's silence, not waited out (timeout 20 s).
            assert took < 5.0, (r, took)
            # By default the layout covers the active ranks only; the victim's picks count for nothing.
            assert early[(r, "default_bound")] == ((case.experts_per_rank, 2 * case.tokens, case.hidden), True)
        more, _ = spawn(replacement_program, [victim], store_port, capacity, case, victim, True, results=results)
        procs += more
        late = collect(results, capacity, 90, procs)
        assert late == {(r, "replaced"): ([1, 1, 1], [0, 0, 0]) for r in range(capacity)}
    finally:
        kill(procs)


def test_masks_set_by_hand(store_port):
    case = Case(hidden=128, experts_per_rank=3, num_topk=2, tokens=4)
    got = _run(masking_program, range(3), store_port, 7, 3, case)
    assert got[(1, "inactive_connect")] == [0, 0, 1]
    assert [got[(r, "masked")] for r in range(3)] == [[0, 0, 1], [0, 0, 1], [1, 1, 0]]
    assert [got[(r, "cleaned")] for r in range(3)] == [[0, 0, 0]] * 3


def test_a_rank_late_to_the_barrier_is_masked_at_the_timeout(store_port):
    got = _run(barrier_program, range(3), store_port, 3, 3, 2, 600)
    for r in (0, 1):
        masks, took, refused = got[(r, "barrier")]
        assert masks == [0, 0, 1], (r, masks)  # clean_mask_buffer leaves a dropped rank out
        assert 0.5 <= took < 5.0, (r, took)
        assert "dropped after a failure" in refused, refused
    masks, took = got[(2, "barrier")]
    assert masks == [1, 1, 0], masks  # the late rank learns at once that it was dropped
    assert took < 0.3, took


# ----------------------------------------------------- the rules, in one process
def _buffer(capacity=2, experts=2, **kwargs):
    buffer = Buffer.create_elastic(rank=0, **kwargs)
    buffer.update_memory_buffers(capacity, experts, Buffer.get_low_latency_buffer_size_hint(4, 128, capacity,
                                                                                            experts * capacity))
    return buffer


def test_before_update_memory_buffers_every_call_says_what_to_do_first():
    buffer = Buffer.create_elastic(rank=1)
    assert isinstance(buffer, Buffer) and buffer.runtime is None and buffer.group_size == 0
    for call in (lambda: buffer.connect_ranks([0]), lambda: buffer.barrier(), lambda: buffer.clean_mask_buffer(),
                 lambda: buffer.update_mask_buffer(0, True), lambda: buffer.get_local_buffer_tensor(torch.uint8)):
        with pytest.raises(RuntimeError, match="update_memory_buffers"):
            call()


def test_alone_it_dispatches_to_itself_and_the_mask_rules_hold():
    buffer = _buffer(capacity=3, experts=2)
    assert buffer._active_ranks.tolist() == [1, 0, 0]
    case = Case(hidden=128, experts_per_rank=2, num_topk=2, tokens=4)
    dev = buffer._active_ranks.device
    x = torch.randn(4, 128).to(torch.bfloat16).to(dev)
    topk = torch.tensor([[0, 1], [1, -1], [0, 1], [-1, -1]], device=dev)
    recv_x, count, handle, _, _ = buffer.dispatch(x, topk, case.tokens, use_fp8=False)
    assert tuple(recv_x.shape) == (2, 4, 128) and count.tolist() == [2, 3]  # rank bound 1: its own two experts
    assert torch.equal(recv_x[0, :2], x[[0, 2]]) and torch.equal(recv_x[1, :3], x[[0, 1, 2]])
    with pytest.raises(ValueError, match="local rank cannot be masked"):
        buffer.update_mask_buffer(0, True)
    with pytest.raises(ValueError, match="not connected"):
        buffer.update_mask_buffer(1, False)
    with pytest.raises(ValueError, match="capacity"):
        buffer.update_mask_buffer(3, True)
    with pytest.raises(ValueError, match="num_experts"):
        buffer.dispatch(x, topk, 4, 8)  # 4 ranks' worth of experts in a capacity of 3
    with pytest.raises(ValueError, match="mask_status"):
        buffer.query_mask_buffer(torch.zeros(2, dtype=torch.int32, device=dev))
    with pytest.raises(ValueError, match="remote_ranks"):
        buffer.connect_ranks([1, 1])
    with pytest.raises(RuntimeError, match="TCPStore"):
        buffer.connect_ranks([1])
    with pytest.raises(NotImplementedError, match="zero_copy"):
        buffer.combine(recv_x, topk, torch.ones(4, 2, device=dev), handle, zero_copy=True)
    with pytest.raises(TypeError, match="handle"):
        buffer.combine(recv_x, topk, torch.ones(4, 2, device=dev), tuple(handle))


def test_capacity_and_destroy_rules():
    with pytest.raises(ValueError, match="rank"):
        Buffer.create_elastic(rank=2).update_memory_buffers(2, 1, 1 << 20)
    with pytest.raises(ValueError, match="num_rdma_bytes"):
        Buffer.create_elastic(rank=0).update_memory_buffers(2, 1, 100)
    with pytest.raises(ValueError, match="timeout_ms"):
        Buffer.create_elastic(timeout_ms=-1)
    buffer = _buffer()
    with pytest.raises(RuntimeError, match="fixed"):
        buffer.update_memory_buffers(2, 2, 1 << 20)
    with pytest.raises(RuntimeError, match="explicitly_destroy"):
        buffer.destroy()
    owned = _buffer(explicitly_destroy=True)
    owned.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        owned.barrier()


def test_the_local_buffer_tensor_is_a_view_of_the_registered_memory():
    buffer = _buffer()
    whole = buffer.get_local_buffer_tensor(torch.uint8)
    assert whole.numel() == buffer.num_rdma_bytes and whole.data_ptr() == buffer.runtime.memory.data_ptr()
    view = buffer.get_local_buffer_tensor(torch.float32, torch.Size([4, 8]), offset=64)
    view.fill_(1.5)
    assert torch.equal(buffer.runtime.memory[64:64 + 128].view(torch.float32).cpu(), torch.full((32,), 1.5))
    with pytest.raises(ValueError, match="offset"):
        buffer.get_local_buffer_tensor(torch.float32, offset=2)
    with pytest.raises(ValueError, match="size"):
        buffer.get_local_buffer_tensor(torch.uint8, torch.Size([buffer.num_rdma_bytes + 1]))
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA stream"):
            buffer.get_comm_stream()


# ------------------------------------------------------------- the wire (pure)
def test_slots_and_send_area_never_overlap():
    from mooncake._ep_peers.wire import Region, minimum_bytes

    for ranks, total in [(1, minimum_bytes(1)), (3, 10_000), (8, Buffer.get_low_latency_buffer_size_hint(
            128, 7168, 8, 288)), (5, 1 << 20)]:
        region = Region(ranks, total)
        spans = [(0, region.send_bytes)] + [(region.slot_offset(p, s), region.slot_offset(p, s) + region.slot_bytes)
                                            for p in (0, 1) for s in range(ranks)]
        spans.sort()
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])), (ranks, total)
        assert spans[-1][1] <= total and region.slot_bytes >= 64 and region.slot_bytes % 64 == 0
        flags = {region.flag_index(p, s) for p in (0, 1) for s in range(ranks)}
        assert len(flags) == 2 * ranks and max(flags) + 3 <= 2 * ranks * 3


def test_a_flag_reads_back_only_whole():
    from mooncake._ep_peers.wire import Flag, expected, read_flag

    flag = Flag(seq=(1 << 32) + 7, incarnation=123456, count=(1 << 40) + 5)
    words = flag.words()
    back = read_flag(words)
    assert back == Flag(seq=7, incarnation=123456, count=(1 << 40) + 5)
    assert expected(back, (1 << 32) + 7, 123456) and not expected(back, 8, 123456)
    assert not expected(back, 7, 654321)
    assert read_flag([0, 0, 0]) is None  # zeroed memory
    older = Flag(seq=6, incarnation=123456, count=99).words()
    for torn in ([words[0], older[1], older[2]], [older[0], words[1], older[2]], [words[0], words[1], older[2]]):
        assert read_flag(torn) is None, torn  # a write seen half done


def test_metadata_round_trip_and_garbage():
    from mooncake._ep_peers.wire import PeerMetadata, metadata_key

    meta = PeerMetadata(segment="10.0.0.5:15000", memory=1 << 40, flags=4096, capacity=8, total=1 << 30,
                        incarnation=77, hostname="h")
    assert PeerMetadata.decode(meta.encode()) == meta
    assert metadata_key(2, 5) == "MOONCAKE_EP/2/5"
    for bad in (b"\x80", b"{}", b"[1, 2]", b'{"segment": 1}'):
        with pytest.raises(RuntimeError, match="connect_ranks"):
            PeerMetadata.decode(bad)
