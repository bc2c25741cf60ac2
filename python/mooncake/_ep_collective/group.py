"""What the EP buffers need to know of their process group."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .presence import mask_of


def control_device(group) -> torch.device:
    """A device the group's collectives accept, for the few values of connect()."""
    for kind in ("cpu", "cuda"):
        try:
            group._get_backend(torch.device(kind))
        except RuntimeError:
            continue
        return torch.device(kind, torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)
    return torch.device("cpu")


def takes_cuda_tensors(group) -> bool:
    """Whether the group's backend is one for CUDA tensors ("mooncake", or one
    with NCCL). By name: torch lists the CPU and CUDA device types for every
    custom backend, "mooncake-cpu" included."""
    name = str(dist.get_backend(group))
    return name == "mooncake" or "nccl" in name


def group_mask_reader(group, num_ranks: int):
    """The process group's own active mask as a bit mask (a Mooncake group
    deactivates dead or stalled ranks); all ranks for any other backend."""
    everyone = (1 << num_ranks) - 1
    try:
        from mooncake import pg  # noqa: PLC0415

        pg.get_active_ranks(group)
    except (TypeError, RuntimeError, AttributeError, ImportError):
        return lambda: everyone

    def read() -> int:
        return mask_of(r for r, bit in enumerate(pg.get_active_ranks(group).tolist()[:num_ranks]) if bit)

    return read


def work_failure_reader(group):
    """``read(work)``: the ranks a finished Work of ``group`` saw fail ([]
    when it succeeded). A Mooncake group completes an operation that lost a
    peer and reports it (``pg.get_local_success``, the failure hint) instead
    of raising; any other backend raises from ``wait()``, so [] there."""
    try:
        from mooncake import pg  # noqa: PLC0415

        pg.get_active_ranks(group)
    except (TypeError, RuntimeError, AttributeError, ImportError):
        return lambda work: []

    def read(work) -> list[int]:
        if pg.get_local_success(work):
            return []
        return [r for r, bit in enumerate(pg.get_failed_ranks_hint(work).tolist()) if bit] or [-1]

    return read
