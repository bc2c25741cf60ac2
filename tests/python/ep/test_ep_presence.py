"""The per-call agreement behind ``timeout_us`` (mooncake/_ep_collective/presence.py),
in one process: ranks are threads sharing an in-memory store, so the protocol's
corner cases run deterministically and fast, also at world sizes the
multi-process tests cannot afford (more ranks than one 60-bit arrival word)."""

import threading
import time

import pytest
import torch.distributed as dist

from mooncake._ep_collective.presence import DELETE_LAG, FLOOR_EVERY, Presence, mask_of

pytestmark = pytest.mark.timeout(60)


def _everyone_alive(num_ranks):
    full = (1 << num_ranks) - 1
    return lambda: full


def _agree_in_threads(store, ranks, num_ranks, seq, expected, timeout_us, alive=None, delays=None):
    """Runs agree() for each rank in `ranks` on its own thread; returns {rank: decision}."""
    alive = alive or _everyone_alive(num_ranks)
    got, errors = {}, []

    def one(rank):
        try:
            if delays and rank in delays:
                time.sleep(delays[rank])
            got[rank] = Presence(store, rank, num_ranks, alive).agree(seq, expected, timeout_us)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append((rank, e))

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert all(not t.is_alive() for t in threads), "an agreement did not return"
    return got


@pytest.mark.parametrize("num_ranks", [2, 61, 130])
def test_everyone_present_agrees_on_everyone(num_ranks):
    store = dist.HashStore()
    full = (1 << num_ranks) - 1
    got = _agree_in_threads(store, range(num_ranks), num_ranks, seq=1, expected=full, timeout_us=-1)
    assert set(got.values()) == {full}


@pytest.mark.parametrize("num_ranks, absent", [(4, {2}), (70, {0, 61, 69})])
def test_absent_ranks_are_left_out_after_the_timeout_and_a_late_rank_learns_it(num_ranks, absent):
    store = dist.HashStore()
    full = (1 << num_ranks) - 1
    present = [r for r in range(num_ranks) if r not in absent]
    # The window must let every present thread arrive: starting 67 Python
    # threads on a loaded 2-core machine took longer than 0.2 s once (a CI
    # flake, not a protocol failure).
    window_s = 0.2 if num_ranks < 10 else 2.0
    start = time.monotonic()
    got = _agree_in_threads(store, present, num_ranks, seq=5, expected=full, timeout_us=int(window_s * 1e6))
    took = time.monotonic() - start
    want = full & ~mask_of(absent)
    assert set(got.values()) == {want}
    assert window_s <= took < window_s + 5.0, took
    # A late rank reads the decision at once, finds itself left out, and (the
    # others being decided on already) goes on alone.
    # At the next level it waits for the other absent ranks, if any, up to its
    # own timeout.
    late = min(absent)
    start = time.monotonic()
    decided = Presence(store, late, num_ranks, _everyone_alive(num_ranks)).agree(5, full, 200_000)
    took = time.monotonic() - start
    assert decided == 1 << late
    assert took < (0.5 if len(absent) == 1 else 1.5), took


def test_late_ranks_agree_among_themselves_at_the_next_level():
    store = dist.HashStore()
    # Ranks 0 and 1 decide without 2 and 3 (short timeout); 2 and 3 come later together.
    first = _agree_in_threads(store, [0, 1], 4, seq=2, expected=0b1111, timeout_us=300_000)
    later = _agree_in_threads(store, [2, 3], 4, seq=2, expected=0b1111, timeout_us=-1)
    assert first == {0: 0b0011, 1: 0b0011}
    assert later == {2: 0b1100, 3: 0b1100}


def test_an_early_quitter_does_not_knock_out_the_others():
    store = dist.HashStore()
    alone = _agree_in_threads(store, [0], 3, seq=1, expected=0b111, timeout_us=50_000)
    rest = _agree_in_threads(store, [1, 2], 3, seq=1, expected=0b111, timeout_us=-1)
    assert alone == {0: 0b001} and rest == {1: 0b110, 2: 0b110}


def test_a_rank_the_group_drops_is_not_waited_for_even_without_timeout():
    store = dist.HashStore()
    dropped = threading.Event()
    alive = lambda: 0b101 if dropped.is_set() else 0b111  # noqa: E731
    start = time.monotonic()
    threading.Timer(0.3, dropped.set).start()
    got = _agree_in_threads(store, [0, 2], 3, seq=1, expected=0b111, timeout_us=-1, alive=alive)
    assert got == {0: 0b101, 2: 0b101}
    assert 0.3 <= time.monotonic() - start < 3.0


def test_arrivals_after_a_slow_start_are_waited_for_without_timeout():
    store = dist.HashStore()
    got = _agree_in_threads(store, [0, 1, 2], 3, seq=9, expected=0b111, timeout_us=-1, delays={1: 0.4})
    assert set(got.values()) == {0b111}


def test_a_call_is_never_confused_with_another():
    """Keys carry the call number: a decision of call 3 (without rank 1) does not
    leak into call 4, where everyone is present."""
    store = dist.HashStore()
    got3 = _agree_in_threads(store, [0, 2], 3, seq=3, expected=0b111, timeout_us=50_000)
    got4 = _agree_in_threads(store, [0, 1, 2], 3, seq=4, expected=0b111, timeout_us=-1)
    assert set(got3.values()) == {0b101} and set(got4.values()) == {0b111}


def test_old_calls_are_forgotten_and_a_rank_stuck_in_one_gives_up():
    store = dist.HashStore()
    alive = _everyone_alive(2)
    ranks = [Presence(store, r, 2, alive) for r in range(2)]
    last = DELETE_LAG + FLOOR_EVERY * 2
    for seq in range(1, last + 1):
        got = _agree_in_threads(store, [0, 1], 2, seq=seq, expected=0b11, timeout_us=-1)
        for r in (0, 1):
            ranks[r]._history[seq] = (0, got[r])  # as agree() records it
            ranks[r].forget_old_calls(seq)  # rank 1 is not the lowest: deletes nothing
    assert not store.check(["1/0/d"]) and not store.check([f"{last - DELETE_LAG}/0/d"])
    assert store.check([f"{last - DELETE_LAG + 1}/0/d"])
    # A rank still in call 1 (no timeout) learns it is forgotten and goes on
    # alone instead of waiting forever.
    start = time.monotonic()
    assert ranks[1].agree(1, 0b11, -1) == 0b10
    assert time.monotonic() - start < 1.0
