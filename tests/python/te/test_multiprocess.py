"""mooncake.engine between real processes: a target process with its own
address space registers memory; this process (the initiator) writes and
reads it, and the target checks what it received. Also what happens when the
target dies or stops answering."""

import contextlib
import multiprocessing
import os
import signal
import time

import numpy as np
import pytest

import _procs
from _procs import addr, pattern, recv_within, sha256

CTX = multiprocessing.get_context("spawn")
START_TIMEOUT = 30.0
REPLY_TIMEOUT = 15.0


class Target:
    def __init__(self, proc, conn, session, base, pid):
        self.proc, self.conn, self.session, self.base, self.pid = proc, conn, session, base, pid

    def ask(self, *msg):
        self.conn.send(msg)
        return recv_within(self.conn, REPLY_TIMEOUT)

    def digest(self, offset, length):
        return self.ask("digest", offset, length)


@contextlib.contextmanager
def spawn_target(protocol, nbytes, env=None):
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_procs.target_main, args=(child, protocol, nbytes, env or {}), daemon=True)
    proc.start()
    child.close()
    try:
        msg = recv_within(parent, START_TIMEOUT)
        tag, session, base, pid, rc = msg
        assert tag == "ready" and rc == 0, msg
        assert pid == proc.pid
        yield Target(proc, parent, session, base, pid)
    finally:
        if proc.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            with contextlib.suppress(Exception):
                parent.send(("exit",))
                recv_within(parent, 5)
            proc.join(5)
        if proc.is_alive():
            proc.kill()
        proc.join(5)
        parent.close()


@pytest.fixture
def initiator(factory):
    """initiator(protocol, nbytes, seed) -> (engine, registered local buffer)."""

    def make(protocol, nbytes, seed=None):
        e = factory.engine(protocol)
        return e, factory.buffer(e, nbytes, seed=seed)

    return make


TARGET_BYTES = 16 << 20


@pytest.mark.timeout(60)
@pytest.mark.parametrize("protocol", ["tcp", "shm"])
def test_write_then_target_verifies(initiator, protocol):
    e, local = initiator(protocol, TARGET_BYTES, seed=101)
    with spawn_target(protocol, TARGET_BYTES) as t:
        # A large write at an odd offset, and a small one elsewhere.
        n1, off1 = (9 << 20) + 7, 13
        assert e.transfer_sync_write(t.session, addr(local), t.base + off1, n1) == 0
        assert t.digest(off1, n1) == sha256(local[:n1])
        n2, off2 = 4095, (12 << 20) + 1
        assert e.transfer_sync_write(t.session, addr(local, 5), t.base + off2, n2) == 0
        assert t.digest(off2, n2) == sha256(local[5 : 5 + n2])
        # What was not written is still zero on the target.
        zeros = np.zeros(TARGET_BYTES, dtype=np.uint8)
        assert t.digest(0, off1) == sha256(zeros[:off1])
        assert t.digest(off1 + n1, off2 - off1 - n1) == sha256(zeros[: off2 - off1 - n1])
        assert t.digest(off2 + n2, TARGET_BYTES - off2 - n2) == sha256(zeros[: TARGET_BYTES - off2 - n2])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("protocol", ["tcp", "shm"])
def test_read_from_target(initiator, protocol):
    e, local = initiator(protocol, TARGET_BYTES)
    with spawn_target(protocol, TARGET_BYTES) as t:
        assert t.ask("fill", 202) == "filled"
        expected = pattern(202, TARGET_BYTES)  # computed here from the seed alone
        assert e.transfer_sync_read(t.session, addr(local, 1), t.base + 3, TARGET_BYTES - 8) == 0
        np.testing.assert_array_equal(local[1 : TARGET_BYTES - 7], expected[3 : TARGET_BYTES - 5])
        assert local[0] == 0 and not local[TARGET_BYTES - 7 :].any()
        assert e.get_first_buffer_address(t.session) == t.base


@pytest.mark.timeout(60)
@pytest.mark.parametrize("protocol", ["tcp", "shm"])
def test_batch_and_async_across_processes(initiator, protocol):
    e, local = initiator(protocol, 4 << 20, seed=303)
    chunk = 1 << 20
    with spawn_target(protocol, TARGET_BYTES) as t:
        # Four chunks scattered in reverse order, synchronously...
        bufs = [addr(local, i * chunk) for i in range(4)]
        peers = [t.base + (3 - i) * chunk for i in range(4)]
        assert e.batch_transfer_sync_write(t.session, bufs, peers, [chunk] * 4) == 0
        for i in range(4):
            assert t.digest((3 - i) * chunk, chunk) == sha256(local[i * chunk : (i + 1) * chunk])
        # ...and the same again, asynchronously, to the upper half.
        bid = e.batch_transfer_async_write(t.session, bufs, [p + (8 << 20) for p in peers], [chunk] * 4)
        assert bid != 0
        assert e.get_batch_transfer_status([bid]) == 0
        assert t.digest(8 << 20, 4 << 20) == t.digest(0, 4 << 20)
        # A submitted single write, polled to completion.
        sid = e.transfer_submit_write(t.session, addr(local), t.base + (14 << 20), 2 << 20)
        deadline = time.monotonic() + 20
        while (st := e.transfer_check_status(sid)) == 0:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert st == 1
        assert t.digest(14 << 20, 2 << 20) == sha256(local[: 2 << 20])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("protocol", ["tcp", "shm"])
def test_killed_peer_fails_fast(initiator, protocol, monkeypatch):
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "2")
    e, local = initiator(protocol, 1 << 20, seed=404)
    with spawn_target(protocol, 1 << 20) as t:
        assert e.transfer_sync_write(t.session, addr(local), t.base, 1 << 20) == 0
        assert e.send_probe(t.session) == 0
        os.kill(t.pid, signal.SIGKILL)
        t.proc.join(5)
        assert not t.proc.is_alive()

        t0 = time.monotonic()
        assert e.transfer_sync_write(t.session, addr(local), t.base, 1 << 20) == -1
        assert time.monotonic() - t0 < 4.0
        t0 = time.monotonic()
        assert e.transfer_sync_read(t.session, addr(local), t.base, 4096) == -1
        assert time.monotonic() - t0 < 4.0
        t0 = time.monotonic()
        assert e.send_probe(t.session) != 0
        assert time.monotonic() - t0 < 1.0
        bid = e.batch_transfer_async_write(t.session, [addr(local)], [t.base], [4096])
        assert bid == 0 or e.get_batch_transfer_status([bid]) == -1
        assert time.monotonic() - t0 < 5.0


@pytest.mark.timeout(60)
def test_probe_after_clean_exit(initiator):
    e, _ = initiator("", 4096)
    with spawn_target("", 4096) as t:
        assert e.send_probe(t.session) == 0
        assert t.ask("exit") == "bye"
        t.proc.join(10)
        assert not t.proc.is_alive()
        t0 = time.monotonic()
        assert e.send_probe(t.session) != 0
        assert time.monotonic() - t0 < 1.0


@pytest.mark.timeout(60)
def test_stopped_peer_times_out_over_tcp(initiator, monkeypatch):
    timeout_s = 2.0
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", str(timeout_s))
    size = 64 << 20
    e, local = initiator("tcp", size, seed=505)
    with spawn_target("tcp", size) as t:
        # First contact while the peer runs: the descriptor is cached.
        assert e.transfer_sync_write(t.session, addr(local), t.base, 4096) == 0
        os.kill(t.pid, signal.SIGSTOP)
        # The stalled write covers the upper 48 MiB only: bytes of it that the
        # peer's socket already holds still land after SIGCONT (a write that
        # failed leaves its range undefined), so the check below writes elsewhere.
        stalled_from = 16 << 20
        try:
            t0 = time.monotonic()
            rc = e.transfer_sync_write(t.session, addr(local, stalled_from), t.base + stalled_from, size - stalled_from)
            elapsed = time.monotonic() - t0
        finally:
            os.kill(t.pid, signal.SIGCONT)
        assert rc == -1
        # Given up by the transfer timeout: not at once, and not much later.
        assert 0.5 * timeout_s <= elapsed <= timeout_s + 3.0, elapsed

        # Once the peer runs again, it is reachable and writable again.
        deadline = time.monotonic() + 10
        while e.send_probe(t.session) != 0:
            assert time.monotonic() < deadline, "peer unreachable after SIGCONT"
            time.sleep(0.05)
        assert e.transfer_sync_write(t.session, addr(local, 1), t.base + 2, 1 << 20) == 0
        assert t.digest(2, 1 << 20) == sha256(local[1 : (1 << 20) + 1])


@pytest.mark.timeout(60)
def test_stopped_peer_async_reports_timeout(initiator, monkeypatch):
    timeout_s = 2.0
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", str(timeout_s))
    size = 64 << 20
    e, local = initiator("tcp", size, seed=606)
    with spawn_target("tcp", size) as t:
        assert e.transfer_sync_write(t.session, addr(local), t.base, 4096) == 0
        os.kill(t.pid, signal.SIGSTOP)
        try:
            # transfer_check_status: pending (0) until the budget runs out, then -2.
            t0 = time.monotonic()
            sid = e.transfer_submit_write(t.session, addr(local), t.base, size)
            assert sid != 0
            while (st := e.transfer_check_status(sid)) == 0:
                assert time.monotonic() - t0 < timeout_s + 5.0, "still pending"
                time.sleep(0.01)
            elapsed = time.monotonic() - t0
            assert st == -2
            assert 0.5 * timeout_s <= elapsed <= timeout_s + 3.0, elapsed

            # get_batch_transfer_status: -1 within the same bound.
            t0 = time.monotonic()
            bid = e.batch_transfer_async_write(t.session, [addr(local)], [t.base], [size])
            assert bid != 0
            assert e.get_batch_transfer_status([bid]) == -1
            elapsed = time.monotonic() - t0
            assert 0.5 * timeout_s <= elapsed <= timeout_s + 3.0, elapsed
        finally:
            os.kill(t.pid, signal.SIGCONT)


@pytest.mark.timeout(60)
def test_peer_killed_mid_transfer_fails_before_the_timeout(initiator, monkeypatch):
    """A connection reset ends a tcp transfer at once; it does not wait out
    MC_TRANSFER_TIMEOUT."""
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "20")
    size = 64 << 20
    e, local = initiator("tcp", size, seed=707)
    with spawn_target("tcp", size) as t:
        assert e.transfer_sync_write(t.session, addr(local), t.base, 4096) == 0
        os.kill(t.pid, signal.SIGSTOP)  # so that the transfer is surely in flight
        t0 = time.monotonic()
        bid = e.batch_transfer_async_write(t.session, [addr(local)], [t.base], [size])
        assert bid != 0
        time.sleep(0.3)
        os.kill(t.pid, signal.SIGKILL)
        assert e.get_batch_transfer_status([bid]) == -1
        assert time.monotonic() - t0 < 5.0
        t.proc.join(5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("protocol", ["tcp", "shm"])
def test_restarted_peer_at_the_same_session(initiator, protocol, monkeypatch):
    """A peer process replaced by a new one listening on the same port (same
    session name): once the old one is gone, transfers reach the new one's
    buffer; nothing stale (connection, pid, descriptor) is used."""
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "2")
    e, local = initiator(protocol, 1 << 20, seed=808)
    with spawn_target(protocol, 1 << 20) as old:
        assert e.transfer_sync_write(old.session, addr(local), old.base, 1 << 20) == 0
        session = old.session
        os.kill(old.pid, signal.SIGKILL)
        old.proc.join(5)
        assert e.transfer_sync_write(session, addr(local), old.base, 4096) == -1
    port = session.rsplit(":", 1)[1]
    with spawn_target(protocol, 1 << 20, env={"MC_MIN_RPC_PORT": port, "MC_MAX_RPC_PORT": port}) as new:
        assert new.session == session
        assert e.transfer_sync_write(session, addr(local, 1), new.base + 2, 100_000) == 0
        assert new.digest(2, 100_000) == sha256(local[1:100_001])
        assert e.get_first_buffer_address(session) == new.base
