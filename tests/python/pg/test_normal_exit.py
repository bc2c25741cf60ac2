"""A normal end of job is quiet (issue 19 §1): when global rank 0, whose
process hosts the coordinator and the job's TCPStore, finishes and exits
first, the others neither warn nor print stack traces; they take over the
coordinator quietly and carry on. Its twin: a killed rank 0 is still a
failure, failed over with warnings as before."""

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from _harness import free_port

REPO_PYTHON = str(pathlib.Path(__file__).resolve().parents[3] / "python")

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time

    import torch
    import torch.distributed as dist

    from mooncake import pg  # registers "mooncake-cpu"

    dist.init_process_group("mooncake-cpu")
    rank, how = dist.get_rank(), sys.argv[1]
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    dist.barrier()
    if rank == 0:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        dist.destroy_process_group()
        sys.exit(0)  # the usual end: rank 0 is done first
    time.sleep(1.5)  # rank 0 is gone by now; the others go on a little
    if rank == 2 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE"):
        # Who the store names once rank 0 has gone (rank 1 is still here: it
        # waits for the exchange below).
        import datetime
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=30))
        deadline = time.monotonic() + 20
        while store.get("mooncake_pg/coordinator_rank") == b"0" and time.monotonic() < deadline:
            time.sleep(0.05)
        named = store.get("mooncake_pg/coordinator").decode()
        os.write(1, f"STORE NAMES {store.get('mooncake_pg/coordinator_rank').decode()} AT {named}\\n".encode())
    got = torch.zeros(3)
    peer = 3 - rank  # 1 <-> 2
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((3,), float(rank)), peer),
                                     dist.P2POp(dist.irecv, got, peer)]):
        w.wait()
    os.write(1, f"RANK {rank} SUM {t[0].item()} GOT {got[0].item()}\\n".encode())
    dist.destroy_process_group()
    """
)

# What may not appear on a normal exit: our warnings, c10's, stack traces.
ALARMS = re.compile(r"^\[mooncake [WE] |^\[W|^\[E|frame #|Traceback|failing over|takes over", re.M)


def _run_job(tmp_path, how, port=None, env_extra=None):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    port = port or free_port()
    procs = []
    for rank in range(3):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=os.pathsep.join(p for p in (REPO_PYTHON, os.environ.get("PYTHONPATH", "")) if p),
                   **(env_extra or {}))
        procs.append(subprocess.Popen([sys.executable, str(script), how], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return [p.communicate(timeout=60) + (p.returncode,) for p in procs]


@pytest.mark.timeout(90)
def test_rank_0_ending_first_is_a_quiet_leave(tmp_path):
    outs = _run_job(tmp_path, "exit")
    for rank, (out, err, code) in enumerate(outs):
        assert code == 0, (rank, code, err[-3000:])
        alarms = ALARMS.findall(err)
        assert not alarms, f"rank {rank} raised the alarm on a normal exit:\n{err[-3000:]}"
    assert "RANK 1 SUM 6.0 GOT 2.0" in outs[1][0], outs[1]
    assert "RANK 2 SUM 6.0 GOT 1.0" in outs[2][0], outs[2]


@pytest.mark.timeout(90)
def test_rank_0_leaving_names_its_successor_in_a_store_that_outlives_it(tmp_path):
    # The store in a process of its own (torchrun's agent store): a later
    # process (a replacement of rank 0, a joiner) must find the coordinator
    # that took over. The failover order is by global rank, so it is rank 1's.
    import datetime

    import torch.distributed as dist

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    outs = _run_job(tmp_path, "exit", port=port,
                    env_extra={"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"})
    for rank, (out, err, code) in enumerate(outs):
        assert code == 0, (rank, code, err[-3000:])
        assert not ALARMS.findall(err), f"rank {rank} raised the alarm on a normal exit:\n{err[-3000:]}"
    assert "RANK 1 SUM 6.0 GOT 2.0" in outs[1][0], outs[1]
    named = re.search(r"STORE NAMES (\d+) AT (\S+):(\d+)", outs[2][0])
    assert named and named.group(1) == "1", outs[2]
    del store


@pytest.mark.timeout(90)
def test_killed_rank_0_is_still_a_failure_failed_over_as_before(tmp_path):
    outs = _run_job(tmp_path, "kill")
    assert outs[0][2] < 0, outs[0]
    for rank in (1, 2):
        out, err, code = outs[rank]
        assert code == 0, (rank, code, err[-3000:])
        assert f"RANK {rank} SUM 6.0 GOT {float(3 - rank)}" in out, (out, err[-3000:])
        assert "failing over" in err, f"rank {rank} took a killed rank 0 for a normal exit:\n{err[-3000:]}"
