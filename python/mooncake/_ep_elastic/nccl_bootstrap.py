"""The NCCL unique id of an ElasticBuffer, from rank 0 to every rank.

Rank 0 makes the id (``ncclGetUniqueId``) and the process group broadcasts
one fixed-size message of int64 words, whatever happened there, so that a
failure at rank 0 reaches every rank as an error instead of leaving them
waiting for an id that never comes:

    [MAGIC, status, NCCL version at rank 0, id bytes, reason bytes,
     id (ID_WORDS words), reason (REASON_WORDS words, UTF-8, cut)]

``status`` is OK or FAILED (then ``reason`` says why). Every rank checks
that rank 0 runs the NCCL it runs: two versions in one communicator are
refused by NCCL in ways that say less.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

MAGIC = 0x4D43_4E43_434C_4944  # "MCNCCLID"
OK, FAILED = 0, 1
ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES
ID_WORDS = ID_BYTES // 8
REASON_WORDS = 32  # 256 bytes of the reason
HEADER_WORDS = 5
MESSAGE_WORDS = HEADER_WORDS + ID_WORDS + REASON_WORDS


def _words(data: bytes, count: int) -> list[int]:
    data = data[:8 * count].ljust(8 * count, b"\0")
    return [int.from_bytes(data[8 * i:8 * i + 8], "little", signed=True) for i in range(count)]


def _bytes(words: list[int], length: int) -> bytes:
    return b"".join(w.to_bytes(8, "little", signed=True) for w in words)[:length]


def encode(unique_id: bytes | None, version: int, reason: str = "") -> list[int]:
    """The message of rank 0: its id (None when making it failed, with ``reason``)."""
    if unique_id is not None and len(unique_id) != ID_BYTES:
        raise ValueError(f"unique_id: must be {ID_BYTES} bytes (an ncclUniqueId), got {len(unique_id)}")
    why = reason.encode()[:8 * REASON_WORDS]
    status = OK if unique_id is not None else FAILED
    uid = unique_id or b""
    return [MAGIC, status, version, len(uid), len(why)] + _words(uid, ID_WORDS) + _words(why, REASON_WORDS)


def decode(words: list[int], my_version: int, version_text=str) -> bytes:
    """The id in rank 0's message; RuntimeError when rank 0 failed, the
    message is not one, or rank 0 runs another NCCL than this rank."""
    if len(words) != MESSAGE_WORDS or words[0] != MAGIC:
        raise RuntimeError("ElasticBuffer (nccl): the unique-id message from rank 0 is not one (did every rank "
                           "construct the buffer with transport='nccl'?)")
    status, version, id_bytes, reason_bytes = words[1:HEADER_WORDS]
    if not 0 <= id_bytes <= ID_BYTES or not 0 <= reason_bytes <= 8 * REASON_WORDS:
        raise RuntimeError("ElasticBuffer (nccl): the unique-id message from rank 0 is corrupt")
    if status != OK:
        reason = _bytes(words[HEADER_WORDS + ID_WORDS:], reason_bytes).decode(errors="replace")
        raise RuntimeError(f"ElasticBuffer (nccl): rank 0 could not make the NCCL unique id: {reason}")
    if version != my_version:
        raise RuntimeError(f"ElasticBuffer (nccl): rank 0 runs NCCL {version_text(version)}, this rank "
                           f"{version_text(my_version)}; every rank must load the same NCCL")
    if id_bytes != ID_BYTES:
        raise RuntimeError(f"ElasticBuffer (nccl): rank 0 sent a unique id of {id_bytes} bytes, not {ID_BYTES}")
    return _bytes(words[HEADER_WORDS:HEADER_WORDS + ID_WORDS], ID_BYTES)


def share_unique_id(group, rank: int, nccl, device: torch.device, timeout: timedelta | None,
                    failed_ranks) -> bytes:
    """Collective: rank 0's unique id on every rank (``nccl``: the native
    module). ``timeout`` bounds the broadcast where the group allows it (CPU
    tensors); ``failed_ranks(work)`` reads who the group saw fail."""
    message = [0] * MESSAGE_WORDS
    if rank == 0:
        try:
            message = encode(nccl.make_unique_id(), nccl.RUNTIME_VERSION)
        except RuntimeError as err:
            message = encode(None, nccl.RUNTIME_VERSION, str(err))
    tensor = torch.tensor(message, dtype=torch.int64, device=device)
    work = dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group, async_op=True)
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)
    failed = failed_ranks(work)
    if failed:
        raise RuntimeError(f"ElasticBuffer (nccl): ranks {failed} failed while the NCCL unique id was shared")
    return decode(tensor.tolist(), nccl.RUNTIME_VERSION, nccl.version_text)
