"""Expert-parallel dispatch/combine: ``Buffer``, the DeepEP low-latency
programming model plus ``active_ranks`` and ``timeout_us``.

    from mooncake.mooncake_ep_buffer import Buffer
    buffer = Buffer(group, Buffer.get_ep_buffer_size_hint(T, H, group.size(), E))
    recv_x, recv_count, handle, event, hook = buffer.dispatch(x, topk_idx, active_ranks, T, E, timeout_us)
    ...  # expert e = rank * L + le computes on recv_x[le, :recv_count[le]]
    out, event, hook = buffer.combine(expert_out, topk_idx, topk_weights, active_ranks, timeout_us, handle)

Two paths, with the same layouts, row order and results (bit for bit in
BF16; identical FP8 bytes and scales):

- the *fast path* (``buffer.path == "ipc"``): GPU kernels that write straight
  into the peers' memory through CUDA IPC (``mooncake._ep_ipc``,
  docs/ep-kernels.md). Chosen at ``connect()`` when every rank of the group
  runs on one host with CUDA tensors over a ``mooncake`` group;
- the *collective path* (``_ep_collective.path.CollectivePath``): built only
  from the group's own operations (``all_to_all_single``, point-to-point) and
  tensor operations, so it works on CPU tensors over a ``mooncake-cpu`` group
  and on CUDA tensors over a ``mooncake`` group, at any world size and across
  hosts.

``Buffer`` itself is the argument checks, the choice of path, and the
fallback from the fast path to the collective one; both paths have the same
interface.

``buffer.path_reason`` says why a path was chosen (also logged by the
``mooncake.ep`` logger); ``disable_p2p=True``, ``MOONCAKE_EP_FAST_PATH=0``, or
setting ``buffer._use_fallback = True`` (the reference's switch) select the
collective path. Layouts, row order, the per-call agreement behind
``timeout_us``, and what differs from the reference are in docs/ep.md.
"""

from __future__ import annotations

import logging
import secrets
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

import mooncake.ep  # noqa: F401 - the loading rule: fails clearly when mooncake.pg is not built
from mooncake._ep_collective import checks
from mooncake._ep_collective.events import EventHandle, EventOverlap
from mooncake._ep_collective.exchange import Exchange
from mooncake._ep_collective.group import control_device, group_mask_reader, takes_cuda_tensors
from mooncake._ep_collective.handle import DispatchHandle, DispatchState
from mooncake._ep_collective.path import CollectivePath
from mooncake._ep_collective.presence import Presence, bits_of, mask_of, ranks_of
from mooncake._ep_collective.sizes import ep_buffer_size_hint, ep_elastic_buffer_size_hint
from mooncake._ep_ipc_path import IpcPath, PathChoice, choose_path, local_statement
from mooncake._ep_ipc_path.path import FastPathUnavailable, IpcDispatchState, close_at_exit

if TYPE_CHECKING:
    from mooncake._ep_peers.buffer import ElasticModeBuffer

__all__ = ["Buffer", "EventOverlap", "EventHandle"]

_STORE_PREFIX = "mooncake_ep"
_log = logging.getLogger("mooncake.ep")

class _Connection:
    """One connect(): the agreement namespace and call counter every rank shares."""

    def __init__(self, buffer: "Buffer", uid: int):
        self.buffer = buffer
        self.uid = uid
        self.calls = 0
        store = dist.PrefixStore(f"{_STORE_PREFIX}/{uid:x}", dist.distributed_c10d._get_default_store())
        self.store = store
        self.alive = buffer._read_alive
        self.presence = Presence(store, buffer.rank, buffer.group_size, self.alive)
        self.exchange = Exchange(buffer.group, buffer.rank, buffer.group_size)

    def begin_call(self, mask: torch.Tensor, timeout_us: int) -> list[int]:
        """Agrees on the ranks this rank exchanges with in this call; clears, in
        ``mask``, the entries of the ranks it will not hear from, and returns the
        participants ([] when the caller masked this rank itself: it takes no part)."""
        self.calls += 1
        call = self.calls
        me = self.buffer.rank
        local = mask.tolist()
        if not local[me]:
            return []
        decided = self.presence.agree(call, mask_of(r for r, bit in enumerate(local) if bit), timeout_us)
        self.presence.forget_old_calls(call)
        updated = [bit if decided >> r & 1 else 0 for r, bit in enumerate(local)]
        if updated != local:
            mask.copy_(torch.tensor(updated, dtype=torch.int32))
        return ranks_of(decided)

    def end_call(self, mask: torch.Tensor, participants: list[int]) -> list[bool]:
        """Masks participants the process group dropped during the exchange; returns the final mask."""
        alive = self.alive()
        local = mask.tolist()
        updated = [bit if alive >> r & 1 else 0 for r, bit in enumerate(local)]
        if updated != local:
            mask.copy_(torch.tensor(updated, dtype=torch.int32))
        return [bool(b) for b in updated]


class Buffer:
    """Dispatch/combine over ``group`` (a Mooncake process group, or any group
    whose backend has all_to_all_single and point-to-point)."""

    def __init__(self, group: dist.ProcessGroup | None, num_ep_buffer_bytes: int = 0, disable_p2p: bool = False):
        if group is None:  # the default group, as torch.distributed's calls take it
            group = dist.distributed_c10d._get_default_group()
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group: must be a torch.distributed ProcessGroup, got {type(group).__name__}")
        self.group = group
        self.rank = group.rank()
        self.group_size = group.size()
        # 0 means "sized on demand": the collective path allocates per call.
        self.num_ep_buffer_bytes = checks.check_buffer(num_ep_buffer_bytes)
        self.disable_p2p = bool(disable_p2p)  # True: the collective path, always
        self._read_alive = group_mask_reader(group, self.group_size)  # the group's active ranks, as bits
        self._collective = CollectivePath(self.group_size)
        self._connection: _Connection | None = None
        self._ipc: IpcPath | None = None
        self._choice = PathChoice(False, "not connected")
        self._forced_fallback = False
        self._destroyed = False
        self.connect()

    # ------------------------------------------------------------------ setup
    @staticmethod
    def get_ep_buffer_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                num_experts: int) -> int:
        return ep_buffer_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @staticmethod
    def get_low_latency_buffer_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                         num_experts: int) -> int:
        """The reference's fixed-capacity buffer size (``mooncake.ep.get_ep_elastic_buffer_size_hint``)."""
        if num_ranks <= 0 or num_experts % num_ranks:
            raise ValueError(f"num_experts: must divide evenly across num_ranks={num_ranks}, got {num_experts}")
        return ep_elastic_buffer_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                           num_experts // num_ranks)

    get_rdma_size_hint = get_low_latency_buffer_size_hint

    @classmethod
    def create_elastic(cls, disable_ll_nvlink: bool = False, explicitly_destroy: bool = False, rank: int = 0,
                       tcp_store_group: dist.Store | None = None, timeout_ms: int = 30000,
                       metadata_timeout_ms: int = 300000) -> ElasticModeBuffer:
        """A fixed-capacity Buffer that joins no process group (the reference's
        elastic mode): ``update_memory_buffers`` sizes it, ``connect_ranks``
        connects it to peers through ``tcp_store_group``, and its own mask
        (``update_mask_buffer``, ``query_mask_buffer``, ``clean_mask_buffer``)
        says which ranks it exchanges with. ``timeout_ms`` bounds each wait
        for a peer (one that misses it is masked; 0: no bound, a dead peer is
        still found); ``metadata_timeout_ms`` the wait for peers' metadata.
        See docs/ep.md, "Elastic mode"."""
        from mooncake._ep_peers.buffer import create  # noqa: PLC0415

        return create(cls, disable_ll_nvlink=disable_ll_nvlink, explicitly_destroy=explicitly_destroy, rank=rank,
                      tcp_store_group=tcp_store_group, timeout_ms=timeout_ms,
                      metadata_timeout_ms=metadata_timeout_ms)

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current CUDA stream (a no-op one without CUDA)."""
        if torch.cuda.is_available():
            return EventOverlap(EventHandle(torch.device("cuda", torch.cuda.current_device())))
        return EventOverlap(EventHandle(None))

    @property
    def runtime(self):
        """The object that runs this connection's calls: the fast path (``IpcPath``)
        or the collective path's connection. Its methods are this project's,
        not those of the reference's native runtime."""
        return self._ipc if self.path == "ipc" else self._connection

    def connect(self, is_update: bool = False) -> None:
        """Collective over the group: agrees on a fresh namespace for the call
        agreement and restarts call numbering, so nothing of an earlier
        connection (or of a process this one replaced) is ever read."""
        del is_update  # same steps either way
        self._close_fast_path()  # collective: the peers close theirs in their connect()
        control = control_device(self.group)
        # One collective agrees on the connection id (the largest draw) and on
        # the ranks every member sees active (the smallest of the bits), so
        # that the path choice starts from the same view on every rank.
        alive = self._read_alive()
        votes = torch.tensor([-secrets.randbits(62)] + bits_of(alive, self.group_size),
                             dtype=torch.int64, device=control)
        dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=self.group)
        votes = votes.tolist()
        conn = self._connection = _Connection(self, -votes[0])
        agreed_alive = mask_of(r for r, bit in enumerate(votes[1:]) if bit)
        self._choice = choose_path(conn.store, self.rank, self.group_size, cuda_group=takes_cuda_tensors(self.group),
                                   alive=agreed_alive, mine=local_statement(self.group_size, self.disable_p2p))
        if self._choice.fast:
            self._ipc = IpcPath(conn.store, self.rank, self.group_size, conn.uid, conn.alive)
            close_at_exit(self._ipc)
        if self.rank == 0:
            _log.info("EP Buffer over %d rank(s): %s path (%s)", self.group_size, self.path, self._choice.reason)

    # ------------------------------------------------------------ the path
    @property
    def path(self) -> str:
        """``"ipc"``: the CUDA IPC kernels; ``"collective"``: the process group's operations."""
        return "ipc" if self._ipc is not None and not self._forced_fallback else "collective"

    @property
    def path_reason(self) -> str:
        if self._forced_fallback:
            return "_use_fallback was set to True"
        return self._choice.reason

    @property
    def _use_fallback(self) -> bool:
        """The reference's flag: True when the collective path runs. Setting it
        to True forces the collective path (on every rank alike)."""
        return self.path != "ipc"

    @_use_fallback.setter
    def _use_fallback(self, value: bool) -> None:
        if not value and self._ipc is None:
            raise ValueError(f"_use_fallback: this connection has no fast path ({self._choice.reason})")
        self._forced_fallback = bool(value)

    def _fall_back(self, why: str) -> None:
        """The fast path failed to set up on some rank (every rank learns it at the same call)."""
        _log.warning("EP Buffer: the CUDA IPC fast path failed to set up (%s); using the collective path", why)
        self._ipc = None
        self._choice = PathChoice(False, f"the fast path failed to set up: {why}")

    def update_ep_member(self) -> None:
        """Call on every member after the group's membership changed (a rank
        replaced or rejoined); handles of earlier dispatches become invalid."""
        self._check_not_destroyed("update_ep_member")
        self.connect(True)

    def destroy(self) -> None:
        """Releases the Buffer (DeepEP's ``destroy``). Collective, like the
        constructor: every rank calls it, since closing the fast path is a
        handshake with the peers (bounded by its attach timeout). Without it
        the fast path closes when the garbage collector frees the Buffer, at a
        different moment on each rank, so the first rank there waits for the
        others. Calls after it raise; a second destroy() does nothing."""
        self._close_fast_path()
        self._connection = None  # also breaks its cycle back to this Buffer
        self._destroyed = True

    def _close_fast_path(self) -> None:
        """Collective with the peers (IpcPath.close); nothing without a fast path."""
        if self._ipc is not None:
            self._ipc.close()
            self._ipc = None

    def _check_not_destroyed(self, call: str) -> None:
        if self._destroyed:
            raise RuntimeError(f"Buffer.{call}: this Buffer was destroyed (destroy()); create a new one")

    # ------------------------------------------------------------ dispatch
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, active_ranks: torch.Tensor | None,
                 num_max_dispatch_tokens_per_rank: int, num_experts: int, timeout_us: int = -1,
                 use_fp8: bool | None = None, async_finish: bool = False, return_recv_hook: bool = False,
                 topk_weights: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor | tuple[torch.Tensor, torch.Tensor], torch.Tensor, DispatchHandle, EventOverlap,
                            Callable[[], None] | None]:
        """Sends every token to the ranks owning its top-k experts.

        Returns ``(recv_x, recv_count, handle, event, hook)``: ``recv_x`` is
        ``[L, R * T, hidden]`` bf16, or with ``use_fp8`` (default True, as in
        the reference) a tuple of e4m3 data and float32 scales ``[L, R * T,
        hidden / 128]``; rows of local expert ``le`` are ``recv_x[le,
        :recv_count[le]]``, ordered by source rank, then token.
        ``topk_weights`` is accepted as in the reference (which reads it on
        XPU only): checked, not used; combine takes the weights.
        """
        self._check_not_destroyed("dispatch")
        num_ranks = self.group_size
        checks.check_tokens(x)
        num_tokens, hidden = x.shape
        checks.check_dispatch_shape(num_tokens, num_max_dispatch_tokens_per_rank, num_experts, num_ranks)
        fast = self.path == "ipc"
        # The fast path never synchronises with the GPU: values go unchecked there.
        checks.check_topk_idx(topk_idx, num_tokens, num_experts, x.device, values=not fast)
        timeout_us = checks.check_timeout(timeout_us)
        checks.check_sync_mode(async_finish, return_recv_hook)
        checks.check_buffer_size(self.num_ep_buffer_bytes, num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                 num_experts)
        checks.check_dispatch_weights(topk_weights, topk_idx)
        use_fp8 = True if use_fp8 is None else bool(use_fp8)
        if fast:
            active_ranks = checks.check_active_ranks(active_ranks, num_ranks)
            try:
                return self._ipc.dispatch(self._connection, x, topk_idx, active_ranks,
                                          num_max_dispatch_tokens_per_rank, num_experts, timeout_us, use_fp8,
                                          async_finish, return_recv_hook)
            except FastPathUnavailable as err:
                self._fall_back(str(err))
                checks.check_topk_idx(topk_idx, num_tokens, num_experts, x.device)
        mask = self._mask(active_ranks)
        return self._collective.dispatch(self._connection, x, topk_idx, mask, num_max_dispatch_tokens_per_rank,
                                         num_experts, timeout_us, use_fp8, async_finish, return_recv_hook)

    # ------------------------------------------------------------- combine
    def combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                active_ranks: torch.Tensor | None, timeout_us: int, handle: DispatchHandle, zero_copy: bool = False,
                async_finish: bool = False, return_recv_hook: bool = False, out: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, EventOverlap, Callable[[], None] | None]:
        """Sends each expert output row back to its token's rank and reduces there:
        ``out[t] = sum over picks k of topk_weights[t, k] * y[t, k]`` in float32,
        rounded to bf16 once, over picks that are not -1 and whose expert's rank is
        active. Returns ``(combined_x, event, hook)``."""
        self._check_not_destroyed("combine")
        state = self._state_of(handle)
        _, _, tokens_per_rank, hidden, num_experts = handle
        num_ranks = self.group_size
        num_local = num_experts // num_ranks
        slots = num_ranks * tokens_per_rank
        fast = isinstance(state, IpcDispatchState)
        checks.check_combine_inputs(x, topk_idx, topk_weights, out, (num_local, slots, hidden), state,
                                    values=not fast)
        timeout_us = checks.check_timeout(timeout_us)
        checks.check_sync_mode(async_finish, return_recv_hook)
        checks.check_buffer_size(self.num_ep_buffer_bytes, tokens_per_rank, hidden, num_ranks, num_experts)
        source = x
        if zero_copy:
            if state.next_combine_buffer is None:
                raise ValueError("zero_copy: True needs the buffer of get_next_combine_buffer(handle), "
                                 "filled with the expert outputs, before combine")
            source = state.next_combine_buffer
        if fast:
            if self._ipc is None:
                raise ValueError("handle: comes from the fast path, which this connection has left (it failed to set "
                                 "up); dispatch again")
            return self._ipc.combine(state, handle, source, topk_idx, topk_weights,
                                     checks.check_active_ranks(active_ranks, num_ranks), timeout_us, async_finish,
                                     return_recv_hook, out)
        mask = self._mask(active_ranks)
        return self._collective.combine(self._connection, state, handle, source, topk_idx, topk_weights, mask,
                                        timeout_us, async_finish, return_recv_hook, out)

    def get_next_combine_buffer(self, handle) -> torch.Tensor:
        """A bf16 [L, R * T, hidden] tensor to write expert outputs into; then
        ``combine(..., handle, zero_copy=True)`` reads them from there."""
        state = self._state_of(handle)
        src_info, _, tokens_per_rank, hidden, num_experts = handle
        if state.next_combine_buffer is None:
            state.next_combine_buffer = torch.empty(num_experts // self.group_size,
                                                    self.group_size * tokens_per_rank, hidden,
                                                    dtype=torch.bfloat16, device=src_info.device)
        return state.next_combine_buffer

    # ------------------------------------------------------------- helpers
    def _state_of(self, handle) -> DispatchState | IpcDispatchState:
        if not isinstance(handle, DispatchHandle):
            raise TypeError("handle: must be the handle returned by this Buffer's dispatch, "
                            f"got {type(handle).__name__}")
        state = handle.state
        if state.connection is not self._connection:
            if state.connection.buffer is self:
                raise ValueError("handle: comes from a dispatch before update_ep_member(); dispatch again")
            raise ValueError("handle: belongs to a dispatch of another Buffer")
        return state

    def _mask(self, active_ranks):
        mask = checks.check_active_ranks(active_ranks, self.group_size)
        if mask is None:
            alive = self._connection.alive()
            mask = torch.tensor(bits_of(alive, self.group_size), dtype=torch.int32)
        return mask
