"""The backend launched the way users launch it: torchrun (python -m
torch.distributed.run) with env:// rendezvous, the package found through
PYTHONPATH."""

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
    import os

    import torch
    import torch.distributed as dist

    from mooncake import pg  # registers "mooncake-cpu"

    dist.init_process_group("mooncake-cpu")  # env:// from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()

    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    avg = torch.full((2,), float(rank + 1))
    dist.all_reduce(avg, op=dist.ReduceOp.AVG)
    gathered = torch.empty(world, dtype=torch.int64)
    dist.all_gather_into_tensor(gathered, torch.tensor([rank * 10]))
    got = torch.empty(3)
    for w in dist.batch_isend_irecv([
        dist.P2POp(dist.isend, torch.full((3,), float(rank)), (rank + 1) % world),
        dist.P2POp(dist.irecv, got, (rank - 1) % world),
    ]):
        w.wait()
    # The mask is read before the barrier: after it a peer may exit at once,
    # and a peer that exits is (rightly) seen inactive.
    active = pg.get_active_ranks(dist.group.WORLD).tolist()
    dist.barrier()
    line = (f"RANK {rank} OF {world} BACKEND {dist.get_backend()} SUM {t.tolist()} AVG {avg.tolist()} "
            f"GATHER {gathered.tolist()} RING {got.tolist()} ACTIVE {active}")
    os.write(1, (line + "\\n").encode())  # one write: the ranks share the pipe
    dist.destroy_process_group()
    """
)


@pytest.mark.timeout(90)
def test_torchrun_two_processes(tmp_path):
    script = tmp_path / "pg_job.py"
    script.write_text(SCRIPT)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_PYTHON, env.get("PYTHONPATH", "")) if p)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
        str(script),
    ]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"torchrun exited with {proc.returncode}:\n{output[-4000:]}"
    lines = sorted(re.findall(r"^RANK \d .*$", proc.stdout, flags=re.M))
    assert lines == [
        "RANK 0 OF 2 BACKEND mooncake-cpu SUM [3.0, 3.0, 3.0, 3.0] AVG [1.5, 1.5] GATHER [0, 10] "
        "RING [1.0, 1.0, 1.0] ACTIVE [1, 1]",
        "RANK 1 OF 2 BACKEND mooncake-cpu SUM [3.0, 3.0, 3.0, 3.0] AVG [1.5, 1.5] GATHER [0, 10] "
        "RING [0.0, 0.0, 0.0] ACTIVE [1, 1]",
    ], output[-4000:]


@pytest.mark.timeout(90)
def test_the_readme_quick_start_runs_under_torchrun(tmp_path):
    # README, "First steps": torchrun --nproc-per-node 2 examples/pg_quickstart.py
    example = pathlib.Path(__file__).resolve().parents[3] / "examples" / "pg_quickstart.py"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_PYTHON, env.get("PYTHONPATH", "")) if p)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(example)]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"torchrun exited with {proc.returncode}:\n{output[-4000:]}"
    assert sorted(re.findall(r"^rank \d .*$", proc.stdout, flags=re.M)) == [
        "rank 0 of 2 on mooncake-cpu: sum 3.0, ring from 1, active ranks [1, 1]",
        "rank 1 of 2 on mooncake-cpu: sum 3.0, ring from 0, active ranks [1, 1]",
    ], output[-4000:]
