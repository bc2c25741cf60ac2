"""Dispatch and combine on the fast path: the kernels of ``mooncake._ep_ipc``
on the caller's current CUDA stream.

Nothing here synchronises with the GPU (no value checks, no reads of device
tensors), so a call costs its kernels plus a few microseconds of Python, and
a warmed-up call can be captured in a CUDA graph. The price: ``topk_idx``
values are not checked here (the kernels ignore entries outside
``[-1, num_experts)``); the collective path checks them.

The native group is opened at the first dispatch, because its receive
region is sized by that call's ``num_max_dispatch_tokens_per_rank``,
``hidden`` and ``num_experts``; a dispatch with other sizes reopens it (both
collective: every rank makes the same calls, and every rank must be alive:
with a rank inactive in the group, the connection falls back to the
collective path instead).
"""

from __future__ import annotations

import atexit
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from mooncake._env import positive_int
from mooncake._ep_collective.events import call_event
from mooncake._ep_collective.fp8 import CHANNELS_PER_SCALE
from mooncake._ep_collective.handle import DispatchHandle
from mooncake._ep_collective.presence import bits_of, ranks_of

ATTACH_TIMEOUT_ENV = "MOONCAKE_EP_ATTACH_TIMEOUT_MS"

# Paths still open: closed before the interpreter goes down (the close is a
# handshake with the peers, which must not run during finalisation).
_OPEN_PATHS: "weakref.WeakSet[IpcPath]" = weakref.WeakSet()


@atexit.register
def _close_open_paths() -> None:
    for path in list(_OPEN_PATHS):
        path.close()


def close_at_exit(path: "IpcPath") -> None:
    _OPEN_PATHS.add(path)


class FastPathUnavailable(RuntimeError):
    """Setting the native group up failed or was refused on some rank: every
    rank gets this at the same call and the connection goes on with the
    collective path."""


@dataclass
class IpcDispatchState:
    connection: object  # the Buffer connection the dispatch ran on
    group: object  # the native group it ran on (combine must use the same one)
    topk_idx: torch.Tensor  # the dispatch's own, for the shape and device checks of combine
    received: bool = False  # its receive half was enqueued (combine reads its outputs)
    next_combine_buffer: torch.Tensor | None = field(default=None)


def _attach_timeout_ms() -> int:
    return positive_int(ATTACH_TIMEOUT_ENV, "milliseconds") or 60000


class _InFlight:
    """Calls of one kind (dispatch or combine) whose receive half waits in a
    hook. The kernels number receives in the order they are enqueued, so
    hooks must run in the order of their calls, a call without a hook may
    not overtake a pending one, and at most two may be pending (the region's
    two halves)."""

    LIMIT = 2

    def __init__(self, kind: str):
        self.kind = kind
        self.pending: deque = deque()

    def check_new_call(self, with_hook: bool) -> None:
        if self.pending and not with_hook:
            raise RuntimeError(f"{self.kind}: the receive hook of an earlier {self.kind} has not been called; call "
                               f"it before a {self.kind} without return_recv_hook")
        if len(self.pending) >= self.LIMIT:
            raise RuntimeError(f"{self.kind}: {self.LIMIT} calls already wait for their receive hooks (the fast path "
                               "has two buffer halves); call the oldest hook first")

    def add(self, token) -> None:
        self.pending.append(token)

    def take(self, token) -> None:
        if token not in self.pending:
            raise RuntimeError(f"{self.kind} hook: already called")
        if self.pending[0] is not token:
            raise RuntimeError(f"{self.kind} hook: receive hooks must be called in the order of their calls")
        self.pending.popleft()


class IpcPath:
    """The fast path of one Buffer connection."""

    def __init__(self, store, rank: int, group_size: int, uid: int, alive):
        from mooncake import _ep_ipc  # noqa: PLC0415 - choose_path made sure it loads

        self._native = _ep_ipc
        self._store = store
        self.rank = rank
        self.group_size = group_size
        self._uid = uid
        self._alive = alive  # the group's active mask as bits
        self._group = None
        self._device: torch.device | None = None
        self._sizes: tuple[int, int, int, int] | None = None
        self._opens = 0
        self._default_mask: torch.Tensor | None = None
        self._in_flight = {"dispatch": _InFlight("dispatch"), "combine": _InFlight("combine")}

    # ---------------------------------------------------------------- group
    def group_for(self, device: torch.device, tokens: int, hidden: int, experts: int, timeout_us: int = -1,
                  output_slots: int = 0):
        """The native group on `device` sized for these values, opened or
        reopened as needed (collective). Ranks the membership has deactivated
        (gone before this first call) are not waited for: the others open
        without them and leave them out; waiting for the others ends at the
        call's `timeout_us` (when positive) or twice the attach timeout.
        `output_slots`: receive buffers lent as outputs (ElasticBuffer's)."""
        sizes = (tokens, hidden, experts, output_slots)
        if self._group is not None and self._sizes == sizes:
            if device != self._device:
                raise ValueError(f"x: the fast path of this Buffer runs on {self._device}, got a tensor on {device}")
            return self._group
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "dispatch: the fast path sets up its receive buffers at the first dispatch with given "
                f"num_max_dispatch_tokens_per_rank, hidden and num_experts {sizes[:3]}; run one such dispatch "
                "before capturing a CUDA graph")
        if any(f.pending for f in self._in_flight.values()):
            raise RuntimeError("dispatch: new sizes while receive hooks are pending; call them first")
        if self._group is not None:
            # The previous calls end normally on every rank before the region goes away.
            torch.cuda.synchronize(self._device)
        self.close()
        self._opens += 1
        key = f"open/{self._opens}"
        # Agree first on who takes part (one rank may see a peer inactive
        # that another does not yet): every rank opens, or none does.
        deadline = time.monotonic() + 2 * _attach_timeout_ms() / 1e3
        if timeout_us > 0:
            deadline = min(deadline, time.monotonic() + timeout_us / 1e6)
        absent, refusal = self._agree_on_absent(f"{key}/ready", deadline)
        if refusal:
            raise FastPathUnavailable(refusal)
        error = ""
        group = None
        try:
            group = self._native.EpIpcGroup(f"/mooncake-ep-{self._uid & 0xFFFFFFFFFFFF:x}-{self._opens}", self.rank,
                                            self.group_size, tokens, hidden, experts, device.index,
                                            _attach_timeout_ms(), absent, output_slots)
        except RuntimeError as err:
            error = str(err) or "failed"
        # Everyone learns whether everyone opened, so every rank leaves together.
        failure = self._agree(f"{key}/opened", error, absent)
        if failure:
            if group is not None:
                group.close()
            raise FastPathUnavailable(failure)
        self._group, self._device, self._sizes = group, device, sizes
        return group

    def _agree_on_absent(self, key: str, deadline: float) -> tuple[int, str]:
        """Who opens the fast path: every rank says it is ready; a rank that
        has not is waited for until it is, or until the membership sees it
        inactive (then it is absent), or `deadline`. Then every rank posts
        the absent ranks it found, and all must have found the same. Returns
        (absent bits, "") or (0, why not)."""
        full = (1 << self.group_size) - 1
        self._store.set(f"{key}/{self.rank}",
                        "" if self._alive() >> self.rank & 1 else f"rank {self.rank} is inactive in the group")
        why, unheard = self._collect(key, range(self.group_size), deadline,
                                     lambda r, post: f"rank {r}: {post}" if post else "",
                                     gone=lambda: full & ~self._alive())
        if why is None:
            return 0, f"rank(s) {sorted(unheard)} did not report in time"
        if why:
            return 0, why
        absent = sum(1 << r for r in unheard)
        found = self._agree(f"{key}/absent", "", absent, posted=str(absent), deadline=deadline)
        return (absent, "") if not found else (0, found)

    def _agree(self, key: str, mine: str, absent: int = 0, posted: str | None = None,
               deadline: float | None = None) -> str:
        """Every rank but the `absent` ones posts `mine` ("" = fine, else
        why not) under `key`; returns the first rank's complaint, "" when
        none, as soon as every rank posted or one complained (bounded by
        `deadline`, else twice the attach timeout). With `posted`, ranks
        post that instead and all must have posted the same."""
        self._store.set(f"{key}/{self.rank}", mine if posted is None else posted)
        if deadline is None:
            deadline = time.monotonic() + 2 * _attach_timeout_ms() / 1e3

        def judge(r: int, post: str) -> str:
            if posted is not None:
                return f"rank {r} found other ranks absent ({post} against {posted})" if post != posted else ""
            return f"rank {r}: {post}" if post else ""

        why, unheard = self._collect(key, [r for r in range(self.group_size) if not absent >> r & 1], deadline,
                                     judge)
        if why is None:
            return f"rank(s) {unheard} did not report within {2 * _attach_timeout_ms()} ms"
        return why

    def _collect(self, key: str, ranks, deadline: float, judge, gone=None) -> tuple[str | None, list[int]]:
        """Reads the posts of `ranks` under `key` until each has posted
        (`judge(rank, post)` returns a complaint, or ""), one complains, or
        `deadline` passes; ranks that `gone()` (bits) names are not waited
        for. Returns (the complaint, "" when none, None at the deadline) and
        the ranks not heard from."""
        waiting = list(ranks)
        while True:
            for r in [r for r in waiting if self._store.check([f"{key}/{r}"])]:
                why = judge(r, self._store.get(f"{key}/{r}").decode())
                if why:
                    return why, waiting
                waiting.remove(r)
            if not waiting or (gone is not None and all(gone() >> r & 1 for r in waiting)):
                return "", waiting
            if time.monotonic() > deadline:
                return None, waiting
            time.sleep(0.001)

    def close(self) -> None:
        """Collective with the peers that are alive (bounded by the attach timeout)."""
        _OPEN_PATHS.discard(self)
        if self._group is not None:
            group, self._group, self._sizes = self._group, None, None
            group.close()

    # ------------------------------------------------------------- dispatch
    def dispatch(self, connection, x, topk_idx, active_ranks, tokens_per_rank, num_experts, timeout_us, use_fp8,
                 async_finish, return_recv_hook):
        device = x.device
        if device.type != "cuda":
            raise ValueError(f"x: this Buffer runs the CUDA IPC fast path; tensors must be on a CUDA device, "
                             f"got {device}")
        num_tokens, hidden = x.shape
        num_ranks = self.group_size
        num_local = num_experts // num_ranks
        slots = num_ranks * tokens_per_rank
        topk_idx = topk_idx.contiguous()
        in_flight = self._in_flight["dispatch"]
        in_flight.check_new_call(return_recv_hook)
        group = self.group_for(device, tokens_per_rank, hidden, num_experts, timeout_us)
        mask, give_back = self._device_mask(active_ranks, device)

        if use_fp8:
            data = torch.empty(num_local, slots, hidden, dtype=torch.uint8, device=device)
            scales_stored = torch.empty(num_local, hidden // CHANNELS_PER_SCALE, slots, dtype=torch.float32,
                                        device=device)
            recv_x = (data.view(torch.float8_e4m3fn), scales_stored.transpose(1, 2))
            scales_ptr = scales_stored.data_ptr()
        else:
            data = torch.empty(num_local, slots, hidden, dtype=torch.bfloat16, device=device)
            recv_x = data
            scales_ptr = 0
        recv_count = torch.empty(num_local, dtype=torch.int32, device=device)
        src_info = torch.empty(num_local, slots, dtype=torch.int32, device=device)
        layout_range = torch.empty(num_local, num_ranks, dtype=torch.int64, device=device)
        stream = torch.cuda.current_stream(device).cuda_stream

        def launch(stages: str) -> None:
            group.dispatch(x.data_ptr(), topk_idx.data_ptr(), num_tokens, topk_idx.size(1), mask.data_ptr(),
                           timeout_us, use_fp8, data.data_ptr(), scales_ptr, recv_count.data_ptr(),
                           src_info.data_ptr(), layout_range.data_ptr(), stream, stages)

        state = IpcDispatchState(connection=connection, group=group, topk_idx=topk_idx)
        handle = DispatchHandle(src_info, layout_range, tokens_per_rank, hidden, num_experts, state)
        tensors = (x, topk_idx, recv_x, recv_count, src_info, layout_range)

        def received() -> None:
            give_back()
            state.received = True

        hook = self._launch(launch, return_recv_hook, received, in_flight)
        return recv_x, recv_count, handle, call_event(async_finish, device, tensors), hook

    # -------------------------------------------------------------- combine
    def combine(self, state: IpcDispatchState, handle, expert_out, topk_idx, topk_weights, active_ranks, timeout_us,
                async_finish, return_recv_hook, out):
        """`expert_out`: the rows to send back (combine's x, or the zero-copy buffer)."""
        if state.group is not self._group:
            raise ValueError("handle: comes from a dispatch with other sizes (the fast path's buffers were "
                             "resized since); dispatch again")
        if not state.received:
            raise ValueError("handle: its dispatch's receive hook has not been called; call it before combine")
        # The devices were checked against the dispatch's (check_combine_inputs): the fast path's device.
        src_info, layout_range = handle[0], handle[1]
        device = self._device
        in_flight = self._in_flight["combine"]
        in_flight.check_new_call(return_recv_hook)
        y = expert_out.contiguous()
        topk_idx, topk_weights = topk_idx.contiguous(), topk_weights.contiguous()
        num_tokens, num_topk = topk_idx.shape
        hidden = y.size(2)
        combined = out if out is not None else torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=device)
        mask, give_back = self._device_mask(active_ranks, device)
        stream = torch.cuda.current_stream(device).cuda_stream
        group = state.group

        def launch(stages: str) -> None:
            group.combine(y.data_ptr(), src_info.data_ptr(), layout_range.data_ptr(), topk_idx.data_ptr(),
                          topk_weights.data_ptr(), num_tokens, num_topk, mask.data_ptr(), timeout_us,
                          combined.data_ptr(), stream, stages)

        tensors = (y, topk_idx, topk_weights, combined)
        hook = self._launch(launch, return_recv_hook, give_back, in_flight)
        return combined, call_event(async_finish, device, tensors), hook

    # -------------------------------------------------------------- helpers
    @staticmethod
    def _launch(launch, return_recv_hook: bool, after_receive, in_flight: _InFlight):
        """The whole call now; or its send half now and the receive half in the returned hook."""
        if not return_recv_hook:
            launch("all")
            after_receive()
            return None
        launch("send")
        token = object()
        in_flight.add(token)

        def hook() -> None:
            in_flight.take(token)
            launch("receive")
            after_receive()

        return hook

    def _device_mask(self, active_ranks, device):
        """The mask the kernels read and update, and what copies it back to
        the caller's tensor afterwards (only for a mask not on the device).

        Without a mask the Buffer keeps its own, from call to call, starting
        from the group's active ranks: a rank given up on in a dispatch stays
        masked in the combine that follows (a fresh mask there would take
        its answer for rows it never sent) until update_ep_member()."""
        if active_ranks is None:
            if self._default_mask is None:
                self._default_mask = torch.tensor(bits_of(self._alive(), self.group_size), dtype=torch.int32,
                                                  device=device)
            return self._default_mask, lambda: None
        if active_ranks.device == device:
            return active_ranks, lambda: None
        if active_ranks.device.type == "cuda":
            raise ValueError(f"active_ranks: must be on {device} (the device of x) or on the CPU, "
                             f"got {active_ranks.device}")
        if torch.cuda.is_current_stream_capturing():
            raise ValueError("active_ranks: a CPU mask cannot be used in CUDA graph capture (it is copied to the GPU "
                             "and back, which synchronises); pass a mask on the GPU")
        # A CPU mask: the kernels work on a device copy, written back once they are done (this synchronises).
        on_device = active_ranks.to(device)
        return on_device, lambda: active_ranks.copy_(on_device)
