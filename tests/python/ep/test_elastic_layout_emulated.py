"""The layout kernels' own code (mooncake-ep/src/elastic_layout.cu), built for
the host over an emulation of CUDA (_layout_emulation.py), against the torch
form bit for bit: the same checks as on a GPU (_elastic_layout_checks.py),
on CPU tensors, so CI (no GPU) runs the kernels' logic."""

import pytest

from _elastic_layout_checks import CASES, check_cached_rows, check_case
from _layout_emulation import build, compiler_missing
from mooncake._ep_elastic.layout_kernels import KernelLayout

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(compiler_missing() is not None, reason=compiler_missing() or "")]


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    return KernelLayout(build(tmp_path_factory.mktemp("layout_emulation")))


@pytest.mark.parametrize("case", CASES, ids=[f"R{c[0]}-T{c[1]}-H{c[2]}-k{c[3]}-L{c[4]}" for c in CASES])
def test_emulated_kernels_equal_the_torch_layout(kernels, case):
    check_case(case, kernels, "cpu")


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("hidden", [128, 100])
def test_emulated_cached_dispatch_rows_equal_the_torch_ones(kernels, fp8, hidden):
    check_cached_rows(fp8, hidden, kernels, "cpu")
