"""Plot docs/benchmarks/ep_ll.csv (benchmarks/ep_ll_bench.py): average
microseconds of FP8 dispatch and BF16 combine per configuration (ranks on one
H200, time-sliced or under MPS), for the fast path, the collective path and
the device-to-device copy of the same bytes, log scale.

    python3 benchmarks/plot_ep_ll.py docs/benchmarks/ep_ll.csv docs/benchmarks/ep_ll.png
"""

import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PATHS = (("ipc", "fast path, eager calls"), ("ipc-graph", "fast path, CUDA graph replay"),
         ("collective", "collective path"), ("d2d-copy", "d2d copy bound"),
         ("peer-copy", "copy into the next rank's GPU"))  # only where ranks sit on several GPUs


def main(src: str, dst: str) -> None:
    with open(src) as f:
        rows = list(csv.DictReader(f))
    # Files before the "gpus" column had every rank on one GPU.
    configs = list(dict.fromkeys((r["label"], r["world"], r.get("gpus", "1 GPU")) for r in rows))
    avg = {(r["label"], r["world"], r.get("gpus", "1 GPU"), r["path"], r["phase"]): float(r["avg_us"]) for r in rows}
    paths = [(path, label) for path, label in PATHS if any(r["path"] == path for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.16
    for ax, phase in zip(axes, ("dispatch", "combine")):
        for i, (path, label) in enumerate(paths):
            xs = [c + (i - (len(paths) - 1) / 2) * width for c in range(len(configs))]
            ax.bar(xs, [avg.get((*cfg, path, phase), 0.0) for cfg in configs], width, label=label)
        ax.set_xticks(range(len(configs)))
        ax.set_xticklabels([f"{w} rank(s), {gpus}\n{lbl}" for lbl, w, gpus in configs], fontsize=8)
        ax.set_yscale("log")
        ax.set_ylim(top=ax.get_ylim()[1] * 8)  # room for the legend above the bars
        ax.set_title(f"{phase} ({'FP8' if phase == 'dispatch' else 'BF16'}), T=128 H=7168 E=288 top-8, H200")
        ax.set_ylabel("average us per call (mean over ranks)")
        ax.grid(True, axis="y", alpha=0.3, which="both")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:3])
