"""Scaffolding for the elastic tests: ranks are plain spawned processes that
each run one scenario function, so that a rank can die, and a replacement or
a joiner can start later with its own options. Every wait is bounded.

A scenario is a module-level function ``fn(ctx)``; ``ctx`` has ``rank``,
``world`` (the size this process declares), ``pg`` (mooncake.pg), ``events``
(named multiprocessing Events shared by every process of the test) and
``say(value)``, which records a result for the parent. What fn returns is
recorded too.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import queue as queue_mod
import time
import traceback
from dataclasses import dataclass, field

from _harness import CTX, HOST, free_port


@dataclass
class ElasticContext:
    rank: int
    world: int
    pg: object
    events: dict
    results: object = None
    said: list = field(default_factory=list)

    def say(self, value):
        self.said.append(value)

    def wait_for(self, name, timeout=60.0):
        if not self.events[name].wait(timeout):
            raise TimeoutError(f"rank {self.rank}: event {name!r} not set within {timeout} s")

    def signal(self, name):
        self.events[name].set()


def _options(pg, spec):
    if spec is None:
        return {}
    return {"pg_options": pg.MooncakeBackendOptions(*spec)}


def _rank_main(fn, rank, world, port, spec, events, results, env, init_timeout_s):
    os.environ.update(env or {})
    os.environ.update(MASTER_ADDR=HOST, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    ctx = None
    try:
        import torch.distributed as dist

        from mooncake import pg

        dist.init_process_group("mooncake-cpu", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=init_timeout_s), **_options(pg, spec))
        ctx = ElasticContext(rank=rank, world=world, pg=pg, events=events)
        value = fn(ctx)
        payload = ("ok", ctx.said, value)
        pickle.dumps(payload)
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        payload = ("err", ctx.said if ctx else [], (type(e).__name__, str(e), traceback.format_exc()))
    results.put((rank, os.getpid(), payload))
    results.close()
    results.join_thread()
    os._exit(0)  # skip teardown: a broken group's destroy must not hold the test


class Job:
    """Processes of one elastic test. ``start(fn, rank, world, spec)`` starts a
    rank (spec: the MooncakeBackendOptions arguments, or None)."""

    def __init__(self, event_names=(), env=None, init_timeout_s=30):
        self.port = free_port()
        self.events = {name: CTX.Event() for name in event_names}
        self.results = CTX.Queue()
        self.env = env
        self.init_timeout_s = init_timeout_s
        self.procs = []

    def start(self, fn, rank, world, spec=None):
        p = CTX.Process(target=_rank_main, daemon=True, name=f"elastic-rank{rank}",
                        args=(fn, rank, world, self.port, spec, self.events, self.results, self.env,
                              self.init_timeout_s))
        p.start()
        self.procs.append(p)
        return p

    def collect(self, expected, timeout=90.0):
        """Waits for `expected` results; returns {rank: (said, value)} and
        raises AssertionError with every rank's error on failure."""
        deadline = time.monotonic() + timeout
        got, errors = {}, []
        while len(got) + len(errors) < expected:
            try:
                rank, _pid, (status, said, value) = self.results.get(timeout=max(0.05, deadline - time.monotonic()))
            except queue_mod.Empty:
                break
            if status == "ok":
                got[rank] = (said, value)
            else:
                errors.append(f"rank {rank}: {value[0]}: {value[1]}\n{value[2]}\nsaid: {said}")
        if errors or len(got) < expected:
            self.kill()
            raise AssertionError(f"{len(got)} of {expected} ranks answered; errors:\n" + "\n".join(errors)
                                 + f"\nanswers: {got}")
        return got

    def kill(self):
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()


def die():
    """Leave at once, as a crash would (no teardown, no goodbye)."""
    os._exit(17)


def poll(predicate, timeout=30.0, interval=0.02):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached in time")
        time.sleep(interval)


def observe(ctx, work, t, start):
    """What a rank saw of a collective on the default group: the tensor, the
    Work's failure hint and local success, the active mask, the world size,
    and the seconds since `start`."""
    import torch.distributed as dist

    return {
        "value": t.tolist(),
        "hint": ctx.pg.get_failed_ranks_hint(work).tolist(),
        "local_success": ctx.pg.get_local_success(work),
        "mask": ctx.pg.get_active_ranks(dist.group.WORLD).tolist(),
        "world": dist.get_world_size(),
        "took": time.monotonic() - start,
    }


def lose_a_rank_between_collectives(ctx, victim, leave=die):
    """Every rank all_reduces and says ("before", sum, epoch); `victim` then
    leaves (`leave`); the others all_reduce twice and say observe() of the
    first and ("after", values, local success, epoch) of the second."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    ctx.say(("before", t.item(), ctx.pg.get_current_epoch(dist.group.WORLD)))
    if ctx.rank == victim:
        leave()
    start = time.monotonic()
    t = torch.tensor([float(ctx.rank + 1)])
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    ctx.say(observe(ctx, work, t, start))
    after = torch.ones(3)
    work = dist.all_reduce(after, async_op=True)
    work.wait()
    ctx.say(("after", after.tolist(), ctx.pg.get_local_success(work), ctx.pg.get_current_epoch(dist.group.WORLD)))


def run_with_a_replacement(job, fn, replacement, world, victim, after_event=None, timeout=90.0):
    """Starts `fn` on every rank of `world`; once `victim` has died (and, with
    `after_event`, that event of the job is set), a replacement
    (is_extension) of it runs `replacement`; returns what every rank said
    (job.collect)."""
    procs = [job.start(fn, r, world) for r in range(world)]
    procs[victim].join(60)
    assert not procs[victim].is_alive(), f"rank {victim} did not die"
    if after_event is not None:
        assert job.events[after_event].wait(60), f"event {after_event!r} not set within 60 s"
    job.start(replacement, victim, world, spec=(world, True))
    return job.collect(world, timeout=timeout)


def replacement_joins(ctx):
    """A replacement process (started with is_extension): joins the group,
    then runs a full-world all_reduce and says what it got."""
    import torch
    import torch.distributed as dist

    ctx.say(("before join", dist.get_world_size()))
    ctx.pg.join_group(dist.group.WORLD)
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    ctx.say(("full", t.item(), ctx.pg.get_active_ranks(dist.group.WORLD).tolist()))
