"""``MoEEpLayer``: an expert-parallel MoE layer over a ``Buffer``.

Hidden states, top-k expert ids and top-k weights in, hidden states out (the
shape of FlashInfer's MoE-EP layer): dispatch -> each local expert's gated
MLP -> combine. Experts are numbered globally; rank r holds experts
``r * L .. r * L + L - 1`` (L = num_experts / num_ranks) in ``w13`` (gate and
up projections stacked, ``[L, 2 * intermediate, hidden]``) and ``w2``
(``[L, hidden, intermediate]``), the layout of FlashInfer and vLLM.

Expert math: ``y = w2 @ (silu(w13_gate @ x) * (w13_up @ x))``, in float32, rounded
to bf16 once; FP8 dispatch delivers e4m3 rows that are dequantised first.
"""

from __future__ import annotations

import torch

import mooncake.ep  # noqa: F401 - the loading rule: fails clearly when mooncake.pg is not built
from mooncake._ep_collective.fp8 import dequantize


class MoEEpLayer(torch.nn.Module):
    def __init__(self, buffer, num_experts: int, hidden_size: int, intermediate_size: int,
                 num_max_dispatch_tokens_per_rank: int, *, use_fp8_dispatch: bool = False, timeout_us: int = -1,
                 device: torch.device | str | None = None):
        super().__init__()
        num_ranks = buffer.group_size
        if num_experts % num_ranks:
            raise ValueError(f"num_experts: must be a multiple of the number of ranks ({num_ranks}), got {num_experts}")
        self.buffer = buffer
        self.num_experts = num_experts
        self.num_local_experts = num_experts // num_ranks
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        self.use_fp8_dispatch = use_fp8_dispatch
        self.timeout_us = timeout_us
        L = self.num_local_experts
        self.w13 = torch.nn.Parameter(torch.zeros(L, 2 * intermediate_size, hidden_size, dtype=torch.bfloat16,
                                                  device=device), requires_grad=False)
        self.w2 = torch.nn.Parameter(torch.zeros(L, hidden_size, intermediate_size, dtype=torch.bfloat16,
                                                 device=device), requires_grad=False)
        # Which ranks take part; dispatch/combine clear entries of ranks that stop
        # taking part. Setting entries back to 1 is the caller's decision.
        self.register_buffer("active_ranks", torch.ones(num_ranks, dtype=torch.int32, device=device))

    @property
    def first_local_expert(self) -> int:
        return self.buffer.rank * self.num_local_experts

    def expert(self, local_expert: int, rows: torch.Tensor) -> torch.Tensor:
        """The gated MLP of one local expert on bf16 rows [n, hidden]."""
        gate_up = rows.float() @ self.w13[local_expert].float().t()
        gate, up = gate_up.split(self.intermediate_size, dim=1)
        return ((torch.nn.functional.silu(gate) * up) @ self.w2[local_expert].float().t()).to(torch.bfloat16)

    def forward(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """[N, hidden] bf16, [N, k] expert ids (-1 = none), [N, k] weights -> [N, hidden] bf16."""
        topk_ids = topk_ids.to(torch.int64)
        topk_weights = topk_weights.to(torch.float32)
        recv_x, recv_count, handle, event, _ = self.buffer.dispatch(
            hidden_states.contiguous(), topk_ids, self.active_ranks, self.num_max_dispatch_tokens_per_rank,
            self.num_experts, self.timeout_us, use_fp8=self.use_fp8_dispatch)
        event.current_stream_wait()
        outputs = self.buffer.get_next_combine_buffer(handle)
        for le, n in enumerate(recv_count.tolist()):
            if not n:
                continue
            if self.use_fp8_dispatch:
                rows = dequantize(recv_x[0][le, :n], recv_x[1][le, :n]).to(torch.bfloat16)
            else:
                rows = recv_x[le, :n]
            outputs[le, :n] = self.expert(le, rows)
        combined, event, _ = self.buffer.combine(outputs, topk_ids, topk_weights, self.active_ranks, self.timeout_us,
                                                 handle, zero_copy=True)
        event.current_stream_wait()
        return combined
