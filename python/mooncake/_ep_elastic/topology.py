"""The domains of an ElasticBuffer.

Physical: ``(num_rdma_ranks, num_nvlink_ranks)`` = (hosts, ranks per host).
Logical: ``(num_scaleout_ranks, num_scaleup_ranks)``: the physical domain
when hybrid mode is allowed and there is more than one host, else
``(1, num_ranks)`` (one flat domain). Rank r sits at scale-out index
``r // num_scaleup_ranks`` and scale-up index ``r % num_scaleup_ranks``.

Ranks per host: ``MOONCAKE_EP_NUM_LOCAL_RANKS``, else ``LOCAL_WORLD_SIZE``
(torchrun), else what the group itself shows: the ranks whose host identity
equals this rank's (the reference counts CUDA devices instead, which is
wrong for several ranks per GPU and for CPU groups). A host split that is
not contiguous and equal-sized has no (scale-out x scale-up) form: then the
domain is flat.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._env import positive_int


@dataclass(frozen=True)
class Topology:
    num_ranks: int
    num_rdma_ranks: int
    num_nvlink_ranks: int
    num_scaleout_ranks: int
    num_scaleup_ranks: int

    def scaleout_index(self, rank: int) -> int:
        return rank // self.num_scaleup_ranks

    def scaleup_index(self, rank: int) -> int:
        return rank % self.num_scaleup_ranks


def local_ranks_setting() -> int:
    """Ranks per host from the environment, 0 when it says nothing."""
    for name in ("MOONCAKE_EP_NUM_LOCAL_RANKS", "LOCAL_WORLD_SIZE"):
        value = positive_int(name, "ranks per host")
        if value is not None:
            return value
    return 0


def ranks_per_host(host_of_rank: list[int]) -> int:
    """Ranks per host when the group's hosts hold contiguous, equal runs of
    ranks; else the group size (one flat domain)."""
    num_ranks = len(host_of_rank)
    run = 1
    while run < num_ranks and host_of_rank[run] == host_of_rank[0]:
        run += 1
    if num_ranks % run:
        return num_ranks
    for start in range(0, num_ranks, run):
        block = host_of_rank[start:start + run]
        if any(h != block[0] for h in block):
            return num_ranks
        if start and block[0] in host_of_rank[:start]:
            return num_ranks
    return run


def topology(num_ranks: int, local_ranks: int, allow_hybrid_mode: bool) -> Topology:
    local = max(1, min(local_ranks, num_ranks))
    hosts = (num_ranks + local - 1) // local
    if allow_hybrid_mode and hosts > 1 and num_ranks % local == 0:
        scaleout, scaleup = hosts, local
    else:
        scaleout, scaleup = 1, num_ranks
    return Topology(num_ranks, hosts, local, scaleout, scaleup)
