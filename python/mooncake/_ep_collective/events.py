"""Stream-ordering objects of the Buffer API.

The collective path finishes its work before dispatch/combine return (on
CUDA, every kernel it launched is queued on the caller's current stream), so
there is nothing to wait for on the host. The objects still exist, and
``current_stream_wait()`` is always callable (the reference asserts when
``async_finish=False``; its own quick start calls it anyway).
"""

from __future__ import annotations

import torch


class EventHandle:
    """A point in a CUDA stream (the current one by default); on CPU, a no-op."""

    def __init__(self, device: torch.device | None = None):
        self._event = None
        if device is not None and device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(device))

    def current_stream_wait(self) -> None:
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)

    def synchronize(self) -> None:
        if self._event is not None:
            self._event.synchronize()


class StreamEventHandle:
    """The reference's native ``mooncake.ep.EventHandle``: an event recorded,
    timing disabled, on the CUDA stream `stream_ptr` (a ``cudaStream_t`` as
    an int; 0 is the default stream) when it is made.
    ``current_stream_wait(stream_ptr)`` makes that stream wait for it."""

    def __init__(self, stream_ptr: int = 0):
        if not torch.cuda.is_available():
            raise RuntimeError("mooncake.ep.EventHandle records a CUDA event: it needs a CUDA device")
        self._event = torch.cuda.Event(enable_timing=False)
        self._event.record(_stream(stream_ptr))

    def current_stream_wait(self, stream_ptr: int = 0) -> None:
        _stream(stream_ptr).wait_event(self._event)

    def synchronize(self) -> None:
        self._event.synchronize()


def _stream(stream_ptr: int):
    if not isinstance(stream_ptr, int) or stream_ptr < 0:
        raise ValueError(f"stream_ptr must be a cudaStream_t as a non-negative int, got {stream_ptr!r}")
    return torch.cuda.ExternalStream(stream_ptr) if stream_ptr else torch.cuda.default_stream()


class EventOverlap:
    """What dispatch/combine return as ``event``: wraps an EventHandle (or none)
    and keeps the call's tensors alive until it is dropped."""

    def __init__(self, event: EventHandle | None = None, extra_tensors: tuple | None = None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is not None:
            self.event.current_stream_wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.current_stream_wait()
        return False


def call_event(async_finish: bool, device, tensors) -> EventOverlap:
    """What a dispatch/combine returns as ``event``: with ``async_finish``, an
    event on the current stream that keeps the call's tensors alive; else an
    empty one."""
    if async_finish:
        return EventOverlap(EventHandle(device), tensors)
    return EventOverlap(None)
