"""Quantisation of attention inputs to fp8 for the fp8 ops (:func:`mla_ops.prefill_fp8`).

:func:`quantize_fp8` scales each head (or the whole tensor) so that its largest magnitude maps to the largest
finite e4m3 value, and returns the factor that undoes it. Engines whose cache is fp8 already pass their own
tensors and factors to the ops instead. On CUDA the maxima and the conversion are one Triton kernel each
(:mod:`mla_ops.kernels.quantize`) where Triton is installed; elsewhere, and under ``torch.compile`` (whose Inductor
fuses it), PyTorch's operators. With ``key_major=True`` the result is laid out with each channel's tokens contiguous
(for ``v``: the layout the fp8 ops' Hopper kernel reads without a transposed copy). Design: docs/design/fp8.md.
"""

from __future__ import annotations

import functools
import math
from types import ModuleType

import torch

from .specs import FP8_DTYPE, FP8_MAX

__all__ = ["quantize_fp8"]

#: Elements converted per step by PyTorch's operators in eager mode: the float32 intermediate of one step stays
#: within 256 MiB.
_STEP_ELEMENTS = 1 << 26
#: The key-major storage's columns are the tokens rounded up to a multiple of this, plus this many while that is a
#: power of two: the width that the key-major conversion kernel's programs tile exactly
#: (:data:`mla_ops.kernels.quantize.KEY_COLUMNS`, which a test holds equal), a multiple of 16 (the 16-byte alignment a
#: TMA load's rows need), and no power of two, as the Gluon kernel's transposed copy's rows are not (its lead columns),
#: so that the kernel's loads meet the strides they were measured with; whether a power of two would cost anything is
#: not measured. 16 for an empty tensor.
_KEY_MAJOR_COLUMNS = 128
#: From this many elements on, the maxima come from the Triton kernel; below, from PyTorch's reduction, which costs
#: less there. quantize_fp8 of bf16 [T, H, 192] with each (H100, Triton 3.6, 2026-12-06), reduction / kernel: 0.81 to
#: 0.88 up to 25.2M elements (1024 x 128), 1.11 at 50.3M (16384 x 16) and 1.40 to 1.46 from 100.7M (4096 x 128) up.
_KERNEL_AMAX_ELEMENTS = 1 << 25


@functools.cache
def _cuda_kernels() -> ModuleType | None:
    """:mod:`mla_ops.kernels.quantize` (the maxima's and the conversions' Triton kernels), or ``None`` where Triton
    does not import."""
    try:
        from .kernels import quantize
    except ImportError:
        return None
    return quantize


def _key_major_storage(
    num_tokens: int, num_heads: int, head_dim: int, device: torch.device, zeroed: bool
) -> torch.Tensor:
    """The contiguous ``[H, D, W]`` storage of a key-major result (``W``: :data:`_KEY_MAJOR_COLUMNS`), of bytes
    (uint8): Inductor cannot fill an e4m3 tensor's slice ("Promotion for Float8 Types is not supported"), so
    PyTorch's steps write the bytes of their e4m3 values (:func:`_tokens`), and :func:`_key_major` views the storage
    as e4m3."""
    width = -(-num_tokens // _KEY_MAJOR_COLUMNS) * _KEY_MAJOR_COLUMNS if num_tokens > 0 else 16
    while num_tokens > 0 and width & (width - 1) == 0:  # no power of two (see _KEY_MAJOR_COLUMNS)
        width += _KEY_MAJOR_COLUMNS
    make = torch.zeros if zeroed else torch.empty
    return make((num_heads, head_dim, width), dtype=torch.uint8, device=device)


def _tokens(storage: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[T, H, D]``, the tokens' columns of a key-major ``storage`` ``[H, D, W]``, for writing."""
    return storage[:, :, :num_tokens].permute(2, 0, 1)


def _key_major(storage: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The key-major result ``[T, H, D]`` on ``storage`` ``[H, D, W]`` (uint8), as e4m3. ``as_strided`` rather than
    a slice and a permute: from those, Inductor (torch 2.13) returns a contiguous copy when ``W == T``."""
    num_heads, head_dim, width = storage.shape
    fp8 = storage.view(FP8_DTYPE)
    return torch.as_strided(fp8, (num_tokens, num_heads, head_dim), (1, head_dim * width, width))


def quantize_fp8(
    x: torch.Tensor, per_head: bool = True, *, key_major: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x`` to ``float8_e4m3fn`` with one factor per head (or one for the tensor).

    Args:
        x: ``[T, H, D]``, any floating dtype, any strides (e.g. ``v`` as a view of a wider ``kv``).
        per_head: one factor per head (``[H]``), else one for the whole tensor (``[]``).
        key_major: lay the result out with each channel's tokens contiguous, for ``v`` (the fp8 ops accept this
            layout for ``v`` only). It is the layout in which the fp8 ops' Hopper kernel reads the values of a
            one-sequence call without first copying them transposed: fp8 wgmma takes its B operand only K-major, and
            in ``P @ V`` the keys are K. Same values and factors as without it, bit for bit.

    Returns:
        ``(x_fp8, descale)``: ``x_fp8`` ``[T, H, D]`` ``float8_e4m3fn``, and ``descale`` float32 (``[H]`` or ``[]``)
        with ``x ≈ x_fp8.float() * descale`` on each head. A head (or tensor) of zeros or with no rows gets the
        factor 1. ``x_fp8`` is contiguous, or with ``key_major`` the view ``storage[:, :, :T].permute(2, 0, 1)`` of
        a contiguous ``storage`` ``[H, D, W]``: strides ``(1, D * W, W)``, ``W`` = ``T`` rounded up to a multiple
        of 128, plus 128 while that is a power of two (the Triton kernel's programs' width; a multiple of 16 as TMA
        needs; 16 when ``T`` is 0), and the columns from ``T`` on hold 0.

    No value is read on the host, so the call can be captured in a CUDA graph and traced by torch.compile.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize_fp8: x must be a torch.Tensor [T, H, D], got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"quantize_fp8: x must be a 3-D tensor [T, H, D], got shape {tuple(x.shape)}")
    if not x.is_floating_point() or x.dtype == FP8_DTYPE:
        raise TypeError(
            f"quantize_fp8: x must be a floating tensor of a wider dtype than fp8 (e.g. bfloat16), got {x.dtype}"
        )
    if not isinstance(per_head, bool):
        raise TypeError(f"quantize_fp8: per_head must be True or False, got {type(per_head).__name__}")
    if not isinstance(key_major, bool):
        raise TypeError(f"quantize_fp8: key_major must be True or False, got {type(key_major).__name__}")
    num_tokens, num_heads, head_dim = x.shape
    if x.numel() == 0:
        descale = torch.ones(num_heads if per_head else (), dtype=torch.float32, device=x.device)
        if key_major:
            storage = _key_major_storage(num_tokens, num_heads, head_dim, x.device, zeroed=True)
            return _key_major(storage, num_tokens), descale
        return torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device), descale
    kernels = None
    if x.is_cuda and x.stride(2) == 1 and not torch.compiler.is_compiling():
        kernels = _cuda_kernels()
    if kernels is not None and x.numel() >= _KERNEL_AMAX_ELEMENTS:
        amax = kernels.amax_rows(x, per_head)
    else:  # the largest magnitude per head, by a reduction that materialises nothing the size of x
        amax = torch.linalg.vector_norm(x, ord=math.inf, dim=(0, 2) if per_head else (0, 1, 2)).float()
    # Times the reciprocal rather than a division: PyTorch's CUDA division by a scalar multiplies by its reciprocal,
    # so a division would give CUDA and CPU factors an ulp apart (measured on the H200); this is one on every device.
    descale = torch.where(amax > 0, amax * (1.0 / FP8_MAX), 1.0)
    scale = 1.0 / descale
    if key_major:
        # The kernel writes every column of the storage; PyTorch's steps write the tokens' columns of a zeroed one.
        # The kernel takes 16-bit inputs with D a power of two up to 128 (kernels.quantize.KEY_MAX_DIM says why).
        kernel = kernels is not None and kernels.key_major_kernel_fits(x)
        storage = _key_major_storage(num_tokens, num_heads, head_dim, x.device, zeroed=not kernel)
        if kernel:
            kernels.quantize_keys_fp8(x, scale.reshape(-1).expand(num_heads), storage.view(FP8_DTYPE))
        else:
            _convert(x, scale, per_head, _tokens(storage, num_tokens))
        return _key_major(storage, num_tokens), descale
    out = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    if kernels is not None:
        return kernels.quantize_rows_fp8(x, scale.reshape(-1).expand(num_heads), out), descale
    return _convert(x, scale, per_head, out), descale


def _convert(x: torch.Tensor, scale: torch.Tensor, per_head: bool, out: torch.Tensor) -> torch.Tensor:
    """Write ``x * scale`` clamped and rounded to e4m3 into ``out`` (``[T, H, D]``, any strides; e4m3, or uint8 for
    the values' bytes) with PyTorch's operators, and return ``out``."""
    num_tokens, num_heads, head_dim = x.shape
    if per_head:
        scale = scale.reshape(-1, 1)
    # Under torch.compile the conversion is one fused kernel; eagerly each step materialises its float32 rows, so
    # steps of bounded size keep that intermediate small (a 128k-token q would otherwise need 13 GB).
    rows = num_tokens if torch.compiler.is_compiling() else max(1, _STEP_ELEMENTS // (num_heads * head_dim))
    for start in range(0, num_tokens, rows):
        part = x[start : start + rows].float() * scale
        out[start : start + rows] = part.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(out.dtype)
    return out
