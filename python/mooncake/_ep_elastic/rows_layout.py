"""The ElasticBuffer layout computed on the device, from received rows at
capacity: no host synchronisation, no operation whose output size depends
on values (so a dispatch can be captured in a CUDA graph). The rules are
those of ``layout`` (which the collective path computes with the sizes on
the host); the IPC path uses these, and its tests compare the two bit for
bit.

Conventions: ``rows`` is what a rank received, at capacity ``C = R * T``
rows, one source after another in rank order (a flat domain), each in token
order; only the first ``total`` are real. ``count[s]`` / ``begin[s]`` are
device tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def picks_by_destination(topk_idx: torch.Tensor, num_local: int) -> torch.Tensor:
    """[N, k]: the destination rank of each pick, -1 for a -1 pick."""
    return torch.where(topk_idx >= 0, torch.div(topk_idx, num_local, rounding_mode="floor"), -1)


def unique_destinations(by_dest: torch.Tensor) -> torch.Tensor:
    """[N, k] int64: ``by_dest`` (``picks_by_destination``) ascending per
    token, each rank once (repeats and -1 picks become -1, sorted first). Combine
    adds the destinations' rows in this order, as ``layout.sum_returned``."""
    dest = torch.sort(by_dest, dim=1).values
    if dest.size(1) > 1:
        repeat = torch.zeros_like(dest, dtype=torch.bool)
        repeat[:, 1:] = dest[:, 1:] == dest[:, :-1]
        dest = torch.where(repeat, -1, dest)
    return dest


def destination_table(dest: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """[N, R] bool: whether token t goes to rank d (``dest`` from ``unique_destinations``)."""
    num_tokens = dest.size(0)
    table = torch.zeros(num_tokens, num_ranks + 1, dtype=torch.bool, device=dest.device)
    table.scatter_(1, torch.where(dest >= 0, dest, num_ranks), True)
    return table[:, :num_ranks]


def index_among_sent(dest_of_pick: torch.Tensor, goes_to: torch.Tensor) -> torch.Tensor:
    """[N, k] int64: each pick's token's index among this rank's tokens sent
    to the pick's destination, in token order (-1 for a pick without one).
    ``dest_of_pick``: a destination per pick, -1 for none (``picks_by_destination``
    or ``unique_destinations``); ``goes_to``: ``destination_table``."""
    within = torch.cumsum(goes_to.to(torch.int64), 0) - 1  # [N, R]
    valid = dest_of_pick >= 0
    return torch.where(valid, torch.gather(within, 1, torch.where(valid, dest_of_pick, 0)), -1)


def dst_slots(dest_of_pick: torch.Tensor, goes_to: torch.Tensor, my_begin: torch.Tensor) -> torch.Tensor:
    """[N, k] int32: the row at its destination of each pick's token (-1 for a -1 pick).
    ``my_begin[d]``: where this rank's block starts at d; the rest as ``index_among_sent``."""
    valid = dest_of_pick >= 0
    slots = my_begin[torch.where(valid, dest_of_pick, 0)] + index_among_sent(dest_of_pick, goes_to)
    return torch.where(valid, slots, -1).to(torch.int32)


@dataclass
class Received:
    """Where the received rows came from (all [C] device tensors)."""
    real: torch.Tensor  # bool: row < total
    source: torch.Tensor  # int64 source rank (the last one past total)
    token: torch.Tensor  # int64 token index at the source (-1 past total)


def received(count: torch.Tensor, src_token: torch.Tensor) -> Received:
    capacity = src_token.numel()
    ends = torch.cumsum(count.to(torch.int64), 0)
    index = torch.arange(capacity, device=count.device)
    source = torch.searchsorted(ends, index, right=True).clamp_(max=count.numel() - 1)
    real = index < ends[-1]
    return Received(real=real, source=source, token=torch.where(real, src_token.to(torch.int64), -1))


def local_picks(global_ids: torch.Tensor, real: torch.Tensor, rank: int, num_local: int) -> torch.Tensor:
    """Global expert ids -> this rank's local ids; -1 elsewhere (other ranks' picks, -1 picks, rows past total)."""
    mine = (global_ids >= 0) & (torch.div(global_ids, num_local, rounding_mode="floor") == rank) & real.unsqueeze(1)
    return torch.where(mine, global_ids - rank * num_local, -1)


def per_expert_counts(local: torch.Tensor, num_local: int) -> torch.Tensor:
    """[L] int64: rows (non-expanded) or copies (expanded) per local expert."""
    flat = torch.where(local >= 0, local, num_local).reshape(-1)
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=local.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return counts[:num_local]


def metadata(rx: Received, local: torch.Tensor, tokens_per_rank: int,
             expanded_slots: torch.Tensor | None) -> torch.Tensor:
    """[C, k + 2] int32, as ``layout.metadata``, rows past total all -1."""
    n, k = local.shape
    out = torch.full((n, k + 2), -1, dtype=torch.int32, device=local.device)
    out[:, 0] = torch.where(rx.real, rx.source * tokens_per_rank + rx.token, -1).to(torch.int32)
    out[:, 1] = torch.where(rx.real, (local >= 0).sum(dim=1), -1).to(torch.int32)
    if expanded_slots is not None:
        out[:, 2:] = expanded_slots.to(torch.int32)
    return out


@dataclass
class DeviceExpansion:
    """The expanded layout of ``layout.expand``, as device tensors: one
    entry per (received row, lane) in expert-then-row order; entries
    without a local pick are sorted last and write into ``dummy`` (one row
    past the capacity, cut off)."""
    slots: torch.Tensor  # [C, k] int64: expanded row of each (row, lane), -1 where none
    src_row: torch.Tensor  # [C * k] received row of each entry
    lane: torch.Tensor  # [C * k]
    dst_row: torch.Tensor  # [C * k] expanded row, ``dummy`` where none
    counts: torch.Tensor  # [L] copies per local expert
    ends: torch.Tensor  # [L] end of each expert's block
    dummy: int  # the capacity of the expanded layout


def expand(local: torch.Tensor, num_local: int, alignment: int) -> DeviceExpansion:
    n, k = local.shape
    device = local.device
    capacity = n * k + num_local * (alignment - 1)
    flat = local.reshape(-1)
    valid = flat >= 0
    # Key: expert, then (row, lane); entries without a pick after every expert.
    key = torch.where(valid, flat, num_local) * (n * k) + torch.arange(n * k, device=device)
    order = torch.sort(key).indices
    expert = torch.where(valid, flat, num_local)[order]
    counts = per_expert_counts(local, num_local)
    aligned = (counts + alignment - 1) // alignment * alignment
    begins = torch.cumsum(aligned, 0) - aligned
    ends = begins + counts
    first = torch.cumsum(counts, 0) - counts
    is_pick = expert < num_local
    e = expert.clamp(max=num_local - 1)
    dst_row = torch.where(is_pick, begins[e] + torch.arange(n * k, device=device) - first[e], capacity)
    slots = torch.full((n * k,), -1, dtype=torch.int64, device=device)
    slots.scatter_(0, order, torch.where(is_pick, dst_row, -1))
    return DeviceExpansion(slots=slots.view(n, k), src_row=order // k, lane=order % k, dst_row=dst_row,
                           counts=counts, ends=ends, dummy=capacity)


def place_expanded(values: torch.Tensor, ex: DeviceExpansion) -> torch.Tensor:
    """One copy of row ``src_row`` of ``values`` per expanded row (zeros in padding); [capacity, ...]."""
    out = values.new_zeros((ex.dummy + 1, *values.shape[1:]))
    out[ex.dst_row] = values[ex.src_row]
    return out[:ex.dummy]


def place_expanded_weights(weights: torch.Tensor, ex: DeviceExpansion) -> torch.Tensor:
    out = weights.new_zeros(ex.dummy + 1)
    out[ex.dst_row] = weights[ex.src_row, ex.lane]
    return out[:ex.dummy]


def reduce_expanded(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[C, H] float32: per received row, its expanded rows of ``x`` added in
    lane order (as ``layout.reduce_expanded``; adding 0.0 where a lane has
    none changes no bit of a sum that starts at +0.0)."""
    n, k = slots.shape
    total = torch.zeros(n, x.size(1), dtype=torch.float32, device=x.device)
    if x.size(0) == 0:  # no expanded rows: no lane has one
        return total
    last = x.size(0) - 1
    for lane in range(k):
        at = slots[:, lane]
        rows = x[at.clamp(0, last)].float()
        total += torch.where((at >= 0).unsqueeze(1), rows, 0.0)
    return total
