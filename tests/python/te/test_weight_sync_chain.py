"""Chained weight sync as RL frameworks do it (verl style): the trainer
stages its weights bucket by bucket through two double-buffered bucket
buffers; rollout 1 pulls each bucket with transfer_sync_read and releases it
by writing a 4-byte completion word into the trainer's flag slot with
transfer_sync_write; rollout 2 pulls the same buckets from rollout 1 and
releases them to rollout 1 the same way. A producer reuses a bucket only
after polling its local flag memory for the release, so a lost or early
release shows up as corrupted weights (or a timeout) at the rollouts.

The roles run in _procs.trainer_main / _procs.rollout_main."""

import hashlib
import multiprocessing
import queue
import time

import pytest

import _procs

CTX = multiprocessing.get_context("spawn")
SEED = 20240611
TOTAL = (24 << 20) + 12345  # the last bucket is a partial one
BUCKET = 4 << 20
RUN_TIMEOUT = 60.0


@pytest.mark.timeout(90)
@pytest.mark.parametrize("protocol", ["", "tcp"], ids=["auto", "tcp"])
def test_chained_weight_sync(protocol):
    cfg = {"protocol": protocol, "seed": SEED, "total": TOTAL, "bucket": BUCKET}
    trainer_to_r1, r1_to_r2, results = CTX.Queue(), CTX.Queue(), CTX.Queue()
    procs = [
        CTX.Process(target=_procs.trainer_main, args=(cfg, trainer_to_r1, results), daemon=True),
        CTX.Process(target=_procs.rollout_main, args=("rollout1", cfg, trainer_to_r1, r1_to_r2, results), daemon=True),
        CTX.Process(target=_procs.rollout_main, args=("rollout2", cfg, r1_to_r2, None, results), daemon=True),
    ]
    for p in procs:
        p.start()
    outcome = {}
    try:
        deadline = time.monotonic() + RUN_TIMEOUT
        while len(outcome) < len(procs):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                name, status, *rest = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                assert not dead, f"a role process died: exit codes {[p.exitcode for p in procs]}, so far {outcome}"
                continue
            assert status == "ok", f"{name} failed:\n{rest[0]}"
            outcome[name] = rest
        assert set(outcome) == {"trainer", "rollout1", "rollout2"}, f"timed out; finished: {sorted(outcome)}"
        for p in procs:
            p.join(10)
            assert p.exitcode == 0, (p.name, p.exitcode)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)

    expected = hashlib.sha256(_procs.pattern(SEED, TOTAL).tobytes()).hexdigest()
    assert outcome["trainer"] == [(TOTAL + BUCKET - 1) // BUCKET]
    for name in ("rollout1", "rollout2"):
        digest, equal = outcome[name]
        assert digest == expected, name
        assert equal, name
