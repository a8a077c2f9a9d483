"""The conversion kernel of :func:`mla_ops.quantize_fp8` on CUDA: ``x * scale[h]`` to e4m3, in one pass.

PyTorch's eager conversion reads ``x``, writes and reads a float32 copy for the multiply and again for the clamp,
then writes the e4m3 result and copies it into place: about 23 bytes of traffic per element of a bf16 input,
against 3 for this kernel (read 2, write 1). The per-head maxima come from one PyTorch reduction before it.
Design: docs/design/fp8.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..runtime.capture import on_device
from ..specs import FP8_MAX
from .launch import CachedLaunch

__all__ = ["quantize_rows_fp8"]

#: Rows of one head per program: with 192 channels (256 with the mask) a program converts 8 KiB of bf16.
_BLOCK_T = 16


@triton.jit(do_not_specialize=["num_tokens"])  # one variant for every token count
def _quantize_kernel(
    X,
    Out,
    Scale,
    num_tokens,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_s,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    FP8_LIMIT: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < num_tokens)[:, None] & (cols < D)[None, :]
    rows = rows.to(tl.int64)
    x = tl.load(X + rows[:, None] * stride_xt + h * stride_xh + cols[None, :], mask=mask, other=0.0)
    # NaN stays NaN (as PyTorch's clamp keeps it), so that a NaN input shows in the attention's output.
    y = x.to(tl.float32) * tl.load(Scale + h * stride_s)
    y = tl.clamp(y, -FP8_LIMIT, FP8_LIMIT, propagate_nan=tl.PropagateNan.ALL)
    tl.store(Out + rows[:, None] * stride_ot + h * stride_oh + cols[None, :], y.to(Out.dtype.element_ty), mask=mask)


_LAUNCHER = CachedLaunch(_quantize_kernel)


def quantize_rows_fp8(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write ``clamp(x * scale[h], -448, 448)`` rounded to e4m3 into ``out``, on ``x``'s device (made current for
    the launch) and its current stream.

    Args:
        x: ``[T, H, D]``, a floating dtype, unit stride in its last dimension (any other strides).
        scale: float32 ``[H]`` (a stride-0 view for one factor), the inverse of the descale factors.
        out: ``[T, H, D]`` ``float8_e4m3fn``, unit stride in its last dimension.

    Returns ``out``. Nothing is read back to the host, so the call can be captured in a CUDA graph.
    """
    num_tokens, num_heads, dim = x.shape
    if num_tokens == 0 or num_heads == 0:
        return out
    grid = (triton.cdiv(num_tokens, _BLOCK_T), num_heads)
    args = (x, out, scale, num_tokens, x.stride(0), x.stride(1), out.stride(0), out.stride(1), scale.stride(0))
    constexprs = dict(D=dim, BLOCK_D=triton.next_power_of_2(dim), BLOCK_T=_BLOCK_T, FP8_LIMIT=FP8_MAX)
    # Triton specialises the strides and the pointers' alignment: they name the compiled variant.
    key = (x.device.index, x.dtype, args[4:], tuple(t.data_ptr() % 16 == 0 for t in (x, out, scale)), dim)
    with on_device(x.device):
        _LAUNCHER(key, x.device, grid, args, constexprs, leading=3, num_warps=4)
    return out
