"""Which transport an ElasticBuffer runs on.

Each rank requests one (the ``transport`` argument; ``"auto"`` is replaced
by ``MOONCAKE_EP_TRANSPORT`` when that is set) and says whether it is ready
for ``"nccl"`` (``ready_for_nccl``). The group agrees in one all-gather, the
same rule on every rank:

- differing requests: an error on every rank, naming who asked for what;
- ``"nccl"`` requested and some rank not ready: an error naming those ranks;
- ``"auto"``: ``"nccl"`` if every rank is ready, else ``"ibgda"``.

``"ibgda"`` is the device-initiated family: CUDA IPC kernels inside a host
and RDMA across hosts where those exist, the collective path (the process
group's own operations, any device) where they do not. ``"nccl"`` runs the
same kernels over an NCCL symmetric window (``nccl_path``).
"""

from __future__ import annotations

import os

TRANSPORTS = ("auto", "ibgda", "nccl")
ENV = "MOONCAKE_EP_TRANSPORT"


def requested(transport) -> str:
    """The request of this rank (case and surrounding blanks do not matter)."""
    if isinstance(transport, str):
        transport = transport.strip().lower()
    if not isinstance(transport, str) or transport not in TRANSPORTS:
        raise ValueError(f"transport: must be one of {', '.join(map(repr, TRANSPORTS))}, got {transport!r}")
    if transport == "auto":
        override = os.environ.get(ENV, "").strip().lower()
        if override:
            if override not in TRANSPORTS:
                raise ValueError(f"{ENV}: must be one of {', '.join(map(repr, TRANSPORTS))}, got {override!r}")
            transport = override
    return transport


def code_of(transport: str) -> int:
    return TRANSPORTS.index(transport)


def ready_for_nccl(problem: str, sized: bool, cuda_group: bool) -> str:
    """"" when this rank can take the ``"nccl"`` transport, else why not:
    ``problem`` is the build's and runtime's (``nccl_support.problem()``);
    the window is sized by the constructor's ``num_max_tokens_per_rank``,
    ``hidden`` and ``num_topk`` (``sized``), and the rows are CUDA tensors
    (``cuda_group``: a group for CUDA tensors, and a CUDA device)."""
    if problem:
        return problem
    if not cuda_group:
        return "the NCCL transport moves CUDA tensors: it needs a process group for CUDA tensors and a CUDA device"
    if not sized:
        return ("the NCCL transport's window is sized at construction: give num_max_tokens_per_rank, hidden and "
                "num_topk")
    return ""


def agree(requests: list[str], nccl_ready: list[bool], my_reason: str = "") -> str:
    """The group's transport from every rank's request and readiness
    (``my_reason``: why this rank is not ready, for the error)."""
    if len(set(requests)) > 1:
        by_request: dict[str, list[int]] = {}
        for rank, request in enumerate(requests):
            by_request.setdefault(request, []).append(rank)
        asked = "; ".join(f"{request!r} by ranks {ranks}" for request, ranks in by_request.items())
        raise RuntimeError(f"ElasticBuffer: the ranks ask for different transports ({asked}); every rank must "
                           f"pass the same transport (or the same {ENV})")
    request = requests[0]
    unready = [rank for rank, ready in enumerate(nccl_ready) if not ready]
    if request == "nccl" and unready:
        here = f"; this rank: {my_reason}" if my_reason else ""
        raise RuntimeError(f"ElasticBuffer: transport='nccl' but ranks {unready} are not ready for it (each says why "
                           f"in its own error){here}; use transport='ibgda' or 'auto'")
    if request == "auto":
        return "ibgda" if unready else "nccl"
    return request
