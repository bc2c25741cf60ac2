"""Code in the style of the reference's examples and tests, checked by
`mypy --strict` against this package's types (scripts/run_tests.sh): the
transfer engine, the process-group helpers, the EP Buffer and ElasticBuffer.
Type-checked only, never run."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mooncake import pg
from mooncake.engine import ScatterTransferCompletionStatus, TransferEngine, TransferNotify, TransferOpcode
from mooncake.mooncake_elastic_buffer import ElasticBuffer, EPHandle
from mooncake.mooncake_ep_buffer import Buffer


def transfer_engine(peer: str) -> bytes:
    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("initialize failed")
    port: int = engine.get_rpc_port()
    buf = engine.allocate_managed_buffer(1 << 20)
    assert engine.register_memory(buf, 1 << 20, "cpu:0") in (0, -7)
    engine.write_bytes_to_buffer(buf, b"hello", 5)
    rc = engine.transfer_sync_write(peer, buf, engine.get_first_buffer_address(peer), 5)
    rc |= engine.transfer_sync(peer, buf, buf, 5, TransferOpcode.Read, TransferNotify("n", "m"))
    rc |= engine.batch_transfer_sync_read(peer, [buf], [buf], [5], nic_hint="")
    batch = engine.batch_transfer_async_write(peer, [buf], [buf], [5])
    rc |= engine.get_batch_transfer_status([batch])
    addresses = np.asarray([buf], dtype=np.uint64)
    rc |= engine.batch_transfer_sync_write_arrays(peer, addresses, addresses, np.asarray([5], dtype=np.uint64))
    ticket = engine.submit_scatter_write(peer, [buf], [5], [buf], [5], [[0]], [[0]], [[5]])
    if ticket.drain(1000) != ScatterTransferCompletionStatus.COMPLETED or rc or not port:
        raise RuntimeError("transfer failed")
    notes = [n.msg for n in engine.get_notifies()]
    del notes
    return engine.read_bytes_from_buffer(buf, 5)


def process_group_helpers(group: dist.ProcessGroup) -> list[bool]:
    pg.set_host_ip("127.0.0.1")
    pg.set_device_filter(["mlx5_0"])
    options = pg.MooncakeBackendOptions(torch.ones(4, dtype=torch.int32), False, 4)
    del options
    active: torch.Tensor = pg.get_active_ranks(group)
    response = pg.recover_ranks(group, [1])
    if response.status != pg.ProposalStatus.Applied:
        return []
    work = dist.all_reduce(active, async_op=True)
    if work is not None:
        work.wait()
        hint: torch.Tensor = pg.get_failed_ranks_hint(work)
        del hint
    return pg.get_peer_state(group, [0, 1])


def ep_buffer(group: dist.ProcessGroup, x: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    size = Buffer.get_ep_buffer_size_hint(128, 7168, group.size(), 288)
    buffer = Buffer(group, size)
    active = torch.ones(group.size(), dtype=torch.int32)
    recv_x, recv_count, handle, event, hook = buffer.dispatch(x, topk_idx, active, 128, 288, 5_000_000,
                                                              use_fp8=False)
    event.current_stream_wait()
    del recv_count, hook
    y = recv_x if isinstance(recv_x, torch.Tensor) else recv_x[0].to(torch.bfloat16)  # FP8 comes as (data, scales)
    combined, _, _ = buffer.combine(y, topk_idx, weights, active, 5_000_000, handle)
    buffer.update_ep_member()
    return combined


def elastic_buffer(x: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    buffer = ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=128, hidden=4096, num_topk=8,
                           explicitly_destroy=True)
    recv_x, recv_idx, recv_w, handle, _ = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights,
                                                          num_experts=256, do_cpu_sync=True)
    assert isinstance(handle, EPHandle) and int(handle.psum_num_recv_tokens_per_scaleup_rank[-1]) >= 0
    del recv_idx, recv_w
    out, _, event = buffer.combine(recv_x if isinstance(recv_x, torch.Tensor) else recv_x[0], handle)
    event.current_stream_wait()
    buffer.destroy()
    return out


def elastic_mode_buffer(store: Any, rank: int, x: torch.Tensor, topk_idx: torch.Tensor,
                        weights: torch.Tensor) -> torch.Tensor:
    # `store` is a dist.TCPStore, a name torch does not export to type checkers.
    buffer = Buffer.create_elastic(rank=rank, tcp_store_group=store, timeout_ms=30000, explicitly_destroy=True)
    buffer.update_memory_buffers(8, 36, Buffer.get_low_latency_buffer_size_hint(128, 7168, 8, 288))
    buffer.connect_ranks([r for r in range(8) if r != rank])
    recv_x, recv_count, handle, event, hook = buffer.dispatch(x, topk_idx, 128, use_fp8=False)
    event.current_stream_wait()
    del recv_count, hook
    y = recv_x if isinstance(recv_x, torch.Tensor) else recv_x[0].to(torch.bfloat16)
    combined, _, _ = buffer.combine(y, topk_idx, weights, handle)
    status = torch.zeros(8, dtype=torch.int32)
    buffer.update_mask_buffer(3, True)
    buffer.query_mask_buffer(status)
    buffer.clean_mask_buffer()
    buffer.disconnect_ranks([3])
    buffer.barrier()
    buffer.destroy()
    return combined
