"""What the ranks of an elastic-mode Buffer agree on without talking: where
each peer's bytes land in a rank's memory, the flag that says a step's
bytes are complete, and the metadata a rank publishes to connect. Pure
functions, tested without sockets or GPUs.

Memory of a rank with capacity R and ``num_rdma_bytes`` B (``Region``):

- the send area, the first half (rounded down to 64 bytes): the step's
  outgoing bytes, peer after peer, which the transfer engine reads;
- the receive area, the second half, cut into ``2 * R`` slots: slot
  ``(parity, source)`` takes source's bytes of a step whose number has that
  parity. Two parities let a step's bytes land while the previous step's
  are still being read (see ``links.py`` for why two are enough).

Flags live apart, in host memory: ``[2, R, 3]`` int64 words per rank, one
``Flag`` per (parity, source). A sender writes a step's flag only after the
engine answered its payload write, so a flag seen means its bytes landed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

WORDS_PER_FLAG = 3
_MASK64 = (1 << 64) - 1
# Mixed into the check word, so that zeroed memory never reads as a flag.
_CHECK_SALT = 0x6D6F6F6E_63616B65  # "mooncake"
_ALIGN = 64


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


@dataclass(frozen=True)
class Region:
    """The layout of one rank's ``num_rdma_bytes`` for a capacity of ``ranks``."""

    ranks: int
    total: int

    @property
    def send_bytes(self) -> int:
        return (self.total // 2) // _ALIGN * _ALIGN

    @property
    def slot_bytes(self) -> int:
        return (self.total - self.send_bytes) // (2 * self.ranks) // _ALIGN * _ALIGN

    def slot_offset(self, parity: int, source: int) -> int:
        """Byte offset, from the start of the memory, of slot (parity, source)."""
        return self.send_bytes + (parity * self.ranks + source) * self.slot_bytes

    def flag_index(self, parity: int, source: int) -> int:
        """Index of the flag's first int64 word in the flags array."""
        return (parity * self.ranks + source) * WORDS_PER_FLAG


def minimum_bytes(ranks: int) -> int:
    """The smallest ``num_rdma_bytes`` that holds the smallest step (a header)."""
    return 2 * _ALIGN * 2 * ranks + 2 * _ALIGN


@dataclass(frozen=True)
class Flag:
    """Step ``seq`` of the sender's connection ``incarnation`` put ``count`` bytes in its slot."""

    seq: int
    incarnation: int
    count: int

    def words(self) -> list[int]:
        """Three int64 words: (seq, incarnation), count, and a check of both."""
        head = ((self.seq & 0xFFFFFFFF) << 32) | (self.incarnation & 0xFFFFFFFF)
        return [_signed(head), _signed(self.count), _signed(head ^ self.count ^ _CHECK_SALT)]


def read_flag(words: list[int]) -> Flag | None:
    """The flag in three words, or None while they do not hold one whole
    (zeroed memory, or a write seen half done)."""
    head, count, check = (w & _MASK64 for w in words)
    if check != head ^ count ^ _CHECK_SALT:
        return None
    return Flag(seq=head >> 32, incarnation=head & 0xFFFFFFFF, count=count)


# The count of a flag that says "this rank dropped you": written into both of
# the peer's slots for this rank, so that the peer stops waiting at once.
LEAVING_COUNT = 1 << 62


def leaving(flag: Flag | None, incarnation: int) -> bool:
    """Whether ``flag`` is the sender's (``incarnation``) notice that it dropped this rank."""
    return flag is not None and flag.count == LEAVING_COUNT and flag.incarnation == incarnation & 0xFFFFFFFF


def expected(flag: Flag | None, seq: int, incarnation: int) -> bool:
    """Whether ``flag`` is step ``seq`` of connection ``incarnation`` (sequence numbers wrap at 2**32)."""
    return flag is not None and flag.seq == seq & 0xFFFFFFFF and flag.incarnation == incarnation & 0xFFFFFFFF


@dataclass(frozen=True)
class PeerMetadata:
    """What a rank publishes to a peer that connects to it."""

    segment: str  # the transfer engine's "host:port"
    memory: int  # address of its num_rdma_bytes
    flags: int  # address of its flags
    capacity: int  # its rank capacity (must equal ours)
    total: int  # its num_rdma_bytes
    incarnation: int  # names the connection: flags of an older one are not read
    hostname: str

    def encode(self) -> bytes:
        return json.dumps(self.__dict__, sort_keys=True).encode()

    @staticmethod
    def decode(data: bytes) -> "PeerMetadata":
        try:
            fields = json.loads(data.decode())
            return PeerMetadata(segment=str(fields["segment"]), memory=int(fields["memory"]),
                                flags=int(fields["flags"]), capacity=int(fields["capacity"]),
                                total=int(fields["total"]), incarnation=int(fields["incarnation"]),
                                hostname=str(fields["hostname"]))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
            raise RuntimeError(f"connect_ranks: a peer's metadata in the store is not this Buffer's ({err})") from err


def metadata_key(source: int, destination: int) -> str:
    """The store key of what ``source`` publishes for ``destination`` (the reference's key names)."""
    return f"MOONCAKE_EP/{source}/{destination}"
