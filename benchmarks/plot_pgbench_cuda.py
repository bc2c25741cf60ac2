"""Collect pgbench.py outputs of backend "mooncake" (and NCCL) on CUDA into a
CSV and a plot: all_reduce time against size per configuration, with the
copy bound that `--bound` measured in the same run (into another process's
buffer through CUDA IPC with ranks sharing a GPU, into the next GPU with ranks
spread over GPUs).

    python3 benchmarks/plot_pgbench_cuda.py docs/benchmarks/pg_cuda_torch.csv docs/benchmarks/pg_cuda_torch.png \\
        "mooncake w1=out/mooncake_w1.txt" "nccl w1=out/nccl_w1.txt" "mooncake w2=out/mooncake_w2.txt" ...

Each argument is LABEL=FILE; the world size is read from the file's header.
"""

import csv
import math
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

FIELDS = ["config", "world", "gpus", "size_bytes", "time_us", "d2d_us", "ipc_us", "ipc_over_time"]


def parse(label: str, path: str) -> list[dict]:
    rows, world, gpus = [], None, 1
    with open(path) as f:
        for line in f:
            m = re.search(r"world=(\d+)", line)
            if line.startswith("# pgbench") and m:
                world = int(m.group(1))
                on = re.search(r" on (\d+) GPU", line)
                gpus = int(on.group(1)) if on else 1
                continue
            parts = line.split()
            if len(parts) < 9 or not parts[0].isdigit():
                continue
            # size count type redop root | out-of-place: time algbw busbw wrong | in-place ... | [d2d ipc ratio]
            row = {"config": label, "world": world, "gpus": gpus, "size_bytes": int(parts[0]),
                   "time_us": float(parts[5]),
                   "d2d_us": "", "ipc_us": "", "ipc_over_time": ""}
            if len(parts) >= 16:
                row["d2d_us"], row["ipc_us"] = float(parts[13]), float(parts[14])
                if not math.isnan(row["ipc_us"]):
                    row["ipc_over_time"] = round(row["ipc_us"] / row["time_us"], 3)
            rows.append(row)
    return rows


def main(csv_path: str, png_path: str, specs: list[str]) -> None:
    rows = []
    for spec in specs:
        label, path = spec.split("=", 1)
        rows += parse(label, path)
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for label in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == label]
        ax.plot([r["size_bytes"] for r in mine], [r["time_us"] for r in mine], marker="o", ms=3, label=label)
    # The bound of the first configuration that measured one.
    measured = [r for r in rows if r["ipc_us"] != "" and not math.isnan(r["ipc_us"])]
    bound = {r["size_bytes"]: r["ipc_us"] for r in measured if r["config"] == measured[0]["config"]} if measured else {}
    if bound:
        sizes = sorted(bound)
        spread = measured[0]["gpus"] > 1
        what = "one copy into the next GPU" if spread else "one CUDA IPC copy"
        ax.plot(sizes, [bound[s] for s in sizes], "k--", lw=1, label=f"{what} (bound)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("µs per all_reduce (fp32 sum)")
    placement = "one rank per H200" if any(r["gpus"] > 1 for r in rows) else "ranks sharing one H200"
    ax.set_title(f'torch.distributed backend "mooncake", {placement}')
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
