"""The values of an fp8 call of the Hopper kernel in Gluon, transposed so that each channel's keys are contiguous.

Hopper's tensor cores take an 8-bit B operand from shared memory only K-major (wgmma: "the B matrix of an fp8
product must be K-major"). In ``P @ V`` the contraction runs over the keys, so each channel's keys must lie
contiguous, where ``v`` ``[Tk, H, Dv]`` (usually a strided view of MLA's ``kv``) holds each key's channels
contiguous. :func:`transposed_values` copies ``v`` once per call into ``[H, Dv, lead + Tk_pad]`` (``Tk_pad`` is
``Tk`` rounded up to 16, key ``t`` in column ``lead + t``), whose ``[Dv, keys]`` blocks the kernel loads through TMA.
The copy reads and writes ``Tk * H * Dv`` bytes once each; at the lengths where fp8 attention pays that is about
1 % of the attention's time (an estimate, not a measurement: 16k causal tokens at H=128 move 2 x 268 MB, about
0.13 ms at 4 TB/s, against 11 TFLOP of attention, about 11 ms at 1 PFLOP/s).
Design: docs/design/fp8.md.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..runtime.capture import on_device
from .launch import CachedLaunch

__all__ = ["KEY_ALIGNMENT", "transposed_values"]

#: Keys the transposed rows are padded to a multiple of: a TMA descriptor's row stride must be a multiple of 16
#: bytes, one e4m3 value a byte.
KEY_ALIGNMENT = 16
#: Keys per program: a ``[64, Dv]`` tile (8 KiB at Dv=128) read as whole 128-byte rows, written as 64-byte runs.
_BLOCK_T = 64


@triton.jit(do_not_specialize=["num_tokens"])  # one variant for every token count
def _transpose_kernel(V, Out, num_tokens, stride_vt, stride_vh, stride_oh, stride_od, D: tl.constexpr,
                      BLOCK_T: tl.constexpr):  # fmt: skip
    """``Out[h, :, t] = V[t, h, :]`` for the ``BLOCK_T`` keys of program ``(t // BLOCK_T, h)``; bytes (uint8)."""
    keys = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    channels = tl.arange(0, D)
    ok = keys < num_tokens
    x = tl.load(V + keys.to(tl.int64)[:, None] * stride_vt + h * stride_vh + channels[None, :], mask=ok[:, None])
    out = Out + h.to(tl.int64) * stride_oh + channels[:, None].to(tl.int64) * stride_od + keys[None, :]
    tl.store(out, tl.trans(x), mask=ok[None, :])


_LAUNCHER = CachedLaunch(_transpose_kernel)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def transposed_values(v: torch.Tensor, lead: int = 0) -> torch.Tensor:
    """``v`` transposed for the fp8 Gluon kernel's ``P @ V``: a new ``[H, Dv, lead + Tk_pad]`` tensor (contiguous,
    ``Tk_pad`` ``Tk`` rounded up to :data:`KEY_ALIGNMENT`) whose ``[h, d, lead + t]`` is ``v[t, h, d]``; the ``lead``
    columns before the keys and those from ``lead + Tk`` on are left unwritten (the kernel's descriptors end at each
    sequence's last key, and its loads start at its first: it never reads them).

    Args:
        v: ``[Tk, H, Dv]`` ``float8_e4m3fn`` (or any 1-byte dtype), unit stride in its last dimension, any other
            strides; ``Dv`` a power of two.
        lead: columns before the first key, a multiple of :data:`KEY_ALIGNMENT`: the kernel's value descriptor of a
            sequence spans the head's columns from 0 to the sequence's last key, and a TMA descriptor must extend
            at least one block in its contiguous dimension, which ``lead`` (one block) ensures for the first
            sequences of a batch.

    On CUDA (and in Triton's interpreter) one Triton kernel on ``v``'s device and current stream, capturable in a CUDA
    graph; elsewhere PyTorch's copy (it serves the CPU stand-ins that ``benchmarks/compile_sm90.py`` compiles from).
    """
    if lead % KEY_ALIGNMENT or lead < 0:
        raise ValueError(f"transposed_values: lead must be a non-negative multiple of {KEY_ALIGNMENT}, got {lead}")
    num_tokens, num_heads, dim = v.shape
    padded = triton.cdiv(num_tokens, KEY_ALIGNMENT) * KEY_ALIGNMENT
    out = torch.empty((num_heads, dim, lead + padded), dtype=v.dtype, device=v.device)
    if num_tokens == 0 or num_heads == 0:
        return out
    # Bytes either way: the copy moves them unchanged, and the interpreter's numpy has no e4m3.
    src, dst = v.view(torch.uint8), out.view(torch.uint8)[..., lead:]
    if not (v.is_cuda or _interpreting()):
        dst[..., :num_tokens].copy_(src.permute(1, 2, 0))
        return out
    grid = (triton.cdiv(num_tokens, _BLOCK_T), num_heads)
    args = (src, dst, num_tokens, src.stride(0), src.stride(1), dst.stride(0), dst.stride(1))
    # Triton specialises the strides and the pointers' alignment: they name the compiled variant.
    key = (v.device.index, args[3:], tuple(t.data_ptr() % 16 == 0 for t in (src, dst)), dim)
    with on_device(v.device):
        _LAUNCHER(key, v.device, grid, args, dict(D=dim, BLOCK_T=_BLOCK_T), leading=2, num_warps=4)
    return out
