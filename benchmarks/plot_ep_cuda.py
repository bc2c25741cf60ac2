"""Plot docs/benchmarks/ep_cuda.csv (benchmarks/ep_bench.py --device cuda, one
GPU shared by the ranks, time-sliced and under MPS): median ms of dispatch and
combine per world size, mode and shape, bf16, log scale: the Buffer (its CUDA
IPC fast path there), the all-gather design, ElasticBuffer (fresh and cached
dispatch), ElasticBuffer sized at construction (its IPC path, eager and
replayed from a CUDA graph) and the copy bound (called eagerly, and replayed
from a CUDA graph where the file has it).

    python3 benchmarks/plot_ep_cuda.py docs/benchmarks/ep_cuda.csv docs/benchmarks/ep_cuda.png [GPU name]

The world-1 columns are named by their mode too when the file holds several
for one world (runs of one rank with and without a switch).
"""

import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

BUFFER, ALLGATHER, ELASTIC = "Buffer (fast path)", "all-gather design", "ElasticBuffer"
IPC, IPC_GRAPH = "ElasticBuffer, IPC path", "ElasticBuffer, IPC path, CUDA graph"
COPY_GRAPH = "copy bound, CUDA graph"
SERIES = {"dispatch": (("buffer", "dispatch", BUFFER), ("allgather-baseline", "dispatch", ALLGATHER),
                       ("elastic", "dispatch", ELASTIC), ("elastic", "dispatch-cached", "ElasticBuffer, cached"),
                       ("elastic-ipc", "dispatch", IPC), ("elastic-ipc-graph", "dispatch", IPC_GRAPH),
                       ("copy-bound", "dispatch", "copy bound"), ("copy-bound-graph", "dispatch", COPY_GRAPH)),
          "combine": (("buffer", "combine", BUFFER), ("allgather-baseline", "combine", ALLGATHER),
                      ("elastic", "combine", ELASTIC), ("elastic-ipc", "combine", IPC),
                      ("elastic-ipc-graph", "combine", IPC_GRAPH), ("copy-bound", "combine", "copy bound"),
                      ("copy-bound-graph", "combine", COPY_GRAPH))}
COLORS = {"Buffer (fast path)": "C0", "all-gather design": "C1", "ElasticBuffer": "C2", "ElasticBuffer, cached": "C4",
          "copy bound": "C3", IPC: "C5", IPC_GRAPH: "C6", COPY_GRAPH: "C7"}


def main(src: str, dst: str, gpu: str) -> None:
    with open(src) as f:
        rows = [r for r in csv.DictReader(f) if r["dtype"] == "bf16"]
    configs = list(dict.fromkeys((r["world"], r["mode"], r["tokens"], r["hidden"], r["topk"]) for r in rows))
    configs.sort(key=lambda c: (int(c[2]), int(c[0]), c[1] != "time-sliced"))
    modes_of_one = len({c[1] for c in configs if c[0] == "1"})
    median = {(r["world"], r["mode"], r["tokens"], r["hidden"], r["topk"], r["impl"], r["phase"]): float(r["median_ms"])
              for r in rows}
    fig, axes = plt.subplots(2, 1, figsize=(12, 8))
    present = {r["impl"] for r in rows}
    for ax, (phase, series) in zip(axes, SERIES.items()):
        series = [s for s in series if s[0] in present]  # files from before a series was measured
        width = 0.8 / len(series)
        for i, (impl, row_phase, label) in enumerate(series):
            xs = [c + (i - (len(series) - 1) / 2) * width for c in range(len(configs))]
            ax.bar(xs, [median.get((*cfg, impl, row_phase), 0.0) for cfg in configs], width, label=label,
                   color=COLORS[label])
        ax.set_yscale("log")
        ax.set_xticks(range(len(configs)))
        ax.set_xticklabels([f"{w} rank{'s' if w != '1' else ''}\n{m if w != '1' or modes_of_one > 1 else 'alone'}\nT={t} H={h}\nk={k}"
                            for w, m, t, h, k in configs], fontsize=7)
        ax.set_title(f"{phase}, bf16, ranks sharing one {gpu} (mooncake CUDA group)")
        ax.set_ylabel("median ms, slowest rank (log)")
        ax.grid(True, axis="y", alpha=0.3, which="both")
        ax.legend(fontsize=7, ncol=5)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "H200")
