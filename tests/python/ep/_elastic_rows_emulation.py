"""A CPU twin of ``ipc_rows.KernelRows``: the same outputs (rows received at
capacity, sources in rank order, each in token order; the token index of
each; ``(begin << 32) | count`` per source), made from the group's own
all_gather and all_to_all, so that the IPC path's layout and handles run in
CI without a GPU. Combine adds each token's returned rows in ascending
destination order in float32, as the kernels do. With output slots (CPU
memory here), a dispatch given its own slot receives the payloads there, as
the kernels' direct heads do, and checks what the slot word says."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mooncake._ep_elastic import rows_layout as rl
from mooncake._ep_elastic.output_slots import OutputSlots


class EmulatedRows:
    def __init__(self, group, rank: int, num_ranks: int, tokens: int, width: int, output_slots: int = 0):
        self.group, self.rank, self.num_ranks = group, rank, num_ranks
        self.tokens, self.width = tokens, width
        self.calls: list[str] = []  # what ran through the seam, for the tests to see
        self.direct_calls = 0  # dispatches whose payload arrived in this rank's output slot
        # Per dispatch through the seam, in order: whether it said it follows the layout's send kernel.
        self.follows_layout_send: list[bool] = []
        self.own_send_calls = 0  # dispatches that passed the layout's own_send
        self.slots = None
        if output_slots:
            slot_bytes = num_ranks * tokens * 2 * width
            arena = torch.full((output_slots * slot_bytes,), 0x5A, dtype=torch.uint8)
            self.slots = OutputSlots(torch.device("cpu"), output_slots, slot_bytes,
                                     lambda i: arena.data_ptr() + i * slot_bytes, lease=arena)

    def _all_to_all(self, send, send_counts, recv_counts):
        recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
        dist.all_to_all_single(recv, send.contiguous(), output_split_sizes=recv_counts,
                               input_split_sizes=send_counts, group=self.group)
        return recv

    def dispatch(self, head, tail, dest, mask, zeroed_rows, slots=None, direct=None, receive=None, carry=None,
                 follows_layout_send=False, own_send=None):
        # Nothing times out here; the layout of the rows received is left to the
        # layout's own launch (the plan stays unmade), as a transport without the EP kernels does.
        del mask, receive
        self.calls.append("dispatch")
        self.follows_layout_send.append(follows_layout_send)
        # The kernels' send blocks build from own_send the very rows given here (head, tail, slots).
        self.own_send_calls += own_send is not None
        assert own_send is None or carry is not None, "own_send goes with a carried row"
        if carry is not None:  # every rank's row, rank s's at row s, all heard
            assert direct is None, "a carried row and direct heads exclude each other"
            assert carry.row.size(0) == 1 and carry.row.size(1) % 16 == 0 and carry.row.size(1) <= 512
            dist.all_gather_into_tensor(carry.into.rows, carry.row.contiguous(), group=self.group)
            carry.into.ranges.copy_((torch.arange(self.num_ranks, dtype=torch.int64) << 32 | 1).view(1, -1))
        num_ranks = self.num_ranks
        head_bytes = head.size(1) if head is not None else 0
        assert head_bytes % 16 == 0 and tail.size(1) % 16 == 0, "the kernels move whole 16-byte vectors"
        assert head_bytes + tail.size(1) <= 2 * self.width, "a row is at most the kernels' width"
        # Messages of the kernels' whole width, as in their receive region:
        # ranks may send parts of other sizes (a rank that refused its call sends none).
        rows = torch.zeros(tail.size(0), 2 * self.width, dtype=torch.uint8)
        rows[:, :head_bytes + tail.size(1)] = torch.cat([head, tail], dim=1) if head is not None else tail
        goes_to = rl.destination_table(dest, num_ranks)
        to_rank, token = torch.nonzero(goes_to.t(), as_tuple=True)  # by destination, then token
        send_counts = goes_to.sum(dim=0)
        if slots is not None:  # the kernels put each row where its slot says: it must be the n-th row to that rank
            n = torch.arange(to_rank.numel()) - (torch.cumsum(send_counts, 0) - send_counts)[to_rank]
            column = (dest[token] == to_rank.unsqueeze(1)).to(torch.int32).argmax(dim=1)
            want = torch.full(dest.shape, -1, dtype=torch.int32)
            want[token, column] = n.to(torch.int32)
            assert torch.equal(slots.cpu(), want), "pick_slots: not each row's index among those sent to its rank"
        table = torch.empty(num_ranks * num_ranks, dtype=torch.int64)
        dist.all_gather_into_tensor(table, send_counts, group=self.group)
        if direct is not None:  # what the kernels read: each rank's counts, then its slot
            assert self.slots is not None and slots is not None, "direct heads need output slots and pick_slots"
            gathered = direct.gathered.table()
            assert torch.equal(gathered[:, :num_ranks].to(torch.int64).view(-1), table), "the gathered counts"
            # This rank's own slot, or -1 while it gave up on a rank (the offer is withdrawn; the
            # kernels then copy the payloads into the slot from the region).
            assert int(gathered[self.rank, num_ranks]) in (direct.own_slot, -1), "the slot word"
            if direct.own_slot >= 0:
                assert direct.own_rows.data_ptr() == self.slots.address(direct.own_slot)
        counts = table.view(num_ranks, num_ranks)[:, self.rank]
        got = self._all_to_all(rows[token], send_counts.tolist(), counts.tolist())
        got_token = self._all_to_all(token.to(torch.int32), send_counts.tolist(), counts.tolist())
        capacity = num_ranks * self.tokens
        # Past the rows received and the zeros asked for: bytes of no meaning,
        # as the kernels' outputs hold there, so that nothing relies on them.
        recv = torch.full((capacity, rows.size(1)), 0xA5, dtype=torch.uint8)
        recv[got.size(0):max(got.size(0), zeroed_rows)] = 0
        recv[:got.size(0)] = got
        src_token = torch.full((1, capacity), -1, dtype=torch.int32)
        src_token[0, :got.size(0)] = got_token
        begins = torch.cumsum(counts, 0) - counts
        recv_head = recv[:, :head_bytes].contiguous() if head is not None else None
        if direct is not None and direct.own_slot >= 0 and head is not None:
            # Rows past those received and zeroed keep what the slot held, as on the device.
            direct.own_rows[:max(got.size(0), zeroed_rows)] = recv_head[:max(got.size(0), zeroed_rows)]
            recv_head = direct.own_rows
            self.direct_calls += 1
        recv_tail = recv[:, head_bytes:head_bytes + tail.size(1)].contiguous()
        return recv_head, recv_tail, src_token, ((begins << 32) | counts).view(1, num_ranks)

    def combine(self, y, src_token, ranges, dest, mask):
        del src_token, mask
        self.calls.append("combine")
        num_ranks = self.num_ranks
        counts = (ranges.view(-1) & 0xFFFFFFFF)
        goes_to = rl.destination_table(dest, num_ranks)
        sent = goes_to.sum(dim=0)
        assert y.dtype == torch.bfloat16 and y.size(1) % 8 == 0 and y.size(1) <= self.width
        assert y.data_ptr() != 0, "the kernels take y's address even when no row comes back (the binding refuses 0)"
        back = self._all_to_all(y[:int(counts.sum())], counts.tolist(), sent.tolist())
        total = torch.zeros(dest.size(0), y.size(1), dtype=torch.float32)
        start = 0
        for d in range(num_ranks):
            tokens = torch.nonzero(goes_to[:, d]).squeeze(1)
            total.index_add_(0, tokens, back[start:start + tokens.numel()].float())
            start += tokens.numel()
        return total.to(torch.bfloat16)
