"""Which path a Buffer takes (docs/ep.md, "What runs"): the per-connection
agreement of ``_ep_ipc_path.choice`` with every rank in a thread over an
in-memory store (each rank posts its own statement; all must reach the same
answer), and the Buffer's path switches on a ``mooncake-cpu`` group. No GPU
needed: the statements are made up."""

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from mooncake._ep_ipc_path.choice import RankStatement, choose_path
from _ep_rounds import RANK_ENV, buffer_of
from _harness import World

pytestmark = pytest.mark.timeout(60)


def able(host="node-a", device=0, gpu="", reaches=()):
    return RankStatement(True, "", host, device, gpu, tuple(reaches))


def unable(why):
    return RankStatement(False, why, "node-a", -1)


def choose_everywhere(statements, *, cuda_group=True, alive=None, silent=(), wait_s=5.0):
    """Runs choose_path on one thread per rank; ranks in `silent` never take part."""
    world = len(statements)
    alive = (1 << world) - 1 if alive is None else alive
    store = dist.HashStore()  # one in-memory store, shared by the thread ranks
    answers = [None] * world

    def rank_main(r):
        answers[r] = choose_path(store, r, world, cuda_group=cuda_group, alive=alive, mine=statements[r],
                                 wait=timedelta(seconds=wait_s))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world) if r not in silent]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return [a for r, a in enumerate(answers) if r not in silent], store


def test_every_rank_able_on_one_host_takes_the_fast_path():
    answers, _ = choose_everywhere([able(device=0), able(device=1), able(device=0), able(device=1)])
    assert all(a.fast for a in answers), answers
    assert len({a.reason for a in answers}) == 1 and "GPU(s) [0, 1]" in answers[0].reason


def test_ranks_on_gpus_with_peer_access_take_the_fast_path():
    both = ("GPU-a", "GPU-b")
    answers, _ = choose_everywhere([able(device=0, gpu="GPU-a", reaches=both),
                                    able(device=1, gpu="GPU-b", reaches=both),
                                    able(device=0, gpu="GPU-a", reaches=both)])
    assert all(a.fast for a in answers), answers


def test_gpus_without_peer_access_send_everyone_to_the_collective_path():
    # Rank 1 runs with another CUDA_VISIBLE_DEVICES: its index 0 is GPU-b, and GPU-b does not
    # reach GPU-a. Every rank must say so, naming the pair, whatever its own view.
    answers, _ = choose_everywhere([able(device=0, gpu="GPU-a", reaches=("GPU-a", "GPU-b")),
                                    able(device=0, gpu="GPU-b", reaches=("GPU-b",))])
    assert [a.fast for a in answers] == [False, False]
    assert len({a.reason for a in answers}) == 1, answers
    assert "rank 1's GPU" in answers[0].reason and "no peer access to rank 0's" in answers[0].reason


def test_one_unable_rank_sends_everyone_to_the_collective_path_and_is_named():
    answers, _ = choose_everywhere([able(), able(), unable("no CUDA device"), able()])
    assert [a.fast for a in answers] == [False] * 4
    assert all(a.reason == "rank 2: no CUDA device" for a in answers), answers


def test_ranks_on_two_hosts_take_the_collective_path():
    answers, _ = choose_everywhere([able("node-a"), able("node-a"), able("node-b")])
    assert [a.fast for a in answers] == [False] * 3
    assert all("2 hosts" in a.reason for a in answers), answers


def test_a_group_without_cuda_decides_alone_without_the_store():
    answers, store = choose_everywhere([able(), able()], cuda_group=False)
    assert [a.fast for a in answers] == [False, False]
    assert "CUDA" in answers[0].reason and store.num_keys() == 0


def test_an_inactive_rank_means_the_collective_path_at_once():
    answers, _ = choose_everywhere([able(), able(), able()], alive=0b101, silent=(1,), wait_s=30.0)
    assert [a.fast for a in answers] == [False, False]
    assert all("[1] inactive" in a.reason for a in answers), answers


def test_a_rank_that_never_states_times_out_to_the_collective_path():
    answers, _ = choose_everywhere([able(), able(), able()], silent=(2,), wait_s=0.3)
    assert [a.fast for a in answers] == [False, False]
    assert all("not every rank stated" in a.reason for a in answers), answers


def _cpu_buffer_paths(ctx):
    buffer = buffer_of(ctx)
    out = {"path": buffer.path, "reason": buffer.path_reason, "fallback": buffer._use_fallback}
    try:
        buffer._use_fallback = False
    except ValueError as err:
        out["unforce"] = str(err)
    buffer._use_fallback = True
    out["forced"] = (buffer.path, buffer.path_reason)
    dist.barrier()
    return out


def test_a_cpu_group_runs_the_collective_path_and_says_why():
    with World(2, gloo=False, env=RANK_ENV) as world:
        outs = world.run(_cpu_buffer_paths, timeout=60)
    for out in outs:
        assert out["path"] == "collective" and out["fallback"] is True, out
        assert "not a 'mooncake' CUDA group" in out["reason"], out
        assert out["unforce"].startswith("_use_fallback: this connection has no fast path"), out
        assert out["forced"] == ("collective", "_use_fallback was set to True"), out
