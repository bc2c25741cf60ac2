"""Plot runs of cross_host_calls.py (one row per run: path, run, and a
value column) as one bar per run, grouped by path. By default the
late-receive runs:

    python3 benchmarks/plot_late_recv.py docs/benchmarks/pg_cpu_netns_late_recv.csv \
        docs/benchmarks/pg_cpu_netns_late_recv.png

Other runs name their column, axis label and title:

    python3 benchmarks/plot_late_recv.py docs/benchmarks/pg_cpu_netns_2026-12-02.csv \
        docs/benchmarks/pg_cpu_netns_2026-12-02.png --value ms --ylabel "ms per call" \
        --title "16 MiB, world 2, 2 netns hosts, 10 Gbit/s (one bar per run)"
"""

import argparse
import csv
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


LATE_RECV_TITLE = "4 KiB receive posted after its message was sent\n(2 netns hosts, 10 Gbit/s, one bar per run)"


def main(src: str, dst: str, value: str, ylabel: str, title: str) -> None:
    runs = defaultdict(list)
    with open(src) as f:
        for row in csv.DictReader(f):
            runs[row["path"]].append(float(row[value]))
    fig, ax = plt.subplots(figsize=(6.5 if len(runs) <= 3 else 9, 3.6))
    x = 0
    ticks, labels = [], []
    for path, values in runs.items():
        positions = [x + i * 0.4 for i in range(len(values))]
        ax.bar(positions, values, width=0.35)
        ticks.append(sum(positions) / len(positions))
        labels.append(path.replace(": ", "\n"))  # "op: build" on two lines
        x = positions[-1] + 1.0
    ax.set_xticks(ticks, labels, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--value", default="us_per_receive", help="the CSV column to plot")
    parser.add_argument("--ylabel", default="µs per receive beyond the busy wait")
    parser.add_argument("--title", default=LATE_RECV_TITLE)
    args = parser.parse_args()
    main(args.src, args.dst, args.value, args.ylabel, args.title)
