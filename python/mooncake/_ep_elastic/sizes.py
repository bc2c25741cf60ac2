"""Size rules of the reference's ElasticBuffer, so that a program sized with
one implementation's hint works with the other.

The workspace mirrors DeepEP V2's fixed limits (1024 ranks, 2048 experts,
1280 channels, 16 barrier tags, 32 in-flight all-gather/reduce-scatter
sessions); the data buffers hold one slot per (rank, token, top-k pick) for
dispatch and room for the combine reductions, twice in hybrid mode.
"""

from __future__ import annotations

MAX_RANKS = 1024
MAX_EXPERTS = 2048
MAX_CHANNELS = 8 * 160
BARRIER_TAGS = 16
MAX_INFLIGHT_AGRS = 32
ALIGNMENT = 32
CHANNELS_PER_SCALE = 128


def ceil_div(x: int, y: int) -> int:
    return (x + y - 1) // y


def align(x: int, alignment: int = ALIGNMENT) -> int:
    return ceil_div(x, alignment) * alignment


def workspace_bytes() -> int:
    """Signals, counters and per-channel state (16,097,440 bytes)."""
    words = [
        BARRIER_TAGS * (8 + 2 * MAX_RANKS * 4),  # barrier counters and per-source slots
        (MAX_RANKS + MAX_EXPERTS) * 8,  # count exchange
        MAX_RANKS * 8 * 2,
        MAX_EXPERTS * 8 * 2,
        MAX_RANKS * 4,
        MAX_RANKS * 4 * 2,
        MAX_EXPERTS * 4 * 2,
        MAX_RANKS * MAX_CHANNELS * 8,  # channel tails
        MAX_RANKS * MAX_CHANNELS * 4,
        2 * 2 * 8,
        (MAX_INFLIGHT_AGRS + 1) * MAX_RANKS * 4,
    ]
    return align(sum(words))


def elastic_buffer_size(num_ranks: int, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                        use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                        allow_multiple_reduction: bool = True) -> int:
    """Bytes: two workspaces (signals and the atomic-result scratch) plus the
    dispatch and combine data buffers."""
    num_topk = max(1, num_topk)
    scale_bytes = ceil_div(hidden, CHANNELS_PER_SCALE) * 4 if use_fp8_dispatch else 0
    token_bytes = align(hidden * (1 if use_fp8_dispatch else 2)) + align(scale_bytes)
    metadata_bytes = align(num_topk * (4 + 4) + (1 + num_topk) * 4)  # ids, weights, source and slots
    dispatch = num_ranks * num_max_tokens_per_rank * num_topk * (token_bytes + metadata_bytes) * 2
    combine = dispatch * (3 if allow_multiple_reduction else 4)
    hybrid = 2 if allow_hybrid_mode and num_ranks > 1 else 1
    return 2 * workspace_bytes() + hybrid * (dispatch + combine)


def engram_storage_size(num_entries: int, hidden: int, num_max_tokens_per_rank: int, itemsize: int) -> int:
    scale_packs = ceil_div(hidden, CHANNELS_PER_SCALE) if itemsize <= 1 else 0
    return align(hidden * itemsize + scale_packs * 4) * (num_entries + num_max_tokens_per_rank)


def pp_buffer_size(num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> int:
    return align(num_max_tensor_bytes) * num_max_inflight_tensors * 2 * 2
