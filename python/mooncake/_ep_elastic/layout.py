"""Where the tokens of an ElasticBuffer dispatch land, and what the handle
records of it (pure tensor logic: no process group here).

Dispatch sends each token once per destination rank (however many of that
rank's experts it picked). A receiver stores the rows of its sources one
source after another, the sources in *layout order* (by scale-up index,
then scale-out index: plain rank order in a flat domain, and grouped so that
``psum_num_recv_tokens_per_scaleup_rank`` has a meaning in a hybrid one),
and inside one source in token order. So the layout is deterministic.

Expanded mode adds a copy per (received row, local pick), grouped by local
expert, each expert's block starting at a multiple of ``expert_alignment``
and ordered by received row; padding rows are zero.

Combine runs the same paths backwards: each received row (in expanded mode,
the float32 sum of its expanded rows, rounded to bf16: the first of the
"multiple reductions") goes back to its source, which adds the rows from
its destinations in destination rank order in float32 and rounds once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .topology import Topology


def layout_order(topo: Topology) -> list[int]:
    """Source ranks in the order their rows are stored at a receiver."""
    return sorted(range(topo.num_ranks), key=lambda s: (topo.scaleup_index(s), topo.scaleout_index(s)))


def destinations(per_rank: torch.Tensor) -> torch.Tensor:
    """[M] destination of each outgoing row (rows are by destination, then token)."""
    return torch.repeat_interleave(torch.arange(per_rank.numel(), device=per_rank.device), per_rank)


def block_begins(counts: torch.Tensor, order: list[int]) -> torch.Tensor:
    """``counts[s, d]`` rows from source s to destination d; returns
    ``begins[s, d]``: the first row of s's block at d."""
    ordered = counts[order]
    begins_ordered = torch.cumsum(ordered, 0) - ordered
    begins = torch.empty_like(counts)
    begins[order] = begins_ordered
    return begins


def dst_slots(topk_idx: torch.Tensor, num_local: int, per_rank: torch.Tensor, token: torch.Tensor,
              my_begins: torch.Tensor) -> torch.Tensor:
    """[N, k] int32: the row at the destination rank where each pick's token
    lands (-1 for a -1 pick). ``my_begins[d]``: where this rank's block starts at d."""
    num_ranks, (num_tokens, _) = per_rank.numel(), topk_idx.shape
    device = topk_idx.device
    dest = destinations(per_rank)
    within = torch.arange(token.numel(), device=device) - (torch.cumsum(per_rank, 0) - per_rank)[dest]
    where = torch.full((num_ranks, num_tokens), -1, dtype=torch.int64, device=device)
    where[dest, token] = my_begins[dest] + within
    valid = topk_idx >= 0
    owner = torch.where(valid, topk_idx // num_local, 0)
    slots = where[owner, torch.arange(num_tokens, device=device).unsqueeze(1)]
    return torch.where(valid, slots, -1).to(torch.int32)


def arrival_to_layout(recv_counts: list[int], order: list[int], device) -> torch.Tensor | None:
    """Rows arrive by source rank; ``perm[i]`` is the arrival index of layout
    row i (None when the two orders agree)."""
    if order == sorted(order):
        return None
    starts = [0]
    for c in recv_counts[:-1]:
        starts.append(starts[-1] + c)
    parts = [torch.arange(starts[s], starts[s] + recv_counts[s], device=device) for s in order]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=device)


def scaleup_psum(recv_counts: list[int], topo: Topology) -> list[int]:
    """Inclusive prefix sums of received rows per source scale-up index."""
    per_index = [0] * topo.num_scaleup_ranks
    for s, c in enumerate(recv_counts):
        per_index[topo.scaleup_index(s)] += c
    return inclusive_psum(per_index)


def local_picks(global_ids: torch.Tensor, rank: int, num_local: int) -> torch.Tensor:
    """Global expert ids -> this rank's local ids; -1 for picks of other ranks (and -1 picks)."""
    mine = (global_ids >= 0) & (global_ids // num_local == rank)
    return torch.where(mine, global_ids - rank * num_local, -1)


@dataclass
class Expansion:
    slots: torch.Tensor  # [n, k] int64: expanded row of each (received row, lane); -1 where none
    src_row: torch.Tensor  # [P] received row of each expanded copy
    lane: torch.Tensor  # [P] its top-k lane
    dst_row: torch.Tensor  # [P] its expanded row
    counts: list[int]  # [L] copies per local expert
    ends: list[int]  # [L] end of each expert's block (the handle's psum_num_recv_tokens_per_expert)
    total: int  # rows of the expanded layout, padding included


def expand(local: torch.Tensor, num_local: int, alignment: int) -> Expansion:
    device = local.device
    row, lane = torch.nonzero(local >= 0, as_tuple=True)  # by row, then lane
    expert = local[row, lane]
    order = torch.sort(expert, stable=True).indices  # by expert, then row
    row, lane, expert = row[order], lane[order], expert[order]
    counts = torch.bincount(expert, minlength=num_local)
    counts_list = counts.tolist()
    begins, ends, end = [], [], 0
    for c in counts_list:
        begin = (end + alignment - 1) // alignment * alignment
        begins.append(begin)
        end = begin + c
        ends.append(end)
    first = torch.cumsum(counts, 0) - counts
    dst_row = torch.tensor(begins, dtype=torch.int64, device=device)[expert] + (
        torch.arange(expert.numel(), device=device) - first[expert])
    slots = torch.full(local.shape, -1, dtype=torch.int64, device=device)
    slots[row, lane] = dst_row
    return Expansion(slots, row, lane, dst_row, counts_list, ends, end)


def per_expert_counts(local: torch.Tensor, num_local: int) -> list[int]:
    """Received rows that picked each local expert (non-expanded mode)."""
    return torch.bincount(local[local >= 0], minlength=num_local).tolist()


def inclusive_psum(counts: list[int]) -> list[int]:
    out, run = [], 0
    for c in counts:
        run += c
        out.append(run)
    return out


def metadata(source: torch.Tensor, token: torch.Tensor, local: torch.Tensor, tokens_per_rank: int,
             expanded_slots: torch.Tensor | None) -> torch.Tensor:
    """[n, k + 2] int32: column 0 the source's global token index
    (``source * num_max_tokens_per_rank + token``), column 1 how many of this
    rank's experts the token picked, columns 2.. the expanded row of each
    lane (-1 where none, and everywhere in non-expanded mode)."""
    n, k = local.shape
    out = torch.full((n, k + 2), -1, dtype=torch.int32, device=local.device)
    out[:, 0] = (source * tokens_per_rank + token).to(torch.int32)
    out[:, 1] = (local >= 0).sum(dim=1).to(torch.int32)
    if expanded_slots is not None:
        out[:, 2:] = expanded_slots.to(torch.int32)
    return out


def reduce_expanded(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[n, H] float32: per received row, the sum over its lanes (lane order) of its expanded rows of ``x``."""
    n, k = slots.shape
    total = torch.zeros(n, x.size(1), dtype=torch.float32, device=x.device)
    for lane in range(k):
        rows = torch.nonzero(slots[:, lane] >= 0).squeeze(1)
        if rows.numel():
            total[rows] += x[slots[rows, lane]].float()
    return total


def sum_returned(rows: torch.Tensor, token: torch.Tensor, per_rank: list[int], num_tokens: int) -> torch.Tensor:
    """[N, H] float32: the rows returned by each destination (blocks in
    destination order, each in token order), added destination by destination."""
    total = torch.zeros(num_tokens, rows.size(1), dtype=torch.float32, device=rows.device)
    start = 0
    for count in per_rank:
        if count:
            total.index_add_(0, token[start:start + count], rows[start:start + count].float())
        start += count
    return total
