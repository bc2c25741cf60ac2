"""Where the multi-process GPU tests and benchmarks put their ranks
(python/mooncake/_gpu_placement.py; tests/cpp/common/test_gpus.h follows the
same rule): rank r on GPU r % G, G from MOONCAKE_TEST_GPUS or every visible
GPU. The device count is made up, so no GPU is needed."""

import pytest
import torch

from mooncake import _gpu_placement as placement


@pytest.fixture
def gpus(monkeypatch):
    def visible(count, wanted=None):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        if wanted is None:
            monkeypatch.delenv("MOONCAKE_TEST_GPUS", raising=False)
        else:
            monkeypatch.setenv("MOONCAKE_TEST_GPUS", wanted)

    return visible


def test_ranks_spread_over_every_visible_gpu_by_default(gpus):
    gpus(4)
    assert [placement.gpu_of_rank(r) for r in range(6)] == [0, 1, 2, 3, 0, 1]
    assert placement.placement(2) == "2 GPUs"


def test_one_gpu_puts_every_rank_on_gpu_0(gpus):
    gpus(8, "1")
    assert [placement.gpu_of_rank(r) for r in range(4)] == [0, 0, 0, 0]
    assert placement.placement(4) == "1 GPU"


def test_a_request_beyond_the_visible_gpus_uses_those_there_are(gpus):
    gpus(2, "4")
    assert [placement.gpu_of_rank(r) for r in range(4)] == [0, 1, 0, 1]
    gpus(2, "0")  # below 1: one GPU
    assert placement.gpus_in_use() == 1


def test_no_visible_gpu_is_an_error_that_says_so(gpus):
    gpus(0)
    assert placement.gpus_in_use() == 0
    with pytest.raises(RuntimeError, match="no CUDA device"):
        placement.gpu_of_rank(0)
