"""Dense references for the ElasticBuffer tests, written as plain loops over
ranks, tokens and picks (independently of mooncake._ep_elastic).

Every rank's inputs come from a seed shared by all ranks (``_ep_refs``), so
each rank computes alone what it must receive and what combine returns.
Spawned ranks import this module: no pytest here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from _ep_refs import Case, expert_fn, inputs_of


@dataclass(frozen=True)
class ElasticCase:
    base: Case
    alignment: int = 1
    fp8: bool = False  # dispatch a pre-quantised (e4m3, scales) tuple
    weights: bool = True  # pass topk_weights
    scaleup: int = 0  # ranks per scale-up domain the buffer uses (0: the whole world)

    def order(self, world: int) -> list[int]:
        """Sources in layout order: by scale-up index, then scale-out index."""
        up = self.scaleup or world
        return sorted(range(world), key=lambda s: (s % up, s // up))


# The grid of test_elastic_buffer.py (CPU) and test_elastic_cuda.py (GPU):
# hidden sizes not a multiple of 128 and up to 7168, top-k 1-9, alignment,
# FP8 tuples, no weights, every pick -1.
GRID = [

    ElasticCase(Case(hidden=128, experts_per_rank=1, num_topk=1, tokens=1)),
    ElasticCase(Case(hidden=100, experts_per_rank=3, num_topk=2, tokens=5, masked=0.2), weights=False),
    ElasticCase(Case(hidden=256, experts_per_rank=8, num_topk=8, tokens=7, masked=0.1), alignment=4),
    ElasticCase(Case(hidden=384, experts_per_rank=9, num_topk=9, tokens=6, masked=0.3), fp8=True),
    ElasticCase(Case(hidden=7168, experts_per_rank=3, num_topk=3, tokens=3), alignment=3, fp8=True),
    ElasticCase(Case(hidden=128, experts_per_rank=5, num_topk=4, tokens=4, masked=1.0)),  # every pick -1
    # Odd byte widths with 0 or 1 rows received: fields at offsets no wider dtype can view in place.
    ElasticCase(Case(hidden=101, experts_per_rank=2, num_topk=1, tokens=1), weights=False),
    ElasticCase(Case(hidden=130, experts_per_rank=2, num_topk=2, tokens=2), fp8=True),
]


def fp8_inputs(case: Case, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-quantised x: e4m3 data and arbitrary float32 scales, which must
    travel unchanged (ElasticBuffer does not quantise)."""
    x = inputs_of(case, rank, world).x
    g = torch.Generator().manual_seed(rank * 31 + world)
    scales = torch.rand(x.size(0), (x.size(1) + 127) // 128, generator=g)
    return x.float().clamp(-448, 448).to(torch.float8_e4m3fn), scales


def rank_fn(rank: int, rows: torch.Tensor) -> torch.Tensor:
    """What a destination rank returns for a received row in non-expanded mode."""
    return (rows.float() * (1.0 + 0.0625 * rank) + 0.5).to(torch.bfloat16)


def received(ec: ElasticCase, world: int, rank: int):
    """Rows `rank` receives, in layout order: (source, token, its top-k as this
    rank's local ids or -1, its weights with non-local picks 0)."""
    L = ec.base.experts_per_rank
    out = []
    for s in ec.order(world):
        inp = inputs_of(ec.base, s, world)
        for t, picks in enumerate(inp.topk_idx.tolist()):
            local = [e - rank * L if e >= 0 and e // L == rank else -1 for e in picks]
            if any(le >= 0 for le in local):
                weights = [float(inp.topk_weights[t, j]) if local[j] >= 0 else 0.0 for j in range(len(picks))]
                out.append((s, t, local, weights))
    return out



def expanded(ec: ElasticCase, world: int, rank: int):
    """The expanded layout: per local expert, (first row, [(received row, lane)]);
    each expert's block starts at a multiple of the alignment."""
    rows = received(ec, world, rank)
    blocks, end = [], 0
    for e in range(ec.base.experts_per_rank):
        begin = -(-end // ec.alignment) * ec.alignment
        members = [(j, lane) for j, (_, _, local, _) in enumerate(rows) for lane, le in enumerate(local) if le == e]
        blocks.append((begin, members))
        end = begin + len(members)
    return blocks, end


def combined(ec: ElasticCase, world: int, rank: int, expand: bool) -> torch.Tensor:
    """What combine returns on `rank`: per token, the float32 sum over its
    destination ranks (ascending) of what each returns, rounded to bf16.
    A destination returns rank_fn of the row (non-expanded), or the bf16
    rounding of the float32 sum, lane by lane, of expert_fn over its picks
    there (expanded)."""
    L = ec.base.experts_per_rank
    inp = inputs_of(ec.base, rank, world)
    x = fp8_inputs(ec.base, rank, world)[0].float().to(torch.bfloat16) if ec.fp8 else inp.x
    n, h = x.shape
    out = torch.zeros(n, h, dtype=torch.bfloat16)
    for t in range(n):
        picks = inp.topk_idx[t].tolist()
        acc = torch.zeros(h, dtype=torch.float32)
        for d in sorted({e // L for e in picks if e >= 0}):
            if expand:
                part = torch.zeros(h, dtype=torch.float32)
                for e in picks:
                    if e >= 0 and e // L == d:
                        part = part + expert_fn(e, x[t:t + 1])[0].float()
                acc = acc + part.to(torch.bfloat16).float()
            else:
                acc = acc + rank_fn(d, x[t:t + 1])[0].float()
        out[t] = acc.to(torch.bfloat16)
    return out
