"""Dispatch -> per-expert function -> combine over 1 to 4 ranks of a
``mooncake-cpu`` group, checked against the dense MoE each rank computes
alone (see _ep_refs): the count, source and contents of every received row
(BF16 exactly; FP8 within half an e4m3 unit, scales exactly), and the
combined tokens (BF16 exactly; FP8 within bf16 rounding of the same FP8
reference). The grid crosses hidden sizes, expert counts, top-k up to 9,
token counts (including ranks with no tokens), masked picks, FP8, the three
synchronisation modes and zero-copy combine, in the spirit of the
reference's test_ep_grid."""

import pytest

from _ep_refs import GRID
from _ep_rounds import RANK_ENV, run_grid
from _harness import World

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_dispatch_combine_grid(world_size):
    with World(world_size, gloo=False, env=RANK_ENV) as world:
        assert world.run(run_grid, GRID, timeout=180) == [len(GRID)] * world_size
