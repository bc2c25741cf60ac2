"""Output slots: receive buffers inside the IPC group's region, handed out
as a dispatch's ``recv_x``, so that peers write each row's payload straight
into its final place (``DirectHeads``, mooncake/ep/cuda/ep_ipc_group.h)
instead of into the region and then, by a second copy, into a fresh tensor.

A slot is lent to one output at a time. The tensor handed out holds an
owner object (through the array interface, which torch keeps a reference
to); when the tensor and every view of it are gone, the slot is free again.
A dispatch that finds every slot held takes the two-copy way, with the same
results. A slot taken while a CUDA graph is being captured stays held for as
long as this object lives: each replay writes into it again, whatever
became of the tensor the capture returned.

Reuse is ordered like torch's own memory: a freed slot is given to this
rank's next dispatch, whose peers learn its index only from the counts that
dispatch gathers, on this rank's stream, after the work enqueued on it
before. Work that reads an output on another stream must be ordered before
the output is dropped, as for ``Tensor.record_stream``; and a dispatch on
another stream than the work that read the earlier outputs must be ordered
after it (``Stream.wait_stream``): unlike torch's allocator, the slots are
not kept per stream.
"""

from __future__ import annotations

import logging
import os

import torch

from .._env import int_setting

# How many output slots the IPC path opens: a count (0: none, every
# dispatch copies twice), or "auto", the default: as many as fit in
# AUTO_SLOTS_BYTES, at least 2 (an eager loop keeps the last output while the
# next dispatch runs) and at most 16 (each CUDA graph captured with a
# dispatch keeps one: small calls are the ones captured, for many batch
# sizes, and their slots are small). Each holds R * T rows of the buffer's
# widest row.
OUTPUT_SLOTS_ENV = "MOONCAKE_EP_ELASTIC_OUTPUT_SLOTS"
AUTO_SLOTS_BYTES = 512 << 20
MIN_AUTO_SLOTS, MAX_AUTO_SLOTS = 2, 16
_log = logging.getLogger("mooncake.ep")


def _setting_text() -> str:
    return os.environ.get(OUTPUT_SLOTS_ENV, "").strip().lower()


def output_slots_asked_for() -> bool:
    """Whether MOONCAKE_EP_ELASTIC_OUTPUT_SLOTS names slots explicitly (set, not "auto", not 0)."""
    return _setting_text() not in ("", "auto", "0")


def output_slots_setting(slot_bytes: int) -> int:
    """MOONCAKE_EP_ELASTIC_OUTPUT_SLOTS for slots of ``slot_bytes``: its count, or "auto"'s (also when unset)."""
    if _setting_text() in ("", "auto"):
        return max(MIN_AUTO_SLOTS, min(MAX_AUTO_SLOTS, AUTO_SLOTS_BYTES // max(1, slot_bytes)))
    return int_setting(OUTPUT_SLOTS_ENV, 'slots, or "auto"', 0)


class _SlotOwner:
    """The memory of one lent slot, as an array-interface object: its
    destruction (the last tensor over it gone) frees the slot."""

    def __init__(self, slots: "OutputSlots", index: int, rows: int, row_bytes: int, keep: bool):
        self._slots, self._index, self._keep = slots, index, keep
        interface = {"shape": (rows, row_bytes), "typestr": "|u1", "data": (slots.address(index), False),
                     "version": 2, "strides": None}
        if slots.device.type == "cuda":
            self.__cuda_array_interface__ = interface
        else:
            interface["version"] = 3
            self.__array_interface__ = interface

    def __del__(self):
        if not self._keep:
            self._slots.release(self._index)


class OutputSlots:
    """The group's output slots on ``device``: ``count`` buffers of
    ``slot_bytes`` bytes each. ``lease`` keeps their memory allocated while
    this object lives, which every lent slot's owner keeps alive (the group
    may close first)."""

    def __init__(self, device: torch.device, count: int, slot_bytes: int, address_of, lease=None):
        """``address_of(i)``: slot i's address."""
        self.device = device
        self.count, self.bytes = count, slot_bytes
        self._addresses = [address_of(i) for i in range(count)]
        self._lease = lease
        self._held = [False] * count
        self._told_capture = False

    def address(self, index: int) -> int:
        return self._addresses[index]

    @property
    def held(self) -> int:
        return sum(self._held)

    def take(self, rows: int, row_bytes: int) -> tuple[int, torch.Tensor | None]:
        """A free slot and a ``[rows, row_bytes]`` uint8 tensor over it, or
        ``(-1, None)`` when every slot is held (or the rows do not fit)."""
        if rows * row_bytes > self.bytes or rows <= 0 or row_bytes <= 0:
            return -1, None
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        free = next((i for i, held in enumerate(self._held) if not held), -1)
        if free < 0:
            if capturing and not self._told_capture:
                self._told_capture = True
                _log.warning("ElasticBuffer: a dispatch captured in a CUDA graph found all %d output slots held; its "
                             "replays copy the rows twice. Each captured dispatch keeps a slot, each output alive "
                             "holds one: drop outputs before capturing, or set %s to more", self.count,
                             OUTPUT_SLOTS_ENV)
            return -1, None
        self._held[free] = True
        owner = _SlotOwner(self, free, rows, row_bytes, keep=capturing)
        if self.device.type == "cuda":
            return free, torch.as_tensor(owner, device=self.device)
        import numpy  # noqa: PLC0415 - CPU slots serve the tests' emulation only

        return free, torch.from_numpy(numpy.asarray(owner))

    def release(self, index: int) -> None:
        self._held[index] = False
