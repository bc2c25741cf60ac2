"""Which GPU a rank of a multi-process GPU test or benchmark runs on.

rank % G, where G is ``MOONCAKE_TEST_GPUS`` when set (1: every rank on GPU 0,
the mode of a one-GPU host; N: spread over the first N GPUs) and otherwise
every visible device. The C++ rank programs follow the same rule
(tests/cpp/common/test_gpus.h), so both place ranks alike.
"""

from __future__ import annotations

import os


def gpus_in_use() -> int:
    import torch

    count = torch.cuda.device_count()
    if count <= 0:
        return 0
    wanted = os.environ.get("MOONCAKE_TEST_GPUS", "")
    return min(max(int(wanted), 1), count) if wanted else count


def gpu_of_rank(rank: int) -> int:
    """The device index for `rank` (raises when no CUDA device is visible)."""
    gpus = gpus_in_use()
    if gpus == 0:
        raise RuntimeError("no CUDA device is visible")
    return rank % gpus


def gpus_used(world: int) -> int:
    """How many GPUs `world` ranks run on."""
    return len({gpu_of_rank(r) for r in range(world)})


def placement(world: int) -> str:
    """How `world` ranks are placed, for labels: "1 GPU" or "2 GPUs"."""
    used = gpus_used(world)
    return f"{used} GPU" + ("s" if used > 1 else "")
