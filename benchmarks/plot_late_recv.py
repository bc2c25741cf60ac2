"""Plot the late-receive runs of cross_host_calls.py (one row per run:
path, run, us_per_receive) as one bar per run, grouped by path.

    python3 benchmarks/plot_late_recv.py docs/benchmarks/pg_cpu_netns_late_recv.csv \
        docs/benchmarks/pg_cpu_netns_late_recv.png
"""

import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
    runs = defaultdict(list)
    with open(src) as f:
        for row in csv.DictReader(f):
            runs[row["path"]].append(float(row["us_per_receive"]))
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    x = 0
    ticks, labels = [], []
    for path, values in runs.items():
        positions = [x + i * 0.4 for i in range(len(values))]
        ax.bar(positions, values, width=0.35)
        ticks.append(sum(positions) / len(positions))
        labels.append(path)
        x = positions[-1] + 1.0
    ax.set_xticks(ticks, labels, fontsize=8)
    ax.set_ylabel("µs per receive beyond the busy wait")
    ax.set_title("4 KiB receive posted after its message was sent\n(2 netns hosts, 10 Gbit/s, one bar per run)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
