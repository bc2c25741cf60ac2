"""The fast path's host-side rules, without a GPU: the order of receive hooks
(``_InFlight``: the kernels number receives in enqueue order, so a hook out
of order must be refused, not pair rows of the wrong call) and the setup
agreement of ``IpcPath._agree`` (every rank opens, or none does), with ranks
as threads over an in-memory store."""

import threading

import pytest
import torch.distributed as dist

from mooncake._ep_ipc_path.path import IpcPath, _InFlight

pytestmark = pytest.mark.timeout(60)

ep_ipc = pytest.importorskip("mooncake._ep_ipc", reason="the native module mooncake._ep_ipc is not built "
                                                        "(it needs the CUDA toolkit at build time)")


def test_hooks_run_in_call_order_and_at_most_two_wait():
    calls = _InFlight("dispatch")
    first, second = object(), object()
    calls.check_new_call(with_hook=True)
    calls.add(first)
    calls.check_new_call(with_hook=True)
    calls.add(second)
    with pytest.raises(RuntimeError, match="2 calls already wait for their receive hooks"):
        calls.check_new_call(with_hook=True)
    with pytest.raises(RuntimeError, match="receive hook of an earlier dispatch has not been called"):
        calls.check_new_call(with_hook=False)
    with pytest.raises(RuntimeError, match="in the order of their calls"):
        calls.take(second)
    calls.take(first)
    with pytest.raises(RuntimeError, match="already called"):
        calls.take(first)
    calls.take(second)
    calls.check_new_call(with_hook=False)  # nothing pending: a whole call may go


def _agree_everywhere(complaints, silent=()):
    world = len(complaints)
    store = dist.HashStore()  # one in-memory store, shared by the thread ranks
    answers = [None] * world

    def rank_main(r):
        path = IpcPath(store, r, world, uid=7, alive=lambda: (1 << world) - 1)
        answers[r] = path._agree("open/1/ready", complaints[r])

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world) if r not in silent]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return [a for r, a in enumerate(answers) if r not in silent]


def test_setup_goes_ahead_only_when_no_rank_complains():
    assert _agree_everywhere(["", "", "", ""]) == ["", "", "", ""]
    answers = _agree_everywhere(["", "rank(s) [3] inactive", "", ""])
    assert answers == ["rank 1: rank(s) [3] inactive"] * 4


def test_a_rank_that_never_reports_ends_the_setup_everywhere(monkeypatch):
    monkeypatch.setenv("MOONCAKE_EP_ATTACH_TIMEOUT_MS", "150")  # the agreement waits twice that
    answers = _agree_everywhere(["", "", ""], silent=(1,))
    assert answers == ["rank(s) [1] did not report within 300 ms"] * 2


def _agree_on_absent_everywhere(world, alive_seen, silent=(), wait_s=0.3):
    """Ranks as threads; `alive_seen[r]`: the active mask rank r's membership shows."""
    import time

    store = dist.HashStore()
    answers = [None] * world

    def rank_main(r):
        path = IpcPath(store, r, world, uid=7, alive=lambda: alive_seen[r])
        start = time.monotonic()
        absent, why = path._agree_on_absent("open/1/ready", time.monotonic() + wait_s)
        answers[r] = (absent, why, time.monotonic() - start)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world) if r not in silent]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return {r: a for r, a in enumerate(answers) if r not in silent}


def test_a_rank_the_membership_saw_go_is_left_out_without_waiting():
    # Rank 1 exited before the first call; every other rank's membership
    # shows it inactive: they open without it at once (issue 19 §1).
    answers = _agree_on_absent_everywhere(3, [0b101] * 3, silent=(1,), wait_s=20)
    for r in (0, 2):
        absent, why, took = answers[r]
        assert (absent, why) == (0b010, ""), answers[r]
        assert took < 2, took
    everyone = _agree_on_absent_everywhere(3, [0b111] * 3)
    assert {r: a[:2] for r, a in everyone.items()} == {r: (0, "") for r in range(3)}


def test_a_silent_rank_still_active_ends_the_setup_at_the_deadline_everywhere():
    answers = _agree_on_absent_everywhere(3, [0b111] * 3, silent=(1,), wait_s=0.3)
    for r in (0, 2):
        absent, why, took = answers[r]
        assert absent == 0 and "did not report" in why, answers[r]
        assert took < 2, took


def test_ranks_that_see_different_absent_ranks_all_refuse():
    # Rank 0 has seen rank 1 go, rank 2 has not (yet): neither opens.
    answers = _agree_on_absent_everywhere(3, [0b101, 0b111, 0b111], silent=(1,), wait_s=0.3)
    for r in (0, 2):
        absent, why, _ = answers[r]
        assert absent == 0 and why, answers[r]
