"""Runs code in W processes that form a ``mooncake-cpu`` process group.

Multiprocessing "spawn" imports this module (and the module of the function
to run) in every child, so nothing here may import pytest or the test
modules' fixtures.

Two ways to use it:

* ``World(size)``: starts W ranks once and keeps them; ``world.run(fn, *args)``
  runs ``fn(ctx, *args)`` on every rank and returns the per-rank results, so
  one start-up (importing torch in W processes) serves many checks.
* ``run_world(fn, size, ...)``: a world for a single call, for tests that
  break or kill the group.

Each rank sets MASTER_ADDR=127.0.0.1 and MASTER_PORT (a free port) and
calls ``init_process_group("mooncake-cpu", rank=..., world_size=...,
timeout=init_timeout_s)``; options: ``pg_options`` (a module-level factory
``(rank, size) -> options``; without it no pg_options argument is passed),
``before_init`` (a module-level ``(rank, size)`` hook, e.g. to call
``pg.set_collective_timeout_us``), ``env`` (extra environment), ``gloo``
(whether to create the gloo reference group) and ``backend`` (the backend
string, ``"mooncake-cpu"`` unless told; ``"mooncake"`` binds rank r to GPU
r mod the GPU count).

Inside a rank, ``ctx`` (a ``RankContext``) has ``rank``, ``size``, ``gloo``
(a gloo group over the same ranks, used as the reference) and ``pg`` (the
``mooncake.pg`` module). ``fn`` must be a module-level function (it is
pickled by name). What ``fn`` returns, or the exception it raised (type name,
message, traceback), comes back per rank through a queue. Every wait is
bounded: a world that does not answer in time is killed and the call fails
with what each rank said so far.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import queue as queue_mod
import signal
import socket
import time
import traceback
from dataclasses import dataclass

import multiprocessing

CTX = multiprocessing.get_context("spawn")
HOST = "127.0.0.1"


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class RankError(Exception):
    """What a rank raised, carried back to the parent (the original type
    travels as its name; the traceback as text)."""

    def __init__(self, rank, type_name, message, tb):
        super().__init__(f"rank {rank}: {type_name}: {message}\n{tb}")
        self.rank, self.type_name, self.message, self.tb = rank, type_name, message, tb


class WorldError(AssertionError):
    pass


@dataclass
class RankContext:
    rank: int
    size: int
    gloo: object = None
    pg: object = None

    def seed(self, *parts) -> int:
        """A reproducible seed from `parts` (same on every rank)."""
        h = 1469598103934665603
        for p in parts:
            for ch in repr(p).encode():
                h = ((h ^ ch) * 1099511628211) & ((1 << 63) - 1)
        return h


# ---------------------------------------------------------------------------
# Child side


def _init_group(rank, size, port, init_timeout_s, pg_options_factory, gloo, backend="mooncake-cpu"):
    import torch
    import torch.distributed as dist

    from mooncake import pg

    os.environ["MASTER_ADDR"] = HOST
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(size)
    kwargs = {}
    if backend == "mooncake":
        # Before the options: a factory may put tensors (a CUDA mask) on the current device.
        # Ranks share the GPUs there are (several ranks on one GPU is supported;
        # MOONCAKE_TEST_GPUS=1 puts them all on GPU 0).
        from mooncake._gpu_placement import gpu_of_rank

        torch.cuda.set_device(gpu_of_rank(rank))
    if pg_options_factory is not None:
        kwargs["pg_options"] = pg_options_factory(rank, size)
    dist.init_process_group(
        backend=backend,
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=init_timeout_s),
        **kwargs,
    )
    ctx = RankContext(rank=rank, size=size, pg=pg)
    if gloo:
        ctx.gloo = dist.new_group(backend="gloo")
    return ctx


def _reply(results, rank, call_id, fn):
    try:
        value = fn()
        pickle.dumps(value)  # fail here, not silently in the queue's feeder thread
        results.put((call_id, rank, "ok", value))
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        results.put((call_id, rank, "err", (type(e).__name__, str(e), traceback.format_exc())))


def _worker_main(rank, size, port, commands, results, options):
    os.environ.update(options.get("env") or {})
    # A child whose parent vanished must not linger: every wait below is bounded.
    idle = options.get("idle_timeout", 300.0)
    ctx_box = {}

    def init():
        pre = options.get("before_init")
        if pre is not None:
            pre(rank, size)
        ctx_box["ctx"] = _init_group(
            rank,
            size,
            port,
            options.get("init_timeout_s", 30),
            options.get("pg_options"),
            options.get("gloo", True),
            options.get("backend", "mooncake-cpu"),
        )
        return os.getpid()

    _reply(results, rank, "init", init)
    if "ctx" not in ctx_box:
        return
    ctx = ctx_box["ctx"]
    while True:
        try:
            msg = commands.get(timeout=idle)
        except queue_mod.Empty:
            break
        if msg is None:
            break
        call_id, fn, args, kwargs = msg
        _reply(results, rank, call_id, lambda: fn(ctx, *args, **kwargs))
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    # Every answer is in the queue: leave without the interpreter's slow teardown.
    results.close()
    results.join_thread()
    os._exit(0)


# ---------------------------------------------------------------------------
# Parent side


class World:
    """W ranks of a ``mooncake-cpu`` group (or ``backend``: ``"mooncake"``
    binds rank r to GPU r mod the GPU count), plus a gloo group over them."""

    def __init__(
        self,
        size,
        *,
        start_timeout=60.0,
        init_timeout_s=30,
        env=None,
        pg_options=None,
        gloo=True,
        before_init=None,
        backend="mooncake-cpu",
    ):
        self.size = size
        self.port = free_port()
        self._results = CTX.Queue()
        self._commands = [CTX.Queue() for _ in range(size)]
        self._calls = 0
        self.dead = False
        options = {
            "env": env,
            "init_timeout_s": init_timeout_s,
            "pg_options": pg_options,
            "gloo": gloo,
            "before_init": before_init,
            "backend": backend,
        }
        self.procs = [
            CTX.Process(
                target=_worker_main,
                args=(r, size, self.port, self._commands[r], self._results, options),
                daemon=True,
                name=f"pg-rank{r}",
            )
            for r in range(size)
        ]
        for p in self.procs:
            p.start()
        self.pids = self._collect("init", start_timeout, allow_dead=())

    # Collects one reply per rank for `call_id`; ranks in `allow_dead` may
    # exit instead (their entry is None). Raises WorldError on timeout.
    def _collect(self, call_id, timeout, allow_dead):
        deadline = time.monotonic() + timeout
        got = {}
        while len(got) < self.size:
            try:
                cid, rank, status, value = self._results.get(timeout=0.05)
            except queue_mod.Empty:
                for r, p in enumerate(self.procs):
                    if r not in got and not p.is_alive():
                        # Give a reply it queued just before exiting a moment to arrive.
                        with contextlib.suppress(queue_mod.Empty):
                            while True:
                                cid, rank, status, value = self._results.get(timeout=0.2)
                                if cid == call_id:
                                    got[rank] = (status, value)
                        if r not in got:
                            got[r] = ("dead", p.exitcode)
                if time.monotonic() > deadline:
                    missing = [r for r in range(self.size) if r not in got]
                    self.kill()
                    raise WorldError(
                        f"call {call_id!r}: ranks {missing} did not answer within {timeout} s; "
                        f"answers so far: {self._describe(got)}"
                    )
                continue
            if cid != call_id:
                continue  # a late answer to an earlier call
            got[rank] = (status, value)
        out = []
        errors = []
        for r in range(self.size):
            status, value = got[r]
            if status == "ok":
                out.append(value)
            elif status == "dead" and r in allow_dead:
                out.append(None)
            elif status == "dead":
                self.dead = True
                errors.append(f"rank {r} exited (exit code {value})")
            else:
                type_name, message, tb = value
                errors.append(str(RankError(r, type_name, message, tb)))
        if errors:
            if call_id == "init":
                self.kill()
            raise WorldError(f"call {call_id!r} failed:\n" + "\n".join(errors))
        return out

    @staticmethod
    def _describe(got):
        parts = []
        for r, (status, value) in sorted(got.items()):
            if status == "err":
                parts.append(f"rank {r}: {value[0]}: {value[1]}\n{value[2]}")
            else:
                parts.append(f"rank {r}: {status} {value!r}"[:500])
        return "\n".join(parts) or "none"

    def run(self, fn, *args, timeout=60.0, allow_dead=(), **kwargs):
        """Runs fn(ctx, *args, **kwargs) on every rank; returns the list of
        return values by rank. Any rank raising fails the call."""
        if self.dead:
            raise WorldError("this world was killed by an earlier failure")
        self._calls += 1
        call_id = self._calls
        for q in self._commands:
            q.put((call_id, fn, args, kwargs))
        try:
            return self._collect(call_id, timeout, allow_dead)
        except WorldError:
            if any(not p.is_alive() for p in self.procs):
                self.dead = True
            raise

    def close(self, timeout=15.0):
        for q in self._commands:
            with contextlib.suppress(Exception):
                q.put(None)
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self):
        self.dead = True
        for p in self.procs:
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
                p.kill()
        for p in self.procs:
            p.join(5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.close()
        else:
            self.kill()


def run_world(fn, size, *args, timeout=60.0, allow_dead=(), **world_kwargs):
    """Starts a world of `size` ranks, runs fn(ctx, *args) once, and ends it."""
    with World(size, **world_kwargs) as world:
        return world.run(fn, *args, timeout=timeout, allow_dead=allow_dead)


def outcome(fn):
    """(kind, value or message, seconds) of calling fn(): kind is "ok" or the exception's type name."""
    start = time.monotonic()
    try:
        value = fn()
        return ("ok", value, time.monotonic() - start)
    except Exception as e:  # noqa: BLE001 - returned for the test to inspect
        return (type(e).__name__, str(e), time.monotonic() - start)


def assert_errors(per_rank, want):
    """``per_rank``: every rank's errors_of() result; ``want``: {name: (exception
    type name, text the message must contain)}. Fails naming the rank and call."""
    for rank, errors in enumerate(per_rank):
        for name, (kind, text) in want.items():
            got_kind, got_message = errors[name]
            assert got_kind == kind and text in got_message, f"rank {rank}, {name}: {got_kind}: {got_message}"


def errors_of(calls):
    """{name: (exception type name, message)} for each zero-argument call; ("no exception", "") if none."""
    out = {}
    for name, call in calls.items():
        kind, message, _ = outcome(call)
        out[name] = ("no exception", "") if kind == "ok" else (kind, message)
    return out
