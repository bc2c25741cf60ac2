"""The dispatch/combine grid and a late rank, on CUDA tensors over the
``mooncake`` CUDA backend, with the same checks against the dense MoE as the
CPU tests (test_ep_grid.py, test_ep_failures.py): the grid on both paths
(the CUDA IPC fast path, chosen by default on one host, and the collective
path, forced with MOONCAKE_EP_FAST_PATH=0), the late rank on the collective
path (whose per-call agreement it checks; the fast path's own failure
semantics are in test_ep_ipc.py). Ranks share the GPUs round-robin (several
ranks on one GPU is fine: both data planes use CUDA IPC). Skipped without a
GPU."""

import time

import pytest
import torch
import torch.distributed as dist

from _ep_refs import GRID, Case
from _ep_rounds import RANK_ENV, buffer_of, run_grid, run_round
from _harness import World

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU: these run the CPU tests' checks on CUDA tensors over the "
                              "'mooncake' CUDA backend (CI has no GPU)"),
]


PATH_ENV = {"ipc": "auto", "collective": "0"}


def _world(size, path="collective"):
    return World(size, gloo=False, env={**RANK_ENV, "MOONCAKE_EP_FAST_PATH": PATH_ENV[path]}, backend="mooncake")


def _grid_on(ctx, path):
    buffer = buffer_of(ctx)
    assert buffer.path == path, f"rank {ctx.rank}: {buffer.path} path ({buffer.path_reason}), want {path}"
    done = run_grid(ctx, GRID, "cuda")
    # The fast path opens at the first dispatch and falls back, with a warning, if that fails
    # (peers on GPUs without peer access, say): the grid must have run on the path asked for.
    assert buffer.path == path, f"rank {ctx.rank}: fell back to {buffer.path} ({buffer.path_reason})"
    return done


@pytest.mark.parametrize("path", ["ipc", "collective"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_dispatch_combine_grid_on_cuda(world_size, path):
    with _world(world_size, path) as world:
        assert world.run(_grid_on, path, timeout=240) == [len(GRID)] * world_size


def _late_rank_on_cuda(ctx, late, stall_s, timeout_us):
    case = Case(hidden=256, experts_per_rank=3, num_topk=4, tokens=6, masked=0.1, fp8=True)
    buffer_of(ctx)
    dist.barrier()
    # The others mask the late rank; the late rank, left out, masks them and goes on alone.
    expect = ([1 if r == late else 0 for r in range(ctx.size)] if ctx.rank == late
              else [0 if r == late else 1 for r in range(ctx.size)])
    if ctx.rank == late:
        time.sleep(stall_s)
    run_round(ctx, case, timeout_us=timeout_us, expect_active=expect, device="cuda")
    run_round(ctx, case, active=[1] * ctx.size, timeout_us=-1, device="cuda")
    return True


def test_late_rank_on_cuda_is_masked_and_rejoins():
    with _world(3) as world:
        assert world.run(_late_rank_on_cuda, 1, 3.0, 1_000_000, timeout=120) == [True] * 3
