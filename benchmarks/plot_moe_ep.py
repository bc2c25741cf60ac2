"""Plot docs/benchmarks/moe_ep_cuda.csv (benchmarks/moe_ep_bench.py): per world
size and mode, each MoEEp layout's dispatch / compute / combine (stacked
medians of the slowest rank, from last_timings_ms) with its whole-forward
median as a dot, beside the dense single-process MoE of the world's tokens.

    python3 benchmarks/plot_moe_ep.py docs/benchmarks/moe_ep_cuda.csv docs/benchmarks/moe_ep_cuda.png
"""

import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LAYOUTS = ("EXPERT_MAJOR", "RANK_MAJOR", "FLAT")
PHASES = (("dispatch", "C0"), ("compute", "C2"), ("combine", "C1"))


def main(src: str, dst: str) -> None:
    with open(src) as f:
        rows = list(csv.DictReader(f))
    median = {(r["world"], r["mode"], r["impl"], r["phase"]): float(r["median_ms"]) for r in rows}
    dense = {r["world"]: float(r["median_ms"]) for r in rows if r["impl"] == "dense"}
    configs = list(dict.fromkeys((r["world"], r["mode"]) for r in rows if r["impl"] != "dense"))
    configs.sort(key=lambda c: (int(c[0]), c[1] != "time-sliced"))
    shape = rows[0]
    fig, ax = plt.subplots(figsize=(12, 4.8))
    width = 0.8 / (len(LAYOUTS) + 1)
    labelled = set()
    for c, (world, mode) in enumerate(configs):
        for i, layout in enumerate(LAYOUTS + ("dense",)):
            x = c + (i - len(LAYOUTS) / 2) * width
            if layout == "dense":
                label = "dense MoE, one process (R·T tokens)" if "dense" not in labelled else None
                labelled.add("dense")
                ax.bar(x, dense.get(world, 0.0), width, color="0.6", label=label)
                continue
            bottom = 0.0
            for phase, color in PHASES:
                ms = median.get((world, mode, f"moe_ep {layout}", phase), 0.0)
                ax.bar(x, ms, width, bottom=bottom, color=color, label=phase if phase not in labelled else None,
                       edgecolor="white", linewidth=0.5)
                labelled.add(phase)
                bottom += ms
            fwd = median.get((world, mode, f"moe_ep {layout}", "forward"))
            if fwd is not None:
                ax.plot(x, fwd, "k.", label="whole forward" if "fwd" not in labelled else None)
                labelled.add("fwd")
            ax.text(x, bottom, layout.split("_")[0][:6], ha="center", va="bottom", fontsize=6, rotation=90)
    ax.set_xticks(range(len(configs)))
    ax.set_xticklabels([f"{w} rank{'s' if w != '1' else ''}, {m if w != '1' else 'alone'}" for w, m in configs])
    ax.set_ylabel("median ms, slowest rank")
    ax.set_title(f"MoEEp forward on one H200, T={shape['tokens_per_rank']} per rank, H={shape['hidden']}, "
                 f"I={shape['intermediate']}, E={shape['experts']}, top-{shape['topk']}, bf16 "
                 "(bars per group: EXPERT_MAJOR, RANK_MAJOR, FLAT, dense)", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
