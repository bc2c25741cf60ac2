"""Plot the CSV of benchmarks/moe_gemm_bench.py: TFLOP/s of each implementation
of one rank's expert compute (the layer's forms, the per-expert loop, torch.mm and
torch.bmm of the same GEMMs) per emulated world size, with the issue's bar
(half of torch.mm's TFLOP/s) drawn over the bar of the layer's blocks.

    python3 benchmarks/plot_moe_gemm.py docs/benchmarks/moe_gemm_cuda.csv docs/benchmarks/moe_gemm_cuda.png
"""

import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

IMPLS = (("blocks", "the layer, expert-major blocks", "C2"), ("grouped", "the layer, sorted rows", "C8"),
         ("grouped_mm", "torch._grouped_mm form", "C0"),
         ("loop", "per-expert loop (MoEEpLayer)", "C3"),
         ("mm", "torch.mm, same FLOPs (the bound)", "0.5"), ("bmm", "torch.bmm, per-expert shapes", "0.75"))


def main(src: str, dst: str) -> None:
    with open(src) as f:
        rows = list(csv.DictReader(f))
    by = {(r["world"], r["impl"]): r for r in rows}
    worlds = list(dict.fromkeys(r["world"] for r in rows))
    shape = rows[0]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(IMPLS)
    for i, (impl, label, color) in enumerate(IMPLS):
        xs = [w + (i - (len(IMPLS) - 1) / 2) * width for w in range(len(worlds))]
        ys = [float(by[(w, impl)]["tflops"]) if (w, impl) in by else 0.0 for w in worlds]
        ax.bar(xs, ys, width, color=color, label=label)
        if impl == "blocks":
            for x, w, y in zip(xs, worlds, ys):
                bar = 0.5 * float(by[(w, "mm")]["tflops"])
                ax.hlines(bar, x - width / 2, x + width / 2, colors="k", linestyles="--",
                          label="0.5 x torch.mm (the bar)" if w == worlds[0] else None)
                ratio = float(by[(w, impl)]["ratio_to_bound"])
                ax.text(x, max(y, bar) * 1.02, f"{ratio:.2f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(worlds)))
    ax.set_xticklabels([f"R={w}: {by[(w, 'grouped')]['local_experts']} experts, "
                        f"{by[(w, 'grouped')]['rows_per_rank']} rows" for w in worlds])
    ax.set_ylabel("TFLOP/s (the two GEMMs; SwiGLU excluded)")
    ax.set_title(f"One rank's expert compute: E={shape['experts']}, top-{shape['topk']}, T={shape['tokens_per_rank']} "
                 f"per rank, H={shape['hidden']}, I={shape['intermediate']}, bf16\n"
                 "(numbers: the blocks' TFLOP/s over torch.mm's)", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_ylim(top=ax.get_ylim()[1] * 1.3)  # room for the legend above the bars
    ax.legend(fontsize=8, ncol=2, loc="upper left")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
