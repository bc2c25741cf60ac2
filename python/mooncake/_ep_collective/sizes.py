"""Buffer size rule of the reference runtime, so that sizes agree between
implementations (a program sized with the reference's hint works here, and
the other way round)."""

from __future__ import annotations

# Each dispatched row reserves two 16-byte headers besides its BF16 payload.
_ROW_HEADER_BYTES = 32
# Per expert: one int32 signal word.
_SIGNAL_BYTES_PER_EXPERT = 4


def ep_buffer_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """Bytes of the reference's double-buffered layout: two halves of
    [send signals | recv signals | send data | recv data], back to back.

    ``num_ranks`` does not enter the formula (the reference ignores it too);
    it is kept for the signature.
    """
    del num_ranks
    signal_bytes = _SIGNAL_BYTES_PER_EXPERT * num_experts
    data_bytes = num_experts * num_max_dispatch_tokens_per_rank * (_ROW_HEADER_BYTES + 2 * hidden)
    return 4 * signal_bytes + 4 * data_bytes


def ep_elastic_buffer_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                num_experts_per_rank: int) -> int:
    """Bytes of the reference's fixed-capacity ("elastic mode") Buffer: per
    rank slot an 8-byte control word, per (rank, local expert) a 16-byte
    signal pair, and per (rank, local expert, token) the double-buffered
    send/receive rows of the layout above (four rows of header + BF16 payload)."""
    row = _ROW_HEADER_BYTES + 2 * hidden
    per_rank = 8 + 16 * num_experts_per_rank + num_experts_per_rank * num_max_dispatch_tokens_per_rank * 4 * row
    return num_ranks * per_rank
