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


def test_steps_are_medians_after_each_replays_first_stamp_on_any_rank():
    from ep_bench import format_steps, step_table  # noqa: PLC0415

    unreached = 2**64 - 1
    # Two ranks, two replays of three points (first, last; ns); no block reached point "c".
    rank0 = [[(100, 150), (200, 300), (unreached, 0)], [(110, 160), (220, 330), (unreached, 0)]]
    rank1 = [[(90, 95), (400, 500), (unreached, 0)], [(120, 130), (210, 240), (unreached, 0)]]
    table = step_table(["a", "b", "c"], [rank0, rank1])
    # Replay 0 starts at 90 (rank 1's "a"), replay 1 at 110 (rank 0's "a").
    # Rank 0, "a": first 10 and 0 ns, last 60 and 50 ns; medians 5 and 55 ns.
    assert table[0] == ("a", [(0.005, 0.055), (0.005, 0.0125)])
    assert table[1] == ("b", [(0.11, 0.215), (0.205, 0.27)])
    assert table[2] == ("c", [None, None])
    assert format_steps(table)[2].split() == ["c", "-", "-", "|", "-", "-"]
