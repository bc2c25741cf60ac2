"""The experts' compute: a SwiGLU MLP per local expert, bf16 in and out with
float32 accumulation, as two batched matmuls over per-expert blocks of rows
when the experts are balanced (the expert-major layout's blocks as they
arrived), else as two grouped GEMMs over rows sorted by expert (torch's
grouped matmul where the installed torch has it for the device, else one
matmul per expert); and the per-pick weighting of the top-k layouts."""

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


# When every expert has about as many rows as the others, the experts run as
# two batched matmuls over rows padded to the largest count: at the design's
# shape on an H200, cuBLAS's batched GEMM over the blocks took 0.53-0.77 of torch._grouped_mm's
# time (docs/benchmarks/moe_ep_cuda.md). Beyond this much padding the grouped
# kernel is kept.
PADDING_LIMIT = 1.25


def padded_rows_per_expert(counts: list[int]) -> int | None:
    """Rows per expert of the batched form for these per-expert counts (read
    on the host already), or None where the grouped form runs (no rows, or
    more padding than PADDING_LIMIT allows)."""
    total = sum(counts)
    largest = max(counts, default=0)
    return largest if total and largest * len(counts) <= PADDING_LIMIT * total else None


def _swiglu(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    gate, up = gate_up.float().split(intermediate, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(torch.bfloat16)


def swiglu_expert_blocks(blocks: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The experts over per-expert blocks of rows, [G, M, H] bf16 (any strides
    along G and M) -> [G, M, H] bf16, as two batched matmuls. Rows are
    independent: padding rows, whatever they hold, touch no other row."""
    activated = _swiglu(torch.bmm(blocks, w13.transpose(1, 2)), w2.size(2))
    return torch.bmm(activated, w2.transpose(1, 2))


def swiglu_experts(rows: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   host_counts: list[int] | None = None) -> torch.Tensor:
    """rows [n, H] bf16 sorted by local expert (``counts[e]`` rows each) -> [n, H]
    bf16. With the counts already on the host (``host_counts``), balanced
    experts take the batched form (padded here); otherwise the grouped form,
    which reads nothing on the host."""
    per_expert = padded_rows_per_expert(host_counts) if host_counts is not None else None
    if per_expert is None:
        return grouped_swiglu_experts(rows, counts, w13, w2)
    groups = counts.numel()
    expert = torch.repeat_interleave(torch.arange(groups, device=rows.device), counts, output_size=rows.size(0))
    slot = torch.arange(rows.size(0), device=rows.device) - (torch.cumsum(counts, 0) - counts)[expert]
    padded = rows.new_zeros(groups, per_expert, rows.size(1))
    padded[expert, slot] = rows
    return swiglu_expert_blocks(padded, w13, w2)[expert, slot]


def grouped_swiglu_experts(rows: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor,
                           w2: torch.Tensor) -> torch.Tensor:
    """``swiglu_experts`` by torch's grouped matmul (or its per-expert fallback)."""
    activated = _swiglu(_grouped(rows, w13, counts), w2.size(2))
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
