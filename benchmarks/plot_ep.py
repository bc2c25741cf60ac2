"""Plot docs/benchmarks/ep_cpu.csv (benchmarks/ep_bench.py): median ms of
dispatch and combine per world size and shape, the Buffer's collective path
beside the all-gather design, ElasticBuffer and the copy bound, bf16.

    python3 benchmarks/plot_ep.py docs/benchmarks/ep_cpu.csv docs/benchmarks/ep_cpu.png
"""

import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

IMPLS = (("buffer", "Buffer (collective path)"), ("allgather-baseline", "all-gather design"),
         ("elastic", "ElasticBuffer"), ("copy-bound", "copy bound"))


def main(src: str, dst: str) -> None:
    with open(src) as f:
        rows = [r for r in csv.DictReader(f) if r["dtype"] == "bf16"]
    configs = list(dict.fromkeys((r["world"], r["tokens"], r["hidden"], r["topk"]) for r in rows))
    median = {(r["world"], r["tokens"], r["hidden"], r["topk"], r["impl"], r["phase"]): float(r["median_ms"])
              for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=False)
    width = 0.8 / len(IMPLS)
    for ax, phase in zip(axes, ("dispatch", "combine")):
        for i, (impl, label) in enumerate(IMPLS):
            xs = [c + (i - (len(IMPLS) - 1) / 2) * width for c in range(len(configs))]
            ax.bar(xs, [median.get((*cfg, impl, phase), 0.0) for cfg in configs], width, label=label)
        ax.set_xticks(range(len(configs)))
        ax.set_xticklabels([f"{w} ranks\nT={t}\nH={h}\nk={k}" for w, t, h, k in configs], fontsize=7)
        ax.set_title(f"{phase}, bf16, mooncake-cpu (2-core VM)")
        ax.set_ylabel("median ms, slowest rank")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
