"""Plot te_bench's CSV: bandwidth and latency against size, each transport
beside the bound it is judged by.

    python3 benchmarks/plot_te.py docs/benchmarks/te.csv docs/benchmarks/te.png
"""

import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SERIES = [
    ("shm_mapped", "shm, shared-memory buffer (memcpy via mapping)", "tab:blue", "-"),
    ("shm_attached", "shm, ordinary buffer (process_vm_writev)", "tab:cyan", "-"),
    ("memcpy", "bound: single-thread memcpy", "tab:blue", ":"),
    ("tcp", "tcp", "tab:red", "-"),
    ("rawtcp", "bound: raw TCP stream + ack", "tab:red", ":"),
]


def main(src: str, dst: str) -> None:
    with open(src) as f:
        rows = list(csv.DictReader(f))
    sizes = [int(r["bytes"]) for r in rows]
    fig, (bw, lat) = plt.subplots(1, 2, figsize=(13, 5))
    for key, label, color, style in SERIES:
        bw.plot(sizes, [float(r[f"{key}_gbps"]) for r in rows], style, color=color, marker="o", ms=3, label=label)
        lat.plot(sizes, [float(r[f"{key}_us"]) for r in rows], style, color=color, marker="o", ms=3, label=label)
    for ax in (bw, lat):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("transfer size (bytes)")
        ax.grid(True, which="both", alpha=0.3)
    bw.set_ylabel("GB/s (1e9 bytes/s), synchronous writes one at a time")
    bw.set_title("Transfer engine bandwidth, two processes, one host")
    lat.set_yscale("log")
    lat.set_ylabel("µs per synchronous write")
    lat.set_title("Transfer engine latency")
    bw.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
