"""Helpers shared by the engine tests, and the code that runs in the separate
processes the multi-process tests start (multiprocessing "spawn" imports this
module in the child, so it must not import the test modules or pytest).

Every wait in here is bounded: a child whose parent vanished exits on its own.
"""

import hashlib
import os
import time
import traceback

import numpy as np

HOST = "127.0.0.1"

# "" is the automatic choice: shm (cross-memory attach) for a same-host peer.
# "rdma" runs over the software verbs provider (the protocol fixture sets
# MC_RDMA_PROVIDER=software): no machine here has an RDMA NIC.
PROTOCOLS = ["tcp", "shm", "", "rdma"]
PROTOCOL_IDS = ["tcp", "shm", "auto", "rdma"]


def session_of(engine):
    return f"{HOST}:{engine.get_rpc_port()}"


def addr(arr, offset=0):
    """Virtual address of byte `offset` of a numpy array."""
    return arr.ctypes.data + offset


def pattern(seed, nbytes):
    """Reproducible random bytes: any process with the seed gets the same."""
    return np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)


def sha256(arr):
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()


def recv_within(conn, timeout):
    """conn.recv() that gives up after `timeout` seconds."""
    if not conn.poll(timeout):
        raise TimeoutError(f"no message within {timeout} s")
    return conn.recv()


def new_engine(protocol):
    from mooncake.engine import TransferEngine

    e = TransferEngine()
    rc = e.initialize(HOST, "P2PHANDSHAKE", protocol, "")
    if rc != 0:
        raise RuntimeError(f"initialize(protocol={protocol!r}) returned {rc}")
    return e


# ---------------------------------------------------------------------------
# A passive target: registers one buffer, reports where it is, and answers
# questions about its contents until told to exit (or left alone too long).


def target_main(conn, protocol, nbytes, env, idle_timeout=120.0):
    os.environ.update(env)
    engine = new_engine(protocol)
    buf = np.zeros(nbytes, dtype=np.uint8)
    rc = engine.register_memory(addr(buf), nbytes)
    conn.send(("ready", session_of(engine), addr(buf), os.getpid(), rc))
    while conn.poll(idle_timeout):
        try:
            cmd, *args = conn.recv()
        except EOFError:
            break
        if cmd == "digest":  # sha256 of buf[offset:offset+length]
            offset, length = args
            conn.send(sha256(buf[offset : offset + length]))
        elif cmd == "fill":  # buf = pattern(seed)
            (seed,) = args
            buf[:] = pattern(seed, nbytes)
            conn.send("filled")
        elif cmd == "exit":
            conn.send("bye")
            break
        else:
            conn.send(f"unknown command {cmd!r}")
    engine.unregister_memory(addr(buf))


# ---------------------------------------------------------------------------
# Chained weight sync (verl style). The trainer owns the weights and stages
# them through two bucket buffers; rollout 1 pulls each bucket from the
# trainer and re-exposes it from its own two buckets to rollout 2. A consumer
# releases a bucket by writing a 4-byte word (chunk index + 1) into the
# producer's flag slot for (bucket, consumer); the producer polls its own
# flag memory before reusing a bucket.

NUM_BUCKETS = 2
QUEUE_TIMEOUT = 30.0
FLAG_TIMEOUT = 30.0


def wait_flag(flags, bucket, consumer, expected, timeout=FLAG_TIMEOUT):
    """Polls the local flag word until a consumer wrote `expected` into it."""
    deadline = time.monotonic() + timeout
    while True:
        value = int(flags[bucket, consumer])
        if value == expected:
            return
        if value > expected:
            raise AssertionError(
                f"flag[{bucket}, {consumer}] = {value}: released a chunk beyond {expected - 1}, "
                "which was never staged"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(f"flag[{bucket}, {consumer}] stayed {value}, waiting for {expected}")
        time.sleep(0.0002)


def _chunks(total, bucket_size):
    n = (total + bucket_size - 1) // bucket_size
    return [(k, k * bucket_size, min(bucket_size, total - k * bucket_size)) for k in range(n)]


def trainer_main(cfg, downstream, results):
    try:
        engine = new_engine(cfg["protocol"])
        weights = pattern(cfg["seed"], cfg["total"])
        buckets = np.zeros((NUM_BUCKETS, cfg["bucket"]), dtype=np.uint8)
        flags = np.zeros((NUM_BUCKETS, 1), dtype=np.uint32)  # one consumer: rollout 1
        assert engine.register_memory(addr(buckets), buckets.nbytes) == 0
        assert engine.register_memory(addr(flags), flags.nbytes) == 0
        downstream.put(("info", session_of(engine), [addr(buckets[b]) for b in range(NUM_BUCKETS)], addr(flags)))
        chunks = _chunks(cfg["total"], cfg["bucket"])
        for k, start, length in chunks:
            b = k % NUM_BUCKETS
            if k >= NUM_BUCKETS:
                wait_flag(flags, b, 0, k - NUM_BUCKETS + 1)
            buckets[b, :length] = weights[start : start + length]
            downstream.put(("ready", k, length))
        for k, _, _ in chunks[-NUM_BUCKETS:]:
            wait_flag(flags, k % NUM_BUCKETS, 0, k + 1)
        results.put(("trainer", "ok", len(chunks)))
    except BaseException:
        results.put(("trainer", "error", traceback.format_exc()))


def rollout_main(name, cfg, upstream, downstream, results):
    """Pulls every chunk from the upstream producer; if `downstream` is given,
    re-exposes each chunk to one consumer of its own."""
    try:
        engine = new_engine(cfg["protocol"])
        assembled = np.zeros(cfg["total"], dtype=np.uint8)
        buckets = np.zeros((NUM_BUCKETS, cfg["bucket"]), dtype=np.uint8)
        flags = np.zeros((NUM_BUCKETS, 1), dtype=np.uint32)
        acks = np.zeros(NUM_BUCKETS, dtype=np.uint32)  # source words of the release writes
        for arr in (buckets, flags, acks):
            assert engine.register_memory(addr(arr), arr.nbytes) == 0

        tag, up_session, up_buckets, up_flags = upstream.get(timeout=QUEUE_TIMEOUT)
        assert tag == "info", tag
        if downstream is not None:
            downstream.put(("info", session_of(engine), [addr(buckets[b]) for b in range(NUM_BUCKETS)], addr(flags)))

        chunks = _chunks(cfg["total"], cfg["bucket"])
        for k, start, length in chunks:
            b = k % NUM_BUCKETS
            msg = upstream.get(timeout=QUEUE_TIMEOUT)
            assert msg == ("ready", k, length), f"expected chunk {k}, got {msg}"
            if downstream is not None and k >= NUM_BUCKETS:
                # Our bucket b still holds chunk k-2 until our consumer releases it.
                wait_flag(flags, b, 0, k - NUM_BUCKETS + 1)
            rc = engine.transfer_sync_read(up_session, addr(buckets[b]), up_buckets[b], length)
            assert rc == 0, f"{name}: read of chunk {k} returned {rc}"
            assembled[start : start + length] = buckets[b, :length]
            acks[b] = k + 1
            slot = up_flags + (b * 1 + 0) * 4  # flags[b, consumer 0] of the producer
            rc = engine.transfer_sync_write(up_session, addr(acks, b * 4), slot, 4)
            assert rc == 0, f"{name}: release of chunk {k} returned {rc}"
            if downstream is not None:
                downstream.put(("ready", k, length))
        if downstream is not None:
            for k, _, _ in chunks[-NUM_BUCKETS:]:
                wait_flag(flags, k % NUM_BUCKETS, 0, k + 1)
        expected = pattern(cfg["seed"], cfg["total"])
        results.put((name, "ok", sha256(assembled), bool(np.array_equal(assembled, expected))))
    except BaseException:
        results.put((name, "error", traceback.format_exc()))


# ---------------------------------------------------------------------------
# A passive target whose buffer is a torch CUDA tensor: a slice `offset`
# bytes into a larger tensor, so the registered range is a piece of one of
# the caching allocator's blocks, as it is in real clients.


def cuda_target_main(conn, protocol, nbytes, offset, seed, idle_timeout=120.0):
    import torch

    engine = new_engine(protocol)
    block = torch.empty(nbytes + offset + 4096, dtype=torch.uint8, device="cuda")
    view = block[offset : offset + nbytes]
    view.copy_(torch.from_numpy(pattern(seed, nbytes)))
    torch.cuda.synchronize()
    rc = engine.register_memory(view.data_ptr(), nbytes)  # location "*": detected as cuda:N
    conn.send(("ready", session_of(engine), view.data_ptr(), os.getpid(), rc))
    while conn.poll(idle_timeout):
        try:
            cmd, *args = conn.recv()
        except EOFError:
            break
        if cmd == "digest":  # sha256 of view[offset:offset+length], copied to the host
            start, length = args
            torch.cuda.synchronize()
            conn.send(sha256(view[start : start + length].cpu().numpy()))
        elif cmd == "exit":
            conn.send("bye")
            break
        else:
            conn.send(f"unknown command {cmd!r}")
    engine.unregister_memory(view.data_ptr())
