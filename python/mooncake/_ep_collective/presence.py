"""Which ranks take part in one dispatch or combine: an agreement bounded by
``timeout_us``.

Why not a collective: a collective waits for every member, so one rank that
does not call would hold everyone until the process group's own timeout, and
that timeout breaks the whole group. Why not point-to-point with bounded
waits: a receive given up on stays posted and would later swallow a message
of another call, and two ranks giving up at different moments can disagree on
who was present. Instead the ranks meet in the job's key-value store (the one
``init_process_group`` rendezvoused through), whose compare-and-set gives one
decision that every rank reads identically:

1. Arrive: add this rank's bit into the call's arrival word(s)
   (``<seq>/<level>/a<w>``; one word holds 60 ranks).
2. Wait, polling, until one of: the decision exists (read it); every expected
   rank has arrived; the deadline passes. In the last two cases propose the
   arrived ranks with compare-and-set on ``<seq>/<level>/d``: the first
   proposal wins and every later one reads it back instead.
3. Expected = the caller's ``active_ranks`` and the process group's own mask
   (a rank the group has deactivated, e.g. a dead process, is not waited for,
   even with ``timeout_us=-1``).
4. A rank that the decision leaves out (it came late) does not give up: it
   moves to the next level with the ranks not yet decided on, and agrees
   with whoever else came late (often nobody: then it goes on alone). So the
   ranks split into groups that each exchange among themselves and mask the
   others; one rank that gives up early never knocks out the rest, which
   simply agree at the next level.

Every key carries the call's sequence number, so nothing of an abandoned call
is ever read by a later one. The lowest rank of each decision deletes that
decision's keys ``DELETE_LAG`` calls later and, now and then, advances
``floor``; a rank still waiting in a call below the floor (its peers are long
gone) goes on alone.
"""

from __future__ import annotations

import time
from typing import Callable

WORD_BITS = 60
DELETE_LAG = 64
FLOOR_EVERY = 16
POLL_MIN_S = 20e-6
POLL_MAX_S = 1e-3
FLOOR_CHECK_S = 0.05
FORGOTTEN = None  # what _agree_at() returns for a call whose keys were already deleted


def mask_of(ranks) -> int:
    out = 0
    for r in ranks:
        out |= 1 << r
    return out


def bits_of(mask: int, n: int) -> list[int]:
    """The first `n` bits of `mask`, one int (0 or 1) per rank."""
    return [mask >> r & 1 for r in range(n)]


def ranks_of(mask: int) -> list[int]:
    out, r = [], 0
    while mask:
        if mask & 1:
            out.append(r)
        mask >>= 1
        r += 1
    return out


class Presence:
    """The agreement of one Buffer connection (``store`` is already prefixed with
    the connection's id); ``alive()`` returns the process group's active mask."""

    def __init__(self, store, rank: int, num_ranks: int, alive: Callable[[], int]):
        self._store = store
        self._rank = rank
        self._self_bit = 1 << rank
        self._num_words = (num_ranks + WORD_BITS - 1) // WORD_BITS
        self._alive = alive
        self._history: dict[int, tuple[int, int]] = {}  # call -> (level, decision), for cleanup

    # -- keys
    @staticmethod
    def _arrival_key(seq: int, level: int, word: int) -> str:
        return f"{seq}/{level}/a{word}"

    @staticmethod
    def _decision_key(seq: int, level: int) -> str:
        return f"{seq}/{level}/d"

    def _read_arrivals(self, seq: int, level: int) -> int:
        mask = 0
        for w in range(self._num_words):
            # add(0) reads the word and creates it when nobody has arrived yet.
            mask |= self._store.add(self._arrival_key(seq, level, w), 0) << (w * WORD_BITS)
        return mask

    def _forgotten(self, seq: int) -> bool:
        if not self._store.check(["floor"]):
            return False
        return seq < int(self._store.get("floor"))

    # -- the agreement
    def agree(self, seq: int, expected: int, timeout_us: int) -> int:
        """The ranks (bit mask, this rank's bit always set) this rank exchanges
        with in call ``seq``; ``expected`` are the ranks it would wait for."""
        deadline = None if timeout_us < 0 else time.monotonic() + timeout_us / 1e6
        decided_elsewhere, level = 0, 0
        while True:
            wanted = expected & ~decided_elsewhere
            if wanted & ~self._self_bit == 0:
                decided = self._self_bit  # nobody left to wait for
                break
            decided = self._agree_at(seq, level, wanted | self._self_bit, deadline)
            if decided is FORGOTTEN:
                decided = self._self_bit
                break
            if decided & self._self_bit:
                break
            decided_elsewhere |= decided
            level += 1
        self._history[seq] = (level, decided)
        return decided

    def _agree_at(self, seq: int, level: int, wanted: int, deadline: float | None) -> int | None:
        word, bit = divmod(self._rank, WORD_BITS)
        self._store.add(self._arrival_key(seq, level, word), 1 << bit)
        decision_key = self._decision_key(seq, level)
        next_floor_check = time.monotonic() + FLOOR_CHECK_S
        delay = POLL_MIN_S
        while True:
            if self._store.check([decision_key]):
                return int(self._store.get(decision_key), 16)
            arrived = self._read_arrivals(seq, level) | self._self_bit
            waiting_for = wanted & (self._alive() | self._self_bit)
            now = time.monotonic()
            if arrived & waiting_for == waiting_for or (deadline is not None and now >= deadline):
                winner = self._store.compare_set(decision_key, "", format(arrived & waiting_for, "x"))
                return int(winner, 16)
            if now >= next_floor_check:
                if self._forgotten(seq):
                    return FORGOTTEN
                next_floor_check = now + FLOOR_CHECK_S
            pause = delay if deadline is None else max(0.0, min(delay, deadline - now))
            time.sleep(pause)
            delay = min(delay * 2, POLL_MAX_S)

    def forget_old_calls(self, seq: int) -> None:
        """Run after call ``seq``: the lowest rank of the decision of call
        ``seq - DELETE_LAG`` deletes its keys (everyone in it finished that call
        long ago)."""
        old = seq - DELETE_LAG
        for stale in [c for c in self._history if c < old]:  # calls this rank sat out skip a turn
            del self._history[stale]
        level, decided = self._history.pop(old, (0, self._self_bit))
        if decided == self._self_bit or decided & -decided != self._self_bit:
            return  # alone then (the store was not used), or not the lowest rank
        for w in range(self._num_words):
            self._store.delete_key(self._arrival_key(old, level, w))
        self._store.delete_key(self._decision_key(old, level))
        if seq % FLOOR_EVERY == 0:
            self._store.set("floor", str(old + 1))
