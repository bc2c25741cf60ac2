"""ElasticBuffer's ``"nccl"`` transport: the IPC path's rows (``ipc_rows``:
``IpcRowsPath`` over ``KernelRows``) through the same EP kernels, with the
peers' memory taken from one NCCL symmetric window instead of CUDA IPC.

``NcclRowsGroup`` stands where ``IpcPath`` stands for the IPC path: it
hands ``KernelRows`` the native group (``group_for``), here an
``EpNcclGroup`` of ``mooncake._ep_nccl`` opened over one NCCL communicator
whose unique id rank 0 made and the process group carried
(``nccl_bootstrap``). Opening is collective and bounded (the NCCL steps are
polled against ``setup_timeout``), and it fails on every rank alike, also
when some rank is outside NCCL's LSA team.
"""

from __future__ import annotations

from datetime import timedelta

import torch


class NcclRowsGroup:
    """The native NCCL group of one ElasticBuffer connection."""

    def __init__(self, nccl, unique_id: bytes, rank: int, num_ranks: int, setup_timeout: timedelta):
        self._nccl = nccl
        self._unique_id = unique_id
        self.rank, self.num_ranks = rank, num_ranks
        self._setup_ms = int(setup_timeout.total_seconds() * 1000)
        self._group = None

    def group_for(self, device: torch.device, tokens: int, width: int, experts: int, timeout_us: int = -1):
        """The native group for these sizes (``KernelRows`` asks once, at
        construction; collective). ``timeout_us`` bounds the calls' waits,
        not this one: setup is bounded by ``setup_timeout``."""
        del timeout_us
        if self._group is None:
            self._group = self._nccl.EpNcclGroup(self._unique_id, self.rank, self.num_ranks, tokens, width, experts,
                                                 device.index, self._setup_ms)
        return self._group

    def close(self, abandon: bool = False) -> None:
        """Collective (bounded); ``abandon`` after a failure: abort instead of meeting the peers."""
        if self._group is not None:
            group, self._group = self._group, None
            group.close(abandon)
