"""The kernels of :func:`mla_ops.quantize_fp8` on CUDA: each head's largest magnitude, then ``x * scale[h]`` to e4m3.

PyTorch's eager conversion reads ``x``, writes and reads a float32 copy for the multiply and again for the clamp,
then writes the e4m3 result and copies it into place: about 23 bytes of traffic per element of a bf16 input,
against 3 for the conversion kernel (read 2, write 1). The maxima's kernel reads ``x`` once, in rows of one head,
where PyTorch's reduction over the tokens and channels of a ``[T, H, D]`` tensor keeps the heads apart. The
key-major conversion (:func:`quantize_keys_fp8`) writes the same bytes transposed, each channel's tokens contiguous,
in one pass as well: the layout in which the fp8 ops' Hopper kernel reads ``v``. Design: docs/design/fp8.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..runtime.capture import on_device
from ..specs import FP8_MAX
from .launch import CachedLaunch

__all__ = ["KEY_COLUMNS", "KEY_MAX_DIM", "amax_rows", "key_major_kernel_fits", "quantize_keys_fp8", "quantize_rows_fp8"]

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

#: The maxima's kernel: rows of one head per step, and at most this many steps per program (a program reduces up to
#: 1024 rows of a head, then makes one atomic maximum).
_AMAX_BLOCK_T = 32
_AMAX_STEPS = 32
#: Programs the maxima's kernel spreads a tensor over, at least where it has the rows: two per multiprocessor of a
#: large GPU. With 32 steps for every tensor, 1024 tokens of 16 heads took 16 programs and 67 µs, against 16 µs for
#: PyTorch's reduction (H100).
_AMAX_PROGRAMS = 264


def _amax_steps(num_tokens: int, num_heads: int) -> int:
    """Steps per program of the maxima's kernel: a power of two (few compiled variants), at most ``_AMAX_STEPS``,
    small enough that the programs number ``_AMAX_PROGRAMS`` where the rows allow."""
    per_head = -(-_AMAX_PROGRAMS // num_heads)
    steps = triton.cdiv(triton.cdiv(num_tokens, _AMAX_BLOCK_T), per_head)
    return min(_AMAX_STEPS, triton.next_power_of_2(max(1, steps)))


@triton.jit(do_not_specialize=["num_tokens"])  # one variant for every token count
def _amax_kernel(
    X,
    Bits,
    num_tokens,
    stride_xt,
    stride_xh,
    stride_b,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    STEPS: tl.constexpr,
):
    h = tl.program_id(1)
    cols = tl.arange(0, BLOCK_D)
    first = tl.program_id(0) * (BLOCK_T * STEPS)
    best = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.int32)
    for step in range(STEPS):
        rows = first + step * BLOCK_T + tl.arange(0, BLOCK_T)
        mask = (rows < num_tokens)[:, None] & (cols < D)[None, :]
        x = tl.load(X + rows.to(tl.int64)[:, None] * stride_xt + h * stride_xh + cols[None, :], mask=mask, other=0.0)
        # The bits of |x|: integers ordered as the magnitudes are, a NaN's above infinity's, so that the maximum keeps
        # a NaN (as PyTorch's reduction does) where a float maximum would drop it.
        best = tl.maximum(best, tl.abs(x.to(tl.float32)).to(tl.int32, bitcast=True))
    tl.atomic_max(Bits + h * stride_b, tl.max(tl.max(best, axis=1), axis=0))


_AMAX_LAUNCHER = CachedLaunch(_amax_kernel)


def amax_rows(x: torch.Tensor, per_head: bool) -> torch.Tensor:
    """The largest magnitude of each head of ``x`` (``per_head``) or of all of it, on ``x``'s device (made current for
    the launch) and its current stream; NaN where there is a NaN.

    Args:
        x: ``[T, H, D]``, a floating dtype, unit stride in its last dimension (any other strides), ``T * H > 0``.
        per_head: one maximum per head (float32 ``[H]``), else one for the tensor (float32 ``[]``).

    Nothing is read back to the host, so the call can be captured in a CUDA graph.
    """
    num_tokens, num_heads, dim = x.shape
    bits = torch.zeros(num_heads if per_head else 1, dtype=torch.int32, device=x.device)
    steps = _amax_steps(num_tokens, num_heads)
    grid = (triton.cdiv(num_tokens, _AMAX_BLOCK_T * steps), num_heads)
    args = (x, bits, num_tokens, x.stride(0), x.stride(1), 1 if per_head else 0)
    constexprs = dict(D=dim, BLOCK_D=triton.next_power_of_2(dim), BLOCK_T=_AMAX_BLOCK_T, STEPS=steps)
    key = (x.device.index, x.dtype, args[3:], tuple(t.data_ptr() % 16 == 0 for t in (x, bits)), dim, steps)
    with on_device(x.device):
        _AMAX_LAUNCHER(key, x.device, grid, args, constexprs, leading=2, num_warps=4)
    amax = bits.view(torch.float32)
    return amax if per_head else amax.reshape(())


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


#: The key-major conversion's words of 4 tokens per program: 128 tokens, a ``[32, D]`` int32 tile (16 KiB at D=128)
#: stored as 128-byte runs of each channel's row (the tiling of :mod:`mla_ops.kernels.transpose`).
_KEYS_BLOCK_W = 32
#: Tokens per program of the key-major conversion: the width of its output must be a multiple of this.
KEY_COLUMNS = 4 * _KEYS_BLOCK_W
#: The head dimensions the key-major conversion kernel takes: powers of two up to this. With Triton 3.6 on an H100
#: (2026-12-06) it wrote wrong bytes (0xFC in every fourth channel from the second program on) for float32 inputs at
#: D=128 and for bfloat16 ones at D=192 (a 256-channel tile with a mask), and right ones for 16-bit inputs at D=64 and
#: 128; :func:`key_major_kernel_fits` keeps it to what was right.
KEY_MAX_DIM = 128


def key_major_kernel_fits(x: torch.Tensor) -> bool:
    """Whether :func:`quantize_keys_fp8` takes ``x``: a 16-bit floating dtype, and a head dimension that is a power
    of two up to :data:`KEY_MAX_DIM` (see there); elsewhere :func:`mla_ops.quantize_fp8` uses PyTorch's operators."""
    dim = x.shape[-1]
    return x.element_size() == 2 and 0 < dim <= KEY_MAX_DIM and dim & (dim - 1) == 0


@triton.jit(do_not_specialize=["num_tokens"])  # one variant for every token count
def _quantize_keys_kernel(
    X,
    Out,
    Scale,
    num_tokens,
    stride_xt,
    stride_xh,
    stride_oh,
    stride_od,
    stride_s,
    D: tl.constexpr,
    BLOCK_W: tl.constexpr,
    FP8_LIMIT: tl.constexpr,
):
    """``Out[h, :, c] = e4m3(clamp(X[c, h, :] * Scale[h]))`` for the ``4 * BLOCK_W`` columns ``c`` of program
    ``(c // (4 * BLOCK_W), h)``, 0 for the columns from ``num_tokens`` on; ``Out`` is the int32 view of the e4m3
    storage, its strides in words. Each word packs the bytes of 4 consecutive tokens, so the tile that changes layout
    between the loads (a token's channels contiguous) and the stores (a channel's tokens contiguous) is of int32, not
    of single bytes."""
    words = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)  # all in the row: the grid tiles it exactly
    h = tl.program_id(1)
    channels = tl.arange(0, D)
    scale = tl.load(Scale + h * stride_s)
    packed = tl.zeros([BLOCK_W, D], tl.int32)
    for byte in tl.static_range(4):
        tokens = words * 4 + byte
        ok = tokens < num_tokens
        rows = X + tokens.to(tl.int64)[:, None] * stride_xt + h * stride_xh + channels[None, :]
        x = tl.load(rows, mask=ok[:, None], other=0.0)
        # As _quantize_kernel converts: the same products, clamp (NaN kept) and rounding, so the same bytes.
        y = tl.clamp(x.to(tl.float32) * scale, -FP8_LIMIT, FP8_LIMIT, propagate_nan=tl.PropagateNan.ALL)
        bits = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
        # The columns past the last token get 0, whatever the factor (0 times a NaN or infinite one is NaN).
        bits = tl.where(ok[:, None], bits, 0)
        packed = packed | (bits << (8 * byte))  # little-endian: column 4w + byte is byte `byte` of word w
    out = Out + h.to(tl.int64) * stride_oh + channels[:, None].to(tl.int64) * stride_od + words[None, :]
    # The programs tile the words exactly, so the stores need no mask and go out as vectors: a mask that varies along
    # the words makes Triton store each one alone.
    tl.store(out, tl.trans(packed))


_KEYS_LAUNCHER = CachedLaunch(_quantize_keys_kernel)


def quantize_keys_fp8(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write ``clamp(x * scale[h], -448, 448)`` rounded to e4m3 into ``out`` transposed, ``out[h, d, t] = x[t, h, d]``
    converted, and 0 into ``out[h, d, T:]``; on ``x``'s device (made current for the launch) and its current stream.
    The bytes are those of :func:`quantize_rows_fp8`.

    Args:
        x: ``[T, H, D]``, bfloat16 or float16, unit stride in its last dimension (any other strides), ``D`` a power
            of two up to :data:`KEY_MAX_DIM` (:func:`key_major_kernel_fits`).
        scale: float32 ``[H]`` (a stride-0 view for one factor), the inverse of the descale factors.
        out: ``[H, D, W]`` ``float8_e4m3fn``, contiguous, ``W >= T`` a multiple of :data:`KEY_COLUMNS` (the programs
            tile it exactly).

    Returns ``out``. Nothing is read back to the host, so the call can be captured in a CUDA graph.
    """
    num_tokens, num_heads, dim = x.shape
    if not key_major_kernel_fits(x):
        raise ValueError(
            f"quantize_keys_fp8: x must be bfloat16 or float16 with a power-of-two head dimension up to {KEY_MAX_DIM}, "
            f"got {x.dtype} with {dim}"
        )
    width = out.shape[-1]
    if out.shape != (num_heads, dim, width) or not out.is_contiguous() or width % KEY_COLUMNS or width < num_tokens:
        raise ValueError(
            f"quantize_keys_fp8: out must be a contiguous [H, D, W] = [{num_heads}, {dim}, W] tensor with W >= "
            f"{num_tokens} a multiple of {KEY_COLUMNS}, got shape {tuple(out.shape)} and strides {out.stride()}"
        )
    if num_heads == 0:
        return out
    words = out.view(torch.uint8).view(torch.int32)  # bytes as words of 4 columns (the interpreter has no e4m3)
    grid = (words.shape[-1] // _KEYS_BLOCK_W, num_heads)
    args = (x, words, scale, num_tokens, x.stride(0), x.stride(1), words.stride(0), words.stride(1), scale.stride(0))
    constexprs = dict(D=dim, BLOCK_W=_KEYS_BLOCK_W, FP8_LIMIT=FP8_MAX)
    # Triton specialises the strides and the pointers' alignment: they name the compiled variant.
    key = (x.device.index, x.dtype, args[4:], tuple(t.data_ptr() % 16 == 0 for t in (x, words, scale)), dim)
    with on_device(x.device):
        _KEYS_LAUNCHER(key, x.device, grid, args, constexprs, leading=3, num_warps=4)
    return out
