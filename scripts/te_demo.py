"""Multi-process transfer engine demo: the main job of this repository until
the process group lands.

A "holder" process owns a KV-cache-like buffer. Two client processes, one
over the same-host transport ("shm") and one over TCP, each push their own
blocks into half of it with ``batch_transfer_sync_write``, read them back
with ``batch_transfer_sync_read``, and tell the holder with a notification.
The holder then checks every byte it received. Nothing here is simulated:
three processes, real sockets and cross-memory attach.

    PYTHONPATH=python python3 scripts/te_demo.py [--mib 64] [--block-kib 256]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time

import numpy as np


def _engine(protocol: str):
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") != 0:
        raise RuntimeError(f"initialize failed for protocol {protocol!r}")
    return engine


def _blocks(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def holder(total: int, info_q, result_q) -> None:
    engine = _engine("")
    cache = np.zeros(total, dtype=np.uint8)
    assert engine.register_memory(cache.ctypes.data, total) == 0
    info_q.put((f"127.0.0.1:{engine.get_rpc_port()}", cache.ctypes.data))
    info_q.put((f"127.0.0.1:{engine.get_rpc_port()}", cache.ctypes.data))
    done, deadline = set(), time.monotonic() + 60
    while len(done) < 2 and time.monotonic() < deadline:
        done.update(n.name for n in engine.get_notifies() if n.msg == "done")
        time.sleep(0.005)
    half = total // 2
    ok = all(np.array_equal(cache[i * half:(i + 1) * half], _blocks(i + 1, half)) for i in range(2))
    result_q.put(("holder", len(done) == 2 and ok, f"notified by {sorted(done)}, contents {'verified' if ok else 'WRONG'}"))
    engine.unregister_memory(cache.ctypes.data)


def client(index: int, protocol: str, total: int, block: int, info_q, result_q) -> None:
    from mooncake.engine import TransferNotify, TransferOpcode

    engine = _engine(protocol)
    session, remote_base = info_q.get(timeout=30)
    half = total // 2
    data = _blocks(index + 1, half)
    readback = np.zeros_like(data)
    assert engine.batch_register_memory([data.ctypes.data, readback.ctypes.data], [half, half]) == 0
    offsets = list(range(0, half, block))
    lengths = [min(block, half - o) for o in offsets]
    remote = [remote_base + index * half + o for o in offsets]
    t0 = time.perf_counter()
    rc_w = engine.batch_transfer_sync_write(session, [data.ctypes.data + o for o in offsets], remote, lengths)
    t1 = time.perf_counter()
    rc_r = engine.batch_transfer_sync_read(session, [readback.ctypes.data + o for o in offsets], remote, lengths)
    t2 = time.perf_counter()
    rc_n = engine.transfer_sync(session, readback.ctypes.data, remote[0], 1, TransferOpcode.Read,
                                TransferNotify(f"client{index}", "done"))
    ok = rc_w == 0 and rc_r == 0 and rc_n == 0 and np.array_equal(data, readback)
    mib = half / 2**20
    result_q.put((f"client{index} [{protocol}]", ok,
                  f"wrote {mib:.0f} MiB in {len(offsets)} blocks at {mib / 1024 / (t1 - t0):.2f} GiB/s, "
                  f"read back at {mib / 1024 / (t2 - t1):.2f} GiB/s, bytes {'match' if ok else 'DIFFER'}"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64, help="size of the holder's buffer (MiB)")
    parser.add_argument("--block-kib", type=int, default=256, help="size of one transferred block (KiB)")
    args = parser.parse_args()
    total, block = args.mib << 20, args.block_kib << 10

    ctx = mp.get_context("spawn")
    info_q, result_q = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=holder, args=(total, info_q, result_q))]
    procs += [ctx.Process(target=client, args=(i, p, total, block, info_q, result_q)) for i, p in enumerate(["shm", "tcp"])]
    for p in procs:
        p.start()
    results = []
    try:
        for _ in procs:
            results.append(result_q.get(timeout=120))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for who, ok, text in sorted(results):
        print(f"{'OK  ' if ok else 'FAIL'} {who}: {text}")
    good = len(results) == len(procs) and all(ok for _, ok, _ in results)
    print("demo passed" if good else "demo FAILED")
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
