"""benchmarks/ep_bench.py's ratios of the IPC path's graphs to the copy
bounds (graph_ratios), on rows made up here: each ratio is its row's median
over the bound's of the same world, mode, shape and phase, and a bound that
was not measured gives no ratio."""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

from ep_bench import graph_ratios  # noqa: E402


def _row(world, tokens, impl, phase, ms, mode="mps"):
    return dict(world=world, tokens=tokens, hidden=4096, experts=256, topk=8, dtype="bf16", impl=impl, phase=phase,
                median_ms=ms, p90_ms=ms, mode=mode, from_last_start_ms=ms)


def test_each_graph_row_is_divided_by_the_bounds_of_its_own_world_shape_and_phase():
    rows = [_row(1, 128, "elastic-ipc-graph", "dispatch", 0.033), _row(1, 128, "copy-bound", "dispatch", 0.020),
            _row(1, 128, "copy-bound-graph", "dispatch", 0.011),
            _row(1, 128, "elastic-ipc-graph", "combine", 0.024), _row(1, 128, "copy-bound", "combine", 0.020),
            _row(2, 128, "elastic-ipc-graph", "dispatch", 0.040), _row(2, 128, "copy-bound", "dispatch", 0.025),
            _row(1, 8192, "elastic-ipc-graph", "dispatch", 0.175), _row(1, 8192, "copy-bound", "dispatch", 0.115,
                                                                        mode="other")]
    got = {(w, m, shape[0], phase, bound): round(ratio, 6) for w, m, shape, phase, bound, ratio in graph_ratios(rows)}
    assert got == {(1, "mps", 128, "dispatch", "copy-bound"): round(0.033 / 0.020, 6),
                   (1, "mps", 128, "dispatch", "copy-bound-graph"): 3.0,
                   (1, "mps", 128, "combine", "copy-bound"): 1.2,
                   (2, "mps", 128, "dispatch", "copy-bound"): 1.6}
