"""Inputs and dense references for the EP tests.

Every rank's inputs come from a seed shared by all ranks, so each rank can
rebuild every other rank's tokens and compute, alone, what it must receive
and what combine must return: no cross-rank gather is needed to check.
The references below are written independently of the implementation
(plain loops over ranks, tokens and picks).

Spawned ranks import this module, so it must not import pytest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_MAX = 448.0


@dataclass(frozen=True)
class Case:
    hidden: int
    experts_per_rank: int
    num_topk: int
    tokens: int  # num_max_dispatch_tokens_per_rank
    masked: float = 0.0  # fraction of picks set to -1
    fp8: bool = False
    mode: str = "sync"  # "sync", "async" (async_finish) or "hook" (return_recv_hook)
    zero_copy: bool = False
    seed: int = 2026

    def experts(self, world: int) -> int:
        return self.experts_per_rank * world

    def tokens_of(self, rank: int, world: int) -> int:
        # Ranks send different numbers of tokens, down to none.
        return max(0, self.tokens - (rank * (self.tokens // 2 + 1)) // max(1, world - 1)) if world > 1 else self.tokens


# The grid of test_ep_grid.py (CPU) and test_ep_cuda.py (GPU): hidden sizes,
# experts per rank, top-k up to 9, token counts, masked picks, FP8, the three
# synchronisation modes (sync, async_finish, return_recv_hook), zero-copy.
GRID = [
    Case(hidden=128, experts_per_rank=1, num_topk=1, tokens=1),
    Case(hidden=128, experts_per_rank=3, num_topk=2, tokens=5, masked=0.2),
    Case(hidden=256, experts_per_rank=8, num_topk=8, tokens=7, masked=0.1, fp8=True),
    Case(hidden=128, experts_per_rank=12, num_topk=9, tokens=16, masked=0.3),
    Case(hidden=512, experts_per_rank=2, num_topk=2, tokens=32, fp8=True, mode="async"),
    Case(hidden=256, experts_per_rank=4, num_topk=3, tokens=9, mode="hook", zero_copy=True),
    Case(hidden=1024, experts_per_rank=4, num_topk=4, tokens=3, fp8=True, mode="hook"),
    Case(hidden=2048, experts_per_rank=2, num_topk=2, tokens=4, masked=0.5, zero_copy=True),
    Case(hidden=128, experts_per_rank=16, num_topk=6, tokens=12, masked=1.0),  # every pick masked
]


@dataclass
class RankInputs:
    x: torch.Tensor  # [N, H] bf16
    topk_idx: torch.Tensor  # [N, K] int64, -1 = masked pick
    topk_weights: torch.Tensor  # [N, K] float32


def inputs_of(case: Case, rank: int, world: int) -> RankInputs:
    """Rank `rank`'s inputs; the same on every process."""
    g = torch.Generator().manual_seed(case.seed * 1009 + rank * 7919 + world)
    n, e = case.tokens_of(rank, world), case.experts(world)
    x = torch.randn(n, case.hidden, generator=g).mul_(2.0).to(torch.bfloat16)
    scores = torch.randn(n, e, generator=g)
    topk_idx = scores.topk(case.num_topk, dim=1).indices.to(torch.int64)
    drop = torch.rand(n, case.num_topk, generator=g) < case.masked
    topk_idx[drop] = -1
    topk_weights = torch.rand(n, case.num_topk, generator=g).to(torch.float32)
    return RankInputs(x, topk_idx, topk_weights)


def expert_fn(expert: int, rows: torch.Tensor) -> torch.Tensor:
    """The mock expert: a per-expert elementwise map, bf16 in and out (exact to recompute)."""
    return (rows.float() * (1.0 + 0.125 * expert) - 0.25 * (expert % 3)).to(torch.bfloat16)


def fp8_roundtrip(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent rendering of the FP8 rule (per token per 128 channels):
    returns (dequantised bf16-ready float32 values, float32 scales)."""
    n, h = x.shape
    out = torch.empty(n, h, dtype=torch.float32)
    scales = torch.empty(n, h // 128, dtype=torch.float32)
    for g in range(h // 128):
        chunk = x[:, g * 128:(g + 1) * 128].float()
        amax = torch.clamp(chunk.abs().max(dim=1).values, min=1e-4)
        q = torch.clamp(chunk * (FP8_MAX / amax)[:, None], -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        scales[:, g] = amax / FP8_MAX
        out[:, g * 128:(g + 1) * 128] = q.float() * scales[:, g:g + 1]
    return out, scales


def expected_rows(case: Case, world: int, rank: int, active: list[int]):
    """What `rank` receives: per local expert, a list of (source rank, token), in
    the documented order (source rank, then token). Sources not in `active` send nothing."""
    experts_here = range(rank * case.experts_per_rank, (rank + 1) * case.experts_per_rank)
    rows = {e: [] for e in experts_here}
    if not active[rank]:
        return rows
    for s in range(world):
        if not active[s]:
            continue
        topk = inputs_of(case, s, world).topk_idx.tolist()
        for t, picks in enumerate(topk):
            for e in picks:
                if e in rows:
                    rows[e].append((s, t))
    return rows


def expected_combine(case: Case, world: int, rank: int, active: list[int]) -> torch.Tensor:
    """The dense MoE for `rank`'s tokens: sum over picks on active ranks of
    weight * expert(token as the expert saw it), float32, picks in order."""
    mine = inputs_of(case, rank, world)
    n, h = mine.x.shape
    seen = fp8_roundtrip(mine.x)[0].to(torch.bfloat16) if case.fp8 else mine.x
    out = torch.zeros(n, h, dtype=torch.bfloat16)
    if not active[rank]:
        return out
    for t in range(n):
        acc = torch.zeros(h, dtype=torch.float32)
        for k in range(case.num_topk):
            e = int(mine.topk_idx[t, k])
            if e < 0 or not active[e // case.experts_per_rank]:
                continue
            y = expert_fn(e, seen[t:t + 1])[0]
            acc = acc + mine.topk_weights[t, k] * y.float()
        out[t] = acc.to(torch.bfloat16)
    return out


def fp8_tolerance(x: torch.Tensor, scales_per_token: torch.Tensor) -> torch.Tensor:
    """Bound on |dequantised - x| for e4m3 with per-128-channel scales: half a
    unit in the last place of a 3-bit mantissa (2^-4 relative) for normal
    values, plus half the subnormal step (2^-10 in the scaled domain, times
    the scale) near zero; 1e-6 relative slack for the float32 arithmetic."""
    scale = scales_per_token.repeat_interleave(128, dim=1)
    return (x.float().abs() * 2.0 ** -4 + scale * 2.0 ** -10) * (1 + 1e-6)
