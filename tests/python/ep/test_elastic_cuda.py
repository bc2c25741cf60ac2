"""The ElasticBuffer grid on CUDA tensors over the ``mooncake`` CUDA backend,
with the same checks against the dense reference as the CPU tests
(test_elastic_buffer.py); ranks share the GPUs round-robin. Skipped without
a GPU."""

import pytest
import torch

from _elastic_refs import GRID
from _elastic_rounds import elastic_buffer_of, run_elastic_grid
from _ep_rounds import RANK_ENV
from _harness import World

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU: these run the CPU tests' checks on CUDA tensors over the "
                              "'mooncake' CUDA backend (CI has no GPU)"),
]


def _grid_on_cuda(ctx):
    done = run_elastic_grid(ctx, GRID, device="cuda")
    buffer = elastic_buffer_of(ctx)
    return done, buffer.transport, buffer.path


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_elastic_grid_on_cuda(world_size):
    with World(world_size, gloo=False, env=RANK_ENV, backend="mooncake") as world:
        got = world.run(_grid_on_cuda, timeout=240)
    assert all((t, p) == ("ibgda", "collective") for _, t, p in got)
    assert any(sum(done) for done, _, _ in got)
