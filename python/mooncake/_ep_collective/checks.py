"""Argument checks of Buffer: each error names the argument and the rule, and
is raised before anything is sent, so a bad call never leaves the other ranks
with half a protocol."""

from __future__ import annotations

import warnings

import torch

from .fp8 import CHANNELS_PER_SCALE
from .sizes import ep_buffer_size_hint


def describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return f"a {type(t).__name__}"
    layout = "contiguous" if t.is_contiguous() else "non-contiguous"
    return f"{layout} {t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"


def int_arg(name: str, value, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
    return value


def check_buffer(num_ep_buffer_bytes) -> int:
    return int_arg("num_ep_buffer_bytes", num_ep_buffer_bytes, minimum=0)


def check_timeout(timeout_us) -> int:
    int_arg("timeout_us", timeout_us)
    if timeout_us < -1:
        raise ValueError(f"timeout_us: must be -1 (no timeout) or >= 0 microseconds, got {timeout_us}")
    return timeout_us


def check_sync_mode(async_finish: bool, return_recv_hook: bool) -> None:
    if async_finish and return_recv_hook:
        raise ValueError("async_finish and return_recv_hook: at most one of them may be True")


def check_buffer_size(num_ep_buffer_bytes: int, tokens: int, hidden: int, num_ranks: int, experts: int) -> None:
    """0 bytes means "size on demand" (the collective path allocates per call)."""
    if num_ep_buffer_bytes == 0:
        return
    need = ep_buffer_size_hint(tokens, hidden, num_ranks, experts)
    if need > num_ep_buffer_bytes:
        raise ValueError(
            f"num_ep_buffer_bytes: the Buffer has {num_ep_buffer_bytes} bytes but "
            f"num_max_dispatch_tokens_per_rank={tokens}, hidden={hidden}, num_experts={experts} need {need} "
            f"(Buffer.get_ep_buffer_size_hint({tokens}, {hidden}, {num_ranks}, {experts}))")


def check_tokens(x) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.bfloat16 or not x.is_contiguous():
        raise TypeError(f"x: must be a 2-D contiguous bfloat16 tensor [num_tokens, hidden], got {describe(x)}")
    if x.size(1) == 0 or x.size(1) % CHANNELS_PER_SCALE:
        raise ValueError(f"x: hidden (x.size(1) = {x.size(1)}) must be a positive multiple of {CHANNELS_PER_SCALE}")


def check_topk_idx(topk_idx, num_tokens: int, num_experts: int, device: torch.device, values: bool = True) -> None:
    """Shape, dtype and device; with ``values`` also the entries (which reads
    them: a synchronisation on CUDA, so the fast path skips it)."""
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2 or topk_idx.dtype != torch.int64:
        raise TypeError(f"topk_idx: must be a 2-D int64 tensor [num_tokens, num_topk], got {describe(topk_idx)}")
    if topk_idx.size(0) != num_tokens:
        raise ValueError(f"topk_idx: must have one row per token of x ({num_tokens}), got {topk_idx.size(0)} rows")
    if topk_idx.device != device:
        raise ValueError(f"topk_idx: must be on the device of x ({device}), got {topk_idx.device}")
    if values:
        check_topk_values(topk_idx, num_experts)


def check_topk_values(topk_idx: torch.Tensor, num_experts: int) -> None:
    """Entries in [-1, num_experts), each expert at most once per token (reads the values)."""
    if topk_idx.numel() == 0:
        return
    low, high = int(topk_idx.min()), int(topk_idx.max())
    if low < -1 or high >= num_experts:
        bad = low if low < -1 else high
        raise ValueError(f"topk_idx: entries must lie in [-1, num_experts) = [-1, {num_experts}); found {bad}")
    if topk_idx.size(1) > 1:
        ordered = torch.sort(topk_idx, dim=1).values
        twice = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
        if bool(twice.any()):
            token = int(torch.nonzero(twice.any(dim=1))[0])
            raise ValueError(f"topk_idx: a token may pick each expert at most once (-1 entries excepted); "
                             f"token {token} picks {topk_idx[token].tolist()}")


def check_dispatch_weights(topk_weights, topk_idx) -> None:
    """dispatch's optional ``topk_weights`` (the reference reads it on XPU only; here it is checked and not used)."""
    if topk_weights is None:
        return
    if not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype != torch.float32 \
            or not topk_weights.is_contiguous() or tuple(topk_weights.shape) != tuple(topk_idx.shape):
        raise TypeError(f"topk_weights: must be None or a contiguous float32 tensor shaped like topk_idx "
                        f"{list(topk_idx.shape)}, got {describe(topk_weights)}")


def check_dispatch_shape(num_tokens: int, tokens_per_rank, num_experts, num_ranks: int) -> None:
    int_arg("num_max_dispatch_tokens_per_rank", tokens_per_rank, minimum=1)
    int_arg("num_experts", num_experts, minimum=1)
    if num_experts % num_ranks:
        raise ValueError(f"num_experts: must be a multiple of the number of ranks ({num_ranks}), got {num_experts}")
    if num_tokens > tokens_per_rank:
        raise ValueError(f"x: has {num_tokens} tokens, more than num_max_dispatch_tokens_per_rank={tokens_per_rank}")


_warned_active_ranks_length = False


def check_active_ranks(active_ranks, num_ranks: int):
    """The caller's mask, or None when a fresh one must be used (None given, or
    a mask of the wrong length: the reference silently replaces those; here it
    warns once, since the caller then never sees which ranks were masked)."""
    global _warned_active_ranks_length
    if active_ranks is None:
        return None
    if not isinstance(active_ranks, torch.Tensor) or active_ranks.dim() != 1 \
            or active_ranks.dtype != torch.int32 or not active_ranks.is_contiguous():
        raise TypeError("active_ranks: must be a 1-D contiguous int32 tensor [num_ranks], "
                        f"got {describe(active_ranks)}")
    if active_ranks.numel() != num_ranks:
        if not _warned_active_ranks_length:
            _warned_active_ranks_length = True
            warnings.warn(f"active_ranks: has {active_ranks.numel()} entries, not num_ranks={num_ranks}; a fresh mask "
                          "is used and the caller's tensor is not updated", RuntimeWarning, stacklevel=4)
        return None
    return active_ranks


def check_combine_inputs(x, topk_idx, topk_weights, out, expected_x_shape, state, values: bool = True) -> None:
    """With ``values``, topk_idx must equal the dispatch's (a synchronisation
    on CUDA, so the fast path compares shapes only)."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or tuple(x.shape) != expected_x_shape:
        raise TypeError(f"x: must be a bfloat16 tensor of shape {list(expected_x_shape)} "
                        f"[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden] "
                        f"(the layout of dispatch's recv_x), got {describe(x)}")
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dtype != torch.int64 or topk_idx.dim() != 2:
        raise TypeError("topk_idx: must be the 2-D int64 tensor given to the matching dispatch, "
                        f"got {describe(topk_idx)}")
    if topk_idx.device != state.topk_idx.device:
        raise ValueError(f"topk_idx: must be on the device of the matching dispatch ({state.topk_idx.device})")
    if tuple(topk_idx.shape) != tuple(state.topk_idx.shape) or (values and not torch.equal(topk_idx, state.topk_idx)):
        raise ValueError("handle: belongs to a dispatch with other topk_idx; combine must get the handle and the "
                         "topk_idx of the same dispatch")
    if not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype != torch.float32 \
            or tuple(topk_weights.shape) != tuple(topk_idx.shape):
        raise TypeError(f"topk_weights: must be a float32 tensor shaped like topk_idx {list(topk_idx.shape)}, "
                        f"got {describe(topk_weights)}")
    if topk_weights.device != x.device or topk_idx.device != x.device:
        raise ValueError(f"topk_idx and topk_weights: must be on the device of x ({x.device})")
    if out is not None:
        want = (topk_idx.size(0), x.size(2))
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16 or tuple(out.shape) != want \
                or not out.is_contiguous() or out.device != x.device:
            raise TypeError(f"out: must be a contiguous bfloat16 tensor of shape {list(want)} on {x.device}, "
                            f"got {describe(out)}")
