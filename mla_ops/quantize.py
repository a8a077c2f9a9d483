"""Quantisation of attention inputs to fp8 for the fp8 ops (:func:`mla_ops.prefill_fp8`).

:func:`quantize_fp8` scales each head (or the whole tensor) so that its largest magnitude maps to the largest
finite e4m3 value, and returns the factor that undoes it. Engines whose cache is fp8 already pass their own
tensors and factors to the ops instead. On CUDA the maxima and the conversion are one Triton kernel each
(:mod:`mla_ops.kernels.quantize`) where Triton is installed; elsewhere, and under ``torch.compile`` (whose Inductor
fuses it), PyTorch's operators. Design: docs/design/fp8.md.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from .specs import FP8_DTYPE, FP8_MAX

__all__ = ["quantize_fp8"]

#: Elements converted per step by PyTorch's operators in eager mode: the float32 intermediate of one step stays
#: within 256 MiB.
_STEP_ELEMENTS = 1 << 26
#: From this many elements on, the maxima come from the Triton kernel; below, from PyTorch's reduction, which costs
#: less there. quantize_fp8 of bf16 [T, H, 192] with each (H100, Triton 3.6, 2026-12-06), reduction / kernel: 0.81 to
#: 0.88 up to 25.2M elements (1024 x 128), 1.11 at 50.3M (16384 x 16) and 1.40 to 1.46 from 100.7M (4096 x 128) up.
_KERNEL_AMAX_ELEMENTS = 1 << 25


@functools.cache
def _cuda_kernels() -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]] | None:
    """:func:`mla_ops.kernels.quantize.amax_rows` and :func:`~mla_ops.kernels.quantize.quantize_rows_fp8`, or
    ``None`` where Triton does not import."""
    try:
        from .kernels.quantize import amax_rows, quantize_rows_fp8
    except ImportError:
        return None
    return amax_rows, quantize_rows_fp8


def quantize_fp8(x: torch.Tensor, per_head: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x`` to ``float8_e4m3fn`` with one factor per head (or one for the tensor).

    Args:
        x: ``[T, H, D]``, any floating dtype, any strides (e.g. ``v`` as a view of a wider ``kv``).
        per_head: one factor per head (``[H]``), else one for the whole tensor (``[]``).

    Returns:
        ``(x_fp8, descale)``: ``x_fp8`` ``[T, H, D]`` contiguous ``float8_e4m3fn``, and ``descale`` float32
        (``[H]`` or ``[]``) with ``x ≈ x_fp8.float() * descale`` on each head. A head (or tensor) of zeros or
        with no rows gets the factor 1.

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
    num_tokens, num_heads, head_dim = x.shape
    if x.numel() == 0:
        descale = torch.ones(num_heads if per_head else (), dtype=torch.float32, device=x.device)
        return torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device), descale
    kernels = None
    if x.is_cuda and x.stride(2) == 1 and not torch.compiler.is_compiling():
        kernels = _cuda_kernels()
    if kernels is not None and x.numel() >= _KERNEL_AMAX_ELEMENTS:
        amax = kernels[0](x, per_head)
    else:  # the largest magnitude per head, by a reduction that materialises nothing the size of x
        amax = torch.linalg.vector_norm(x, ord=math.inf, dim=(0, 2) if per_head else (0, 1, 2)).float()
    # Times the reciprocal rather than a division: PyTorch's CUDA division by a scalar multiplies by its reciprocal,
    # so a division would give CUDA and CPU factors an ulp apart (measured on the H200); this is one on every device.
    descale = torch.where(amax > 0, amax * (1.0 / FP8_MAX), 1.0)
    scale = 1.0 / descale
    out = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    if kernels is not None:
        return kernels[1](x, scale.reshape(-1).expand(num_heads), out), descale
    if per_head:
        scale = scale.reshape(-1, 1)
    # Under torch.compile the conversion is one fused kernel; eagerly each step materialises its float32 rows, so
    # steps of bounded size keep that intermediate small (a 128k-token q would otherwise need 13 GB).
    rows = num_tokens if torch.compiler.is_compiling() else max(1, _STEP_ELEMENTS // (num_heads * head_dim))
    for start in range(0, num_tokens, rows):
        part = x[start : start + rows].float() * scale
        out[start : start + rows] = part.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return out, descale
