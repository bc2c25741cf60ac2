"""The IPC path's layout kernels on a GPU against their torch form, bit for
bit (the checks: _elastic_layout_checks.py), and replayed from a CUDA graph;
the choice between the two forms. Skipped without a GPU, but for the
choice; the kernels' code also runs on CPU over an emulation of CUDA
(test_elastic_layout_emulated.py)."""

import pytest
import torch

from _elastic_layout_checks import CASES, assert_same, check_cached_rows, check_case, defined_tail, inputs, on_device
from mooncake._ep_elastic.ipc_rows import RowFormat
from mooncake._ep_elastic.layout_kernels import KERNELS, LAYOUT_ENV, TORCH, TorchLayout, layout_for

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU: compares the layout kernels with their torch form on "
                                       "CUDA tensors (CI has no GPU)")


@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=[f"R{c[0]}-T{c[1]}-H{c[2]}-k{c[3]}-L{c[4]}" for c in CASES])
def test_kernels_equal_the_torch_layout(case):
    check_case(case, KERNELS, "cuda")


@needs_cuda
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("hidden", [128, 100])
def test_cached_dispatch_rows_equal_the_torch_ones(fp8, hidden):
    """The cached dispatch's rows: payload and scales only (no ids)."""
    check_cached_rows(fp8, hidden, KERNELS, "cuda")


@needs_cuda
def test_kernels_run_in_a_cuda_graph():
    """Captured and replayed on new picks written in place: the replay's outputs are the new picks' layout."""
    gen = torch.Generator().manual_seed(3)
    data, sf, topk, w = (on_device("cuda", t) for t in inputs(gen, 300, 128, 8, 8, False, True))
    row = RowFormat.of(data, sf, 8)
    shape = torch.arange(5, dtype=torch.int32, device="cuda")
    KERNELS.send(data, sf, row, topk, w, 4, 2, shape)  # warm up (the module's import) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sent = KERNELS.send(data, sf, row, topk, w, 4, 2, shape)
    topk.copy_(on_device("cuda", inputs(gen, 300, 128, 8, 8, False, True)[2]))
    graph.replay()
    torch.cuda.synchronize()
    ref = TORCH.send(data, sf, row, topk, w, 4, 2, shape)
    assert_same("dest", sent.dest, ref.dest)
    assert_same("counts and shape", sent.counts_row, ref.counts_row)
    assert_same("tail", defined_tail(sent.tail, row, True), defined_tail(ref.tail, row, True))


def test_the_layout_is_chosen_by_device_and_environment(monkeypatch):
    """No GPU needed: CPU tensors take the torch form; CUDA the kernels unless the variable says torch."""
    monkeypatch.delenv(LAYOUT_ENV, raising=False)
    assert layout_for(torch.device("cpu")) is TORCH
    assert layout_for(torch.device("cuda", 0)) is KERNELS
    assert layout_for(torch.device("cuda", 0), 33) is TORCH  # more picks than the kernels take
    monkeypatch.setenv(LAYOUT_ENV, "torch")
    assert layout_for(torch.device("cuda", 0)) is TORCH
    assert isinstance(layout_for(torch.device("cpu")), TorchLayout)
    monkeypatch.setenv(LAYOUT_ENV, "fast")
    with pytest.raises(ValueError, match=LAYOUT_ENV):
        layout_for(torch.device("cuda", 0))
