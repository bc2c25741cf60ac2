"""The dispatch handle.

To the caller it is the reference's 5-tuple
``(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)``
(``handle[0]``, ``handle[1]``, unpacking all work). It also carries, as an
attribute, what combine needs to send rows back without asking anyone: the
sender's plan and the receiver's layout, plus what identifies the dispatch
(its Buffer connection and call number) so that a handle from an unrelated
or an outdated dispatch is refused with a clear error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .routing import SendPlan


@dataclass
class DispatchState:
    connection: object  # the Buffer connection the dispatch ran on
    call: int  # the dispatch's call number on that connection
    topk_idx: torch.Tensor  # a copy, to recognise the matching combine
    num_topk: int
    plan: SendPlan  # picks this rank sent, in send order
    kept_counts: torch.Tensor  # [R, L] rows kept per (source rank, local expert)
    begins: torch.Tensor  # [L, R] first row of each source in each block
    next_combine_buffer: torch.Tensor | None = field(default=None)


class DispatchHandle(tuple):
    """A 5-tuple with the combine state in ``.state``."""

    state: DispatchState  # or the fast path's IpcDispatchState

    def __new__(cls, src_info, layout_range, tokens_per_rank, hidden, num_experts, state: DispatchState):
        self = super().__new__(cls, (src_info, layout_range, tokens_per_rank, hidden, num_experts))
        self.state = state
        return self
