"""Groups whose ranks run on different hosts. Each "host" is a separate user
+ pid namespace (``unshare -Urp``): the transfer engine tells hosts apart by
boot id and pid namespace, so ranks in different namespaces cannot use each
other's shared memory and must go through the network (tcp over loopback),
exactly as on two machines. Ranks of one namespace share a host arena.

* torchrun with --nnodes=2, one launch per host, as users start multi-node
  jobs: every collective checked against Gloo over the same ranks.
* the failure twin: a rank on the second host dies; the others' collective
  completes over the survivors within the deadline and names it.
* the second host's leader has its traffic cut: the first host's leader,
  waiting for it on the network, stops when the view deactivates it (about
  the heartbeat deadline), not at the 20 s collective timeout.
"""

import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from _harness import free_port
from _multi_host_checks import assert_cut_leader_given_up, assert_last_rank_given_up, finish, rank_env

JOB = str(pathlib.Path(__file__).with_name("_multi_host_job.py"))


def _namespaces_available():
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-Urp", "--fork", "true"], capture_output=True)
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(
    not _namespaces_available(),
    reason="user+pid namespaces (unshare -Urp) are unavailable here; they stand in for separate hosts",
)


def _host(cmd):
    """A command run as its own host: new user and pid namespace; the kernel
    kills everything in it when its first process (the launcher) ends."""
    return ["unshare", "-Urp", "--fork", "--kill-child", *cmd]


@pytest.mark.timeout(240)
def test_torchrun_two_hosts_every_collective_matches_gloo():
    port = free_port()
    procs = [
        subprocess.Popen(
            _host([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
                   "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={port}", JOB]),
            env=rank_env(TORCH_CPP_LOG_LEVEL="INFO"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in range(2)
    ]
    outputs = finish(procs, timeout=200)
    text = "\n".join(outputs)
    assert all(p.returncode == 0 for p in procs), text[-6000:]
    assert sorted(re.findall(r"^RANK (\d) OK HOSTS (\d)$", text, flags=re.M)) == [
        ("0", "2"), ("1", "2"), ("2", "2"), ("3", "2")], text[-6000:]
    # The backend saw two hosts and said so in its log.
    assert "span 2 hosts" in text, text[-6000:]


def _launch_rank(rank, world, port, *args):
    env = rank_env(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    return [sys.executable, JOB, *args], env


@pytest.mark.timeout(120)
def _two_hosts(mode, timeout):
    """Hosts {0, 1} and {2, 3}, each rank its own launch, two per namespace via
    a tiny shell launcher; returns their output."""
    port = free_port()
    world = 4
    procs = []
    for ranks in ((0, 1), (2, 3)):
        script = " & ".join(
            f"RANK={r} WORLD_SIZE={world} LOCAL_RANK={i} MASTER_ADDR=127.0.0.1 MASTER_PORT={port} "
            f"{sys.executable} {JOB} {mode}" for i, r in enumerate(ranks)) + " & wait"
        procs.append(subprocess.Popen(_host(["sh", "-c", script]), env=rank_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return "\n".join(finish(procs, timeout=timeout))


@pytest.mark.timeout(120)
def test_rank_dying_on_another_host_the_others_complete_without_it():
    # Rank 3 dies after the first collective.
    assert_last_rank_given_up(_two_hosts("fail", timeout=90), within_s=4.0)


@pytest.mark.timeout(90)
def test_leader_cut_off_on_another_host_is_given_up_at_the_heartbeat_deadline():
    # Rank 2, the second host's leader, has its traffic cut and keeps calling
    # collectives. Rank 0 waits for it on the network; rank 3 in their arena.
    assert_cut_leader_given_up(_two_hosts("cut", timeout=60), within_s=4.0)
