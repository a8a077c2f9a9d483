"""The values of an fp8 call of the Hopper kernel in Gluon, transposed so that each channel's keys are contiguous.

Hopper's tensor cores take an 8-bit B operand from shared memory only K-major (wgmma: "the B matrix of an fp8
product must be K-major"). In ``P @ V`` the contraction runs over the keys, so each channel's keys must lie
contiguous, where ``v`` ``[Tk, H, Dv]`` (usually a strided view of MLA's ``kv``) holds each key's channels
contiguous. :func:`transposed_values` copies ``v`` once per call into ``[H, Dv, width]``, whose ``[Dv, keys]``
blocks the kernel loads through TMA. A TMA load must start on a 16-byte boundary in the contiguous dimension, so
each sequence's keys start on a column that is a multiple of 16 (:func:`sequence_column`), not at its offset in
``v``. The copy reads and writes ``Tk * H * Dv`` bytes once each, as a plain copy of ``v`` does, at nearly its speed:
on an H100, 0.197 ms for 16384 keys at H=128 (a plain copy: 0.182 ms), against about 11.8 ms of fp8 attention on
one causal sequence of them. Design: docs/design/fp8.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..runtime.capture import on_device
from .launch import CachedLaunch, FixedLaunch, LaunchPlan
from .launch import interpreting as _interpreting

__all__ = ["KEY_ALIGNMENT", "copy_plan", "copy_relaunch", "sequence_column", "transposed_values", "transposed_width"]

#: Keys (bytes, one e4m3 value each) that a TMA load's start in the contiguous dimension, and a descriptor's row
#: stride, must be a multiple of.
KEY_ALIGNMENT = 16
#: Words of 4 columns per program: 128 keys, a ``[32, Dv]`` int32 tile (16 KiB at Dv=128) read as whole 128-byte
#: rows, written as 128-byte runs.
_BLOCK_W = 32
#: Columns per program of the copy.
_PROGRAM_COLUMNS = 4 * _BLOCK_W


def sequence_column(key_start: int, sequence: int) -> int:
    """The column (after ``lead``) of the first key of sequence ``sequence``, whose keys start at row ``key_start`` of
    ``v``: ``key_start`` rounded up to :data:`KEY_ALIGNMENT`, plus that many columns per earlier sequence, so that
    each sequence starts aligned and after the previous one's last key. The kernels compute the same."""
    return -(-key_start // KEY_ALIGNMENT) * KEY_ALIGNMENT + KEY_ALIGNMENT * sequence


def transposed_width(num_tokens: int, num_seqs: int, lead: int) -> int:
    """Columns of the transposed values of ``num_tokens`` key rows in ``num_seqs`` sequences after ``lead``: every
    sequence's keys fit (:func:`sequence_column` of the last one plus its length is at most ``Tk + 16 * B - 1``),
    and the columns after ``lead`` are a multiple of :data:`_PROGRAM_COLUMNS` (so the copy's programs tile them
    exactly and store without a mask, in 16-byte vectors), hence of :data:`KEY_ALIGNMENT` (the descriptors' row
    stride)."""
    keys = -(-num_tokens // KEY_ALIGNMENT) * KEY_ALIGNMENT + KEY_ALIGNMENT * num_seqs
    return lead + -(-keys // _PROGRAM_COLUMNS) * _PROGRAM_COLUMNS


@triton.jit(do_not_specialize=["num_tokens", "num_seqs", "search_steps"])  # one variant per shape
def _transpose_kernel(V, Out, CuSeqlens, num_tokens, num_seqs, search_steps, stride_vt, stride_vh,
                      stride_oh, stride_od, D: tl.constexpr, BLOCK_W: tl.constexpr, ALIGN: tl.constexpr):  # fmt: skip
    """``Out[h, :, c] = V[key(c), h, :]`` for the ``4 * BLOCK_W`` columns ``c`` of program ``(c // (4 * BLOCK_W), h)``
    that hold a key, written as int32 words of 4 columns (``Out`` is the int32 view, its strides in words; ``V`` bytes).
    ``key(c)`` inverts :func:`sequence_column`: a word's sequence ``b`` is the last whose first column is at most the
    word's first (a binary search of ``search_steps`` steps over ``CuSeqlens``); a sequence's columns start on a
    multiple of 16, so each word's keys are of one sequence, and a column holds a key when it lies within ``b``'s
    length of that first column (the others get 0; the kernel never reads them). Each word packs the bytes of 4
    consecutive keys, so the tile that changes layout between the loads (a key's channels contiguous) and the stores
    (a channel's columns contiguous) is of int32, not of single bytes."""
    words = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)  # all in the row: the grid tiles it exactly
    h = tl.program_id(1)
    channels = tl.arange(0, D)
    columns = words * 4
    # Invariant: sequence lo's first column <= the word's (or lo = 0), and hi's > it (or hi = num_seqs).
    lo = tl.zeros([BLOCK_W], tl.int32)
    hi = tl.full([BLOCK_W], 0, tl.int32) + num_seqs
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        start = tl.load(CuSeqlens + mid)
        below = (start + ALIGN - 1) // ALIGN * ALIGN + ALIGN * mid <= columns
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    start = tl.load(CuSeqlens + lo)
    end = tl.minimum(tl.load(CuSeqlens + lo + 1), num_tokens)
    first = (start + ALIGN - 1) // ALIGN * ALIGN + ALIGN * lo
    packed = tl.zeros([BLOCK_W, D], tl.int32)
    for byte in tl.static_range(4):
        keys = start + columns + byte - first
        ok = (columns + byte >= first) & (keys < end)
        rows = V + keys.to(tl.int64)[:, None] * stride_vt + h * stride_vh + channels[None, :]
        x = tl.load(rows, mask=ok[:, None], other=0)
        packed = packed | (x.to(tl.int32) << (8 * byte))  # little-endian: column 4w + byte is byte `byte`
    out = Out + h.to(tl.int64) * stride_oh + channels[:, None].to(tl.int64) * stride_od + words[None, :]
    # The programs tile the words exactly (transposed_width), so the stores need no mask and go out as vectors: a
    # mask that varies along the words (as a key's would) makes Triton store each one alone.
    tl.store(out, tl.trans(packed))


_LAUNCHER = CachedLaunch(_transpose_kernel)


def transposed_values(v: torch.Tensor, cu_seqlens: torch.Tensor, lead: int = 0) -> torch.Tensor:
    """``v`` transposed for the fp8 Gluon kernel's ``P @ V``: a new ``[H, Dv, width]`` tensor (contiguous,
    :func:`transposed_width`) whose ``[h, d, lead + sequence_column(cu_seqlens[b], b) + j]`` is
    ``v[cu_seqlens[b] + j, h, d]`` for each key ``j`` of each sequence ``b``. The other columns hold no key: the
    ``lead`` before the keys is left unwritten; the gaps that align each sequence and the columns past the last key
    get 0 from the Triton kernel (its programs store whole rows of words) and are left unwritten by PyTorch's copies.
    The kernel's descriptors end at each sequence's last key and its loads start at its first, so it never reads them.

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
    if not (v.is_cuda or _interpreting()):
        # Bytes either way: the copy moves them unchanged, and the interpreter's numpy has no e4m3.
        src, dst = v.view(torch.uint8), out.view(torch.uint8)[..., lead:]
        offsets = cu_seqlens.tolist()
        for b in range(num_seqs):
            first, end = offsets[b], min(offsets[b + 1], num_tokens)
            column = sequence_column(first, b)
            dst[..., column : column + end - first].copy_(src[first:end].permute(1, 2, 0))
        return out
    plan = copy_plan(v, cu_seqlens, out, lead)
    with on_device(v.device):
        _LAUNCHER.launch(plan, v.device)
    return out


def copy_plan(v: torch.Tensor, cu_seqlens: torch.Tensor, out: torch.Tensor, lead: int) -> LaunchPlan:
    """The copy kernel's launch into ``out`` (:func:`transposed_values`'s, of :func:`transposed_width` columns) as a
    :class:`~mla_ops.kernels.launch.LaunchPlan`; the tensors may be CPU stand-ins with the GPU ones' shapes, strides
    and alignment (``benchmarks/compile_sm90.py`` compiles it for sm_90a from them)."""
    num_tokens, num_heads, dim = v.shape
    num_seqs = cu_seqlens.shape[0] - 1
    src = v.view(torch.uint8)  # bytes: the copy moves them unchanged, and the interpreter's numpy has no e4m3
    # Words of 4 columns: the width and lead are multiples of 16, so the rows and the keys' start are word-aligned.
    words = out.view(torch.int32)[..., lead // 4 :]
    grid = (words.shape[-1] // _BLOCK_W, num_heads)
    args = (
        src, words, cu_seqlens, num_tokens, num_seqs, num_seqs.bit_length(), src.stride(0),
        src.stride(1), words.stride(0), words.stride(1),
    )  # fmt: skip
    # Triton specialises the strides and the pointers' alignment: they name the compiled variant.
    key = (v.device.index, args[6:], tuple(t.data_ptr() % 16 == 0 for t in (src, words, cu_seqlens)), dim)
    constexprs = dict(D=dim, BLOCK_W=_BLOCK_W, ALIGN=KEY_ALIGNMENT)
    return LaunchPlan(key, grid, args, constexprs, dict(num_warps=4), 3)


def copy_relaunch(v: torch.Tensor, cu_seqlens: torch.Tensor, out: torch.Tensor, lead: int) -> FixedLaunch | None:
    """The copy of :func:`transposed_values` into ``out`` as a :class:`~mla_ops.kernels.launch.FixedLaunch` whose
    three leading arguments are the addresses of ``v``, of ``out``'s column ``lead`` and of ``cu_seqlens``: it copies
    another ``v`` of the same shape, strides and alignment into another ``out`` alike. ``None`` where that variant
    has not been launched on ``v``'s device (the current one) yet."""
    return _LAUNCHER.fixed_launch(copy_plan(v, cu_seqlens, out, lead), v.device)
