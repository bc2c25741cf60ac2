"""The pure rules of ElasticBuffer, without processes: the buffer size rule
(the reference's formula, restated here from its description), the domains,
the transport agreement and its environment override, and the layout
helpers against plain loops."""

import math

import pytest
import torch

from mooncake._ep_elastic import layout, nccl_support, sizes, topology, transport


def _formula(num_ranks, tokens, hidden, num_topk, fp8, hybrid, multiple_reduction):
    """ep.md 4.1, written out: total = 2 W + hybrid * (dispatch + combine)."""
    def a32(v):
        return math.ceil(v / 32) * 32

    k = max(1, num_topk)
    token = a32(hidden * (1 if fp8 else 2)) + a32(math.ceil(hidden / 128) * 4 if fp8 else 0)
    meta = a32(8 * k + 4 * (1 + k))
    dispatch = num_ranks * tokens * k * (token + meta) * 2
    combine = dispatch * (3 if multiple_reduction else 4)
    return 2 * 16_097_440 + (2 if hybrid and num_ranks > 1 else 1) * (dispatch + combine)


def test_workspace_is_the_reference_constant():
    assert sizes.workspace_bytes() == 16_097_440


@pytest.mark.parametrize("args", [(8, 128, 4096, 8, False, True, True), (2, 128, 7168, 8, True, True, True),
                                  (1, 64, 100, 0, False, True, True), (16, 256, 2048, 9, True, False, False),
                                  (4, 1, 128, 1, False, True, False)])
def test_buffer_size_follows_the_formula(args):
    assert sizes.elastic_buffer_size(*args) == _formula(*args)


def test_the_documented_example_is_about_1_12_gb():
    assert abs(sizes.elastic_buffer_size(8, 128, 4096, 8) / 1e9 - 1.12) < 0.01


# Values printed by the reference's 0.3.14 wheel (mooncake._ep, on this machine, 2026-12-02).
REFERENCE_ELASTIC_SIZES = {(8, 128, 4096, 8, False, True, True): 1122713920,
                           (2, 128, 7168, 8, True, True, True): 278610240,
                           (1, 64, 100, 0, False, True, True): 32325952,
                           (16, 256, 2048, 9, True, False, False): 857948480}
REFERENCE_FIXED_CAPACITY_SIZES = {(1, 128, 1, 1): 1176, (2, 128, 1, 1): 2328, (1, 256, 1, 1): 2200,
                                  (1, 128, 2, 1): 2352, (1, 128, 1, 4): 4680, (128, 7168, 8, 36): 2118652480}
REFERENCE_LEGACY_SIZES = {(128, 7168, 8, 288): 2118652416, (256, 2048, 8, 288): 1217401344, (1, 128, 3, 2): 2336}


def test_mooncake_ep_sizes_are_the_reference_wheels():
    ep = pytest.importorskip("mooncake.ep", reason="mooncake.pg is not built for this torch")
    for args, want in REFERENCE_ELASTIC_SIZES.items():
        assert ep.calculate_elastic_buffer_size(*args) == want, args
    for args, want in REFERENCE_FIXED_CAPACITY_SIZES.items():
        assert ep.get_ep_elastic_buffer_size_hint(*args) == want, args
    for args, want in REFERENCE_LEGACY_SIZES.items():
        assert ep.get_ep_buffer_size_hint(*args) == want, args
    # Answers from the build and the NCCL in this process (test_elastic_nccl_rules.py checks the rule).
    assert ep.has_nccl_device_support() is (not nccl_support.problem())
    assert not hasattr(ep, "ElasticBuffer")  # the native runtime class: absent, and hasattr says so


@pytest.mark.parametrize("hosts,want", [([7, 7, 7, 7], 4), ([1, 1, 2, 2], 2), ([1, 2, 3], 1), ([1, 2, 1, 2], 4),
                                        ([1, 1, 1, 2, 2], 5), ([5], 1), ([1, 1, 2, 2, 1, 1], 6)])
def test_ranks_per_host_needs_contiguous_equal_runs(hosts, want):
    assert topology.ranks_per_host(hosts) == want


def test_domains():
    t = topology.topology(8, 4, allow_hybrid_mode=True)
    assert (t.num_rdma_ranks, t.num_nvlink_ranks, t.num_scaleout_ranks, t.num_scaleup_ranks) == (2, 4, 2, 4)
    assert (t.scaleout_index(5), t.scaleup_index(5)) == (1, 1)
    flat = topology.topology(8, 4, allow_hybrid_mode=False)
    assert (flat.num_scaleout_ranks, flat.num_scaleup_ranks) == (1, 8)
    one_host = topology.topology(4, 4, allow_hybrid_mode=True)
    assert (one_host.num_rdma_ranks, one_host.num_scaleout_ranks, one_host.num_scaleup_ranks) == (1, 1, 4)
    uneven = topology.topology(6, 4, allow_hybrid_mode=True)  # 4 + 2: no (scale-out x scale-up) form
    assert (uneven.num_rdma_ranks, uneven.num_scaleout_ranks, uneven.num_scaleup_ranks) == (2, 1, 6)


def test_local_ranks_setting(monkeypatch):
    monkeypatch.delenv("MOONCAKE_EP_NUM_LOCAL_RANKS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert topology.local_ranks_setting() == 0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert topology.local_ranks_setting() == 4
    monkeypatch.setenv("MOONCAKE_EP_NUM_LOCAL_RANKS", "2")
    assert topology.local_ranks_setting() == 2
    monkeypatch.setenv("MOONCAKE_EP_NUM_LOCAL_RANKS", "two")
    with pytest.raises(ValueError, match="MOONCAKE_EP_NUM_LOCAL_RANKS"):
        topology.local_ranks_setting()


def test_transport_request_and_override(monkeypatch):
    monkeypatch.delenv(transport.ENV, raising=False)
    assert transport.requested("auto") == "auto"
    assert transport.requested("nccl") == "nccl"
    assert transport.requested(" NCCL ") == "nccl"
    monkeypatch.setenv(transport.ENV, "IBGDA")
    assert transport.requested("auto") == "ibgda"
    assert transport.requested("nccl") == "nccl"  # an explicit request wins over the environment
    monkeypatch.setenv(transport.ENV, "rdma")
    with pytest.raises(ValueError, match=transport.ENV):
        transport.requested("auto")
    with pytest.raises(ValueError, match="transport"):
        transport.requested("tcp")


@pytest.mark.parametrize("requests,ready,want", [
    (["auto"] * 3, [True] * 3, "nccl"),
    (["auto"] * 3, [True, False, True], "ibgda"),
    (["ibgda"] * 2, [True, True], "ibgda"),
    (["nccl"] * 2, [True, True], "nccl"),
])
def test_transport_agreement(requests, ready, want):
    assert transport.agree(requests, ready) == want


def test_transport_agreement_errors_name_the_ranks():
    with pytest.raises(RuntimeError, match=r"'ibgda' by ranks \[0, 2\]; 'auto' by ranks \[1\]"):
        transport.agree(["ibgda", "auto", "ibgda"], [True] * 3)
    with pytest.raises(RuntimeError, match=r"ranks \[1\] are not ready for it .*; this rank: no NCCL here"):
        transport.agree(["nccl"] * 3, [True, False, True], "no NCCL here")


def test_layout_helpers_against_loops():
    g = torch.Generator().manual_seed(3)
    num_ranks, num_local, n, k = 3, 4, 7, 3
    topk = torch.stack([torch.randperm(num_ranks * num_local, generator=g)[:k] for _ in range(n)])
    topk[torch.rand(n, k, generator=g) < 0.2] = -1
    local = layout.local_picks(topk, 1, num_local)
    assert local.tolist() == [[e - 4 if 4 <= e < 8 else -1 for e in row] for row in topk.tolist()]
    exp = layout.expand(local, num_local, alignment=4)
    end, ends = 0, []
    for e in range(num_local):
        begin = -(-end // 4) * 4
        members = [(j, lane) for j, row in enumerate(local.tolist()) for lane, le in enumerate(row) if le == e]
        for i, (j, lane) in enumerate(members):
            assert int(exp.slots[j, lane]) == begin + i
        end = begin + len(members)
        ends.append(end)
    assert exp.ends == ends and exp.total == end
    counts = torch.tensor([[0, 2, 1], [3, 0, 0], [1, 1, 4]])
    begins = layout.block_begins(counts, [0, 2, 1])
    for d in range(3):
        at = 0
        for s in [0, 2, 1]:
            assert int(begins[s, d]) == at
            at += int(counts[s, d])
    assert layout.arrival_to_layout([2, 1, 3], [0, 2, 1], "cpu").tolist() == [0, 1, 3, 4, 5, 2]
    assert layout.arrival_to_layout([2, 1, 3], [0, 1, 2], "cpu") is None
