"""ElasticBuffer's NCCL transport, what runs without a GPU: the unique-id
message (alone and broadcast over a real group), this rank's readiness,
``has_nccl_device_support()`` from the build and the runtime, and the
transport's selection when every rank is ready or some rank is not
(readiness monkeypatched: no NCCL transport runs here). The version,
LSA-team and window-size rules are C++ (tests/cpp/ep_nccl/); the GPU run is
test_elastic_nccl.py."""

from types import SimpleNamespace

import pytest

from _ep_rounds import RANK_ENV
from _harness import World, assert_errors, errors_of
from mooncake._ep_elastic import nccl_bootstrap as boot
from mooncake._ep_elastic import nccl_support, transport

UID = bytes(range(128))


def test_unique_id_message_layout_and_round_trip():
    words = boot.encode(UID, 23206)
    assert len(words) == 5 + 16 + 32
    assert words[:5] == [boot.MAGIC, boot.OK, 23206, 128, 0]
    # Word 5 holds the id's first 8 bytes, little-endian; the last id word its last 8.
    assert words[5] == int.from_bytes(bytes(range(8)), "little")
    assert words[20] == int.from_bytes(bytes(range(120, 128)), "little")
    assert words[21:] == [0] * 32
    assert boot.decode(words, 23206) == UID


def test_unique_id_message_carries_rank_0s_failure():
    words = boot.encode(None, 23206, "ncclGetUniqueId: no usable network interface")
    assert words[1] == boot.FAILED and words[3] == 0
    with pytest.raises(RuntimeError, match="rank 0 could not make the NCCL unique id: ncclGetUniqueId: no usable"):
        boot.decode(words, 23206)


def test_unique_id_message_refusals():
    with pytest.raises(RuntimeError, match="rank 0 runs NCCL 23206, this rank 22809; every rank must load the same"):
        boot.decode(boot.encode(UID, 23206), 22809)
    with pytest.raises(RuntimeError, match="is not one"):
        boot.decode([0] * boot.MESSAGE_WORDS, 23206)
    with pytest.raises(RuntimeError, match="is not one"):
        boot.decode(boot.encode(UID, 23206)[:-1], 23206)
    corrupt = boot.encode(UID, 23206)
    corrupt[3] = 129
    with pytest.raises(RuntimeError, match="corrupt"):
        boot.decode(corrupt, 23206)
    with pytest.raises(ValueError, match="unique_id: must be 128 bytes"):
        boot.encode(b"short", 23206)


def _fake_nccl(rank_0_fails: bool):
    def make_unique_id():
        if rank_0_fails:
            raise RuntimeError("ncclGetUniqueId: bootstrap failed")
        return UID

    return SimpleNamespace(make_unique_id=make_unique_id, RUNTIME_VERSION=23206, version_text=str)


def _share(ctx, rank_0_fails):
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from mooncake._ep_collective.group import work_failure_reader

    nccl = _fake_nccl(rank_0_fails)
    if ctx.rank:  # only rank 0 may make the id
        nccl.make_unique_id = None
    share = lambda: boot.share_unique_id(dist.group.WORLD, ctx.rank, nccl, torch.device("cpu"),  # noqa: E731
                                         timedelta(seconds=30), work_failure_reader(dist.group.WORLD))
    return share() if not rank_0_fails else errors_of({"share": share})


def test_unique_id_reaches_every_rank_and_so_does_rank_0s_failure():
    with World(3, gloo=False, env=RANK_ENV) as world:
        assert world.run(_share, False, timeout=60) == [UID] * 3  # rank 0's: the others cannot make one
        seen = world.run(_share, True, timeout=60)
    assert_errors(seen, {"share": ("RuntimeError", "rank 0 could not make the NCCL unique id: ncclGetUniqueId: "
                                                   "bootstrap failed")})


def test_readiness_of_this_rank():
    assert transport.ready_for_nccl("no build", sized=True, cuda_group=True) == "no build"
    assert "CUDA tensors" in transport.ready_for_nccl("", sized=True, cuda_group=False)
    assert "num_max_tokens_per_rank, hidden and num_topk" in transport.ready_for_nccl("", sized=False,
                                                                                    cuda_group=True)
    assert transport.ready_for_nccl("", sized=True, cuda_group=True) == ""


def test_support_from_the_build_and_the_runtime(monkeypatch):
    import mooncake.ep as ep

    monkeypatch.setattr(nccl_support, "native", lambda: None)
    assert "-DMOONCAKE_WITH_NCCL_DEVICE=ON" in nccl_support.problem()
    assert ep.has_nccl_device_support() is False
    old = "the NCCL loaded in this process is 2.28.9 ...; preload ... LD_PRELOAD"
    monkeypatch.setattr(nccl_support, "native", lambda: SimpleNamespace(RUNTIME_PROBLEM=old))
    assert nccl_support.problem() == old
    assert ep.has_nccl_device_support() is False
    monkeypatch.setattr(nccl_support, "native", lambda: SimpleNamespace(RUNTIME_PROBLEM=""))
    assert ep.has_nccl_device_support() is True


def _select(ctx, request, ready_ranks, opens):
    """Constructs an ElasticBuffer with readiness and the NCCL setup replaced:
    rank r is ready when in ``ready_ranks``; the setup succeeds (``opens``)
    with a stand-in path, or fails as the native open would (RuntimeError)."""
    import torch.distributed as dist

    from mooncake import mooncake_elastic_buffer as meb

    calls = []
    meb.transports.ready_for_nccl = lambda *a: "" if ctx.rank in ready_ranks else f"rank {ctx.rank} has no NCCL"

    def nccl_rows_path(self, topo, explicit):
        calls.append(explicit)
        if opens:
            return meb.CollectivePath(self.group, self.rank_idx, topo, self._generation, None)
        if explicit:
            raise RuntimeError("ElasticBuffer: transport='nccl' could not be set up: NCCL's LSA team of this rank "
                               "holds 2 of the 4 ranks")
        self._path_reason = "transport 'auto' took 'ibgda': the NCCL transport could not be set up"
        return None

    meb.ElasticBuffer._nccl_rows_path = nccl_rows_path
    try:
        buf = meb.ElasticBuffer(dist.group.WORLD, transport=request)
    except RuntimeError as err:
        return "RuntimeError", str(err), calls
    return buf.transport, buf.path_reason, calls


def test_selection_when_every_rank_is_ready_or_not():
    with World(2, gloo=False, env=RANK_ENV) as world:
        everyone = world.run(_select, "auto", (0, 1), True, timeout=60)
        assert [(t, c) for t, _, c in everyone] == [("nccl", [False])] * 2
        # The setup failed on every rank alike (the native open agrees inside NCCL): "auto" takes "ibgda".
        fallback = world.run(_select, "auto", (0, 1), False, timeout=60)
        assert [(t, c) for t, _, c in fallback] == [("ibgda", [False])] * 2
        assert all("could not be set up" in why for _, why, _ in fallback)
        # One rank not ready: "auto" never tries NCCL.
        assert [(t, c) for t, _, c in world.run(_select, "auto", (0,), True, timeout=60)] == [("ibgda", [])] * 2
        explicit = world.run(_select, "nccl", (0,), True, timeout=60)
        failed = world.run(_select, "nccl", (0, 1), False, timeout=60)
    assert [(t, c) for t, _, c in explicit] == [("RuntimeError", [])] * 2
    assert "ranks [1] are not ready for it" in explicit[0][1] and "this rank: rank 1 has no NCCL" in explicit[1][1]
    assert [(t, c) for t, _, c in failed] == [("RuntimeError", [True])] * 2
    assert all("holds 2 of the 4 ranks" in why for _, why, _ in failed)
