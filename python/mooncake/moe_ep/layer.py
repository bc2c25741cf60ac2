"""``MoEEp``: dispatch -> grouped-GEMM experts -> combine, in the layout of
its FleetConfig, with per-stage timings on request."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import mooncake.ep  # noqa: F401 - the loading rule: fails clearly when mooncake.pg is not built
from mooncake._ep_collective.fp8 import dequantize

from .config import Algorithm, EpBootstrap, ExpertWeights, FleetConfig, Layout
from .experts import grouped_swiglu_experts, padded_rows_per_expert, swiglu_expert_blocks, weighted_topk


def available_backends() -> dict[str, str]:
    """(algorithm/layout) -> the transport that serves it in this build."""
    return {f"{Algorithm.LOW_LATENCY.name}/{Layout.EXPERT_MAJOR.name}": "mooncake_ep_buffer.Buffer",
            f"{Algorithm.LOW_LATENCY.name}/{Layout.RANK_MAJOR.name}": "mooncake_elastic_buffer.ElasticBuffer",
            f"{Algorithm.HIGH_THROUGHPUT.name}/{Layout.FLAT.name}": "mooncake_elastic_buffer.ElasticBuffer"}


class _Stages:
    """Per-stage wall times: CUDA events on the layer's stream, else the host clock."""

    def __init__(self, enabled: bool, device: torch.device, stream):
        self.enabled, self.device, self.stream = enabled, device, stream
        self.marks: list[object] = []

    def mark(self) -> None:
        if not self.enabled:
            return
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(self.stream)
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def milliseconds(self) -> dict[str, float]:
        if not self.enabled or len(self.marks) != 4:
            return {}
        names = ("dispatch", "compute", "combine")
        if self.device.type == "cuda":
            self.marks[-1].synchronize()
            return {n: self.marks[i].elapsed_time(self.marks[i + 1]) for i, n in enumerate(names)}
        return {n: (self.marks[i + 1] - self.marks[i]) * 1e3 for i, n in enumerate(names)}


class MoEEp:
    def __init__(self, bootstrap: EpBootstrap, fleet: FleetConfig, weights: ExpertWeights, enable_timing: bool = False):
        group = bootstrap.group if bootstrap.group is not None else dist.distributed_c10d._get_default_group()
        self.group = group
        self.rank, self.world = group.rank(), group.size()
        fleet.check(self.world)
        self.fleet = fleet
        self.num_local_experts = fleet.num_experts // self.world
        weights.check(self.num_local_experts, fleet)
        self.weights = weights
        self.device = torch.device(bootstrap.device) if bootstrap.device is not None else weights.w13.device
        if weights.w13.device != self.device or weights.w2.device != self.device:
            raise ValueError(f"ExpertWeights: must be on the layer's device ({self.device})")
        self.stream = bootstrap.stream if bootstrap.stream is not None or self.device.type != "cuda" else \
            torch.cuda.current_stream(self.device)
        self.enable_timing = enable_timing
        self.last_timings_ms: dict[str, float] = {}
        if fleet.layout == Layout.EXPERT_MAJOR:
            from mooncake.mooncake_ep_buffer import Buffer  # noqa: PLC0415

            self.transport = Buffer(group)
            self.active_ranks = torch.ones(self.world, dtype=torch.int32, device=self.device)
        else:
            from mooncake.mooncake_elastic_buffer import ElasticBuffer  # noqa: PLC0415

            self.transport = ElasticBuffer(group, num_max_tokens_per_rank=fleet.max_tokens_per_rank,
                                           hidden=fleet.hidden, num_topk=fleet.num_topk)

    @property
    def first_local_expert(self) -> int:
        return self.rank * self.num_local_experts

    def forward(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """[N, hidden] bf16, [N, k] global expert ids (-1: none), [N, k] weights -> [N, hidden] bf16."""
        if self.transport is None:
            raise RuntimeError("MoEEp: the layer has been destroyed")
        if hidden_states.dim() != 2 or hidden_states.size(1) != self.fleet.hidden:
            raise ValueError(f"hidden_states: must be [num_tokens, {self.fleet.hidden}], got {list(hidden_states.shape)}")
        if tuple(topk_ids.shape) != tuple(topk_weights.shape) or topk_ids.size(0) != hidden_states.size(0):
            raise ValueError("topk_ids, topk_weights: must both be [num_tokens, k] for the tokens of hidden_states")
        stages = _Stages(self.enable_timing, self.device, self.stream)
        context = torch.cuda.stream(self.stream) if self.device.type == "cuda" else _nothing()
        with context:
            x = hidden_states.to(torch.bfloat16).contiguous()
            ids, weights = topk_ids.to(torch.int64).contiguous(), topk_weights.to(torch.float32).contiguous()
            if self.fleet.layout == Layout.EXPERT_MAJOR:
                out = self._expert_major(x, ids, weights, stages)
            else:
                out = self._top_k(x, ids, weights, stages)
        self.last_timings_ms = stages.milliseconds()
        return out

    __call__ = forward

    def _expert_major(self, x, ids, weights, stages: _Stages) -> torch.Tensor:
        """Rows arrive per local expert (top-1 per row); combine re-weights."""
        stages.mark()
        recv_x, recv_count, handle, event, _ = self.transport.dispatch(
            x, ids, self.active_ranks, self.fleet.max_tokens_per_rank, self.fleet.num_experts, -1,
            use_fp8=self.fleet.use_fp8_dispatch)
        event.current_stream_wait()
        stages.mark()
        counts = recv_count.to(torch.int64)
        per_expert = counts.tolist()
        outputs = self.transport.get_next_combine_buffer(handle)
        padded = padded_rows_per_expert(per_expert)
        if padded is not None:
            # Balanced experts run on their blocks as they arrived, [L, padded, H]:
            # no gather into rows and no scatter back (combine reads rows below each count only).
            blocks = dequantize(recv_x[0][:, :padded], recv_x[1][:, :padded]).to(torch.bfloat16) \
                if self.fleet.use_fp8_dispatch else recv_x[:, :padded]
            outputs[:, :padded] = swiglu_expert_blocks(blocks, self.weights.w13, self.weights.w2)
        else:
            if self.fleet.use_fp8_dispatch:
                data, scales = recv_x
                blocks = [dequantize(data[le, :n], scales[le, :n]).to(torch.bfloat16)
                          for le, n in enumerate(per_expert)]
            else:
                blocks = [recv_x[le, :n] for le, n in enumerate(per_expert)]
            rows = torch.cat(blocks) if blocks else x.new_empty(0, self.fleet.hidden)
            y = grouped_swiglu_experts(rows, counts, self.weights.w13, self.weights.w2)
            start = 0
            for le, n in enumerate(per_expert):
                outputs[le, :n] = y[start:start + n]
                start += n
        stages.mark()
        combined, event, _ = self.transport.combine(outputs, ids, weights, self.active_ranks, -1, handle,
                                                    zero_copy=True)
        event.current_stream_wait()
        stages.mark()
        return combined

    def _top_k(self, x, ids, weights, stages: _Stages) -> torch.Tensor:
        """Rows arrive once per (token, rank), with their top-k as local ids
        (-1: elsewhere) and weights (0 there); combine sums what ranks return."""
        stages.mark()
        recv_x, local_ids, recv_weights, handle, _ = self.transport.dispatch(
            x, topk_idx=ids, topk_weights=weights, num_experts=self.fleet.num_experts,
            num_max_tokens_per_rank=self.fleet.max_tokens_per_rank)
        stages.mark()
        if self.fleet.layout == Layout.RANK_MAJOR:
            # [R, T, H] (flattened): a row at its source token; its routing beside it.
            slot = handle.recv_src_metadata[:, 0].to(torch.int64)
            capacity = self.world * self.fleet.max_tokens_per_rank
            rows = x.new_zeros(capacity, self.fleet.hidden)
            rows[slot] = recv_x
            routed = torch.full((capacity, ids.size(1)), -1, dtype=torch.int64, device=x.device)
            routed[slot] = local_ids
            routed_w = weights.new_zeros(capacity, ids.size(1))
            routed_w[slot] = recv_weights
            y = weighted_topk(rows, routed, routed_w, self.weights.w13, self.weights.w2)[slot]
        else:
            y = weighted_topk(recv_x, local_ids, recv_weights, self.weights.w13, self.weights.w2)
        stages.mark()
        combined, _, event = self.transport.combine(y.contiguous(), handle)
        event.current_stream_wait()
        stages.mark()
        return combined

    def destroy(self) -> None:
        if self.transport is not None and hasattr(self.transport, "destroy"):
            self.transport.destroy()
        self.transport = None


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
