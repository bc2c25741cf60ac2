"""ElasticBuffer's IPC path: the rows travel through the Buffer fast path's
kernels (``mooncake._ep_ipc``, CUDA IPC between the GPUs of one host), and
the layout is computed on the device (``layout_kernels``: three small
kernels on CUDA, ``rows_layout``'s tensor operations on CPU), so a dispatch
costs two calls of the EP kernels (the counts, then the rows), the layout's
kernels and a few tensor operations, and at most one
host synchronisation: none with ``do_cpu_sync=False``, which a CUDA graph
can then capture.

How the kernels serve a per-rank dispatch: they are opened with one
"expert" per rank, and each token's picks are given as the ranks they go to
(each rank once, ascending), so the kernel's per-expert deduplication is
the per-rank one, and its layout (sources in rank order, each in token
order) is ElasticBuffer's in a flat domain. A row carries the token's
payload (and FP8 scales), then its global top-k ids and weights, as bytes:
the kernels copy rows bit for bit. Combine returns rows with weight 1.0 in
ascending destination order, which is the collective path's float32 sum.

A fresh dispatch that is not expanded returns its payload in an output slot
of the kernels' region when one is free (``output_slots.py``): each rank
puts its slot in the counts row it gathers, and the peers then write each
payload straight into its final row there (``DirectHeads``), one copy
instead of two.

The transport is a seam (``dispatch``/``combine`` below): ``KernelRows``
on a GPU; the tests run the same path on CPU over an emulation built from
the group's collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._env import int_setting, positive_int
from . import rows_layout as rl
from .collective import FACTS, Outputs, call_facts, check_call_table
from .handle import EPHandle
from .host_summary import read_summary
from .layout_kernels import VECTOR_BYTES, Gathered, gather_row, layout_for
from .output_slots import OutputSlots
from .topology import Topology

ROW_ALIGN_BYTES = 256  # rows are whole multiples of the kernels' 128 bf16 channels
META_ALIGN_BYTES = 4
CHANNELS_PER_VECTOR = VECTOR_BYTES // 2  # bf16
# Calls with more bytes of rows per rank (num_max_tokens_per_rank x row
# width) than this variable says take the collective path (unset: none do).
MAX_CALL_BYTES_ENV = "MOONCAKE_EP_ELASTIC_IPC_MAX_BYTES"
# Buffers whose rows per rank (num_max_tokens_per_rank x 2 x width) take at
# most this many bytes carry each dispatch's counts with its rows (0: none do).
CARRY_BYTES_ENV = "MOONCAKE_EP_ELASTIC_CARRY_BYTES"
DEFAULT_CARRY_BYTES = 4 << 20


def carry_bytes_setting() -> int:
    """MOONCAKE_EP_ELASTIC_CARRY_BYTES, or its default when unset."""
    value = int_setting(CARRY_BYTES_ENV, "bytes", 0)
    return DEFAULT_CARRY_BYTES if value is None else value


def carries_counts(rows_bytes: int, limit: int, num_ranks: int) -> bool:
    """Whether a buffer of ``num_ranks`` ranks whose rows per rank take
    ``rows_bytes`` carries its dispatches' counts with the rows (``limit``:
    ``carry_bytes_setting()``, the same on every rank; 0: never). Such a
    dispatch needs no gather of the counts before its rows, a round trip
    between ranks fewer, which is most of a small call's time; its heads then
    come through the receive region (no direct heads: those need the counts
    before the rows are sent), a copy that costs more than the gather only for
    large calls. A rank alone has no peer rows to place (its own rows travel
    as references either way), so it carries at any size."""
    if limit <= 0 or rows_bytes <= 0:
        return False
    return num_ranks == 1 or rows_bytes <= limit


# A dispatch's gathered row, int32 words: the tokens to each of the R ranks,
# then this rank's output slot (-1: none; DirectHeads), then the call's
# FACTS, then 1 if this rank refused its arguments.
def _slot_word(num_ranks: int) -> int:
    return num_ranks


def _facts_begin(num_ranks: int) -> int:
    return _slot_word(num_ranks) + 1


@dataclass(frozen=True)
class RowFormat:
    """Byte offsets of one dispatched row: payload, scales, ids, weights.
    The kernels move a row in two parts: the head, the payload read where
    the caller's tensor is (when its rows are whole 16-byte vectors), and
    the tail, the rest, staged (small beside the payload)."""
    payload: int
    scales: int
    num_topk: int

    @classmethod
    def of(cls, data: torch.Tensor, sf: torch.Tensor | None, num_topk: int) -> "RowFormat":
        """The rows of a call with payload ``data`` and scales ``sf`` (or None)."""
        return cls(data.size(1) * data.element_size(), sf.size(1) * sf.element_size() if sf is not None else 0,
                   num_topk)

    @property
    def ids(self) -> int:
        return (self.payload + self.scales + META_ALIGN_BYTES - 1) // META_ALIGN_BYTES * META_ALIGN_BYTES

    @property
    def weights(self) -> int:
        return self.ids + 4 * self.num_topk

    @property
    def bytes(self) -> int:
        return self.weights + 4 * self.num_topk

    @property
    def head(self) -> int:
        """Bytes of a row sent from the payload itself (0: all in the tail)."""
        return self.payload if self.payload % VECTOR_BYTES == 0 else 0

    @property
    def tail(self) -> int:
        """Bytes of a row sent from the staged tail, which starts at ``head``."""
        return -(-self.bytes // VECTOR_BYTES) * VECTOR_BYTES - self.head


def row_width(hidden: int, num_topk: int) -> int:
    """bf16 channels of the kernels' rows for calls up to these sizes (bf16
    payload, or FP8 payload with float32 scales per 128 channels)."""
    payload = max(2 * hidden, hidden + 4 * ((hidden + 127) // 128))
    need = RowFormat(payload, 0, num_topk).bytes
    return (need + ROW_ALIGN_BYTES - 1) // ROW_ALIGN_BYTES * ROW_ALIGN_BYTES // 2


@dataclass(frozen=True)
class DirectHeads:
    """Heads straight into each destination's output slot (ep_ipc_group.h's
    DirectHeads): every rank's counts row as gathered (its counts per rank,
    then its slot, at word R), and this rank's own slot with
    the tensor over it (-1 and None: its rows come through the region)."""
    gathered: Gathered
    own_slot: int = -1
    own_rows: torch.Tensor | None = None


@dataclass(frozen=True)
class CarriedCounts:
    """This rank's counts row (``SendLayout.counts_row``: ``gather_row``'s
    form) that the rows' own call carries to every rank with its signals,
    and where every rank's arrives: ``into``, in the gather's form (rank
    s's at row s; count 0, zeros, for a rank not heard)."""
    row: torch.Tensor
    into: Gathered

    @classmethod
    def of(cls, row: torch.Tensor, n: int, num_ranks: int) -> "CarriedCounts":
        """For ``row`` ([1, bytes] uint8) holding ``n`` int32 words: ``into`` made empty."""
        into = Gathered(rows=torch.empty(num_ranks, row.size(1), dtype=torch.uint8, device=row.device),
                        ranges=torch.empty(1, num_ranks, dtype=torch.int64, device=row.device), n=n)
        return cls(row, into)


class KernelRows:
    """The rows through ``mooncake._ep_ipc``'s kernels, on the current stream."""

    def __init__(self, ipc_path, device: torch.device, tokens: int, width: int, num_ranks: int, timeout_us: int,
                 output_slots: int = 0):
        """``output_slots``: receive buffers lent as outputs (``output_slots.py``; the IPC group only)."""
        self.tokens, self.width, self.num_ranks = tokens, width, num_ranks
        self.timeout_us = timeout_us
        if output_slots:
            self.group = ipc_path.group_for(device, tokens, width, num_ranks, timeout_us, output_slots=output_slots)
            self.slots = OutputSlots(device, self.group.output_slots, self.group.output_slot_bytes,
                                     self.group.output_slot, self.group.lease())
        else:
            self.group = ipc_path.group_for(device, tokens, width, num_ranks, timeout_us)
            self.slots = None
        self.device = device

    def dispatch(self, head: torch.Tensor | None, tail: torch.Tensor, dest: torch.Tensor, mask: torch.Tensor,
                 zeroed_rows: int, slots: torch.Tensor | None = None, direct: DirectHeads | None = None,
                 receive: ReceivePlan | None = None, carry: CarriedCounts | None = None,
                 follows_layout_send: bool = False, own_send: dict | None = None):
        """Rows of ``head`` ([N, h] bytes, or None) then ``tail`` ([N, t]
        bytes) to the ranks of ``dest``; ``slots`` (``SendLayout.dest_slots``,
        or None: the kernels count) says where each row goes among this
        rank's; ``direct`` (with ``slots``): heads go straight into the output
        slots the destinations published. Returns the rows received at
        capacity, as head ([C, h], None without; ``direct.own_rows`` when
        given) and tail ([C, t]), each source's in token order (then zeros up
        to row ``zeroed_rows``; past those, what the buffers held), the source
        token of each row and ``(begin << 32) | count`` per source. ``receive``
        (a ``ReceivePlan`` of at most this capacity, or None): the copy blocks
        lay out its rows as they copy them, and the plan is marked made.
        ``carry`` (not with ``direct``): its row goes to every rank with the
        call, and every rank's arrives in ``carry.into``.
        ``follows_layout_send``: nothing was enqueued on the stream since the
        layout's send kernel, so the call's launch may overlap that kernel's end.
        ``own_send`` (``SendLayout.own_send``, with ``carry``): the send blocks
        build the rows from the picks and the tail's sources it names, so they
        need nothing of that kernel but the carried row."""
        capacity = self.num_ranks * self.tokens
        head_bytes = head.size(1) if head is not None else 0
        in_slot = direct is not None and direct.own_slot >= 0
        recv_head = direct.own_rows if in_slot else torch.empty(capacity, head_bytes, dtype=torch.uint8,
                                                                device=self.device)
        recv_tail = torch.empty(capacity, tail.size(1), dtype=torch.uint8, device=self.device)
        count = torch.empty(1, dtype=torch.int32, device=self.device)
        src_token = torch.empty(1, capacity, dtype=torch.int32, device=self.device)
        ranges = torch.empty(1, self.num_ranks, dtype=torch.int64, device=self.device)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        gathered = direct.gathered if direct is not None else None
        self.group.dispatch_bytes(head.data_ptr() if head is not None else 0, head_bytes, tail.data_ptr(),
                                  tail.size(1), dest.data_ptr(), tail.size(0), dest.size(1), mask.data_ptr(),
                                  self.timeout_us, 0 if in_slot else recv_head.data_ptr(), recv_tail.data_ptr(),
                                  zeroed_rows, count.data_ptr(), src_token.data_ptr(), ranges.data_ptr(), stream, "all",
                                  slots.data_ptr() if slots is not None else 0,
                                  gathered=gathered.rows.data_ptr() if gathered is not None else 0,
                                  gathered_stride=gathered.rows.size(1) // 4 if gathered is not None else 0,
                                  gathered_ranges=gathered.ranges.data_ptr() if gathered is not None else 0,
                                  slot_word=_slot_word(self.num_ranks),
                                  own_slot=direct.own_slot if direct is not None else -1,
                                  receive_layout=receive.args if receive is not None else None,
                                  carried=carry.row.data_ptr() if carry is not None else 0,
                                  carried_bytes=carry.row.size(1) if carry is not None else 0,
                                  carried_received=carry.into.rows.data_ptr() if carry is not None else 0,
                                  carried_ranges=carry.into.ranges.data_ptr() if carry is not None else 0,
                                  follows_layout_send=follows_layout_send, own_send=own_send)
        if receive is not None:
            receive.made = True
        return recv_head if head is not None else None, recv_tail, src_token, ranges

    def combine(self, y: torch.Tensor, src_token: torch.Tensor, ranges: torch.Tensor, dest: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """``y``: bf16 [rows, c], c a multiple of 8, rows >= 1 (the kernels
        take its address even when no row comes back); returns bf16 [N, c]."""
        num_tokens, num_topk = dest.shape
        channels = y.size(1)
        ones = torch.ones(num_tokens, num_topk, dtype=torch.float32, device=self.device)
        out = torch.empty(num_tokens, channels, dtype=torch.bfloat16, device=self.device)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self.group.combine(y.data_ptr(), src_token.data_ptr(), ranges.data_ptr(), dest.data_ptr(), ones.data_ptr(),
                           num_tokens, num_topk, mask.data_ptr(), self.timeout_us, out.data_ptr(), stream, "all",
                           channels)
        return out


@dataclass
class IpcRouting:
    """The native handle of an IPC-path dispatch (see ``handle.Routing`` for the collective path's)."""
    generation: object
    num_tokens: int
    hidden: int
    num_topk: int
    dest: torch.Tensor  # [N, k] destination ranks, each once, ascending (-1: none)
    dest_slots: torch.Tensor  # [N, k] each row's place among this rank's at its destination (SendLayout's)
    src_token: torch.Tensor  # the kernels' handle: token index at the source of each received row
    ranges: torch.Tensor  # the kernels' handle: (begin << 32) | count per source
    capacity: int  # C = R * num_max_tokens_per_rank: rows of the layout at capacity
    num_recv: int  # rows received (capacity when not trimmed)
    real: torch.Tensor  # [C] bool: row < rows received (ReceiveLayout.real)
    recv_topk_idx: torch.Tensor
    expansion: rl.DeviceExpansion | None
    expanded_rows: int  # rows of the expanded layout (capacity when not trimmed)
    trimmed: bool

    @property
    def rows_for_combine(self) -> int:
        return self.expanded_rows if self.expansion is not None else self.num_recv


class IpcRowsPath:
    name = "ipc"

    def __init__(self, rank: int, topo: Topology, generation: object, transport, max_tokens: int, layout=None,
                 carry_counts: bool = False):
        """``layout``: the layout's form (``layout_kernels``), None: ``layout_for`` the call's device
        (the tests give the kernels' code built for the host). ``carry_counts``
        (``carries_counts``, alike on every rank): each dispatch's counts ride
        with its rows instead of a gather before them."""
        self.rank, self.topo, self.generation = rank, topo, generation
        self.carry_counts = carry_counts
        self.transport = transport
        self.layout = layout
        self.max_tokens = max_tokens
        self.mask: torch.Tensor | None = None  # the kernels' active ranks: a rank that times out is cleared
        # The calls' shapes as device tensors, made once per shape: a copy from
        # the host cannot be captured in a CUDA graph, a warmed-up shape can.
        self._facts: dict[tuple[int, ...], torch.Tensor] = {}
        self._to_everyone: torch.Tensor | None = None  # [1, R]: one token that goes to every rank

    def _mask(self, device: torch.device) -> torch.Tensor:
        if self.mask is None:
            self.mask = torch.ones(self.topo.num_ranks, dtype=torch.int32, device=device)
        return self.mask

    def takes(self, tokens_per_rank: int, row: RowFormat) -> bool:
        """Whether this path runs a call of this shape: it fits the buffers
        opened at construction (and MOONCAKE_EP_ELASTIC_IPC_MAX_BYTES, when
        set, bounds its rows). Other calls take the collective path."""
        limit = positive_int(MAX_CALL_BYTES_ENV, "bytes")
        return (tokens_per_rank <= self.max_tokens and row.bytes <= 2 * self.transport.width
                and (limit is None or tokens_per_rank * 2 * self.transport.width <= limit))

    # ------------------------------------------------------------ dispatch
    def dispatch(self, data, sf, topk_idx, topk_weights, num_experts, tokens_per_rank, alignment, do_expand,
                 do_cpu_sync, num_sms) -> Outputs:
        num_ranks, me = self.topo.num_ranks, self.rank
        num_tokens, hidden = data.shape
        num_topk = topk_idx.size(1)
        num_local = num_experts // num_ranks
        device = data.device
        capacity = num_ranks * tokens_per_rank
        row = RowFormat.of(data, sf, num_topk)

        facts = call_facts(tokens_per_rank, hidden, num_topk, num_experts, sf is not None, topk_weights is not None,
                           do_expand)
        layout = self._layout(device, num_topk)
        own_slot, own_rows = self._take_slot(capacity, row, do_expand)
        # Gathered after the counts: this rank's output slot, the call's shape, not refused.
        shape = self._shape_row(facts, own_slot, device)
        mask = self._mask(device)
        # The slot is offered only while this rank hears every rank: a receiver
        # that gave up on a source lays its rows out without it, where senders
        # that still count it would misplace theirs (DirectHeads).
        sent = layout.send(data, sf, row, topk_idx, topk_weights, num_local, num_ranks, shape,
                           offer_word=_slot_word(num_ranks) if self.transport.slots is not None else -1,
                           active_ranks=mask)
        dest = sent.dest
        # Counts per destination and the call's shape, from every rank, on the
        # stream (no wait on the host): the handle's dst_buffer_slot_idx needs
        # where this rank's block starts at each destination. Carried by the
        # rows' call itself, or gathered before it (then heads may go straight
        # into the destinations' output slots).
        gathered, carry = self._exchange_counts(sent.counts_row, num_ranks + shape.numel(), mask,
                                                follows_layout_send=True)
        heads_direct = carry is None and self.transport.slots is not None
        direct = DirectHeads(gathered, own_slot, own_rows) if heads_direct else None
        # The kernels' layout of the rows received, made by the rows' own call where the transport can.
        plan = layout.plan_receive(sent, gathered, row, capacity, me, num_local, tokens_per_rank,
                                   topk_weights is not None)
        # Rows past the received ones are cut (do_cpu_sync), or read through
        # the expansion, which never picks them; else they are the output's zeros.
        recv_head, recv_tail, src_token, ranges = self.transport.dispatch(
            sent.head, sent.tail, dest, mask, zeroed_rows=0 if do_cpu_sync or do_expand else capacity,
            slots=sent.dest_slots, direct=direct, receive=plan, carry=carry, follows_layout_send=carry is not None,
            own_send=sent.own_send if carry is not None else None)
        received = ReceivedRows(row, recv_head, recv_tail, capacity)
        got = layout.receive(sent, gathered, ranges, src_token, received, me, num_local, tokens_per_rank,
                             topk_weights is not None, plan=plan)
        local, weights, meta = got.local, got.weights, got.metadata

        expansion = rl.expand(local, num_local, alignment) if do_expand else None
        if expansion is None:
            per_expert, expert_psum = got.per_expert, got.expert_psum
            recv_x = received.payload(data, sf, got.real, None)
            recv_w = weights
        else:
            meta[:, 2:] = expansion.slots.to(torch.int32)
            per_expert, expert_psum = expansion.counts, expansion.ends
            recv_x = received.payload(data, sf, got.real, expansion)
            recv_w = rl.place_expanded_weights(weights, expansion) if weights is not None else None

        num_recv, expanded_rows = capacity, expansion.dummy if expansion is not None else 0
        per_expert_list: list[int] = []
        if do_cpu_sync:
            # The one synchronisation: sizes, the shape agreement, and who answered.
            total = expansion.ends[-1:] if expansion is not None and num_local else None
            summary = read_summary(gathered, _facts_begin(num_ranks), ranges, per_expert, total, mask)
            self._check_answered(summary.mask)
            check_call_table(summary.facts)
            num_recv = sum(summary.recv_count)
            per_expert_list = summary.per_expert
            if expansion is not None:
                expanded_rows = summary.total if summary.total is not None else 0
            cut = expanded_rows if expansion is not None else num_recv
            recv_x = _first_rows(recv_x, cut)
            if recv_w is not None:
                recv_w = recv_w[:cut]
            local, meta = local[:num_recv], meta[:num_recv]

        routing = IpcRouting(generation=self.generation, num_tokens=num_tokens, hidden=hidden, num_topk=num_topk,
                             dest=dest, dest_slots=sent.dest_slots, src_token=src_token, ranges=ranges,
                             capacity=capacity, num_recv=num_recv, real=got.real, recv_topk_idx=local,
                             expansion=expansion, expanded_rows=expanded_rows, trimmed=do_cpu_sync)
        handle = EPHandle(
            do_expand=do_expand, num_experts=num_experts, expert_alignment=alignment,
            num_max_tokens_per_rank=tokens_per_rank, num_sms=num_sms, topk_idx=_own_copy(topk_idx, sent.topk_copy),
            num_recv_tokens_per_expert_list=per_expert_list,
            psum_num_recv_tokens_per_scaleup_rank=got.scaleup_psum,
            psum_num_recv_tokens_per_expert=expert_psum.to(torch.int32),
            recv_src_metadata=meta, dst_buffer_slot_idx=got.slots, native_handle=routing)
        return Outputs(recv_x, local, recv_w, handle)

    def _take_slot(self, capacity: int, row: RowFormat, do_expand: bool) -> tuple[int, torch.Tensor | None]:
        """An output slot for this dispatch's payload, when the transport
        has them and the payload is returned as received: (-1, None) when
        expanded (each row is copied to its experts' places anyway), sent in
        the tail, or when every slot is held."""
        if self.transport.slots is None or self.carry_counts or do_expand or not row.head:
            return -1, None
        return self.transport.slots.take(capacity, row.head)

    def _layout(self, device: torch.device, num_topk: int = 0):
        return self.layout if self.layout is not None else layout_for(device, num_topk)

    def _shape_row(self, facts: list[int], own_slot: int, device: torch.device) -> torch.Tensor:
        """``(own_slot, *facts, 0)`` as int32 on ``device``: a row of a table
        made at a shape's first call, with a row for every slot value (-1 ..
        slots - 1), so that a captured call whose slot differs from the
        eager ones' still finds its row made (a copy from the host cannot be
        captured)."""
        key = tuple(facts)
        if key not in self._facts:
            count = self.transport.slots.count if self.transport.slots is not None else 0
            rows = [(slot, *facts, 0) for slot in range(-1, count)]
            self._facts[key] = torch.tensor(rows, dtype=torch.int32, device=device)
        return self._facts[key][own_slot + 1]

    def _exchange_counts(self, row: torch.Tensor, n: int, mask: torch.Tensor,
                         follows_layout_send: bool = False) -> tuple[Gathered, CarriedCounts | None]:
        """Where every rank's counts row (``row``, ``n`` int32) will be, and how
        it travels: gathered now by a call of its own (carry None), or carried
        by the rows' call that follows, which must pass the returned carry
        (the Gathered is then filled by that call). ``follows_layout_send``:
        as ``KernelRows.dispatch``'s, for the gather."""
        if self.carry_counts:
            carry = CarriedCounts.of(row, n, self.topo.num_ranks)
            return carry.into, carry
        return self._gather(row, n, mask, follows_layout_send), None

    def _gather(self, row: torch.Tensor, n: int, mask: torch.Tensor, follows_layout_send: bool = False) -> Gathered:
        """Every rank's ``n`` int32 (``row``, ``gather_row``'s form), through
        the kernels themselves (one token that goes to every rank), so that a
        rank that died is given up on within the kernels' bound, as for the
        rows. A rank given up on reads as zeros (``Gathered.table``), and
        stays cleared in ``mask``."""
        num_ranks = self.topo.num_ranks
        if self._to_everyone is None:
            self._to_everyone = torch.arange(num_ranks, dtype=torch.int64, device=row.device).view(1, num_ranks)
        _, recv, _, ranges = self.transport.dispatch(None, row, self._to_everyone, mask, zeroed_rows=0,
                                                     follows_layout_send=follows_layout_send)
        return Gathered(rows=recv, ranges=ranges, n=n)

    def _check_answered(self, mask: list[int]) -> None:
        """A rank the kernels gave up on stays cleared in the mask: it is
        reported by the first synchronised call after it (and the buffer then
        refuses calls until update_ep_member())."""
        silent = [r for r in range(self.topo.num_ranks) if not mask[r]]
        if silent:
            raise RuntimeError(f"ranks {silent} did not take part in the dispatch in time (the kernels' wait is bounded "
                               "by num_gpu_timeout_secs)")

    def join_refused(self, device: torch.device) -> None:
        """This rank refused its arguments: it still takes its part in the
        collectives and the kernels' call (sending nothing), saying so; the
        others raise at their synchronisation."""
        num_ranks = self.topo.num_ranks
        mine = torch.zeros(_facts_begin(num_ranks) + len(FACTS) + 1, dtype=torch.int32, device=device)
        mine[_slot_word(num_ranks)] = -1  # no output slot: the peers' rows come through the region
        mine[-1] = 1
        mask = self._mask(device)
        nothing = torch.empty(0, VECTOR_BYTES, dtype=torch.uint8, device=device)
        no_dest = torch.empty(0, 1, dtype=torch.int64, device=device)
        gathered, carry = self._exchange_counts(gather_row(mine), mine.numel(), mask)  # the calls the others make
        self.transport.dispatch(None, nothing, no_dest, mask, zeroed_rows=0, carry=carry)
        check_call_table(gathered.table()[:, _facts_begin(num_ranks):].tolist())

    def dispatch_cached(self, data, sf, handle: EPHandle) -> Outputs:
        routing: IpcRouting = handle.native_handle
        row = RowFormat.of(data, sf, 0)  # the payload (and scales) only
        head, tail = self._layout(data.device).send_rows(data, sf, row)
        recv_head, recv_tail, _, _ = self.transport.dispatch(
            head, tail, routing.dest, self._mask(data.device),
            zeroed_rows=0 if routing.trimmed or routing.expansion is not None else routing.capacity,
            slots=routing.dest_slots)
        recv_x = ReceivedRows(row, recv_head, recv_tail, routing.capacity).payload(data, sf, routing.real,
                                                                                 routing.expansion)
        if routing.trimmed:
            recv_x = _first_rows(recv_x, routing.rows_for_combine)
        return Outputs(recv_x, routing.recv_topk_idx.clone(), None, handle)

    # ------------------------------------------------------------- combine
    def combine(self, x: torch.Tensor, handle: EPHandle) -> torch.Tensor:
        routing: IpcRouting = handle.native_handle
        if routing.expansion is not None:
            back = rl.reduce_expanded(x, routing.expansion.slots).to(torch.bfloat16)
        else:
            back = x[:routing.capacity]
        # The rows as they are when they can be: bf16, contiguous, whole
        # 16-byte vectors (the kernels' unit), else padded to them.
        hidden = routing.hidden
        channels = -(-hidden // CHANNELS_PER_VECTOR) * CHANNELS_PER_VECTOR
        if channels == hidden:
            y = back.to(torch.bfloat16).contiguous()
            if y.data_ptr() % VECTOR_BYTES:
                y = y.clone()
        else:
            y = torch.zeros(back.size(0), channels, dtype=torch.bfloat16, device=x.device)
            y[:, :hidden] = back
        if y.size(0) == 0:  # no row came here (trimmed outputs): the kernels still take y's address
            y = torch.empty(1, channels, dtype=torch.bfloat16, device=x.device)
        out = self.transport.combine(y, routing.src_token, routing.ranges, routing.dest, self._mask(x.device))
        return out if channels == hidden else out[:, :hidden].contiguous()


class ReceivedRows:
    """The rows a dispatch received, at capacity: the head (payload) where
    it was sent apart, and the tail; fields by their offsets in the row."""

    def __init__(self, row: RowFormat, head: torch.Tensor | None, tail: torch.Tensor, capacity: int):
        """``capacity``: the call's rows at capacity (the buffers hold those of the largest call)."""
        self.row = row
        self.head = head[:capacity] if head is not None else None
        self.tail = tail[:capacity]

    def field(self, begin: int, end: int) -> torch.Tensor:
        """[C, end - begin] bytes of each row (the head, or a slice of the tail)."""
        if self.head is not None and (begin, end) == (0, self.row.head):
            return self.head
        return self.tail[:, begin - self.row.head:end - self.row.head]

    def payload(self, data, sf, real, expansion):
        """The received payload (and scales) at capacity: rows as received
        (a head received apart is returned as it is: the kernels zeroed the
        rows past ``real`` where it matters), or one copy per expanded row."""
        def values(begin: int, end: int, like: torch.Tensor) -> torch.Tensor:
            part = self.field(begin, end)
            if expansion is not None:
                out = rl.place_expanded(part, expansion)
            elif part is self.head:
                out = part
            else:
                out = torch.where(real.unsqueeze(1), part, 0)
            return out.view(like.dtype)

        row = self.row
        payload = values(0, row.payload, data)
        if sf is None:
            return payload
        return payload, values(row.payload, row.payload + row.scales, sf)


def _own_copy(topk_idx: torch.Tensor, made: torch.Tensor | None) -> torch.Tensor:
    """The handle's own copy of the picks: the one the layout's kernel made
    (int64, as the picks are when they come as int64), else a clone."""
    if made is not None and topk_idx.dtype == made.dtype and topk_idx.shape == made.shape:
        return made
    return topk_idx.clone()


def _first_rows(recv_x, rows: int):
    """``recv_x`` (a tensor, or FP8 data and scales) cut to its first ``rows``."""
    return tuple(t[:rows] for t in recv_x) if isinstance(recv_x, tuple) else recv_x[:rows]
