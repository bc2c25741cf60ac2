"""Plot pg_vs_gloo.py's CSV: time per operation against size, mooncake-cpu
and Gloo, one panel per operation, one line style per world size.

    python3 benchmarks/plot_pg.py docs/benchmarks/pg_cpu.csv docs/benchmarks/pg_cpu.png [title]
"""

import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str, title: str = "mooncake-cpu vs Gloo, same processes, same run (2-core VM)") -> None:
    data = defaultdict(list)
    with open(src) as f:
        for row in csv.DictReader(f):
            data[(row["op"], int(row["world"]))].append(
                (int(row["bytes"]), float(row["mooncake_us"]), float(row["gloo_us"])))
    ops = sorted({op for op, _ in data})
    worlds = sorted({w for _, w in data})
    fig, axes = plt.subplots(1, len(ops), figsize=(4.2 * len(ops), 4.2), squeeze=False)
    styles = ["-", "--", ":", "-."]
    for ax, op in zip(axes[0], ops):
        for i, w in enumerate(worlds):
            rows = sorted(data[(op, w)])
            if not rows:
                continue
            x = [r[0] for r in rows]
            ax.plot(x, [r[1] for r in rows], styles[i % 4], color="tab:blue", marker="o", ms=3, label=f"mooncake-cpu, world {w}")
            ax.plot(x, [r[2] for r in rows], styles[i % 4], color="tab:red", marker="o", ms=3, label=f"gloo, world {w}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(op)
        ax.set_xlabel("message size (bytes)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("µs per operation (slowest rank)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(dst, dpi=100)


if __name__ == "__main__":
    main(*sys.argv[1:4])
