"""FP8 wire format of dispatch: ``float8_e4m3fn`` data with one float32
scale per token per 128 channels.

amax = max(|x| over the 128 channels, 1e-4); data = saturate(x * (448 / amax));
the stored scale is amax / 448, so dequantisation is data * scale.
Computed in float32, as the kernels do.
"""

from __future__ import annotations

import torch

CHANNELS_PER_SCALE = 128
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, H] bf16 -> ([N, H] float8_e4m3fn, [N, H / 128] float32 scales)."""
    n, h = x.shape
    groups = x.float().view(n, h // CHANNELS_PER_SCALE, CHANNELS_PER_SCALE)
    amax = groups.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    scaled = groups * (E4M3_MAX / amax).unsqueeze(-1)
    # Saturate explicitly: the cast alone does not promise it.
    data = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(n, h)
    return data, amax / E4M3_MAX


def dequantize(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of ``quantize`` up to rounding: [..., H] e4m3 and [..., H / 128] -> [..., H] float32."""
    *lead, h = data.shape
    groups = data.float().reshape(*lead, h // CHANNELS_PER_SCALE, CHANNELS_PER_SCALE)
    return (groups * scales.unsqueeze(-1)).reshape(*lead, h)
