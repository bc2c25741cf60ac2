"""The layer's configuration: who takes part (bootstrap), what the fleet of
experts looks like (fleet), and this rank's expert weights."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.distributed as dist


class Algorithm(enum.Enum):
    LOW_LATENCY = "low_latency"
    HIGH_THROUGHPUT = "high_throughput"


class Layout(enum.Enum):
    EXPERT_MAJOR = "expert_major"  # rows pre-assigned to local experts; combine re-weights
    RANK_MAJOR = "rank_major"  # rows at their source token; top-k routing; unweighted sum
    FLAT = "flat"  # rows as received, token-major; top-k routing; unweighted sum


# The layouts each algorithm offers.
LAYOUTS = {Algorithm.LOW_LATENCY: (Layout.EXPERT_MAJOR, Layout.RANK_MAJOR), Algorithm.HIGH_THROUGHPUT: (Layout.FLAT,)}


@dataclass
class EpBootstrap:
    """The process group (None: the default one), the device of the tensors
    (None: the current CUDA device for a CUDA group, else CPU) and the CUDA
    stream the layer orders its work on (None: the current one)."""
    group: dist.ProcessGroup | None = None
    device: torch.device | str | None = None
    stream: torch.cuda.Stream | None = None


@dataclass
class FleetConfig:
    num_experts: int
    max_tokens_per_rank: int
    hidden: int
    intermediate: int
    num_topk: int = 8
    dtype: torch.dtype = torch.bfloat16
    algorithm: Algorithm = Algorithm.LOW_LATENCY
    layout: Layout = Layout.EXPERT_MAJOR
    use_fp8_dispatch: bool = False  # EXPERT_MAJOR only: the Buffer quantises; the experts dequantise

    def check(self, num_ranks: int) -> None:
        for name in ("num_experts", "max_tokens_per_rank", "hidden", "intermediate", "num_topk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"FleetConfig.{name}: must be a positive int, got {value!r}")
        if self.num_experts % num_ranks:
            raise ValueError(f"FleetConfig.num_experts: must be a multiple of the number of ranks ({num_ranks}), "
                             f"got {self.num_experts}")
        if self.dtype != torch.bfloat16:
            raise ValueError(f"FleetConfig.dtype: only torch.bfloat16 is supported, got {self.dtype}")
        if self.layout not in LAYOUTS[self.algorithm]:
            allowed = ", ".join(layout.name for layout in LAYOUTS[self.algorithm])
            raise ValueError(f"FleetConfig.layout: {self.algorithm.name} offers {allowed}, got {self.layout.name}")
        if self.use_fp8_dispatch and self.layout != Layout.EXPERT_MAJOR:
            raise ValueError("FleetConfig.use_fp8_dispatch: only the EXPERT_MAJOR layout quantises for dispatch")
        if self.layout == Layout.EXPERT_MAJOR and self.hidden % 128:
            raise ValueError(f"FleetConfig.hidden: the EXPERT_MAJOR layout (Buffer) needs a multiple of 128, "
                             f"got {self.hidden}")


@dataclass
class ExpertWeights:
    """This rank's experts: ``w13 [L, 2 * intermediate, hidden]`` (gate, then
    up) and ``w2 [L, hidden, intermediate]``, bf16."""
    w13: torch.Tensor
    w2: torch.Tensor

    def check(self, num_local: int, fleet: FleetConfig) -> None:
        want13 = (num_local, 2 * fleet.intermediate, fleet.hidden)
        want2 = (num_local, fleet.hidden, fleet.intermediate)
        for name, tensor, want in (("w13", self.w13, want13), ("w2", self.w2, want2)):
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != want or tensor.dtype != torch.bfloat16:
                got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise ValueError(f"ExpertWeights.{name}: must be a bf16 tensor of shape {list(want)} "
                                 f"[local experts, ...], got {got}")
