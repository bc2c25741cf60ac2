"""Bad arguments raise on the calling rank, before anything is queued, with
an exception type and a message naming the argument; the group then keeps
working (checked by a correct collective on every rank right after).

Where only the root validates an argument (gather_list, scatter_list), only
the root makes the bad call: had it queued anything, the next collective
would mismatch across ranks.
"""

import pytest
import torch
import torch.distributed as dist

from _harness import World, errors_of

pytestmark = pytest.mark.timeout(120)

W = 3


@pytest.fixture(scope="module")
def world():
    w = World(W)
    yield w
    w.close()


def f32(*shape):
    return torch.ones(*shape)


# name -> (bad call(ctx), expected exception type, substrings of the message,
#          which ranks make the call: "all" or "root0")
CASES = {
    # list lengths != world size
    "all_gather list length": (
        lambda c: dist.all_gather([f32(3) for _ in range(W + 1)], f32(3)), ValueError, ["tensor_list", "world_size"], "all"),
    "reduce_scatter list length": (
        lambda c: dist.reduce_scatter(f32(3), [f32(3) for _ in range(W - 1)]), ValueError, ["input_list"], "all"),
    "all_to_all list length": (
        lambda c: dist.all_to_all([f32(2) for _ in range(W)], [f32(2) for _ in range(W + 1)]),
        ValueError, ["input_tensor_list", "output_tensor_list"], "all"),
    "all_to_all_single split count": (
        lambda c: dist.all_to_all_single(f32(2 * W), f32(2 * W), input_split_sizes=[2 * W] + [0] * W),
        ValueError, ["input_split_sizes", "world_size"], "all"),
    "all_to_all_single output split count": (
        lambda c: dist.all_to_all_single(f32(2 * W), f32(2 * W), output_split_sizes=[2] * (W - 1)),
        ValueError, ["output_split_sizes"], "all"),
    "gather_list length on dst": (
        lambda c: dist.gather(f32(3), [f32(3) for _ in range(W + 1)], dst=0), ValueError, ["gather_list"], "root0"),
    "scatter_list length on src": (
        lambda c: dist.scatter(f32(3), [f32(3) for _ in range(W - 1)], src=0), ValueError, ["scatter_list"], "root0"),
    # output / element sizes
    "all_gather_into_tensor output size": (
        lambda c: dist.all_gather_into_tensor(f32(3 * W + 1), f32(3)), ValueError, ["output_tensor", "input_tensor"], "all"),
    "reduce_scatter_tensor input size": (
        lambda c: dist.reduce_scatter_tensor(f32(3), f32(3 * W - 1)), ValueError, ["input", "output"], "all"),
    "all_gather element size": (
        lambda c: dist.all_gather([f32(4) for _ in range(W)], f32(3)), ValueError, ["tensor_list"], "all"),
    "reduce_scatter element size": (
        lambda c: dist.reduce_scatter(f32(3), [f32(4) for _ in range(W)]), ValueError, ["input_list"], "all"),
    "all_to_all_single split sum": (
        lambda c: dist.all_to_all_single(f32(2 * W), f32(2 * W), input_split_sizes=[1] * W),
        ValueError, ["input_split_sizes", "input.size(0)"], "all"),
    "all_to_all_single output split sum": (
        lambda c: dist.all_to_all_single(f32(2 * W), f32(2 * W), output_split_sizes=[3] * W),
        ValueError, ["output_split_sizes", "output.size(0)"], "all"),
    "all_to_all_single negative split": (
        lambda c: dist.all_to_all_single(f32(2 * W), f32(2 * W), input_split_sizes=[-1, 2 * W + 1] + [0] * (W - 2)),
        ValueError, ["input_split_sizes", "negative"], "all"),
    "all_to_all_single indivisible": (
        lambda c: dist.all_to_all_single(f32(2 * W + 1), f32(2 * W + 1)), ValueError, ["input.size(0)", "world_size"], "all"),
    "gather_list element size on dst": (
        lambda c: dist.gather(f32(3), [f32(4) for _ in range(W)], dst=0), ValueError, ["gather_list"], "root0"),
    "scatter_list element size on src": (
        lambda c: dist.scatter(f32(3), [f32(4) for _ in range(W)], src=0), ValueError, ["scatter_list"], "root0"),
    # dtype mismatch between input and output
    "all_gather_into_tensor dtype": (
        lambda c: dist.all_gather_into_tensor(torch.empty(3 * W, dtype=torch.int32), f32(3)),
        TypeError, ["input_tensor", "output_tensor", "dtype"], "all"),
    "reduce_scatter_tensor dtype": (
        lambda c: dist.reduce_scatter_tensor(torch.empty(3, dtype=torch.float64), f32(3 * W)),
        TypeError, ["input", "output", "dtype"], "all"),
    # torch checks the list forms itself, before the backend (a ValueError without argument names)
    "all_gather list dtype (torch's check)": (
        lambda c: dist.all_gather([torch.empty(3, dtype=torch.int64) for _ in range(W)], f32(3)),
        ValueError, ["different dtypes"], "all"),
    "all_to_all_single dtype (torch's check)": (
        lambda c: dist.all_to_all_single(torch.empty(2 * W, dtype=torch.int32), f32(2 * W)),
        ValueError, ["different dtypes"], "all"),
    # roots out of range
    "broadcast src too large": (lambda c: dist.broadcast(f32(3), src=W), ValueError, ["src", str(W)], "all"),
    "broadcast src negative": (lambda c: dist.broadcast(f32(3), src=-1), ValueError, ["src", "-1"], "all"),
    "reduce dst too large": (lambda c: dist.reduce(f32(3), dst=W), ValueError, ["dst", str(W)], "all"),
    "gather dst too large": (lambda c: dist.gather(f32(3), None, dst=W), ValueError, ["dst", str(W)], "all"),
    "scatter src too large": (lambda c: dist.scatter(f32(3), None, src=W), ValueError, ["src", str(W)], "all"),
    # unsupported op / dtype combinations
    "BAND on float32": (
        lambda c: dist.all_reduce(f32(3), op=dist.ReduceOp.BAND), TypeError, ["BAND", "float32"], "all"),
    "BXOR on bfloat16": (
        lambda c: dist.all_reduce(f32(3).bfloat16(), op=dist.ReduceOp.BXOR), TypeError, ["BXOR", "bfloat16"], "all"),
    "AVG on bool": (
        lambda c: dist.all_reduce(torch.ones(3, dtype=torch.bool), op=dist.ReduceOp.AVG), TypeError, ["AVG", "bool"], "all"),
    "SUM on float8_e4m3fn": (
        lambda c: dist.all_reduce(f32(3).to(torch.float8_e4m3fn)), TypeError, ["float8_e4m3fn"], "all"),
    "MAX on float8_e5m2 (reduce)": (
        lambda c: dist.reduce(f32(3).to(torch.float8_e5m2), dst=0, op=dist.ReduceOp.MAX), TypeError, ["float8_e5m2"], "all"),
    "reduce_scatter_tensor on float8": (
        lambda c: dist.reduce_scatter_tensor(f32(3).to(torch.float8_e5m2), f32(3 * W).to(torch.float8_e5m2)),
        TypeError, ["float8_e5m2"], "all"),
    "PREMUL_SUM": (
        lambda c: dist.all_reduce(f32(3), op=dist._make_nccl_premul_sum(2.0)), ValueError, ["op", "PREMUL_SUM"], "all"),
    "complex MAX (torch's check)": (
        lambda c: dist.all_reduce(torch.ones(3, dtype=torch.complex64), op=dist.ReduceOp.MAX),
        ValueError, ["complex"], "all"),
    "unsupported dtype float8_e4m3fnuz": (
        lambda c: dist.broadcast(f32(3).to(torch.float8_e4m3fnuz), src=0), TypeError, ["tensor", "Float8_e4m3fnuz"], "all"),
    "sparse tensor": (lambda c: dist.all_reduce(f32(3).to_sparse()), ValueError, ["tensor", "dense"], "all"),
    # point-to-point arguments
    "send dst too large": (lambda c: dist.send(f32(2), dst=W), ValueError, ["dst", str(W)], "all"),
    "isend dst too large": (lambda c: dist.isend(f32(2), dst=W + 1), ValueError, ["dst", str(W + 1)], "all"),
    "recv src too large": (lambda c: dist.recv(f32(2), src=W), ValueError, ["src", str(W)], "all"),
    "irecv src too large": (lambda c: dist.irecv(f32(2), src=W), ValueError, ["src", str(W)], "all"),
    "recv from any source": (lambda c: dist.recv(f32(2)), RuntimeError, ["any source"], "all"),
    "send unsupported dtype": (
        lambda c: dist.send(f32(2).to(torch.float8_e5m2fnuz), dst=(c.rank + 1) % W), TypeError,
        ["tensor", "Float8_e5m2fnuz"], "all"),
}


def _bad_then_good(ctx, name):
    call, _, _, who = CASES[name]
    outcome = None
    if who == "all" or ctx.rank == 0:
        try:
            call(ctx)
            outcome = ("no exception", "")
        except Exception as e:  # noqa: BLE001 - the test inspects it
            outcome = (type(e).__name__, str(e))
    # The group still works: a correct collective right after, on every rank.
    t = torch.full((5,), float(ctx.rank + 1))
    dist.all_reduce(t)
    after = t.tolist()
    return outcome, after


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_raises_and_group_survives(world, name):
    _, exc_type, words, who = CASES[name]
    results = world.run(_bad_then_good, name, timeout=30)
    for rank, (outcome, after) in enumerate(results):
        assert after == [float(W * (W + 1) / 2)] * 5, f"rank {rank}: all_reduce after the error gave {after}"
        if who == "root0" and rank != 0:
            continue
        kind, message = outcome
        assert kind == exc_type.__name__, f"rank {rank}: expected {exc_type.__name__}, got {kind}: {message}"
        for word in words:
            assert word in message, f"rank {rank}: message does not mention {word!r}: {message}"


def _cuda_tensor(ctx):
    out = errors_of({
        "all_reduce": lambda: dist.all_reduce(torch.ones(3, device="cuda")),
        "broadcast": lambda: dist.broadcast(torch.ones(3, device="cuda"), src=0),
        "all_gather_into_tensor output": lambda: dist.all_gather_into_tensor(torch.empty(3 * W, device="cuda"),
                                                                            torch.ones(3)),
    })
    t = torch.full((5,), float(ctx.rank + 1))
    dist.all_reduce(t)
    return out, t.tolist()


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to make a CUDA tensor")


@pytest.fixture(scope="module")
def cuda_outcomes(world):
    return world.run(_cuda_tensor, timeout=60)


@needs_cuda
def test_cuda_tensor_is_refused_and_group_survives(cuda_outcomes):
    for rank, (out, after) in enumerate(cuda_outcomes):
        assert after == [float(W * (W + 1) / 2)] * 5
        for name, (kind, message) in out.items():
            assert kind != "no exception", f"rank {rank}: {name} with a CUDA tensor did not raise"


@needs_cuda
def test_cuda_tensor_error_names_the_argument(cuda_outcomes):
    for out, _ in cuda_outcomes:
        kind, message = out["all_gather_into_tensor output"]
        assert kind == "ValueError" and "output_tensor" in message and "cuda" in message, (kind, message)
        kind, message = out["all_reduce"]
        assert kind == "ValueError" and "tensor" in message and "cuda" in message, (kind, message)


_INIT_WITH_ENV = """
import torch.distributed as dist
from mooncake import pg  # noqa: F401
try:
    dist.init_process_group("mooncake-cpu", store=dist.HashStore(), rank=0, world_size=1)
    print("created")
except ValueError as e:
    print("ValueError:", e)
"""


@pytest.mark.parametrize("value", ["12", "4k", "-8192", " -8192", "99999999999999999999999"])
def test_a_bad_byte_count_in_the_environment_names_the_variable(value):
    """Byte counts read from the environment (settings.cpp envBytes) are
    checked when the group is made: a ValueError that names the variable and
    the rule, never a silent default."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, MOONCAKE_PG_SHM_SLOT_BYTES=value)
    out = subprocess.run([sys.executable, "-c", _INIT_WITH_ENV], env=env, capture_output=True, text=True, timeout=90)
    assert "ValueError:" in out.stdout, out.stdout + out.stderr
    assert "MOONCAKE_PG_SHM_SLOT_BYTES" in out.stdout and ">= 4096" in out.stdout, out.stdout
