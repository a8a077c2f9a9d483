"""The values of an fp8 call of the Hopper kernel in Gluon, transposed so that each channel's keys are contiguous.

Hopper's tensor cores take an 8-bit B operand from shared memory only K-major (wgmma: "the B matrix of an fp8
product must be K-major"). In ``P @ V`` the contraction runs over the keys, so each channel's keys must lie
contiguous, where ``v`` ``[Tk, H, Dv]`` (usually a strided view of MLA's ``kv``) holds each key's channels
contiguous. :func:`transposed_values` copies ``v`` once per call into ``[H, Dv, width]``, whose ``[Dv, keys]``
blocks the kernel loads through TMA. A TMA load must start on a 16-byte boundary in the contiguous dimension, so
each sequence's keys start on a column that is a multiple of 16 (:func:`sequence_column`), not at its offset in
``v``. The copy reads and writes ``Tk * H * Dv`` bytes once each, as a plain copy of ``v`` does, but at a tenth of its
speed: on an H100, 2.09 ms for 16384 keys at H=128 (a plain copy: 0.18 ms), against about 11.6 ms of fp8 attention
on one causal sequence of them, and 16.40 ms for 131072 keys. Design: docs/design/fp8.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..runtime.capture import on_device
from .launch import CachedLaunch
from .launch import interpreting as _interpreting

__all__ = ["KEY_ALIGNMENT", "sequence_column", "transposed_values", "transposed_width"]

#: Keys (bytes, one e4m3 value each) that a TMA load's start in the contiguous dimension, and a descriptor's row
#: stride, must be a multiple of.
KEY_ALIGNMENT = 16
#: Keys per program: a ``[64, Dv]`` tile (8 KiB at Dv=128) read as whole 128-byte rows, written as 64-byte runs.
_BLOCK_T = 64


def sequence_column(key_start: int, sequence: int) -> int:
    """The column (after ``lead``) of the first key of sequence ``sequence``, whose keys start at row ``key_start`` of
    ``v``: ``key_start`` rounded up to :data:`KEY_ALIGNMENT`, plus that many columns per earlier sequence, so that
    each sequence starts aligned and after the previous one's last key. The kernels compute the same."""
    return -(-key_start // KEY_ALIGNMENT) * KEY_ALIGNMENT + KEY_ALIGNMENT * sequence


def transposed_width(num_tokens: int, num_seqs: int, lead: int) -> int:
    """Columns of the transposed values of ``num_tokens`` key rows in ``num_seqs`` sequences after ``lead``: every
    sequence's keys fit (:func:`sequence_column` of the last one plus its length is at most ``Tk + 16 * B - 1``),
    and the width is a multiple of :data:`KEY_ALIGNMENT` (the descriptors' row stride)."""
    return lead + -(-num_tokens // KEY_ALIGNMENT) * KEY_ALIGNMENT + KEY_ALIGNMENT * num_seqs


@triton.jit(do_not_specialize=["num_tokens", "num_columns", "num_seqs", "search_steps"])  # one variant per shape
def _transpose_kernel(V, Out, CuSeqlens, num_tokens, num_columns, num_seqs, search_steps, stride_vt, stride_vh,
                      stride_oh, stride_od, D: tl.constexpr, BLOCK_T: tl.constexpr, ALIGN: tl.constexpr):  # fmt: skip
    """``Out[h, :, c] = V[key(c), h, :]`` for the ``BLOCK_T`` columns ``c`` of program ``(c // BLOCK_T, h)`` that hold a
    key; bytes (uint8). ``key(c)`` inverts :func:`sequence_column`: the column's sequence ``b`` is the last whose first
    column is at most ``c`` (a binary search of ``search_steps`` steps over ``CuSeqlens``), and ``c`` holds a key when
    it lies within ``b``'s length of that first column. The program walks output columns, not keys, so that its
    stores are whole aligned runs of one channel's columns (vector stores); its loads are whole rows of ``V``."""
    columns = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    channels = tl.arange(0, D)
    # Invariant: sequence lo's first column <= c (or lo = 0), and hi's > c (or hi = num_seqs); mid < num_seqs.
    lo = tl.zeros([BLOCK_T], tl.int32)
    hi = tl.full([BLOCK_T], 0, tl.int32) + num_seqs
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        start = tl.load(CuSeqlens + mid)
        below = (start + ALIGN - 1) // ALIGN * ALIGN + ALIGN * mid <= columns
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    start = tl.load(CuSeqlens + lo)
    first = (start + ALIGN - 1) // ALIGN * ALIGN + ALIGN * lo
    keys = start + columns - first
    ok = (columns < num_columns) & (columns >= first) & (keys < tl.load(CuSeqlens + lo + 1)) & (keys < num_tokens)
    x = tl.load(V + keys.to(tl.int64)[:, None] * stride_vt + h * stride_vh + channels[None, :], mask=ok[:, None])
    out = Out + h.to(tl.int64) * stride_oh + channels[:, None].to(tl.int64) * stride_od + columns[None, :]
    tl.store(out, tl.trans(x), mask=ok[None, :])


_LAUNCHER = CachedLaunch(_transpose_kernel)


def transposed_values(v: torch.Tensor, cu_seqlens: torch.Tensor, lead: int = 0) -> torch.Tensor:
    """``v`` transposed for the fp8 Gluon kernel's ``P @ V``: a new ``[H, Dv, width]`` tensor (contiguous,
    :func:`transposed_width`) whose ``[h, d, lead + sequence_column(cu_seqlens[b], b) + j]`` is
    ``v[cu_seqlens[b] + j, h, d]`` for each key ``j`` of each sequence ``b``; the other columns (the ``lead`` before
    the keys, the gaps that align each sequence, the rows past ``cu_seqlens[-1]``) are left unwritten: the kernel's
    descriptors end at each sequence's last key and its loads start at its first, so it never reads them.

    Args:
        v: ``[Tk, H, Dv]`` ``float8_e4m3fn`` (or any 1-byte dtype), unit stride in its last dimension, any other
            strides; ``Dv`` a power of two.
        cu_seqlens: int32 ``[B + 1]`` on ``v``'s device, the sequences' key offsets (read on the device only).
        lead: columns before the keys, a multiple of :data:`KEY_ALIGNMENT`: the kernel's value descriptor of a
            sequence spans the head's columns from 0 to the sequence's last key, and a TMA descriptor may not be
            narrower than its block (the CUDA driver's rule for descriptors built on the host), which ``lead``
            (one block) ensures for the first sequences of a batch.

    On CUDA (and in Triton's interpreter) one Triton kernel on ``v``'s device and current stream, capturable in a CUDA
    graph; elsewhere PyTorch's copies (they serve the CPU stand-ins that ``benchmarks/compile_sm90.py`` compiles from).
    """
    if lead % KEY_ALIGNMENT or lead < 0:
        raise ValueError(f"transposed_values: lead must be a non-negative multiple of {KEY_ALIGNMENT}, got {lead}")
    num_tokens, num_heads, dim = v.shape
    num_seqs = cu_seqlens.shape[0] - 1
    out = torch.empty((num_heads, dim, transposed_width(num_tokens, num_seqs, lead)), dtype=v.dtype, device=v.device)
    if num_tokens == 0 or num_heads == 0 or num_seqs <= 0:
        return out
    # Bytes either way: the copy moves them unchanged, and the interpreter's numpy has no e4m3.
    src, dst = v.view(torch.uint8), out.view(torch.uint8)[..., lead:]
    if not (v.is_cuda or _interpreting()):
        offsets = cu_seqlens.tolist()
        for b in range(num_seqs):
            first, end = offsets[b], min(offsets[b + 1], num_tokens)
            column = sequence_column(first, b)
            dst[..., column : column + end - first].copy_(src[first:end].permute(1, 2, 0))
        return out
    num_columns = dst.shape[-1]
    grid = (triton.cdiv(num_columns, _BLOCK_T), num_heads)
    args = (
        src, dst, cu_seqlens, num_tokens, num_columns, num_seqs, num_seqs.bit_length(), src.stride(0),
        src.stride(1), dst.stride(0), dst.stride(1),
    )  # fmt: skip
    # Triton specialises the strides and the pointers' alignment: they name the compiled variant.
    key = (v.device.index, args[7:], tuple(t.data_ptr() % 16 == 0 for t in (src, dst, cu_seqlens)), dim)
    with on_device(v.device):
        constexprs = dict(D=dim, BLOCK_T=_BLOCK_T, ALIGN=KEY_ALIGNMENT)
        _LAUNCHER(key, v.device, grid, args, constexprs, leading=3, num_warps=4)
    return out
