"""The IPC path's layout in two implementations with one face: ``TorchLayout``
(``rows_layout``'s tensor operations: the CPU implementation, and the
reference of the tests) and ``KernelLayout`` (the same rules in three CUDA
kernels of ``mooncake._ep_ipc``, mooncake-ep/src/elastic_layout.cu). On a
GPU the torch form was about 60 small operations, longer than the EP kernels
themselves (docs/benchmarks/ep_cuda.md); the kernels are launched on the
current stream with no host synchronisation, so a CUDA graph captures them.

``layout_for`` is the one place the choice is made:
``MOONCAKE_EP_ELASTIC_LAYOUT=torch`` keeps the torch form on CUDA too.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from . import rows_layout as rl

LAYOUT_ENV = "MOONCAKE_EP_ELASTIC_LAYOUT"
VECTOR_BYTES = 16  # the EP kernels copy rows in 16-byte vectors
MAX_KERNEL_TOPK = 32  # kMaxLayoutTopk (mooncake/ep/cuda/elastic_layout.h)
SEND_TILE_TOKENS = 256  # kLayoutSendTileTokens (the same header; layout_send refuses a smaller scratch)


def layout_for(device: torch.device, num_topk: int = 0):
    """The layout of the IPC path's calls on ``device`` with ``num_topk``
    picks per token: the kernels on CUDA (up to MAX_KERNEL_TOPK picks) unless
    MOONCAKE_EP_ELASTIC_LAYOUT=torch, the torch form elsewhere."""
    choice = os.environ.get(LAYOUT_ENV, "").strip().lower() or "kernels"
    if choice not in ("kernels", "torch"):
        raise ValueError(f"{LAYOUT_ENV}: must be 'kernels' or 'torch', got {choice!r}")
    takes = device.type == "cuda" and choice == "kernels" and num_topk <= MAX_KERNEL_TOPK
    return KERNELS if takes else TORCH


@dataclass
class Gathered:
    """Every rank's ``[n]`` int32 (its counts per destination, then its
    output slot and the call's shape) as the EP kernels delivered them here: the received rows
    and their ranges, one row per source that answered."""
    rows: torch.Tensor  # [C, bytes] uint8, contiguous: source s's at row ranges[s] >> 32
    ranges: torch.Tensor  # [1, R] int64: (begin << 32) | count per source
    n: int
    _table: torch.Tensor | None = None

    def table(self) -> torch.Tensor:
        """[R, n] int32, zeros for a rank given up on (made once; the
        kernels read the rows themselves, which saves these operations)."""
        if self._table is None:
            count, begin = self.ranges.view(-1) & 0xFFFFFFFF, self.ranges.view(-1) >> 32
            got = self.rows[:, :4 * self.n][begin.clamp(max=self.rows.size(0) - 1)].contiguous().view(torch.int32)
            self._table = torch.where((count > 0).unsqueeze(1), got, 0)
        return self._table


def gather_row(values: torch.Tensor) -> torch.Tensor:
    """[1, bytes] uint8: ``values`` ([n] int32) zero-padded to whole 16-byte
    vectors, the row in which they are sent to every rank."""
    n = values.numel()
    row = torch.zeros(1, -(-4 * n // VECTOR_BYTES) * VECTOR_BYTES, dtype=torch.uint8, device=values.device)
    row[0, :4 * n] = values.view(torch.uint8)
    return row


@dataclass
class SendLayout:
    """What a dispatch sends, from this rank's picks."""
    dest: torch.Tensor  # [N, k] int64: destination ranks, each once, ascending (-1: none)
    # [N, k] int32 beside dest: the token's row among those this rank sends to
    # that destination (-1 where none): the EP kernels' pick_slots.
    dest_slots: torch.Tensor
    counts_row: torch.Tensor  # gather_row of the tokens sent to each rank ([R] int32), then the call's shape
    head: torch.Tensor | None  # [N, head] bytes: the payload itself, or None (all in the tail)
    tail: torch.Tensor  # [N, tail] bytes
    topk_idx: torch.Tensor  # [N, k] the picks (for the slots, after the counts are gathered)
    slot_state: object  # what the slots need from the send side (per implementation)
    num_ranks: int
    # Made by the kernels' send for the rest of the call (None: the torch form):
    topk_copy: torch.Tensor | None = None  # int64 [N, k], a copy of the picks (the handle's)
    receive_counters: torch.Tensor | None = None  # int64 [L + 1] zeros, what layout_receive adds to
    # For a call of one layout tile: the rows' call's own_send (DispatchArgs::own_send), with which
    # its send blocks build the rows from the picks and the tail's sources beside layout_send.
    own_send: dict | None = None
    sources: tuple = ()  # the tensors own_send reads, kept until the rows' call is enqueued

    @property
    def counts(self) -> torch.Tensor:
        """[R] int32: tokens sent to each rank."""
        return self.counts_row[0, :4 * self.num_ranks].view(torch.int32)


@dataclass
class ReceiveLayout:
    """The layout of the rows received (C at capacity), and the handle's slots."""
    slots: torch.Tensor  # [N, k] int32: dst_buffer_slot_idx
    real: torch.Tensor  # [C] bool: row < rows received
    local: torch.Tensor  # [C, k] int64: local expert of each pick here (-1: none)
    weights: torch.Tensor | None  # [C, k] float32 (0 where no pick is here)
    metadata: torch.Tensor  # [C, k + 2] int32, columns 2.. -1 (the expanded slots go there)
    per_expert: torch.Tensor  # [L] int64: picks per local expert
    expert_psum: torch.Tensor  # [L] int32: its inclusive prefix sums (the handle's psum_num_recv_tokens_per_expert)
    scaleup_psum: torch.Tensor  # [R] int32: inclusive prefix sums of the rows per source


@dataclass
class ReceivePlan:
    """A receive layout made ready before the rows' call: its outputs, and
    ``layout_receive``'s arguments but for the rows themselves (``ranges``,
    ``src_token``, ``recv_tail``). A transport that runs the EP kernels hands
    the arguments to the rows' call, whose copy blocks then lay out each row
    as they copy it (DispatchArgs::receive_layout), and sets ``made``; else
    the layout's ``receive`` launches layout_receive after the call."""
    out: ReceiveLayout
    args: dict
    made: bool = False


def payload_rows(data: torch.Tensor, payload_bytes: int) -> torch.Tensor:
    """[N, payload_bytes] bytes of ``data``, contiguous and 16-byte aligned
    (the kernels read the head from there in 16-byte vectors)."""
    data = data.contiguous()
    if data.data_ptr() % VECTOR_BYTES:
        data = data.clone()
    return data.view(torch.uint8).view(data.size(0), payload_bytes)


class TorchLayout:
    """``rows_layout``'s operations (CPU tensors, or CUDA with MOONCAKE_EP_ELASTIC_LAYOUT=torch)."""

    @staticmethod
    def send_rows(data, sf, row, topk_idx=None, topk_weights=None):
        """The two parts of the rows: the payload itself as the head (when
        it can be), and the rest staged as the tail."""
        num_tokens = data.size(0)
        payload = payload_rows(data, row.payload)
        tail = torch.empty(num_tokens, row.tail, dtype=torch.uint8, device=data.device)

        def put(begin: int, values: torch.Tensor) -> None:
            tail[:, begin - row.head:begin - row.head + values.size(1)] = values

        if not row.head:
            put(0, payload)
        if sf is not None:
            put(row.payload, sf.contiguous().view(torch.uint8).view(num_tokens, row.scales))
        if topk_idx is not None:
            put(row.ids, topk_idx.to(torch.int32).view(torch.uint8))
        if topk_weights is not None:
            put(row.weights, topk_weights.contiguous().view(torch.uint8))
        return (payload if row.head else None), tail

    def send(self, data, sf, row, topk_idx, topk_weights, num_local: int, num_ranks: int,
             shape: torch.Tensor, offer_word: int = -1, active_ranks: torch.Tensor | None = None) -> SendLayout:
        """``shape``: [F] int32, the call's shape, gathered after the counts;
        word ``offer_word`` of the gathered row (-1: none) is -1 while any of
        ``active_ranks`` is 0 (SendLayoutArgs::offer_word)."""
        by_dest = rl.picks_by_destination(topk_idx, num_local)
        dest = rl.unique_destinations(by_dest)
        goes_to = rl.destination_table(dest, num_ranks)
        head, tail = self.send_rows(data, sf, row, topk_idx, topk_weights)
        values = torch.cat([goes_to.sum(dim=0).to(torch.int32), shape])
        if offer_word >= 0 and active_ranks is not None:
            values[offer_word] = torch.where((active_ranks != 0).all(), values[offer_word], -1)
        counts_row = gather_row(values)
        dest_slots = rl.index_among_sent(dest, goes_to).to(torch.int32)
        return SendLayout(dest=dest, dest_slots=dest_slots, counts_row=counts_row, head=head, tail=tail,
                          topk_idx=topk_idx, slot_state=(by_dest, goes_to), num_ranks=num_ranks)

    @staticmethod
    def plan_receive(sent: SendLayout, gathered: Gathered, row, capacity: int, rank: int, num_local: int,
                     tokens_per_rank: int, with_weights: bool) -> None:
        """None: the torch form lays out after the call (``receive``)."""
        return None

    def receive(self, sent: SendLayout, gathered: Gathered, ranges, src_token, received, rank: int, num_local: int,
                tokens_per_rank: int, with_weights: bool, plan: None = None) -> ReceiveLayout:
        row, capacity = received.row, received.tail.size(0)
        by_dest, goes_to = sent.slot_state
        counts = gathered.table()[:, :goes_to.size(1)]
        my_begin = torch.cumsum(counts, 0)[rank] - counts[rank]
        slots = rl.dst_slots(by_dest, goes_to, my_begin)
        recv_count = ranges.view(-1) & 0xFFFFFFFF
        rx = rl.received(recv_count, src_token.view(-1)[:capacity])
        ids = received.field(row.ids, row.weights).view(torch.int32).to(torch.int64)
        local = rl.local_picks(ids, rx.real, rank, num_local)
        per_expert = rl.per_expert_counts(local, num_local)
        weights = None
        if with_weights:
            weights = torch.where(local >= 0, received.field(row.weights, row.bytes).view(torch.float32), 0.0)
        return ReceiveLayout(slots=slots, real=rx.real, local=local, weights=weights,
                             metadata=rl.metadata(rx, local, tokens_per_rank, None),
                             per_expert=per_expert, expert_psum=torch.cumsum(per_expert, 0).to(torch.int32),
                             scaleup_psum=torch.cumsum(recv_count, 0).to(torch.int32))


def _address(t: torch.Tensor | None) -> int:
    return t.data_ptr() if t is not None else 0


class KernelLayout:
    """The kernels of mooncake-ep/src/elastic_layout.cu, on the current stream."""

    def __init__(self, kernels=None):
        """``kernels``: what has layout_send, send_tail and layout_receive
        (default: mooncake._ep_ipc, on CUDA tensors). The tests give the same
        code built for the host, on CPU tensors (_layout_emulation.py)."""
        self._module = kernels

    def _kernels(self):
        if self._module is None:
            from .. import _ep_ipc  # built with the EP kernels (CUDA builds)
            self._module = _ep_ipc
        return self._module

    @staticmethod
    def _on(device: torch.device):
        return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()

    @staticmethod
    def _stream(device: torch.device) -> int:
        return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0

    @staticmethod
    def _tail_sources(data, sf, row, topk_weights):
        """The payload (the head), and the tail with the arguments that say
        how to stage it (send_tail's, or layout_send's in the same launch),
        and the tensors those arguments point into."""
        payload = payload_rows(data, row.payload)
        tail = torch.empty(data.size(0), row.tail, dtype=torch.uint8, device=data.device)
        scales = sf.contiguous() if sf is not None else None
        weights = topk_weights.to(torch.float32).contiguous() if topk_weights is not None else None
        staging = dict(payload=_address(payload), payload_bytes=row.payload, scales=_address(scales),
                       scale_bytes=row.scales, weights=_address(weights), head_bytes=row.head, ids_at=row.ids,
                       tail=_address(tail), tail_bytes=row.tail)
        return (payload if row.head else None), tail, staging, (payload, scales, weights)

    def send_rows(self, data, sf, row, topk_idx=None, topk_weights=None):
        """As ``TorchLayout.send_rows``; the tail's padding is zeros."""
        num_tokens, device = data.size(0), data.device
        head, tail, staging, _ = self._tail_sources(data, sf, row, topk_weights)
        ids = topk_idx.to(torch.int64).contiguous() if topk_idx is not None else None
        with self._on(device):
            self._kernels().send_tail(topk_idx=_address(ids), num_tokens=num_tokens, num_topk=row.num_topk,
                                      stream=self._stream(device), **staging)
        return head, tail

    def send(self, data, sf, row, topk_idx, topk_weights, num_local: int, num_ranks: int,
             shape: torch.Tensor, offer_word: int = -1, active_ranks: torch.Tensor | None = None) -> SendLayout:
        device = topk_idx.device
        topk = topk_idx.to(torch.int64).contiguous()
        shape = shape.to(torch.int32).contiguous()
        num_tokens, num_topk = topk.shape
        dest = torch.empty(num_tokens, num_topk, dtype=torch.int64, device=device)
        dest_slots = torch.empty(num_tokens, num_topk, dtype=torch.int32, device=device)
        token_index = torch.empty(num_tokens, num_topk, dtype=torch.int32, device=device)
        words = num_ranks + shape.numel()
        counts_row = torch.empty(1, -(-4 * words // VECTOR_BYTES) * VECTOR_BYTES, dtype=torch.uint8, device=device)
        tile_counts = torch.empty(max(1, -(-num_tokens // SEND_TILE_TOKENS)) * num_ranks, dtype=torch.int32,
                                  device=device)
        # The same launch stages the tails, copies the picks and zeroes what
        # layout_receive adds to: three launches fewer per dispatch.
        head, tail, staging, sources = self._tail_sources(data, sf, row, topk_weights)
        topk_copy = torch.empty_like(topk)
        receive_counters = torch.empty(num_local + 1, dtype=torch.int64, device=device)
        with self._on(device):
            self._kernels().layout_send(topk_idx=_address(topk), num_tokens=num_tokens, num_topk=num_topk,
                                        num_local=num_local, num_ranks=num_ranks, dest=_address(dest),
                                        dest_slots=_address(dest_slots),
                                        token_index=_address(token_index), counts=_address(counts_row),
                                        count_words=counts_row.size(1) // 4, shape=_address(shape),
                                        shape_words=shape.numel(), tile_counts=_address(tile_counts),
                                        tile_count_words=tile_counts.numel(), stream=self._stream(device),
                                        offer_word=offer_word, active_ranks=_address(active_ranks),
                                        zeroed=_address(receive_counters), zeroed_words=receive_counters.numel(),
                                        topk_copy=_address(topk_copy), **staging)
        # Only where the payload is the head: a tail that holds payload bytes is built a byte at a
        # time, which layout_send's helper blocks do side by side and a sending warp would do alone.
        own_send = None
        if num_tokens <= SEND_TILE_TOKENS and row.head:
            own_send = dict(picks=_address(topk), picks_per_rank=num_local, num_tokens=num_tokens,
                            num_topk=num_topk, **{k: v for k, v in staging.items() if k != "tail"})
        return SendLayout(dest=dest, dest_slots=dest_slots, counts_row=counts_row, head=head, tail=tail, topk_idx=topk,
                          slot_state=token_index, num_ranks=num_ranks, topk_copy=topk_copy,
                          receive_counters=receive_counters, own_send=own_send, sources=sources)

    def plan_receive(self, sent: SendLayout, gathered: Gathered, row, capacity: int, rank: int, num_local: int,
                     tokens_per_rank: int, with_weights: bool) -> ReceivePlan:
        """The receive layout's outputs and arguments, before the rows' call (``ReceivePlan``)."""
        device = sent.topk_idx.device
        num_tokens, num_topk = sent.topk_idx.shape
        num_ranks = gathered.ranges.numel()
        # What the kernel adds to, zeros: the counts per expert, then its count of finished blocks
        # (zeroed by the send's kernel when it made them).
        added_to = sent.receive_counters
        if added_to is None or added_to.numel() != num_local + 1:
            added_to = torch.zeros(num_local + 1, dtype=torch.int64, device=device)
        out = ReceiveLayout(
            slots=torch.empty(num_tokens, num_topk, dtype=torch.int32, device=device),
            real=torch.empty(capacity, dtype=torch.bool, device=device),
            local=torch.empty(capacity, num_topk, dtype=torch.int64, device=device),
            weights=torch.empty(capacity, num_topk, dtype=torch.float32, device=device) if with_weights else None,
            metadata=torch.empty(capacity, num_topk + 2, dtype=torch.int32, device=device),
            per_expert=added_to[:num_local],
            expert_psum=torch.empty(num_local, dtype=torch.int32, device=device),
            scaleup_psum=torch.empty(num_ranks, dtype=torch.int32, device=device))
        # The kernel reads rows by their stride: the gathered rows are a whole, contiguous buffer.
        assert gathered.rows.is_contiguous() and gathered.ranges.is_contiguous() and gathered.rows.size(1) % 4 == 0
        args = dict(
            topk_idx=_address(sent.topk_idx), token_index=_address(sent.slot_state), gathered=_address(gathered.rows),
            gathered_stride=gathered.rows.size(1) // 4, gathered_ranges=_address(gathered.ranges),
            num_tokens=num_tokens, tail_bytes=row.tail, ids_at=row.ids - row.head,
            weights_at=row.weights - row.head if with_weights else -1, capacity=capacity, num_topk=num_topk,
            num_local=num_local, num_ranks=num_ranks, rank=rank, tokens_per_rank=tokens_per_rank,
            slots=_address(out.slots), real=_address(out.real), local=_address(out.local),
            weights=_address(out.weights), metadata=_address(out.metadata), per_expert=_address(out.per_expert),
            expert_psum=_address(out.expert_psum), scaleup_psum=_address(out.scaleup_psum),
            finished_blocks=_address(added_to[num_local:]))
        return ReceivePlan(out=out, args=args)

    def receive(self, sent: SendLayout, gathered: Gathered, ranges, src_token, received, rank: int, num_local: int,
                tokens_per_rank: int, with_weights: bool, plan: ReceivePlan | None = None) -> ReceiveLayout:
        """The layout of the rows received: ``plan``'s, made by the rows' call
        when it says so, else by a launch of layout_receive now."""
        tail = received.tail
        if plan is None:
            plan = self.plan_receive(sent, gathered, received.row, tail.size(0), rank, num_local, tokens_per_rank,
                                     with_weights)
        if plan.made:
            return plan.out
        # The kernel reads rows by their stride: the received tensors are whole, contiguous buffers.
        assert tail.is_contiguous() and ranges.is_contiguous() and src_token.is_contiguous()
        assert tail.size(1) == plan.args["tail_bytes"]
        device = tail.device
        with self._on(device):
            self._kernels().layout_receive(ranges=_address(ranges), src_token=_address(src_token),
                                           recv_tail=_address(tail), stream=self._stream(device), **plan.args)
        return plan.out


TORCH = TorchLayout()
KERNELS = KernelLayout()
