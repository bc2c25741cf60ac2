"""Argument checks of ElasticBuffer: each error names the argument and the
rule, and is raised before anything is sent, so a bad call never leaves the
other ranks with half a protocol."""

from __future__ import annotations

import torch

from .._ep_collective.checks import check_topk_values, describe, int_arg
from .sizes import CHANNELS_PER_SCALE, ceil_div

SCALE_DTYPES = (torch.float32, torch.int32)  # float scales, or four UE8M0 exponents packed in an int32


def split_x(x) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` is a bf16 tensor, or a pre-quantised ``(e4m3 data, scales)`` pair."""
    if isinstance(x, tuple):
        if len(x) != 2:
            raise TypeError(f"x: a tuple must be (x_fp8, scales), got {len(x)} items")
        data, sf = x
        if not isinstance(data, torch.Tensor) or data.dim() != 2 or data.dtype != torch.float8_e4m3fn \
                or not data.is_contiguous():
            raise TypeError(f"x[0]: must be a 2-D contiguous float8_e4m3fn tensor [num_tokens, hidden], "
                            f"got {describe(data)}")
        packs = ceil_div(data.size(1), CHANNELS_PER_SCALE)
        if not isinstance(sf, torch.Tensor) or sf.dim() != 2 or sf.dtype not in SCALE_DTYPES \
                or tuple(sf.shape) != (data.size(0), packs) or sf.device != data.device:
            raise TypeError(f"x[1]: must be float32 or int32 scales [num_tokens, ceil(hidden / 128)] = "
                            f"[{data.size(0)}, {packs}] on {data.device}, got {describe(sf)}")
        return data, sf
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.bfloat16 or not x.is_contiguous():
        raise TypeError("x: must be a 2-D contiguous bfloat16 tensor [num_tokens, hidden] or an (x_fp8, scales) "
                        f"tuple, got {describe(x)}")
    return x, None


def check_hidden(hidden: int) -> None:
    if hidden == 0:
        raise ValueError("x: hidden (x.size(1)) must be positive, got 0")


def check_topk_idx(topk_idx, num_tokens: int, device: torch.device) -> None:
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2 or topk_idx.dtype != torch.int64:
        raise TypeError(f"topk_idx: must be a 2-D int64 tensor [num_tokens, num_topk], got {describe(topk_idx)}")
    if topk_idx.size(0) != num_tokens:
        raise ValueError(f"topk_idx: must have one row per token of x ({num_tokens}), got {topk_idx.size(0)} rows")
    if topk_idx.size(1) == 0:
        raise ValueError("topk_idx: num_topk (topk_idx.size(1)) must be positive, got 0")
    if topk_idx.device != device:
        raise ValueError(f"topk_idx: must be on the device of x ({device}), got {topk_idx.device}")


def check_topk_weights(topk_weights, topk_idx: torch.Tensor) -> None:
    if topk_weights is None:
        return
    if not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype != torch.float32 \
            or tuple(topk_weights.shape) != tuple(topk_idx.shape) or topk_weights.device != topk_idx.device:
        raise TypeError(f"topk_weights: must be None or a float32 tensor shaped like topk_idx "
                        f"{list(topk_idx.shape)} on {topk_idx.device}, got {describe(topk_weights)}")


def check_num_experts(num_experts, num_ranks: int) -> int:
    int_arg("num_experts", num_experts, minimum=1)
    if num_experts % num_ranks:
        raise ValueError(f"num_experts: must be a multiple of the number of ranks ({num_ranks}), got {num_experts}")
    return num_experts


def check_tokens_per_rank(tokens_per_rank, num_tokens: int) -> int:
    int_arg("num_max_tokens_per_rank", tokens_per_rank, minimum=1)
    if num_tokens > tokens_per_rank:
        raise ValueError(f"x: has {num_tokens} tokens, more than num_max_tokens_per_rank={tokens_per_rank}")
    return tokens_per_rank


def check_alignment(expert_alignment) -> int:
    return int_arg("expert_alignment", expert_alignment, minimum=1)


def check_num_sms(num_sms) -> None:
    if num_sms is not None:
        int_arg("num_sms", num_sms, minimum=1)


def check_cached_call(topk_idx, topk_weights, do_expand: bool, handle_expands: bool) -> None:
    if topk_idx is not None or topk_weights is not None:
        raise ValueError("topk_idx, topk_weights: must be None with a handle (cached dispatch reuses the routing "
                         "of the handle's dispatch)")
    if do_expand and not handle_expands:
        raise ValueError("do_expand: the handle comes from a non-expanded dispatch; a cached dispatch keeps the "
                         "handle's layout")


def check_combine_weights(topk_weights, routing, num_topk: int) -> None:
    """combine's optional weights are the received rows' (dispatch's
    ``recv_topk_weights``): ``[rows, k]``, or one per expanded row."""
    rows = routing.rows_for_combine
    expanded = routing.expansion is not None
    if not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype != torch.float32 \
            or (topk_weights.dim() != (1 if expanded else 2)) or topk_weights.size(0) < rows \
            or (not expanded and topk_weights.size(1) != num_topk):
        want = f"[>= {rows}]" if expanded else f"[>= {rows}, {num_topk}]"
        raise TypeError(f"topk_weights: must be None or float32 weights of the received rows {want} (dispatch's "
                        f"recv_topk_weights), got {describe(topk_weights)}")


def check_combine_x(x, hidden: int, rows_needed: int, device: torch.device) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.bfloat16 or not x.is_contiguous():
        raise TypeError(f"x: must be a 2-D contiguous bfloat16 tensor (one row per received row of the dispatch), "
                        f"got {describe(x)}")
    if x.size(1) != hidden:
        raise ValueError(f"x: hidden must be the dispatch's ({hidden}), got {x.size(1)}")
    if x.size(0) < rows_needed:
        raise ValueError(f"x: has {x.size(0)} rows, fewer than the {rows_needed} rows the dispatch delivered")
    if x.device != device:
        raise ValueError(f"x: must be on the device of the dispatch ({device}), got {x.device}")
