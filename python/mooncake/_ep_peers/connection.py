"""The connection object the collective path's dispatch and combine run on
(``_ep_collective.path.CollectivePath``), made of an elastic-mode Buffer's
pairwise links instead of a process group: the ranks that take part in a
call are the active ones of the Buffer's own mask, and rows move in steps
of ``PeerLinks``. A rank whose step fails is masked there; the call goes on
without it, and its rows (zeros) are dropped by the final mask, as the
collective path drops a rank the process group lost."""

from __future__ import annotations

import torch

from mooncake._ep_collective.exchange import Exchange

from .links import PeerLinks


class PeerExchange(Exchange):
    """``Exchange.rows`` over the links; ``same_size_blocks`` is Exchange's own."""

    def __init__(self, conn: "PeerConnection", rank: int, num_ranks: int):
        super().__init__(None, rank, num_ranks)
        self._conn = conn

    def rows(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int], participants: list[int],
             timeout=None) -> torch.Tensor:
        del timeout  # the call's timeout, from begin_call
        conn = self._conn
        row_shape = tuple(send.shape[1:])
        recv = send.new_zeros((sum(recv_counts), *row_shape))
        send_parts = torch.split(send, send_counts)
        recv_parts = torch.split(recv, recv_counts)
        live = [q for q in participants if conn.mask[q]]
        blocks = {q: send_parts[q].contiguous().view(torch.uint8).reshape(-1) for q in live}
        expected = {q: recv_parts[q].numel() * recv.element_size() for q in live}
        got = conn.links.step(blocks, conn.mask, conn.timeout_s, conn.what, expected)
        for q, data in got.items():
            if data.numel():
                recv_parts[q].copy_(data.view(send.dtype).view(recv_parts[q].shape))
        return recv


class PeerConnection:
    """The calls of an elastic-mode Buffer (``calls`` numbers them; a handle
    records the connection it came from, so another Buffer's is refused)."""

    def __init__(self, buffer, links: PeerLinks, rank: int, capacity: int):
        self.buffer = buffer
        self.links = links
        self.rank = rank
        self.calls = 0
        self.exchange = PeerExchange(self, rank, capacity)
        self.mask = torch.zeros(capacity, dtype=torch.int32)
        self.timeout_s: float | None = None
        self.what = ""

    def begin_call(self, mask: torch.Tensor, timeout_us: int) -> list[int]:
        """``mask``: this call's CPU int32 mask over the rank bound (updated
        in place when a rank is dropped). Returns the ranks taking part."""
        self.calls += 1
        self.mask = mask
        self.timeout_s = timeout_us / 1e6 if timeout_us > 0 else None
        return [r for r, bit in enumerate(mask.tolist()) if bit and (r == self.rank or self.links.connected(r))]

    def end_call(self, mask: torch.Tensor, participants: list[int]) -> list[bool]:
        del participants
        return [bool(b) for b in mask.tolist()]
