"""What a synchronised IPC-path dispatch (``do_cpu_sync``) reads back to the
host, in one device-to-host copy: every rank's call facts from the counts'
gather, the rows received from each source, the picks per local expert, the
expanded layout's size, and who answered.

An eager dispatch is bound by the host on a GPU (about 0.55 ms a call at
128 tokens against 0.04 ms of kernels; docs/benchmarks/ep_cuda.md), and each
small torch operation costs several microseconds there, so the summary is
one ``torch.cat`` of byte views (no operation for the views themselves), one
copy, and then slices of a host tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout_kernels import Gathered


@dataclass
class HostSummary:
    facts: list[list[int]]  # per rank: words [facts_begin, n) of its counts row (zeros: a rank not heard)
    recv_count: list[int]  # rows received from each source
    per_expert: list[int]  # picks (or expanded copies) per local expert
    total: int | None  # rows of the expanded layout (None: not asked for)
    mask: list[int]  # the kernels' active ranks after the call (0: given up on)


def _bytes(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as flat bytes of ``dtype`` values (a view where it already is)."""
    if t.dtype != dtype:
        t = t.to(dtype)
    return t.reshape(-1).view(torch.uint8)


def read_summary(gathered: Gathered, facts_begin: int, ranges: torch.Tensor, per_expert: torch.Tensor,
                 total: torch.Tensor | None, mask: torch.Tensor) -> HostSummary:
    """The summary of a dispatch whose counts rows are ``gathered``
    (``Gathered``: a source's row at ``ranges[s] >> 32`` of its own ranges,
    at most one row per source, so within its first R rows), whose rows
    arrived per ``ranges`` (``[1, R]`` int64, ``(begin << 32) | count``),
    with ``per_expert`` ([L]), ``total`` ([1] or None) and ``mask`` ([R]
    int32). Waits for the current stream."""
    num_ranks = mask.numel()
    rows = gathered.rows[:num_ranks]
    width = rows.size(1)
    pieces = [rows.reshape(-1), _bytes(gathered.ranges, torch.int64), _bytes(ranges, torch.int64),
              _bytes(per_expert, torch.int64)]
    if total is not None:
        pieces.append(_bytes(total, torch.int64))
    pieces.append(_bytes(mask, torch.int32))
    host = torch.cat(pieces).cpu()

    at = num_ranks * width
    words = host[:at].view(torch.int32).view(num_ranks, width // 4)
    at, gathered_ranges = _take(host, at, num_ranks, torch.int64)
    at, recv_ranges = _take(host, at, num_ranks, torch.int64)
    at, per_expert_list = _take(host, at, per_expert.numel(), torch.int64)
    total_value = None
    if total is not None:
        at, (total_value,) = _take(host, at, 1, torch.int64)
    _, mask_list = _take(host, at, num_ranks, torch.int32)

    table = words[:, :gathered.n].tolist()
    facts = []
    for r in range(num_ranks):
        begin, count = gathered_ranges[r] >> 32, gathered_ranges[r] & 0xFFFFFFFF
        facts.append(table[begin][facts_begin:] if count > 0 else [0] * (gathered.n - facts_begin))
    return HostSummary(facts=facts, recv_count=[r & 0xFFFFFFFF for r in recv_ranges], per_expert=per_expert_list,
                       total=total_value, mask=mask_list)


def _take(host: torch.Tensor, at: int, count: int, dtype: torch.dtype) -> tuple[int, list[int]]:
    """``count`` values of ``dtype`` from byte ``at`` of ``host``, and the byte after them."""
    end = at + count * dtype.itemsize
    return end, host[at:end].view(dtype).tolist()
