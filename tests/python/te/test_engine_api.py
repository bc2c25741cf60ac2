"""mooncake.engine API tests with two engines in one process. The engines
still talk through the real transports: tcp over loopback sockets, shm
through process_vm_writev/readv on this process's own pid."""

import gc
import json
import operator
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import mooncake.engine as mce
from _procs import HOST, PROTOCOL_IDS, PROTOCOLS, addr, pattern, session_of
from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode

pytestmark = pytest.mark.timeout(60)

UNKNOWN_SESSION = "127.0.0.1:1"  # nothing listens on port 1


def assert_untouched(arr, seed, start=0, stop=None):
    """arr[start:stop] still holds the random bytes pattern(seed) put there."""
    stop = arr.size if stop is None else stop
    np.testing.assert_array_equal(arr[start:stop], pattern(seed, arr.size)[start:stop])


# ---------------------------------------------------------------------------
# module surface


def test_module_constants_and_enums():
    assert int(TransferOpcode.Read) == 0
    assert int(TransferOpcode.Write) == 1
    assert TransferEngine.TransferOpcode.Read == TransferOpcode.Read
    assert TransferEngine.TransferOpcode.Write == TransferOpcode.Write
    assert mce.Read == TransferOpcode.Read and mce.Write == TransferOpcode.Write
    for flag in ("SUPPORT_CUDA", "SUPPORT_RDMA", "SUPPORT_EFA", "SUPPORT_HIP", "SUPPORT_MNNVL", "SUPPORT_MUSA",
                 "SUPPORT_INTRA_NVLINK", "SUPPORT_MULTI_PROTOCOL"):
        assert isinstance(getattr(mce, flag), bool), flag
    assert mce.SUPPORT_MULTI_PROTOCOL  # tcp and shm (and cuda_ipc) side by side, chosen per request
    # Usable as an int, and made from one, as the reference's enum.
    assert operator.index(TransferOpcode.Write) == 1 and [10, 20][TransferOpcode.Write] == 20
    assert TransferOpcode(1) == TransferOpcode.Write and TransferOpcode.Write.value == 1
    n = TransferNotify("name", "msg")
    assert (n.name, n.msg) == ("name", "msg")
    n.msg = "other"
    assert n.msg == "other"


def test_engine_ptr_and_topology(factory):
    a, b = factory.engine(), factory.engine()
    assert a.get_engine_ptr() != 0
    assert a.get_engine_ptr() != b.get_engine_ptr()
    assert a.get_engine_ptr() == a.get_engine_ptr()
    topo = json.loads(a.get_local_topology())
    assert isinstance(topo, dict) and topo
    for location, devices in topo.items():
        assert location.startswith("cpu:")
        assert isinstance(devices, list) and len(devices) == 2


# ---------------------------------------------------------------------------
# initialize


def test_initialize_rejects_unsupported_metadata_and_protocol(factory):
    e = TransferEngine()
    assert e.initialize(HOST, "etcd://127.0.0.1:2379", "tcp", "") == -1
    assert e.initialize(HOST, "", "tcp", "") == -1
    assert e.initialize(HOST, "P2PHANDSHAKE", "bogus", "") == -1
    # The failed attempts leave the engine uninitialized, not broken.
    assert e.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
    assert e.get_rpc_port() > 0
    # A second initialize is refused and keeps the first identity.
    port = e.get_rpc_port()
    assert e.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == -1
    assert e.get_rpc_port() == port
    peer = factory.engine()
    assert peer.send_probe(f"{HOST}:{port}") == 0


@pytest.mark.parametrize("protocol", PROTOCOLS + ["rdma"], ids=PROTOCOL_IDS + ["rdma"])
def test_initialize_protocols_transfer(factory, protocol):
    """Every accepted protocol, including "rdma" (falls back to the automatic
    choice in this build), gives an engine that can move bytes."""
    src = factory.engine(protocol)
    dst = factory.engine("")
    s = factory.buffer(src, 4096, seed=11)
    d = factory.buffer(dst, 4096, seed=12)
    assert src.transfer_sync_write(session_of(dst), addr(s), addr(d), 4096) == 0
    np.testing.assert_array_equal(d, s)


_REINIT_SCRIPT = textwrap.dedent(
    """
    import os
    import numpy as np
    from mooncake.engine import TransferEngine

    a = TransferEngine()
    assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    port = a.get_rpc_port()
    os.environ["MC_MIN_RPC_PORT"] = os.environ["MC_MAX_RPC_PORT"] = str(port)  # only a busy port
    b = TransferEngine()
    print("first", b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""), flush=True)
    del os.environ["MC_MIN_RPC_PORT"], os.environ["MC_MAX_RPC_PORT"]
    print("retry", b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""), flush=True)
    print("probe", a.send_probe(f"127.0.0.1:{b.get_rpc_port()}"), flush=True)
    src = np.random.default_rng(1).integers(0, 256, 8 << 20, dtype=np.uint8)
    dst = np.zeros(8 << 20, dtype=np.uint8)
    assert b.register_memory(src.ctypes.data, src.nbytes) == 0
    assert a.register_memory(dst.ctypes.data, dst.nbytes) == 0
    rc = b.transfer_sync_write(f"127.0.0.1:{port}", src.ctypes.data, dst.ctypes.data, src.nbytes)
    print("write", rc, bool((src == dst).all()), flush=True)
    del b
    print("destroyed", flush=True)
    """
)


def test_initialize_retry_after_failed_start():
    """initialize() that fails because no RPC port is free, then succeeds on a
    retry with a free range: the engine must work like a fresh one. Runs in a
    subprocess because the failure mode aborts the process."""
    proc = subprocess.run([sys.executable, "-c", _REINIT_SCRIPT], capture_output=True, text=True, timeout=30)
    lines = proc.stdout.split("\n")
    assert "first -1" in lines, proc.stdout + proc.stderr
    assert "retry 0" in lines, proc.stdout + proc.stderr
    assert "probe 0" in lines, proc.stdout + proc.stderr
    assert "write 0 True" in lines, proc.stdout + proc.stderr
    assert "destroyed" in lines and proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])


def test_distinct_engines_get_distinct_ports(factory):
    ports = {factory.engine().get_rpc_port() for _ in range(4)}
    assert len(ports) == 4


def test_calls_before_initialize(factory):
    e = TransferEngine()
    target = factory.engine()
    t = factory.buffer(target, 64, seed=3)
    local = np.zeros(64, dtype=np.uint8)
    assert e.register_memory(addr(local), 64) != 0
    assert e.allocate_managed_buffer(4096) == 0
    assert e.transfer_sync_write(session_of(target), addr(local), addr(t), 64) == -1
    assert e.send_probe(session_of(target)) != 0
    assert_untouched(t, 3)


# ---------------------------------------------------------------------------
# registration


def test_register_zero_length_is_refused(factory):
    e = factory.engine()
    arr = np.zeros(64, dtype=np.uint8)
    assert e.register_memory(addr(arr), 0) == -1
    # ...and registered nothing: the full range is still free.
    assert e.register_memory(addr(arr), 64) == 0
    assert e.unregister_memory(addr(arr)) == 0


@pytest.mark.parametrize(
    "start, length",
    [(0, 4096), (100, 10), (0, 1), (4095, 1), (4000, 200), (-50, 51), (-100, 5000)],
    ids=["same", "inside", "first-byte", "last-byte", "tail", "head", "covering"],
)
def test_register_overlap_is_refused(factory, start, length):
    e = factory.engine()
    arr = np.zeros(3 * 4096, dtype=np.uint8)
    base = addr(arr, 4096)  # the registered region is arr[4096:8192]
    assert e.register_memory(base, 4096) == 0
    assert e.register_memory(base + start, length) == -7
    assert e.unregister_memory(base) == 0


def test_register_adjacent_regions_is_allowed(factory):
    e = factory.engine()
    arr = np.zeros(3 * 4096, dtype=np.uint8)
    assert e.register_memory(addr(arr, 4096), 4096) == 0
    assert e.register_memory(addr(arr, 0), 4096) == 0  # ends where the first begins
    assert e.register_memory(addr(arr, 8192), 4096) == 0  # begins where the first ends
    assert e.batch_unregister_memory([addr(arr, 0), addr(arr, 4096), addr(arr, 8192)]) == 0


def test_unregister_needs_the_exact_base(factory):
    e = factory.engine()
    arr = np.zeros(8192, dtype=np.uint8)
    base = addr(arr)
    assert e.register_memory(base, 8192) == 0
    assert e.unregister_memory(base + 1) != 0
    assert e.unregister_memory(base + 4096) != 0
    assert e.unregister_memory(base - 1) != 0
    # Still registered: an overlapping registration is refused.
    assert e.register_memory(base + 10, 10) == -7
    assert e.unregister_memory(base) == 0
    assert e.unregister_memory(base) != 0  # already gone
    # Gone: the range can be registered again, differently.
    assert e.register_memory(base + 10, 10) == 0
    assert e.unregister_memory(base + 10) == 0


def test_batch_register_is_all_or_nothing(factory):
    e = factory.engine()
    arr = np.zeros(4 * 4096, dtype=np.uint8)
    a, b, c = addr(arr, 0), addr(arr, 4096), addr(arr, 8192)
    assert e.register_memory(b, 4096) == 0
    # One entry overlaps the registered region: nothing of the batch is registered.
    assert e.batch_register_memory([a, b + 100], [4096, 100]) == -7
    assert e.register_memory(a, 4096) == 0
    # Two entries of one batch that overlap each other: likewise nothing.
    assert e.batch_register_memory([c, c + 4095], [4096, 10]) != 0
    assert e.register_memory(c, 4096) == 0
    # A zero length in a batch: likewise nothing.
    d = addr(arr, 3 * 4096)
    assert e.batch_register_memory([d, d + 2048], [1024, 0]) != 0
    assert e.register_memory(d, 1024) == 0
    assert e.batch_unregister_memory([a, b, c, d]) == 0


def test_batch_register_length_mismatch(factory):
    e = factory.engine()
    arr = np.zeros(8192, dtype=np.uint8)
    assert e.batch_register_memory([addr(arr), addr(arr, 4096)], [4096]) != 0
    assert e.register_memory(addr(arr), 8192) == 0
    assert e.unregister_memory(addr(arr)) == 0


def test_batch_register_and_unregister(factory):
    e = factory.engine()
    peer = factory.engine()
    arrs = [np.zeros(1000 + i, dtype=np.uint8) for i in range(5)]
    assert e.batch_register_memory([addr(x) for x in arrs], [x.size for x in arrs]) == 0
    # The registrations are visible to a peer, first one first.
    assert peer.get_first_buffer_address(session_of(e)) == addr(arrs[0])
    for x in arrs:
        assert e.register_memory(addr(x), 1) == -7
    assert e.batch_unregister_memory([addr(x) for x in arrs]) == 0
    for x in arrs:
        assert e.register_memory(addr(x), x.size) == 0
    assert e.batch_unregister_memory([addr(x) for x in arrs]) == 0


def test_get_first_buffer_address(factory):
    e, peer = factory.engine(), factory.engine()
    first = factory.buffer(e, 100)
    second = factory.buffer(e, 100)
    assert peer.get_first_buffer_address(session_of(e)) == addr(first)
    # The answer follows the peer's registrations, not a cached copy.
    assert e.unregister_memory(addr(first)) == 0
    assert peer.get_first_buffer_address(session_of(e)) == addr(second)


# ---------------------------------------------------------------------------
# synchronous transfers


SIZES = [1, 4095, (1 << 20) + 3, 8 << 20]
SIZE_IDS = ["1B", "4095B", "1MiB+3", "8MiB"]


@pytest.mark.parametrize("size", SIZES, ids=SIZE_IDS)
def test_sync_write_odd_offsets(pair, size):
    loff, roff = 3, 7
    s, d = pair.buffers(size + 16, size + 16)
    assert pair.src.transfer_sync_write(pair.dst_session, addr(s, loff), addr(d, roff), size) == 0
    np.testing.assert_array_equal(d[roff : roff + size], s[loff : loff + size])
    # Nothing around the target range changed.
    assert_untouched(d, 2, 0, roff)
    assert_untouched(d, 2, roff + size)
    assert_untouched(s, 1)


@pytest.mark.parametrize("size", SIZES, ids=SIZE_IDS)
def test_sync_read_odd_offsets(pair, size):
    loff, roff = 5, 1
    s, d = pair.buffers(size + 16, size + 16)
    assert pair.src.transfer_sync_read(pair.dst_session, addr(s, loff), addr(d, roff), size) == 0
    np.testing.assert_array_equal(s[loff : loff + size], d[roff : roff + size])
    assert_untouched(s, 1, 0, loff)
    assert_untouched(s, 1, loff + size)
    assert_untouched(d, 2)


def test_transfer_sync_with_opcode(pair):
    s, d = pair.buffers(10000, 10000)
    assert pair.src.transfer_sync(pair.dst_session, addr(s), addr(d), 5000, TransferOpcode.Write) == 0
    np.testing.assert_array_equal(d[:5000], s[:5000])
    assert pair.src.transfer_sync(pair.dst_session, addr(s, 5000), addr(d, 5000), 5000,
                                  TransferEngine.TransferOpcode.Read) == 0
    np.testing.assert_array_equal(s[5000:], d[5000:])
    assert_untouched(d, 2, 5000)


def test_transfer_sync_takes_the_opcode_as_an_int(pair):
    s, d = pair.buffers(4096, 4096)
    assert pair.src.transfer_sync(pair.dst_session, addr(s), addr(d), 4096, 1) == 0  # 1: Write
    np.testing.assert_array_equal(d, s)
    d[:64] = 7
    batch = pair.src.batch_transfer_async(pair.dst_session, [addr(s)], [addr(d)], [64], 0)  # 0: Read
    assert batch != 0 and pair.src.get_batch_transfer_status([batch]) == 0
    assert (s[:64] == 7).all()


def test_every_transfer_call_takes_a_nic_hint(pair):
    # The reference's NIC preference (an RDMA device name). No transport here
    # has NICs to choose from, so the calls move the same bytes with it.
    s, d = pair.buffers(1 << 14, 1 << 14)
    e, t, n = pair.src, pair.dst_session, "mlx5_0"
    assert e.transfer_sync_write(t, addr(s), addr(d), 1024, "", n) == 0
    assert e.transfer_sync_read(t, addr(s, 1024), addr(d, 1024), 1024, nic_hint=n) == 0
    assert e.transfer_sync(t, addr(s, 2048), addr(d, 2048), 1024, TransferOpcode.Write, None, "", n) == 0
    assert e.batch_transfer_sync_write(t, [addr(s, 3072)], [addr(d, 3072)], [1024], nic_hint=n) == 0
    assert e.batch_transfer_sync_read(t, [addr(s, 4096)], [addr(d, 4096)], [1024], nic_hint=n) == 0
    assert e.batch_transfer_sync(t, [addr(s, 5120)], [addr(d, 5120)], [1024], TransferOpcode.Write, nic_hint=n) == 0
    ids = [e.batch_transfer_async_write(t, [addr(s, 6144)], [addr(d, 6144)], [1024], nic_hint=n),
           e.batch_transfer_async_read(t, [addr(s, 7168)], [addr(d, 7168)], [1024], nic_hint=n),
           e.batch_transfer_async(t, [addr(s, 8192)], [addr(d, 8192)], [1024], TransferOpcode.Write, nic_hint=n)]
    assert all(ids) and e.get_batch_transfer_status(ids) == 0
    batch = e.transfer_submit_write(t, addr(s, 9216), addr(d, 9216), 1024, nic_hint=n)
    deadline = time.monotonic() + 10
    while (status := e.transfer_check_status(batch)) == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert status == 1
    np.testing.assert_array_equal(d[:10240], s[:10240])


def test_region_not_remote_accessible_is_a_local_source_only(pair):
    s = pair.factory.buffer(pair.src, 8192, seed=5, register=False)
    assert pair.src.register_memory(addr(s), 8192, "*", remote_accessible=False) == 0
    d = pair.factory.buffer(pair.dst, 8192, seed=6)
    # This engine writes from it and reads into it ...
    assert pair.src.transfer_sync_write(pair.dst_session, addr(s), addr(d), 4096) == 0
    np.testing.assert_array_equal(d[:4096], s[:4096])
    assert pair.src.transfer_sync_read(pair.dst_session, addr(s, 4096), addr(d, 4096), 4096) == 0
    np.testing.assert_array_equal(s[4096:], d[4096:])
    # ... but a peer can neither find it nor reach it.
    before = s.copy()
    assert pair.dst.get_first_buffer_address(pair.src_session) != addr(s)
    assert pair.dst.transfer_sync_write(pair.src_session, addr(d), addr(s), 4096) == -1
    assert pair.dst.transfer_sync_read(pair.src_session, addr(d), addr(s), 4096) == -1
    np.testing.assert_array_equal(s, before)
    assert pair.src.unregister_memory(addr(s)) == 0


@pytest.mark.parametrize("hint", ["", "tcp", "shm"])
def test_transport_hints(pair, hint):
    s, d = pair.buffers(1 << 16, 1 << 16)
    assert pair.src.transfer_sync_write(pair.dst_session, addr(s), addr(d), 1 << 15, transport_hint=hint) == 0
    assert pair.src.transfer_sync_read(pair.dst_session, addr(s, 1 << 15), addr(d, 1 << 15), 1 << 15, hint) == 0
    np.testing.assert_array_equal(d[: 1 << 15], s[: 1 << 15])
    np.testing.assert_array_equal(s[1 << 15 :], pattern(2, 1 << 16)[1 << 15 :])


def test_bad_transport_hint_raises(pair):
    s, d = pair.buffers(64, 64)
    e, t = pair.src, pair.dst_session
    calls = [
        lambda: e.transfer_sync_write(t, addr(s), addr(d), 64, "efa"),
        lambda: e.transfer_sync_read(t, addr(s), addr(d), 64, transport_hint="TCP"),
        lambda: e.transfer_sync(t, addr(s), addr(d), 64, TransferOpcode.Write, None, "nvlink"),
        lambda: e.batch_transfer_sync_write(t, [addr(s)], [addr(d)], [64], "bogus"),
        lambda: e.batch_transfer_sync_read(t, [addr(s)], [addr(d)], [64], "bogus"),
        lambda: e.batch_transfer_async_write(t, [addr(s)], [addr(d)], [64], "bogus"),
        lambda: e.batch_transfer_async_read(t, [addr(s)], [addr(d)], [64], "bogus"),
        lambda: e.transfer_submit_write(t, addr(s), addr(d), 64, "bogus"),
    ]
    for call in calls:
        with pytest.raises(ValueError):
            call()
    assert_untouched(d, 2)
    assert_untouched(s, 1)
    # "rdma" is a transport of every build: without a device (no software
    # provider asked for) the transfer fails with a negative status instead of
    # raising, and leaves the target alone; with one it lands.
    rc = e.transfer_sync_write(t, addr(s), addr(d), 64, "rdma")
    if pair.protocol == "rdma":
        assert rc == 0
        np.testing.assert_array_equal(d, s)
    else:
        assert rc < 0
        assert_untouched(d, 2)


# ---------------------------------------------------------------------------
# batches


def _batch_layout():
    # (local offset, remote offset, length): odd, disjoint, of mixed sizes
    return [(0, 1, 1), (3, 100, 4095), (5000, 9000, (1 << 20) + 3), (2 << 20, (3 << 20) + 5, 1 << 20)]


def test_batch_sync_write_and_read(pair):
    layout = _batch_layout()
    s, d = pair.buffers(4 << 20, 5 << 20)
    bufs = [addr(s, lo) for lo, _, _ in layout]
    peers = [addr(d, ro) for _, ro, _ in layout]
    lens = [n for _, _, n in layout]
    assert pair.src.batch_transfer_sync_write(pair.dst_session, bufs, peers, lens) == 0
    expected = pattern(2, d.size)
    for lo, ro, n in layout:
        expected[ro : ro + n] = s[lo : lo + n]
    np.testing.assert_array_equal(d, expected)

    # Read back into a fresh local buffer at the same local offsets.
    back = pair.factory.buffer(pair.src, s.size, fill=0)
    assert pair.src.batch_transfer_sync_read(pair.dst_session, [addr(back, lo) for lo, _, _ in layout], peers,
                                             lens) == 0
    for lo, _, n in layout:
        np.testing.assert_array_equal(back[lo : lo + n], s[lo : lo + n])


def test_batch_sync_with_opcode(pair):
    s, d = pair.buffers(8192, 8192)
    assert pair.src.batch_transfer_sync(pair.dst_session, [addr(s), addr(s, 4096)], [addr(d, 4096), addr(d)],
                                        [4096, 4096], TransferOpcode.Write) == 0
    np.testing.assert_array_equal(d[4096:], s[:4096])
    np.testing.assert_array_equal(d[:4096], s[4096:])


def test_batch_length_mismatch(pair):
    s, d = pair.buffers(8192, 8192)
    e, t = pair.src, pair.dst_session
    assert e.batch_transfer_sync_write(t, [addr(s), addr(s, 10)], [addr(d)], [10, 10]) == -1
    assert e.batch_transfer_sync_read(t, [addr(s)], [addr(d)], [10, 10]) == -1
    assert e.batch_transfer_async_write(t, [addr(s)], [addr(d), addr(d, 10)], [10]) == 0
    assert_untouched(d, 2)
    assert_untouched(s, 1)


def test_batch_with_one_unregistered_entry_fails(pair):
    s, d = pair.buffers(8192, 8192)
    outside = pair.factory.buffer(pair.dst, 4096, seed=5, register=False)
    rc = pair.src.batch_transfer_sync_write(pair.dst_session, [addr(s), addr(s, 4096)], [addr(d), addr(outside)],
                                            [4096, 4096])
    assert rc == -1
    assert_untouched(outside, 5)


# ---------------------------------------------------------------------------
# asynchronous transfers


def test_async_write_and_batch_status(pair):
    layout = _batch_layout()
    s, d = pair.buffers(4 << 20, 5 << 20)
    e, t = pair.src, pair.dst_session
    bid = e.batch_transfer_async_write(t, [addr(s, lo) for lo, _, _ in layout], [addr(d, ro) for _, ro, _ in layout],
                                       [n for _, _, n in layout])
    assert bid != 0
    assert e.get_batch_transfer_status([bid]) == 0
    for lo, ro, n in layout:
        np.testing.assert_array_equal(d[ro : ro + n], s[lo : lo + n])
    # The id was released by the status call.
    assert e.get_batch_transfer_status([bid]) == -1


def test_async_read_several_batches(pair):
    s, d = pair.buffers(3 << 20, 3 << 20)
    e, t = pair.src, pair.dst_session
    ids = []
    for i in range(3):
        off = i << 20
        ids.append(e.batch_transfer_async_read(t, [addr(s, off)], [addr(d, off)], [1 << 20]))
    assert all(ids) and len(set(ids)) == 3
    assert e.get_batch_transfer_status(ids) == 0
    np.testing.assert_array_equal(s, d)
    for bid in ids:
        assert e.get_batch_transfer_status([bid]) == -1


def test_async_generic_opcode(pair):
    s, d = pair.buffers(1 << 20, 1 << 20)
    bid = pair.src.batch_transfer_async(pair.dst_session, [addr(s)], [addr(d)], [1 << 20], TransferOpcode.Write)
    assert bid != 0
    assert pair.src.get_batch_transfer_status([bid]) == 0
    np.testing.assert_array_equal(s, d)


def test_async_failure_is_reported(pair):
    s, d = pair.buffers(8192, 8192)
    outside = pair.factory.buffer(pair.dst, 8192, seed=6, register=False)
    bid = pair.src.batch_transfer_async_write(pair.dst_session, [addr(s)], [addr(outside)], [8192])
    assert bid == 0 or pair.src.get_batch_transfer_status([bid]) == -1
    assert_untouched(outside, 6)
    # One failed batch among good ones fails the status call; all are released.
    good = pair.src.batch_transfer_async_write(pair.dst_session, [addr(s)], [addr(d)], [4096])
    bad = pair.src.batch_transfer_async_write(pair.dst_session, [addr(s)], [addr(outside)], [4096])
    assert good != 0
    ids = [good] + ([bad] if bad else [])
    if bad:
        assert pair.src.get_batch_transfer_status(ids) == -1
    else:
        assert pair.src.get_batch_transfer_status(ids) == 0
    np.testing.assert_array_equal(d[:4096], s[:4096])
    assert pair.src.get_batch_transfer_status([good]) == -1


def test_submit_write_and_check_status(pair):
    size = 8 << 20
    s, d = pair.buffers(size, size)
    e = pair.src
    bid = e.transfer_submit_write(pair.dst_session, addr(s), addr(d), size)
    assert bid != 0
    deadline = time.monotonic() + 20
    seen = []
    while True:
        st = e.transfer_check_status(bid)
        seen.append(st)
        if st != 0:
            break
        assert time.monotonic() < deadline, "transfer stayed pending"
        time.sleep(0.001)
    assert st == 1, seen[-5:]
    assert set(seen[:-1]) <= {0}
    np.testing.assert_array_equal(s, d)
    # Completed ids are released.
    assert e.transfer_check_status(bid) == -1


def test_submit_write_failure(pair):
    s, _ = pair.buffers(4096, 4096)
    outside = pair.factory.buffer(pair.dst, 4096, seed=7, register=False)
    bid = pair.src.transfer_submit_write(pair.dst_session, addr(s), addr(outside), 4096)
    if bid != 0:
        deadline = time.monotonic() + 20
        while (st := pair.src.transfer_check_status(bid)) == 0:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert st == -1
    assert_untouched(outside, 7)


# ---------------------------------------------------------------------------
# notifications


def _wait_notifies(engine, count, timeout=5.0):
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        got += engine.get_notifies()
        if len(got) < count:
            time.sleep(0.005)
    return got


def test_notify_delivery(pair):
    s, d = pair.buffers(4096, 4096)
    note = TransferNotify("weights", "step=7")
    rc = pair.src.transfer_sync(pair.dst_session, addr(s), addr(d), 4096, TransferOpcode.Write, notify=note)
    assert rc == 0
    np.testing.assert_array_equal(d, s)
    got = _wait_notifies(pair.dst, 1)
    assert [(n.name, n.msg) for n in got] == [("weights", "step=7")]
    assert pair.src.get_notifies() == []  # delivered to the target only


def test_notify_with_batch_and_read(pair):
    s, d = pair.buffers(8192, 8192)
    assert pair.src.batch_transfer_sync(pair.dst_session, [addr(s)], [addr(d)], [4096], TransferOpcode.Write,
                                        TransferNotify("n1", "a")) == 0
    assert pair.src.transfer_sync(pair.dst_session, addr(s, 4096), addr(d, 4096), 4096, TransferOpcode.Read,
                                  TransferNotify("n2", "b" * 1000)) == 0
    got = _wait_notifies(pair.dst, 2)
    assert sorted((n.name, n.msg) for n in got) == [("n1", "a"), ("n2", "b" * 1000)]
    np.testing.assert_array_equal(d[:4096], s[:4096])
    np.testing.assert_array_equal(s[4096:], d[4096:])


def test_failed_transfer_sends_no_notify(pair):
    s, _ = pair.buffers(4096, 4096)
    outside = pair.factory.buffer(pair.dst, 4096, seed=8, register=False)
    rc = pair.src.transfer_sync(pair.dst_session, addr(s), addr(outside), 4096, TransferOpcode.Write,
                                TransferNotify("x", "y"))
    assert rc == -1
    time.sleep(0.05)
    assert pair.dst.get_notifies() == []


# ---------------------------------------------------------------------------
# managed buffers


def test_managed_buffers_round_trip(pair):
    a, b = pair.src, pair.dst
    data = pattern(21, 100_003).tobytes()
    src = a.allocate_managed_buffer(len(data))
    dst = b.allocate_managed_buffer(len(data))
    assert src != 0 and dst != 0
    assert a.write_bytes_to_buffer(src, data, len(data)) == 0
    assert a.read_bytes_from_buffer(src, len(data)) == data
    # The managed buffers are registered: usable on both ends of a transfer.
    assert a.transfer_sync_write(pair.dst_session, src, dst, len(data)) == 0
    assert b.read_bytes_from_buffer(dst, len(data)) == data
    # Partial write at an offset, read back remotely.
    assert b.write_bytes_to_buffer(dst + 11, b"hello world", 5) == 0
    assert a.transfer_sync_read(pair.dst_session, src, dst, 20) == 0
    assert a.read_bytes_from_buffer(src, 20) == data[:11] + b"hello" + data[16:20]
    # A str is written as its UTF-8 bytes, as the reference takes it.
    assert a.write_bytes_to_buffer(src + 3, "héllo", 6) == 0
    assert a.read_bytes_from_buffer(src, 10) == data[:3] + "héllo".encode() + data[9:10]
    with pytest.raises(TypeError, match="bytes or str"):
        a.write_bytes_to_buffer(src, 42, 1)
    assert a.free_managed_buffer(src, len(data)) == 0
    assert b.free_managed_buffer(dst, len(data)) == 0


def test_managed_buffer_is_registered_and_distinct(factory):
    e = factory.engine()
    x = e.allocate_managed_buffer(5000)
    y = e.allocate_managed_buffer(5000)
    assert x != 0 and y != 0 and x != y
    assert abs(x - y) >= 5000  # no overlap
    assert e.register_memory(x, 1) == -7  # already registered by the engine
    assert e.free_managed_buffer(x, 5000) == 0
    assert e.free_managed_buffer(y, 5000) == 0


def test_managed_buffer_errors(factory):
    e = factory.engine()
    assert e.allocate_managed_buffer(0) == 0
    x = e.allocate_managed_buffer(64)
    assert x != 0
    with pytest.raises(ValueError):
        e.write_bytes_to_buffer(x, b"abc", 4)
    assert e.free_managed_buffer(x + 1, 64) != 0
    assert e.free_managed_buffer(x, 64) == 0


def test_managed_buffer_double_free(factory):
    e = factory.engine()
    x = e.allocate_managed_buffer(4096)
    assert x != 0
    assert e.free_managed_buffer(x, 4096) == 0
    second_free = e.free_managed_buffer(x, 4096)
    a = e.allocate_managed_buffer(4096)
    b = e.allocate_managed_buffer(4096)
    assert a != 0 and b != 0
    assert a != b, "two live managed buffers share one address"
    assert second_free != 0
    e.free_managed_buffer(a, 4096)
    if b != a:
        e.free_managed_buffer(b, 4096)


def test_large_managed_buffer(pair):
    n = (256 << 20) + 12345  # above the largest recycled size class: a dedicated registration
    src = pair.src.allocate_managed_buffer(n)
    dst = pair.dst.allocate_managed_buffer(n)
    assert src and dst
    data = pattern(22, 4096).tobytes()
    pair.src.write_bytes_to_buffer(src + n - 4096, data, 4096)
    assert pair.src.transfer_sync_write(pair.dst_session, src + n - 4096, dst + n - 4096, 4096) == 0
    assert pair.dst.read_bytes_from_buffer(dst + n - 4096, 4096) == data
    assert pair.src.free_managed_buffer(src, n) == 0
    assert pair.dst.free_managed_buffer(dst, n) == 0


# ---------------------------------------------------------------------------
# ranges outside registrations


def test_unregistered_remote_range(pair):
    s, _ = pair.buffers(8192, 16)
    remote = pair.factory.buffer(pair.dst, 8192, seed=9, register=False)
    assert pair.dst.register_memory(addr(remote), 4096) == 0  # only the first half
    e, t = pair.src, pair.dst_session
    # Entirely outside, straddling the end, and one byte past it.
    for roff, n in [(4096, 4096), (4000, 200), (4096, 1), (0, 4097)]:
        assert e.transfer_sync_write(t, addr(s), addr(remote, roff), n) == -1, (roff, n)
        assert e.transfer_sync_read(t, addr(s), addr(remote, roff), n) == -1, (roff, n)
    assert_untouched(remote, 9)
    assert_untouched(s, 1)
    # The registered half works.
    assert e.transfer_sync_write(t, addr(s), addr(remote, 96), 4000) == 0
    np.testing.assert_array_equal(remote[96:4096], s[:4000])
    assert pair.dst.unregister_memory(addr(remote)) == 0


def test_unregistered_local_range(pair):
    _, d = pair.buffers(16, 8192)
    local = pair.factory.buffer(pair.src, 8192, seed=10, register=False)
    assert pair.src.register_memory(addr(local), 4096) == 0
    e, t = pair.src, pair.dst_session
    for loff, n in [(4096, 100), (4000, 200), (0, 4097)]:
        assert e.transfer_sync_write(t, addr(local, loff), addr(d), n) == -1, (loff, n)
        assert e.transfer_sync_read(t, addr(local, loff), addr(d), n) == -1, (loff, n)
    assert_untouched(d, 2)
    assert_untouched(local, 10)
    assert pair.src.unregister_memory(addr(local)) == 0


def test_unknown_session_fails_fast(pair):
    s, _ = pair.buffers(64, 64)
    e = pair.src
    for target in (UNKNOWN_SESSION, "not-a-session", "127.0.0.1", "127.0.0.1:99999"):
        t0 = time.monotonic()
        assert e.transfer_sync_write(target, addr(s), 0x10000, 64) == -1, target
        assert e.batch_transfer_async_write(target, [addr(s)], [0x10000], [64]) == 0, target
        assert time.monotonic() - t0 < 2.0, target
    t0 = time.monotonic()
    assert e.send_probe(UNKNOWN_SESSION) != 0
    assert time.monotonic() - t0 < 1.0
    assert e.send_probe(pair.dst_session) == 0


# ---------------------------------------------------------------------------
# the peer changes its registrations


def test_write_after_peer_unregisters_fails(pair):
    s, d = pair.buffers(8192, 8192)
    e, t = pair.src, pair.dst_session
    assert e.transfer_sync_write(t, addr(s), addr(d), 4096) == 0  # caches the descriptor
    np.testing.assert_array_equal(d[:4096], s[:4096])
    snapshot = d.copy()
    assert pair.dst.unregister_memory(addr(d)) == 0
    # The cached descriptor still lists the buffer; the engine must notice it is stale.
    assert e.transfer_sync_write(t, addr(s, 4096), addr(d), 4096) == -1
    assert e.transfer_sync_read(t, addr(s), addr(d, 4096), 4096) == -1
    np.testing.assert_array_equal(d, snapshot)
    assert_untouched(s, 1)


def test_write_after_peer_shrinks_registration(pair):
    s, d = pair.buffers(8192, 8192)
    e, t = pair.src, pair.dst_session
    assert e.transfer_sync_write(t, addr(s), addr(d, 6000), 100) == 0
    assert pair.dst.unregister_memory(addr(d)) == 0
    assert pair.dst.register_memory(addr(d), 4096) == 0
    snapshot = d.copy()
    assert e.transfer_sync_write(t, addr(s), addr(d, 6000), 100) == -1
    np.testing.assert_array_equal(d, snapshot)
    assert e.transfer_sync_write(t, addr(s, 1), addr(d, 1), 4095) == 0
    np.testing.assert_array_equal(d[1:4096], s[1:4096])
    np.testing.assert_array_equal(d[4096:], snapshot[4096:])


def test_write_to_buffer_registered_after_first_contact(pair):
    s, d = pair.buffers(4096, 4096)
    e, t = pair.src, pair.dst_session
    assert e.transfer_sync_write(t, addr(s), addr(d), 4096) == 0  # caches the descriptor
    later = pair.factory.buffer(pair.dst, 4096, seed=13)
    assert e.transfer_sync_write(t, addr(s, 1), addr(later, 2), 4000) == 0
    np.testing.assert_array_equal(later[2:4002], s[1:4001])
    assert_untouched(later, 13, 0, 2)
    assert_untouched(later, 13, 4002)


def test_engine_recreated_in_same_process_at_same_session(factory, protocol, monkeypatch):
    """The session name now belongs to a new engine (same process, same port):
    memory registered only with the old engine must not be writable."""
    ini = factory.engine(protocol)
    src = factory.buffer(ini, 4096, seed=14)
    old_only = np.zeros(4096, dtype=np.uint8)
    fresh = np.zeros(4096, dtype=np.uint8)
    first = TransferEngine()
    assert first.initialize(HOST, "P2PHANDSHAKE", protocol, "") == 0
    port = first.get_rpc_port()
    session = f"{HOST}:{port}"
    assert first.register_memory(addr(old_only), 4096) == 0
    assert ini.transfer_sync_write(session, addr(src), addr(old_only), 100) == 0  # caches the descriptor
    old_only[:] = 0
    del first
    gc.collect()

    monkeypatch.setenv("MC_MIN_RPC_PORT", str(port))
    monkeypatch.setenv("MC_MAX_RPC_PORT", str(port))
    second = TransferEngine()
    assert second.initialize(HOST, "P2PHANDSHAKE", protocol, "") == 0
    assert second.get_rpc_port() == port
    try:
        assert second.register_memory(addr(fresh), 4096) == 0
        # old_only is not registered with the engine serving the session now.
        rc = ini.transfer_sync_write(session, addr(src), addr(old_only), 100)
        assert not old_only.any(), "bytes landed in memory the serving engine never registered"
        assert rc == -1
        assert ini.transfer_sync_write(session, addr(src), addr(fresh), 100) == 0
        np.testing.assert_array_equal(fresh[:100], src[:100])
    finally:
        second.unregister_memory(addr(fresh))


# ---------------------------------------------------------------------------
# concurrency


def test_many_threads(pair):
    threads_n, per_thread, chunk = 8, 50, 1024
    span = per_thread * chunk
    s, d = pair.buffers(threads_n * span, threads_n * span)
    read_back = pair.factory.buffer(pair.src, threads_n * span, fill=0)
    e, t = pair.src, pair.dst_session
    failures = []
    start = threading.Barrier(threads_n)

    def worker(i):
        try:
            start.wait(timeout=10)
            for j in range(per_thread):
                off = i * span + j * chunk
                if e.transfer_sync_write(t, addr(s, off), addr(d, off), chunk) != 0:
                    failures.append(("write", i, j))
                if e.transfer_sync_read(t, addr(read_back, off), addr(d, off), chunk) != 0:
                    failures.append(("read", i, j))
        except Exception as exc:  # noqa: BLE001 - reported below
            failures.append(("exception", i, repr(exc)))

    workers = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads_n)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=40)
    assert not any(w.is_alive() for w in workers), "a worker thread hung"
    assert failures == []
    np.testing.assert_array_equal(d, s)
    np.testing.assert_array_equal(read_back, s)


def test_many_threads_async(pair):
    threads_n, per_thread, chunk = 8, 20, 4096
    span = per_thread * chunk
    s, d = pair.buffers(threads_n * span, threads_n * span)
    e, t = pair.src, pair.dst_session
    failures = []

    def worker(i):
        try:
            ids = []
            for j in range(per_thread):
                off = i * span + j * chunk
                ids.append(e.batch_transfer_async_write(t, [addr(s, off)], [addr(d, off)], [chunk]))
            if not all(ids) or e.get_batch_transfer_status(ids) != 0:
                failures.append((i, ids))
        except Exception as exc:  # noqa: BLE001
            failures.append((i, repr(exc)))

    workers = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads_n)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=40)
    assert not any(w.is_alive() for w in workers)
    assert failures == []
    np.testing.assert_array_equal(d, s)
