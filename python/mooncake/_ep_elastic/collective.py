"""ElasticBuffer dispatch and combine from the process group's own
operations: one all-gather of the per-destination counts (with the call's
shape, so that ranks calling with different shapes all fail alike), then
one all-to-all of the rows; combine is one all-to-all back. Any device the
group takes (CPU tensors on ``mooncake-cpu``, CUDA tensors on ``mooncake``
or ``nccl``), any shape. The layout rules are in ``layout``."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .._ep_collective.exchange import Exchange, wait
from .._ep_collective.group import work_failure_reader
from .._ep_collective.routing import byte_rows, token_rows
from . import layout
from .handle import EPHandle, Routing
from .topology import Topology

# The call's shape, gathered beside the counts: every rank must agree on these.
FACTS = ("num_max_tokens_per_rank", "hidden", "num_topk", "num_experts", "fp8 input", "topk_weights given",
         "do_expand")


def call_facts(tokens_per_rank: int, hidden: int, num_topk: int, num_experts: int, fp8: bool, weights: bool,
               do_expand: bool) -> list[int]:
    """The values of ``FACTS`` for one call."""
    return [tokens_per_rank, hidden, num_topk, num_experts, int(fp8), int(weights), int(do_expand)]


def check_call_table(seen: list[list[int]]) -> None:
    """``seen[r]``: rank r's ``FACTS`` values, then 1 if it refused its own
    arguments. Raises the same error on every rank (all read the same table)."""
    refusing = [r for r, row in enumerate(seen) if row[-1]]
    if refusing:
        raise ValueError(f"dispatch: ranks {refusing} refused their arguments (their own error says why); no row "
                         "moved, and the buffer takes the next call")
    for i, name in enumerate(FACTS):
        values = [row[i] for row in seen]
        if len(set(values)) > 1:
            raise ValueError(f"{name}: every rank must dispatch with the same value; rank by rank: {values}")


@dataclass
class Outputs:
    recv_x: torch.Tensor | tuple
    recv_topk_idx: torch.Tensor
    recv_topk_weights: torch.Tensor | None
    handle: EPHandle


class CollectivePath:
    name = "collective"

    def __init__(self, group, rank: int, topo: Topology, generation: object, timeout: timedelta):
        self.group = group
        self.rank = rank
        self.topo = topo
        self.generation = generation
        self.timeout = timeout
        self.exchange = Exchange(group, rank, topo.num_ranks, check=self._check_work)
        self.everyone = list(range(topo.num_ranks))
        self._failed_ranks = work_failure_reader(group)

    def _check_work(self, work) -> None:
        """A Mooncake group completes an operation that lost a peer and reports it: raise here."""
        failed = self._failed_ranks(work)
        if failed:
            seats = "an unknown rank" if failed == [-1] else f"ranks {failed}"
            raise RuntimeError(f"{seats} failed during the exchange")

    def _timeout_for(self, t: torch.Tensor) -> timedelta | None:
        # CUDA Works complete on their stream; the group's own failure detection bounds them.
        return self.timeout if t.device.type == "cpu" else None

    def _rows(self, send, send_counts, recv_counts):
        return self.exchange.rows(send, send_counts, recv_counts, self.everyone, self._timeout_for(send))

    # ------------------------------------------------------------ dispatch
    def dispatch(self, data, sf, topk_idx, topk_weights, num_experts, tokens_per_rank, alignment, do_expand,
                 do_cpu_sync, num_sms) -> Outputs:
        num_ranks, me = self.topo.num_ranks, self.rank
        num_tokens, hidden = data.shape
        num_topk = topk_idx.size(1)
        num_local = num_experts // num_ranks
        device = data.device
        offer = token_rows(topk_idx, num_ranks, num_local, torch.ones(num_ranks, dtype=torch.bool, device=device))
        facts = call_facts(tokens_per_rank, hidden, num_topk, num_experts, sf is not None, topk_weights is not None,
                           do_expand)
        counts = self._gather_counts(offer.per_rank, facts)
        recv_counts = counts[:, me].tolist()
        order = layout.layout_order(self.topo)
        begins = layout.block_begins(counts, order)
        slots = layout.dst_slots(topk_idx, num_local, offer.per_rank, offer.token, begins[me])

        tokens = offer.token
        parts = [data.view(torch.uint8)[tokens]]
        if sf is not None:
            parts.append(sf.contiguous().view(torch.uint8)[tokens])
        parts.append(tokens.to(torch.int32).unsqueeze(1).view(torch.uint8))
        parts.append(topk_idx[tokens].to(torch.int32).view(torch.uint8))
        if topk_weights is not None:
            parts.append(topk_weights[tokens].view(torch.uint8))
        send_counts = offer.per_rank.tolist()
        rows = self._rows(byte_rows(parts), send_counts, recv_counts)
        to_layout = layout.arrival_to_layout(recv_counts, order, device)
        sources = torch.repeat_interleave(torch.arange(num_ranks, device=device),
                                          torch.tensor(recv_counts, device=device), output_size=rows.size(0))
        if to_layout is not None:
            rows, sources = rows[to_layout], sources[to_layout]
        num_recv = rows.size(0)

        fields = _Fields(data, sf, num_topk, topk_weights is not None)
        token = fields.take(rows, "token").view(torch.int32).squeeze(1).to(torch.int64)
        local = layout.local_picks(fields.take(rows, "ids").view(torch.int32).to(torch.int64), me, num_local)
        weights = None
        if topk_weights is not None:
            weights = torch.where(local >= 0, fields.take(rows, "weights").view(torch.float32), 0.0)

        capacity_rows = num_ranks * tokens_per_rank
        out_rows = num_recv if do_cpu_sync else capacity_rows
        recv_topk_idx = torch.full((out_rows, num_topk), -1, dtype=torch.int64, device=device)
        recv_topk_idx[:num_recv] = local
        expansion = layout.expand(local, num_local, alignment) if do_expand else None
        meta = torch.full((out_rows, num_topk + 2), -1, dtype=torch.int32, device=device)
        meta[:num_recv] = layout.metadata(sources, token, local, tokens_per_rank,
                                          expansion.slots if expansion is not None else None)

        if expansion is None:
            per_expert = layout.per_expert_counts(local, num_local)
            expert_psum = layout.inclusive_psum(per_expert)
            recv_x = fields.place(rows, out_rows, None)
            recv_w = None
            if weights is not None:
                recv_w = torch.zeros(out_rows, num_topk, dtype=torch.float32, device=device)
                recv_w[:num_recv] = weights
        else:
            per_expert, expert_psum = expansion.counts, expansion.ends
            capacity_expanded = capacity_rows * num_topk + num_local * (alignment - 1)
            expanded_rows = expansion.total if do_cpu_sync else capacity_expanded
            recv_x = fields.place(rows, expanded_rows, expansion)
            recv_w = None
            if weights is not None:
                recv_w = torch.zeros(expanded_rows, dtype=torch.float32, device=device)
                recv_w[expansion.dst_row] = weights[expansion.src_row, expansion.lane]

        routing = Routing(generation=self.generation, num_tokens=num_tokens, hidden=hidden, num_topk=num_topk,
                          send_token=tokens, send_counts=send_counts, recv_counts=recv_counts, to_layout=to_layout,
                          num_recv=num_recv, recv_topk_idx=recv_topk_idx, expansion=expansion, trimmed=do_cpu_sync)
        handle = EPHandle(
            do_expand=do_expand, num_experts=num_experts, expert_alignment=alignment,
            num_max_tokens_per_rank=tokens_per_rank, num_sms=num_sms, topk_idx=topk_idx.clone(),
            num_recv_tokens_per_expert_list=list(per_expert) if do_cpu_sync else [],
            psum_num_recv_tokens_per_scaleup_rank=torch.tensor(layout.scaleup_psum(recv_counts, self.topo),
                                                               dtype=torch.int32, device=device),
            psum_num_recv_tokens_per_expert=torch.tensor(expert_psum, dtype=torch.int32, device=device),
            recv_src_metadata=meta, dst_buffer_slot_idx=slots, native_handle=routing)
        return Outputs(recv_x, recv_topk_idx, recv_w, handle)

    def _gather_counts(self, per_rank: torch.Tensor, facts: list[int], refused: bool = False) -> torch.Tensor:
        """``counts[s, d]``: rows from s to d. Ranks whose call differs in shape,
        or that refused their own arguments, get an error on every rank before
        any row moves (a rank that raised alone would leave the others paired
        with its next call)."""
        num_ranks = self.topo.num_ranks
        mine = torch.cat([per_rank, torch.tensor(facts + [int(refused)], dtype=torch.int64, device=per_rank.device)])
        table = torch.zeros(num_ranks * mine.numel(), dtype=torch.int64, device=mine.device)
        work = dist.all_gather_into_tensor(table, mine, group=self.group, async_op=True)
        wait(work, self._timeout_for(mine))
        self._check_work(work)
        table = table.view(num_ranks, mine.numel())
        check_call_table(table[:, num_ranks:].tolist())
        return table[:, :num_ranks]

    def join_refused(self, device: torch.device) -> None:
        """This rank refused its dispatch's arguments: it still meets the
        others' count exchange, saying so, and everyone raises."""
        num_ranks = self.topo.num_ranks
        self._gather_counts(torch.zeros(num_ranks, dtype=torch.int64, device=device), [0] * len(FACTS), refused=True)

    def dispatch_cached(self, data, sf, handle: EPHandle) -> Outputs:
        routing: Routing = handle.native_handle
        parts = [data.view(torch.uint8)[routing.send_token]]
        if sf is not None:
            parts.append(sf.contiguous().view(torch.uint8)[routing.send_token])
        rows = self._rows(byte_rows(parts), routing.send_counts, routing.recv_counts)
        if routing.to_layout is not None:
            rows = rows[routing.to_layout]
        fields = _Fields(data, sf, routing.num_topk, False, metadata=False)
        num_ranks = self.topo.num_ranks
        capacity_rows = num_ranks * handle.num_max_tokens_per_rank
        expansion = routing.expansion
        if expansion is None:
            out_rows = routing.num_recv if routing.trimmed else capacity_rows
        else:
            capacity = capacity_rows * routing.num_topk + (handle.num_experts // num_ranks) * (
                handle.expert_alignment - 1)
            out_rows = expansion.total if routing.trimmed else capacity
        return Outputs(fields.place(rows, out_rows, expansion), routing.recv_topk_idx.clone(), None, handle)

    # ------------------------------------------------------------- combine
    def combine(self, x: torch.Tensor, handle: EPHandle) -> torch.Tensor:
        routing: Routing = handle.native_handle
        if routing.expansion is not None:
            back = layout.reduce_expanded(x, routing.expansion.slots).to(torch.bfloat16)
        else:
            back = x[:routing.num_recv]
        arrival = routing.arrival_order()
        if arrival is not None:
            back = back[arrival]
        got = self._rows(back.contiguous(), routing.recv_counts, routing.send_counts)
        total = layout.sum_returned(got, routing.send_token, routing.send_counts, routing.num_tokens)
        return total.to(torch.bfloat16)


class _Fields:
    """Byte offsets of the fields of a dispatched row: payload, scales, then
    (fresh dispatch only) token index, top-k ids, top-k weights."""

    def __init__(self, data: torch.Tensor, sf: torch.Tensor | None, num_topk: int, weights: bool,
                 metadata: bool = True):
        self.data, self.sf = data, sf
        widths = [("payload", data.size(1) * data.element_size())]
        if sf is not None:
            widths.append(("scales", sf.size(1) * sf.element_size()))
        if metadata:
            widths += [("token", 4), ("ids", 4 * num_topk)]
            if weights:
                widths.append(("weights", 4 * num_topk))
        self.span = {}
        at = 0
        for name, width in widths:
            self.span[name] = (at, at + width)
            at += width

    def take(self, rows: torch.Tensor, name: str) -> torch.Tensor:
        """The field's bytes, in storage of their own (a slice of 0 or 1 rows
        stays a view at the field's offset, which a wider dtype cannot view)."""
        begin, end = self.span[name]
        return rows[:, begin:end].clone()

    def place(self, rows: torch.Tensor, out_rows: int, expansion: layout.Expansion | None):
        """The received payload (and scales) in the output layout: rows as
        received, or one copy per expanded row; rows past them are zero."""
        out = self._into(rows, "payload", self.data, out_rows, expansion)
        if self.sf is None:
            return out
        return out, self._into(rows, "scales", self.sf, out_rows, expansion)

    def _into(self, rows, name, like: torch.Tensor, out_rows: int, expansion):
        begin, end = self.span[name]
        out = torch.zeros(out_rows, like.size(1), dtype=like.dtype, device=rows.device) \
            if like.dtype != torch.float8_e4m3fn else \
            torch.zeros(out_rows, like.size(1), dtype=torch.uint8, device=rows.device).view(like.dtype)
        raw = out.view(torch.uint8)
        if expansion is None:
            raw[:rows.size(0)] = rows[:, begin:end]
        else:
            raw[expansion.dst_row] = rows[expansion.src_row, begin:end]
        return out
