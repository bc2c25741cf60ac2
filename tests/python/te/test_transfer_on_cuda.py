"""The stream-ordered transfers (transfer_*_on_cuda, batch_transfer_*_on_cuda):
a transfer starts only after the work queued on its stream before it, and the
work queued after it sees its bytes. Each check sleeps on the stream first, so
a transfer that ran at once would move the old bytes, and copies the result
out on the same stream, so a stream that did not wait would copy the old ones.
Two engines in this process over "tcp" (GPU memory staged through host memory
by the engine's own thread while the stream is held)."""

import pytest

from _procs import HOST, addr

torch = pytest.importorskip("torch", reason="torch is not installed")
mce = pytest.importorskip("mooncake.engine")

NBYTES = (4 << 20) + 3
SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU time: far longer than queuing a transfer



def needs_gpu(test):
    test = pytest.mark.skipif(not mce.SUPPORT_CUDA, reason="mooncake.engine was built without CUDA")(test)
    return pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.cuda is unavailable (no GPU)")(test)


METHODS = ["transfer_write_on_cuda", "transfer_read_on_cuda",
           "batch_transfer_write_on_cuda", "batch_transfer_read_on_cuda"]


def test_the_methods_exist_exactly_in_cuda_builds():
    engine = mce.TransferEngine()
    assert [hasattr(engine, m) for m in METHODS] == [mce.SUPPORT_CUDA] * 4


@pytest.mark.skipif(not mce.SUPPORT_CUDA, reason="mooncake.engine was built without CUDA")
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_without_a_gpu_the_call_raises_instead_of_skipping_the_transfer(factory):
    src, dst = factory.engine("tcp"), factory.engine("tcp")
    a, b = factory.buffer(src, 4096, seed=1), factory.buffer(dst, 4096)
    with pytest.raises(RuntimeError, match="could not queue the transfer"):
        src.transfer_write_on_cuda(f"{HOST}:{dst.get_rpc_port()}", addr(a), addr(b), 4096)
    assert not b.any()


class GpuPair:
    def __init__(self, factory):
        self.src, self.dst = factory.engine("tcp"), factory.engine("tcp")
        self.session = f"{HOST}:{self.dst.get_rpc_port()}"
        self.mine = torch.zeros(NBYTES, dtype=torch.uint8, device="cuda")
        self.peer = torch.zeros(NBYTES, dtype=torch.uint8, device="cuda")
        self.seen = torch.zeros(NBYTES, dtype=torch.uint8, device="cuda")
        assert self.src.register_memory(self.mine.data_ptr(), NBYTES) == 0
        assert self.dst.register_memory(self.peer.data_ptr(), NBYTES) == 0

    def close(self):
        torch.cuda.synchronize()
        self.src.unregister_memory(self.mine.data_ptr())
        self.dst.unregister_memory(self.peer.data_ptr())


@pytest.fixture
def gpu_pair(factory):
    pair = GpuPair(factory)
    yield pair
    pair.close()


def _halves(t):
    half = NBYTES // 2
    return [t.data_ptr(), t.data_ptr() + half], [half, NBYTES - half]


@needs_gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("batched", [False, True], ids=["single", "batch"])
@pytest.mark.parametrize("on_default_stream", [False, True], ids=["side-stream", "default-stream"])
def test_a_write_waits_for_earlier_work_and_later_work_waits_for_it(gpu_pair, batched, on_default_stream):
    p = gpu_pair
    stream = torch.cuda.default_stream() if on_default_stream else torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
        p.mine.fill_(7)
    if batched:
        (mine, sizes), (peer, _) = _halves(p.mine), _halves(p.peer)
        p.src.batch_transfer_write_on_cuda(p.session, mine, peer, sizes, stream_ptr=stream.cuda_stream)
    else:
        p.src.transfer_write_on_cuda(p.session, p.mine.data_ptr(), p.peer.data_ptr(), NBYTES,
                                     stream_ptr=stream.cuda_stream)
    with torch.cuda.stream(stream):
        p.seen.copy_(p.peer)
    stream.synchronize()
    assert int((p.peer != 7).sum()) == 0, "the transfer did not wait for the stream's earlier work"
    assert int((p.seen != 7).sum()) == 0, "the stream's later work did not wait for the transfer"


@needs_gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("batched", [False, True], ids=["single", "batch"])
def test_a_read_waits_for_earlier_work_and_later_work_waits_for_it(gpu_pair, batched):
    p = gpu_pair
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
        p.peer.fill_(9)  # the target's bytes, changed by work earlier on the stream
    if batched:
        (mine, sizes), (peer, _) = _halves(p.mine), _halves(p.peer)
        p.src.batch_transfer_read_on_cuda(p.session, mine, peer, sizes, stream_ptr=stream.cuda_stream)
    else:
        p.src.transfer_read_on_cuda(p.session, p.mine.data_ptr(), p.peer.data_ptr(), NBYTES,
                                    stream_ptr=stream.cuda_stream)
    with torch.cuda.stream(stream):
        p.seen.copy_(p.mine)
    stream.synchronize()
    assert int((p.mine != 9).sum()) == 0
    assert int((p.seen != 9).sum()) == 0


@needs_gpu
@pytest.mark.timeout(120)
def test_a_failed_transfer_releases_the_stream_and_the_next_call_raises_it(gpu_pair):
    p = gpu_pair
    stream = torch.cuda.Stream()
    outside = p.peer.data_ptr() + (64 << 20)  # not registered by the peer
    p.src.transfer_write_on_cuda(p.session, p.mine.data_ptr(), outside, 4096, stream_ptr=stream.cuda_stream)
    with torch.cuda.stream(stream):
        p.seen.fill_(1)
    stream.synchronize()  # returns: the failure did not hold the stream
    assert int((p.seen != 1).sum()) == 0
    with pytest.raises(RuntimeError, match="earlier stream-ordered transfer failed: transfer_write_on_cuda"):
        p.src.transfer_write_on_cuda(p.session, p.mine.data_ptr(), p.peer.data_ptr(), NBYTES,
                                     stream_ptr=stream.cuda_stream)
    # Reported once; the engine goes on.
    p.mine.fill_(3)
    torch.cuda.synchronize()
    p.src.transfer_write_on_cuda(p.session, p.mine.data_ptr(), p.peer.data_ptr(), NBYTES,
                                 stream_ptr=stream.cuda_stream)
    stream.synchronize()
    assert int((p.peer != 3).sum()) == 0


@pytest.mark.parametrize("method", METHODS)
def test_bad_arguments_raise_naming_the_rule(factory, method):
    if not hasattr(mce.TransferEngine, method):
        pytest.skip("mooncake.engine was built without CUDA")
    src, dst = factory.engine("tcp"), factory.engine("tcp")
    session = f"{HOST}:{dst.get_rpc_port()}"
    call = getattr(src, method)
    if method.startswith("batch"):
        with pytest.raises(ValueError, match="must have the same length"):
            call(session, [1, 2], [3], [4, 5])
        with pytest.raises(RuntimeError, match="cannot open segment"):
            call("127.0.0.1:1", [1], [2], [3])
    else:
        with pytest.raises(RuntimeError, match="cannot open segment"):
            call("127.0.0.1:1", 1, 2, 3)
    with pytest.raises(ValueError, match="transport_hint"):
        call(session, *([[1], [2], [3]] if method.startswith("batch") else [1, 2, 3]), transport_hint="carrier-pigeon")

