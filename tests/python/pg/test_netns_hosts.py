"""Groups whose ranks run on real separate hosts: one network namespace per
host, each with its own address, joined through a bridge by veth pairs
(mooncake/_virtual_hosts.py). Nothing is shared but the kernel: the ranks
reach each other only over the network, by the addresses the backend picks
itself (no set_host_ip: the address on the route to MASTER_ADDR).

* every collective and P2P, checked against Gloo over the same ranks, at
  world 2 (1 + 1 ranks), 4 (2 + 2) and 6 on uneven hosts (1 + 2 + 3, so the
  leaders' ring runs too);
* the failure twins across hosts: a rank on the last host is killed, or
  stalled (SIGSTOP: alive, connections open, silent), or has its traffic cut;
  the others' next collective completes over the survivors within seconds and
  names it.

Skipped with the reason where network namespaces cannot be made (not root,
no iproute2).
"""

import pathlib
import re
import subprocess
import sys

import pytest

from _harness import free_port
from _multi_host_checks import assert_cut_leader_given_up, assert_last_rank_given_up, finish, rank_env
from mooncake._virtual_hosts import VirtualHosts, unavailable

JOB = str(pathlib.Path(__file__).with_name("_multi_host_job.py"))
_WHY = unavailable()

pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"no network namespaces here: {_WHY}")


def _run(ranks_per_host, mode, timeout, stalled=(), **extra_env):
    """Runs the job with ranks_per_host[h] ranks on host h; returns the
    ranks' output. The ranks in `stalled` stop themselves: they are killed
    once the others have ended. `extra_env` goes to every rank."""
    world = sum(ranks_per_host)
    port = free_port()
    with VirtualHosts(len(ranks_per_host)) as hosts:
        procs, rank = [], 0
        for h, count in enumerate(ranks_per_host):
            for local in range(count):
                env = rank_env(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local),
                           MASTER_ADDR=hosts.address(0), MASTER_PORT=str(port), TORCH_CPP_LOG_LEVEL="INFO",
                               **extra_env)
                procs.append(subprocess.Popen(hosts.command(h, [sys.executable, JOB, mode]), env=env,
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
                rank += 1
        outputs = finish(procs, timeout, stalled)
    return procs, "\n".join(outputs)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("ranks_per_host", [(1, 1), (2, 2), (1, 2), (1, 2, 3)], ids=["2x1", "2x2", "1+2", "1+2+3"])
def test_every_collective_and_p2p_matches_gloo_across_hosts(ranks_per_host):
    procs, text = _run(ranks_per_host, "check", timeout=360)
    world = sum(ranks_per_host)
    assert all(p.returncode == 0 for p in procs), text[-6000:]
    found = sorted(re.findall(r"^RANK (\d+) OK HOSTS (\d+)$", text, flags=re.M), key=lambda x: int(x[0]))
    assert found == [(str(r), str(len(ranks_per_host))) for r in range(world)], text[-6000:]
    # The backend saw the hosts and said so.
    assert f"span {len(ranks_per_host)} hosts" in text, text[-6000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["fail", "stall"])
def test_rank_killed_or_stalled_on_another_host_the_others_complete_without_it(mode):
    # Rank 3 (second host) exits, or stops itself, after the first collective:
    # given up at the heartbeat deadline whether it is gone or silent.
    _, text = _run((2, 2), mode, timeout=60, stalled=(3,) if mode == "stall" else ())
    assert_last_rank_given_up(text, within_s=5.0)


@pytest.mark.timeout(90)
def test_leader_cut_off_on_another_host_is_given_up():
    assert_cut_leader_given_up(_run((2, 2), "cut", timeout=60)[1], within_s=5.0)


# The same across hosts over rdma: the software verbs provider (no machine
# here has an RDMA NIC) gives each host's engine a device, so the automatic
# choice sends cross-host traffic over rdma, same-host traffic over shm.
_RDMA = dict(MC_RDMA_PROVIDER="software", MC_LOG_LEVEL="INFO")


@pytest.mark.timeout(400)
def test_every_collective_and_p2p_matches_gloo_across_hosts_over_rdma():
    procs, text = _run((2, 2), "check", timeout=360, **_RDMA)
    assert all(p.returncode == 0 for p in procs), text[-6000:]
    found = re.findall(r"^RANK (\d+) OK HOSTS 2$", text, flags=re.M)
    assert sorted(found, key=int) == ["0", "1", "2", "3"], text[-6000:]
    # Queue pairs were made between the hosts (each host's ranks reach the
    # other's over them).
    assert re.search(r"rdma: connected soft0 .* to 10\.", text), text[-6000:]


@pytest.mark.timeout(120)
def test_rank_killed_on_another_host_over_rdma_the_others_complete_without_it():
    _, text = _run((2, 2), "fail", timeout=60, **_RDMA)
    assert_last_rank_given_up(text, within_s=5.0)
