"""The experts' compute: a SwiGLU MLP per local expert, as two grouped
GEMMs over rows sorted by expert (torch's grouped matmul where the installed
torch has it for the device, else one matmul per expert), bf16 in and out
with float32 accumulation; and the per-pick weighting of the top-k layouts."""

from __future__ import annotations

import torch


def _grouped(rows: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """rows [n, K] sorted by group, weights [G, N, K] (out x in), counts [G] -> [n, N] bf16."""
    grouped = getattr(torch, "_grouped_mm", None)
    if grouped is not None and rows.size(0):
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        try:
            return grouped(rows, weights.transpose(1, 2), offs=offsets)
        except (RuntimeError, NotImplementedError):
            pass  # shapes or device this torch's kernel does not take: the loop below
    out = rows.new_empty(rows.size(0), weights.size(1))
    start = 0
    for g, n in enumerate(counts.tolist()):
        if n:
            out[start:start + n] = (rows[start:start + n].float() @ weights[g].float().t()).to(torch.bfloat16)
        start += n
    return out


def swiglu_experts(rows: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """rows [n, H] bf16 sorted by local expert (``counts[e]`` rows each) -> [n, H] bf16."""
    intermediate = w2.size(2)
    gate_up = _grouped(rows, w13, counts)
    gate, up = gate_up.float().split(intermediate, dim=1)
    activated = (torch.nn.functional.silu(gate) * up).to(torch.bfloat16)
    return _grouped(activated, w2, counts)


def weighted_topk(rows: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor) -> torch.Tensor:
    """The top-k layouts: each row's picks of this rank's experts (``local_ids``
    [n, k], -1 for picks elsewhere) run through their expert, weighted by
    ``weights`` [n, k] and summed in float32 -> [n, H] bf16."""
    num_local = w13.size(0)
    row, lane = torch.nonzero(local_ids >= 0, as_tuple=True)
    expert = local_ids[row, lane]
    order = torch.sort(expert, stable=True).indices
    row, lane, expert = row[order], lane[order], expert[order]
    counts = torch.bincount(expert, minlength=num_local)
    y = swiglu_experts(rows[row], counts, w13, w2)
    total = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
    total.index_add_(0, row, y.float() * weights[row, lane].unsqueeze(1).float())
    return total.to(torch.bfloat16)
