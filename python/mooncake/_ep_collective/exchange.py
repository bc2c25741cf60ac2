"""Moving rows among the ranks that take part in a call.

Only operations of the given group are used, so the same code serves CPU
tensors on a ``mooncake-cpu`` group and CUDA tensors on a ``mooncake`` group:

- everyone takes part: one ``all_to_all_single`` with uneven splits;
- some rank is left out: point-to-point among the others (a collective would
  wait for the missing rank), all messages of a call posted as one batch.

Both sides of every pair know the sizes before rows move (from the count
exchange of dispatch, or from the dispatch handle in combine), so no
message is ever left unmatched.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

# Tag of the EP path's point-to-point messages, apart from the user's own.
EP_P2P_TAG = 0x4550


class Exchange:
    """``check(work)``, called after each finished Work, may raise for one
    that completed without every message (the default accepts all)."""

    def __init__(self, group, rank: int, num_ranks: int, check=None):
        self._group = group
        self._rank = rank
        self._num_ranks = num_ranks
        self._check = check or (lambda work: None)

    def _everyone(self, participants: list[int]) -> bool:
        # After the group has dropped a member its size shrinks: a collective
        # over the Buffer's original ranks is then impossible.
        return len(participants) == self._num_ranks and self._group.size() == self._num_ranks

    def rows(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int],
             participants: list[int], timeout: timedelta | None = None) -> torch.Tensor:
        """``send`` holds rows for each destination in rank order (``send_counts[d]``
        rows for rank d); returns the rows received, in source rank order.
        Counts of ranks outside ``participants`` must be 0. ``timeout`` bounds
        the wait for the messages (a Work error after it)."""
        recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
        if self._everyone(participants):
            work = dist.all_to_all_single(recv, send, output_split_sizes=recv_counts,
                                          input_split_sizes=send_counts, group=self._group, async_op=True)
            wait(work, timeout)
            self._check(work)
            return recv
        send_parts = torch.split(send, send_counts)
        recv_parts = torch.split(recv, recv_counts)
        ops = []
        for peer in participants:
            if peer == self._rank:
                recv_parts[peer].copy_(send_parts[peer])
                continue
            if send_counts[peer]:
                ops.append(dist.P2POp(dist.isend, send_parts[peer], group=self._group,
                                      group_peer=peer, tag=EP_P2P_TAG))
            if recv_counts[peer]:
                ops.append(dist.P2POp(dist.irecv, recv_parts[peer], group=self._group,
                                      group_peer=peer, tag=EP_P2P_TAG))
        if ops:
            errors = []
            for work in dist.batch_isend_irecv(ops):
                try:
                    wait(work, timeout)
                    self._check(work)
                except Exception as err:  # noqa: BLE001 - every message is waited for first
                    errors.append(err)
            if errors:
                raise errors[0]
        return recv

    def same_size_blocks(self, send: torch.Tensor, participants: list[int]) -> torch.Tensor:
        """Each participant sends block ``send[d]`` to rank d and receives block s
        from rank s: ``send`` is [num_ranks, ...]; blocks of other ranks come back as zeros."""
        per_rank = [1 if r in participants else 0 for r in range(self._num_ranks)]
        packed = send[[r for r in range(self._num_ranks) if per_rank[r]]]
        got = self.rows(packed, per_rank, per_rank, participants)
        out = torch.zeros_like(send)
        out[[r for r in range(self._num_ranks) if per_rank[r]]] = got
        return out


def wait(work, timeout: timedelta | None) -> None:
    """Waits for a Work, no longer than ``timeout`` when one is given."""
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)
