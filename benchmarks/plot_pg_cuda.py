"""Plot the CudaIpcGroup all_reduce figures of docs/benchmarks/pg_cuda.md
(docs/benchmarks/pg_cuda_all_reduce.csv, H200, ranks sharing one GPU): time
against size before and after the per-kernel fix, and under MPS, per world.

    python3 benchmarks/plot_pg_cuda.py docs/benchmarks/pg_cuda_all_reduce.csv docs/benchmarks/pg_cuda_all_reduce.png
"""

import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

UNITS = {"KiB": 1 << 10, "MiB": 1 << 20}


def size_bytes(text: str) -> int:
    value, unit = text.split()
    return int(value) * UNITS[unit]


def main(src: str, dst: str) -> None:
    with open(src) as f:
        rows = list(csv.DictReader(f))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), squeeze=False)
    for ax, world in zip(axes[0], ("2", "4")):
        mine = sorted((r for r in rows if r["world"] == world), key=lambda r: size_bytes(r["size"]))
        for key, label, style in (("before_us", "before", ":"), ("after_us", "after", "-"),
                                  ("mps_after_us", "after, under MPS", "--")):
            pts = [(size_bytes(r["size"]), float(r[key])) for r in mine if r[key]]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", ms=3, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"all_reduce fp32, world {world} on one H200")
        ax.set_xlabel("message size (bytes)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("µs per operation")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=100)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
