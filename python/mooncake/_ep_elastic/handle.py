"""``EPHandle``: what an ElasticBuffer dispatch returns besides the rows.

Its public fields are DeepEP V2's (see docs/ep.md, "ElasticBuffer"); its
``native_handle`` is the :class:`Routing` that cached dispatch and combine
run on: who sent how many rows to whom, in which order they were stored,
and which buffer generation made it (a handle from before
``update_ep_member()`` is refused).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import Expansion


@dataclass
class Routing:
    generation: object  # the buffer connection that ran the dispatch
    num_tokens: int
    hidden: int
    num_topk: int
    send_token: torch.Tensor  # [M] token of each outgoing row, by destination then token
    send_counts: list[int]  # [R] rows sent to each destination
    recv_counts: list[int]  # [R] rows received from each source (arrival order = source rank order)
    to_layout: torch.Tensor | None  # arrival index of each layout row (None: the same order)
    num_recv: int  # rows received
    recv_topk_idx: torch.Tensor  # the dispatch's recv_topk_idx: local expert ids (-1: not this rank's)
    expansion: Expansion | None  # the expanded layout (expanded mode)
    trimmed: bool  # outputs cut to the received rows (a CPU-synchronised dispatch), else at capacity

    @property
    def rows_for_combine(self) -> int:
        """Rows of ``x`` combine reads: the expanded rows, or the received ones."""
        return self.expansion.total if self.expansion is not None else self.num_recv

    def arrival_order(self) -> torch.Tensor | None:
        """Layout index of each arriving row (the inverse of ``to_layout``)."""
        if self.to_layout is None:
            return None
        return torch.argsort(self.to_layout)


class EPHandle:
    def __init__(self, *, do_expand: bool, num_experts: int, expert_alignment: int, num_max_tokens_per_rank: int,
                 num_sms: int, topk_idx: torch.Tensor, num_recv_tokens_per_expert_list: list[int],
                 psum_num_recv_tokens_per_scaleup_rank: torch.Tensor, psum_num_recv_tokens_per_expert: torch.Tensor,
                 recv_src_metadata: torch.Tensor, dst_buffer_slot_idx: torch.Tensor,
                 token_metadata_at_forward: torch.Tensor | None = None,
                 channel_linked_list: torch.Tensor | None = None, native_handle: Routing | None = None):
        self.do_expand = do_expand
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        # Per local expert, only after a CPU-synchronised dispatch (else []).
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.recv_src_metadata = recv_src_metadata
        self.dst_buffer_slot_idx = dst_buffer_slot_idx
        # The hybrid kernels' forwarding state; the collective path forwards nothing.
        self.token_metadata_at_forward = token_metadata_at_forward
        self.channel_linked_list = channel_linked_list
        self.native_handle = native_handle
        # DeepEP's convention: the received rows after a CPU sync, else the capacity.
        self.num_recv_tokens = int(recv_src_metadata.shape[0])

    def __repr__(self) -> str:
        return (f"EPHandle(do_expand={self.do_expand}, num_experts={self.num_experts}, "
                f"num_max_tokens_per_rank={self.num_max_tokens_per_rank}, num_recv_tokens={self.num_recv_tokens})")
