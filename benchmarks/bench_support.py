"""What the multi-process benchmarks share.

Starting a benchmark's ranks: one spawned process per rank on this host,
rendezvous on a free local port, each rank's result back through a queue.

    per_rank = run_ranks(rank_main, world, args, timeout)   # {rank: what rank_main put}
    rows = sweep_worlds("name", run_world, args)             # run_world(world, args) per args.worlds
    write_csv(rows, args.csv, append=False)                  # stdout, and the file if given

``rank_main(rank, world, port, args, queue)`` must put ``(rank, result)`` on
the queue; an exception in a rank is sent as ``(rank, "Type: message")`` and
ends the run (SystemExit naming the ranks) instead of waiting out the timeout.
"""

from __future__ import annotations

import csv
import os
import socket
import sys
import time

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _guarded(target, rank, world, port, args, queue):
    try:
        target(rank, world, port, args, queue)
    except BaseException as err:  # the parent must hear of it instead of waiting out its timeout
        queue.put((rank, RankFailure(f"{type(err).__name__}: {err}")))
        raise


class RankFailure(str):
    """What a rank that raised sends instead of its result."""


def run_ranks(target, world: int, args, timeout: float) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_guarded, args=(target, r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    per_rank = dict(queue.get(timeout=timeout) for _ in range(world))
    failed = {r: v for r, v in per_rank.items() if isinstance(v, RankFailure)}
    if failed:
        for p in procs:
            p.kill()
        raise SystemExit(f"world {world}: {failed}")
    for p in procs:
        p.join(timeout)
    return per_rank


def sweep_worlds(name: str, run_world, args) -> list[dict]:
    """The rows of ``run_world(world, args)`` for each of ``args.worlds``, with
    each world's wall time on stderr (``args.device`` and ``args.label`` name the run)."""
    rows = []
    for world in args.worlds:
        start = time.perf_counter()
        rows += run_world(world, args)
        print(f"[{name}] world {world} ({args.device}, {args.label}): {time.perf_counter() - start:.1f} s",
              file=sys.stderr, flush=True)
    return rows


def write_csv(rows: list[dict], path: str | None = None, append: bool = False) -> None:
    """Rows (dicts with the same keys) as CSV on stdout and, with `path`, into
    that file (appended without a second header when `append`)."""
    fields = list(rows[0])
    out = csv.DictWriter(sys.stdout, fields)
    out.writeheader()
    out.writerows(rows)
    if path:
        existed = os.path.exists(path)
        with open(path, "a" if append else "w", newline="") as f:
            w = csv.DictWriter(f, fields)
            if not (append and existed):
                w.writeheader()
            w.writerows(rows)
