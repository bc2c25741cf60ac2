"""Plot elastic_bench.py's CSV: per kill-and-replace cycle, the time to the
survivors' completed Work, to the new view, to the first correct collective,
and from a replacement's init to the full world, beside the reference's
default budget and issue 4's targets (log scale).

    python3 benchmarks/plot_elastic.py docs/benchmarks/elastic.csv docs/benchmarks/elastic.png
"""

import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SERIES = [
    ("kill_to_failed_work_s", "kill → survivors' Work completed"),
    ("kill_to_first_correct_s", "kill → first correct collective"),
    ("replacement_init_to_full_world_s", "replacement init → full world"),
    ("replacement_spawn_to_full_world_s", "replacement spawn → full world (incl. Python/torch import)"),
]


def main(src: str, dst: str) -> None:
    with open(src) as f:
        rows = list(csv.DictReader(f))
    cycles = [int(r["cycle"]) for r in rows]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for key, label in SERIES:
        ys = [float(r[key]) for r in rows]
        ax.plot(cycles, ys, marker="o", ms=3, label=label)
    ax.axhline(40.0, color="tab:red", ls="--", label="reference default: 10 s timeout + 30 s window")
    ax.axhline(3.0, color="gray", ls=":", label="issue 4 target: kill → usable ≤ 3 s")
    ax.axhline(2.0, color="gray", ls="-.", label="issue 4 target: replacement → full world ≤ 2 s")
    ax.set_yscale("log")
    ax.set_xlabel("kill-and-replace cycle (world 4, seat 1 SIGKILLed each cycle)")
    ax.set_ylabel("seconds (worst survivor)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("mooncake-cpu elastic recovery (2-core VM)")
    fig.tight_layout()
    fig.savefig(dst, dpi=100)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
