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

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from mooncake._ep_collective.events import EventHandle, EventOverlap
from mooncake._ep_collective.fp8 import CHANNELS_PER_SCALE

ATTACH_TIMEOUT_ENV = "MOONCAKE_EP_ATTACH_TIMEOUT_MS"


class FastPathUnavailable(RuntimeError):
    """Opening the native group failed on some rank: every rank gets this
    at the same call and the connection goes on with the collective path."""


@dataclass
class IpcDispatchState:
    connection: object  # the Buffer connection the dispatch ran on
    group: object  # the native group it ran on (combine must use the same one)
    topk_idx: torch.Tensor  # the dispatch's own, for the shape and device checks of combine
    next_combine_buffer: torch.Tensor | None = field(default=None)


def _attach_timeout_ms() -> int:
    raw = os.environ.get(ATTACH_TIMEOUT_ENV, "60000")
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{ATTACH_TIMEOUT_ENV}: must be an integer number of milliseconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{ATTACH_TIMEOUT_ENV}: must be > 0 milliseconds, got {value}")
    return value


def _check_on(device: torch.device, name: str, t: torch.Tensor) -> None:
    if t.device != device:
        raise ValueError(f"{name}: must be on {device} (the device of x; the fast path runs there), got {t.device}")


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
        self._sizes: tuple[int, int, int] | None = None
        self._opens = 0

    # ---------------------------------------------------------------- group
    def group_for(self, tokens: int, hidden: int, experts: int):
        """The native group sized for these values, opened or reopened as needed (collective)."""
        sizes = (tokens, hidden, experts)
        if self._group is not None and self._sizes == sizes:
            return self._group
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "dispatch: the fast path sets up its receive buffers at the first dispatch with given "
                f"num_max_dispatch_tokens_per_rank, hidden and num_experts {sizes}; run one such dispatch "
                "before capturing a CUDA graph")
        self.close()
        everyone = (1 << self.group_size) - 1
        missing = [r for r in range(self.group_size) if not self._alive() >> r & 1] if self._alive() != everyone else []
        if missing:
            raise FastPathUnavailable(f"rank(s) {missing} inactive in the group: the fast path is set up with "
                                      "every rank")
        self._opens += 1
        name = f"/mooncake-ep-{self._uid & 0xFFFFFFFFFFFF:x}-{self._opens}"
        error = ""
        group = None
        try:
            group = self._native.EpIpcGroup(name, self.rank, self.group_size, tokens, hidden, experts,
                                            torch.cuda.current_device(), _attach_timeout_ms())
        except RuntimeError as err:
            error = str(err) or "failed"
        # Everyone learns whether everyone opened, so every rank leaves together.
        key = f"open/{self._opens}"
        self._store.set(f"{key}/{self.rank}", error)
        keys = [f"{key}/{r}" for r in range(self.group_size)]
        try:
            self._store.wait(keys, timedelta(milliseconds=2 * _attach_timeout_ms()))
            errors = [(r, self._store.get(k).decode()) for r, k in enumerate(keys)]
        except RuntimeError as err:
            errors = [(-1, f"not every rank reported its open ({err})")]
        failed = [(r, e) for r, e in errors if e]
        if failed:
            if group is not None:
                group.close()
            r, e = failed[0]
            raise FastPathUnavailable(f"rank {r}: {e}" if r >= 0 else e)
        self._group, self._sizes = group, sizes
        return group

    def close(self) -> None:
        """Collective with the peers that are alive (bounded by the attach timeout)."""
        if self._group is not None:
            group, self._group, self._sizes = self._group, None, None
            group.close()

    # ------------------------------------------------------------- dispatch
    def dispatch(self, connection, x, topk_idx, active_ranks, tokens_per_rank, num_experts, timeout_us, use_fp8,
                 async_finish, return_recv_hook, make_handle):
        device = x.device
        if device.type != "cuda":
            raise ValueError(f"x: this Buffer runs the CUDA IPC fast path; tensors must be on a CUDA device, "
                             f"got {device}")
        num_tokens, hidden = x.shape
        num_ranks = self.group_size
        num_local = num_experts // num_ranks
        slots = num_ranks * tokens_per_rank
        topk_idx = topk_idx.contiguous()
        group = self.group_for(tokens_per_rank, hidden, num_experts)
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
        handle = make_handle(src_info, layout_range, tokens_per_rank, hidden, num_experts, state)
        tensors = (x, topk_idx, recv_x, recv_count, src_info, layout_range)
        hook = self._launch(launch, return_recv_hook, give_back)
        return recv_x, recv_count, handle, self._event(async_finish, device, tensors), hook

    # -------------------------------------------------------------- combine
    def combine(self, state: IpcDispatchState, handle, x, topk_idx, topk_weights, active_ranks, timeout_us,
                zero_copy, async_finish, return_recv_hook, out):
        if state.group is not self._group:
            raise ValueError("handle: comes from a dispatch with other sizes (the fast path's buffers were "
                             "resized since); dispatch again")
        src_info, layout_range = handle[0], handle[1]
        device = x.device
        y = state.next_combine_buffer if zero_copy else x.contiguous()
        for name, t in (("x", y), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
            _check_on(device, name, t)
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
        hook = self._launch(launch, return_recv_hook, give_back)
        return combined, self._event(async_finish, device, tensors), hook

    # -------------------------------------------------------------- helpers
    @staticmethod
    def _launch(launch, return_recv_hook: bool, give_back):
        """The whole call now; or its send half now and the receive half in the returned hook."""
        if not return_recv_hook:
            launch("all")
            give_back()
            return None
        launch("send")

        def hook() -> None:
            launch("receive")
            give_back()

        return hook

    def _device_mask(self, active_ranks, device):
        """The mask the kernels read and update, and what copies it back to
        the caller's tensor afterwards (only for a mask not on the device)."""
        if active_ranks is None:
            return torch.ones(self.group_size, dtype=torch.int32, device=device), lambda: None
        if active_ranks.device == device:
            return active_ranks, lambda: None
        if active_ranks.device.type == "cuda":
            raise ValueError(f"active_ranks: must be on {device} (the device of x) or on the CPU, "
                             f"got {active_ranks.device}")
        # A CPU mask: the kernels work on a device copy, written back once they are done (this synchronises).
        on_device = active_ranks.to(device)
        return on_device, lambda: active_ranks.copy_(on_device)

    @staticmethod
    def _event(async_finish: bool, device, tensors) -> EventOverlap:
        if async_finish:
            return EventOverlap(EventHandle(device), tensors)
        return EventOverlap(None)
