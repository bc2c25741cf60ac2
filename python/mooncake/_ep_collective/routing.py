"""Where each (token, expert) pick goes and where it lands.

Dispatch sends each token once per destination rank (however many of that
rank's experts it picked), with a bitmap of the picked local experts; the
receiver expands it into one row per (token, local expert).

Row order, the contract of the layout (docs/ep.md):
- a sender sends its tokens to rank d in token order;
- a receiver stores, in local expert ``le``'s block, the rows of source rank
  0 first, then rank 1, ...; inside one source, in token order.
So every block is ordered by (source rank, token), deterministically.
Combine returns one row per pick along the same paths, block by block
((local expert, token) order per source), which the token's rank can
rebuild from its own picks (``plan_sends``): no index travels back.

A pick is named by its flat position ``p = token * num_topk + slot``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SendPlan:
    picks: torch.Tensor  # [M] int64 flat pick positions, in send order
    experts: torch.Tensor  # [M] int64 global expert of each pick
    counts: torch.Tensor  # [R, L] int64 picks per (destination rank, local expert)


def plan_sends(topk_idx: torch.Tensor, num_ranks: int, num_local_experts: int,
               send_to: torch.Tensor) -> SendPlan:
    """Picks to send: expert >= 0 and ``send_to[owner rank]`` true (a bool [R] tensor)."""
    flat = topk_idx.reshape(-1)
    owner = torch.where(flat >= 0, flat // num_local_experts, 0)
    keep = (flat >= 0) & send_to[owner]
    picks = torch.nonzero(keep).squeeze(1)
    experts = flat[picks]
    # Stable sort by expert keeps (token, slot) order inside each expert.
    order = torch.sort(experts, stable=True).indices
    picks, experts = picks[order], experts[order]
    counts = torch.bincount(experts, minlength=num_ranks * num_local_experts)
    return SendPlan(picks=picks, experts=experts, counts=counts.view(num_ranks, num_local_experts))


@dataclass
class TokenRows:
    """What dispatch sends: one row per (destination rank, token), in that order."""
    token: torch.Tensor  # [M] int64 token index
    experts: torch.Tensor  # [M, L] bool: the destination's local experts the token picked
    per_rank: torch.Tensor  # [R] int64 rows per destination


def token_rows(topk_idx: torch.Tensor, num_ranks: int, num_local_experts: int, send_to: torch.Tensor) -> TokenRows:
    """Rows for the ranks with ``send_to[rank]`` true (a bool [R] tensor)."""
    num_tokens = topk_idx.size(0)
    valid = topk_idx >= 0
    owner = torch.where(valid, topk_idx // num_local_experts, 0)
    keep = valid & send_to[owner]
    picked = torch.zeros(num_tokens, num_ranks * num_local_experts + 1, dtype=torch.bool, device=topk_idx.device)
    # Dropped picks land in the extra last column, which is cut off.
    picked.scatter_(1, torch.where(keep, topk_idx, num_ranks * num_local_experts), True)
    per_rank_experts = picked[:, :-1].view(num_tokens, num_ranks, num_local_experts).transpose(0, 1)
    has = per_rank_experts.any(dim=2)  # [R, N]
    dest, token = torch.nonzero(has, as_tuple=True)  # by destination, then token
    return TokenRows(token=token, experts=per_rank_experts[dest, token], per_rank=has.sum(dim=1))


def byte_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Per-row byte fields ([M, w] uint8 each) side by side, padded to whole
    int64 words, so that a receiver copies payloads word-wise (a byte-wise
    copy of the same rows is several times slower on CPU)."""
    rows = parts[0].size(0)
    unaligned = sum(p.size(1) for p in parts) % 8
    if unaligned:
        parts = [*parts, torch.zeros(rows, 8 - unaligned, dtype=torch.uint8, device=parts[0].device)]
    return torch.cat(parts, dim=1)


def bitmap_bytes(num_local_experts: int) -> int:
    """Bytes of a row's expert bitmap, a multiple of 4 to keep rows 4-byte aligned."""
    return (num_local_experts + 31) // 32 * 4


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """[M, L] bool -> [M, bitmap_bytes(L)] uint8, bit j of byte b = expert 8b + j."""
    rows, width = bits.shape
    nbytes = bitmap_bytes(width)
    padded = torch.zeros(rows, nbytes * 8, dtype=torch.int32, device=bits.device)
    padded[:, :width] = bits.to(torch.int32)
    weights = torch.tensor([1 << j for j in range(8)], dtype=torch.int32, device=bits.device)
    return (padded.view(rows, nbytes, 8) * weights).sum(dim=2).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, width: int) -> torch.Tensor:
    """Inverse of ``pack_bits``."""
    rows, nbytes = packed.shape
    shifts = torch.arange(8, dtype=torch.int32, device=packed.device)
    bits = (packed.to(torch.int32).unsqueeze(2) >> shifts) & 1
    return bits.view(rows, nbytes * 8)[:, :width].bool()


@dataclass
class Segments:
    """Rows grouped by (source rank, local expert), in that order, as they travel."""
    source: torch.Tensor  # [M] source (or destination) rank of each row
    local_expert: torch.Tensor  # [M]
    slot: torch.Tensor  # [M] row index inside the local expert's block


def segments(counts: torch.Tensor, begin: torch.Tensor) -> Segments:
    """``counts[s, le]`` rows per (rank, local expert) in (s, le) order; ``begin[le, s]``
    the first row of each segment in ``le``'s block."""
    num_ranks, num_local = counts.shape
    sizes = counts.reshape(-1)
    total = int(sizes.sum())
    device = counts.device
    seg = torch.repeat_interleave(torch.arange(sizes.numel(), device=device), sizes, output_size=total)
    seg_start = torch.cumsum(sizes, 0) - sizes
    within = torch.arange(total, device=device) - seg_start[seg]
    source = seg // num_local
    local_expert = seg % num_local
    return Segments(source=source, local_expert=local_expert,
                    slot=begin.t().reshape(-1)[seg] + within)


def block_begins(counts: torch.Tensor) -> torch.Tensor:
    """``counts[s, le]`` -> ``begin[le, s]``: sources one after another in each block."""
    per_block = counts.t()
    return torch.cumsum(per_block, 1) - per_block
