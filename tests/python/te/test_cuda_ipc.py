"""mooncake.engine with torch CUDA tensors between two processes: each side
registers a slice of a larger tensor (a piece of one of the caching
allocator's blocks) with location "*", and the bytes are checked on both
sides. Automatic choice (cuda_ipc on one host) and protocol "tcp" (GPU memory
staged through host memory). Skips, saying why, without torch or a GPU."""

import contextlib
import multiprocessing

import numpy as np
import pytest

import _procs
from _procs import addr, pattern, recv_within, sha256

torch = pytest.importorskip("torch", reason="torch is not installed")
mce = pytest.importorskip("mooncake.engine")

pytestmark = [
    pytest.mark.skipif(not mce.SUPPORT_CUDA, reason="mooncake.engine was built without CUDA"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.cuda is unavailable (no GPU)"),
]

CTX = multiprocessing.get_context("spawn")  # children start CUDA afresh
NBYTES = (8 << 20) + 13
TARGET_OFFSET = 4099  # where the target's slice starts in its tensor
TARGET_SEED = 7


@contextlib.contextmanager
def cuda_target(protocol):
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_procs.cuda_target_main,
                       args=(child, protocol, NBYTES, TARGET_OFFSET, TARGET_SEED), daemon=True)
    proc.start()
    child.close()
    try:
        tag, session, base, pid, rc = recv_within(parent, 60)
        assert tag == "ready" and rc == 0 and pid == proc.pid

        def digest(start, length):
            parent.send(("digest", start, length))
            return recv_within(parent, 30)

        yield session, base, digest
    finally:
        with contextlib.suppress(Exception):
            parent.send(("exit",))
            recv_within(parent, 10)
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        parent.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("protocol", ["", "tcp"], ids=["auto", "tcp"])
def test_torch_cuda_tensor_slices_between_processes(factory, protocol):
    engine = factory.engine(protocol)
    block = torch.empty(NBYTES + 8192, dtype=torch.uint8, device="cuda")
    local = block[1001 : 1001 + NBYTES]
    src = pattern(3, NBYTES)
    local.copy_(torch.from_numpy(src))
    torch.cuda.synchronize()
    assert engine.register_memory(local.data_ptr(), NBYTES) == 0
    host = factory.buffer(engine, 1 << 20, seed=11)  # a registered numpy buffer beside the tensor
    try:
        with cuda_target(protocol) as (session, base, digest):
            expected = pattern(TARGET_SEED, NBYTES)  # the target's contents, as we change them
            # GPU -> GPU, odd offsets on both sides.
            n = NBYTES - 64
            assert engine.transfer_sync_write(session, local.data_ptr() + 5, base + 9, n) == 0
            expected[9 : 9 + n] = src[5 : 5 + n]
            assert digest(9, n) == sha256(expected[9 : 9 + n])
            # Host -> GPU.
            assert engine.transfer_sync_write(session, addr(host), base + 3, 1 << 20) == 0
            expected[3 : 3 + (1 << 20)] = host
            assert digest(0, NBYTES) == sha256(expected)
            # GPU -> GPU reads, in one batch of three pieces, into our tensor.
            pieces = [(0, 7, 1), (100, 4096, 65537), (200000, 300001, 5 << 20)]
            assert engine.batch_transfer_sync_read(
                session, [local.data_ptr() + lo for lo, _, _ in pieces], [base + ro for _, ro, _ in pieces],
                [length for _, _, length in pieces]) == 0
            torch.cuda.synchronize()
            got = local.cpu().numpy()
            for lo, ro, length in pieces:
                np.testing.assert_array_equal(got[lo : lo + length], expected[ro : ro + length])
            # GPU -> host read.
            assert engine.transfer_sync_read(session, addr(host), base + 12345, 1 << 20) == 0
            np.testing.assert_array_equal(host, expected[12345 : 12345 + (1 << 20)])
    finally:
        assert engine.unregister_memory(local.data_ptr()) == 0


def test_gpu_memory_is_detected_on_registration(factory):
    """location "*" on a CUDA pointer inside a tensor: registered as GPU
    memory; a second registration overlapping it is refused like any."""
    engine = factory.engine()
    t = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    assert engine.register_memory(t.data_ptr() + 100, 4096) == 0
    assert engine.register_memory(t.data_ptr() + 200, 16) == -7
    assert engine.unregister_memory(t.data_ptr() + 100) == 0


def test_mislabeled_gpu_memory_still_registers(factory):
    """A GPU tensor registered as "cpu:0" is registered as GPU memory (with a
    warning), so transports do not treat it as host memory; here after a
    piece of the same tensor was registered and unregistered."""
    engine = factory.engine()
    t = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    assert engine.register_memory(t.data_ptr() + 100, 4096) == 0
    assert engine.unregister_memory(t.data_ptr() + 100) == 0
    assert engine.register_memory(t.data_ptr(), 1 << 20, "cpu:0") == 0
    assert engine.unregister_memory(t.data_ptr()) == 0
