"""Varlen flash-attention forward for MLA prefill, in Triton.

:func:`attention_triton` is the entry point for every GPU and Triton's interpreter. On Hopper it hands
large batches to :mod:`mla_ops.kernels.attention_sm90` (written in Gluon) where that kernel covers the
inputs; everything else runs the ``tl.dot`` kernel below.

One program computes ``BLOCK_M`` query rows of one head of one sequence against all the keys that
those rows see, with an online softmax in base 2 (``log2(e)`` is folded into the scale so the inner
loop calls ``exp2``) and fp32 accumulators. Design points:

- **Varlen, no host sync, a grid that does not grow with max_seqlen.** ``cu_seqlens`` are read on
  the device. Query blocks are numbered in a packed "slot" space: sequence ``b`` owns the slots from
  ``cu_seqlens_q[b] // BLOCK_M + b``, which is at least as many as it has blocks, so
  ``Tq // BLOCK_M + B`` slots per head cover any batch that fits in ``q``. A grid sized from
  ``B * cdiv(max_seqlen, BLOCK_M)`` instead would launch mostly empty programs when ``max_seqlen``
  is a CUDA graph's token budget, and each of those holds a whole SM's shared memory while it
  exits. Each program finds its sequence with one vectorised pass over ``cu_seqlens``.
- **Dqk != Dv, no padding of 192 to 256.** The QK product is split into two ``tl.dot`` calls whose
  widths are powers of two (192 = 128 + 64; other widths pad only the second part, with masks), and
  both accumulate into one fp32 score tile.
- **Mask-free main loop.** Key tiles that every row of the block sees in full run without any mask
  or bounds code; only the causal diagonal and the ragged tail of a sequence take the masked loop.
- **Softmax overlapped with P @ V (``ovl``, optional).** :func:`_attend_tiles_overlapped` computes
  each tile's softmax while the previous tile's P @ V runs on the tensor cores, with no branch and
  no product in flight across a step's end: either makes ptxas serialise every wgmma of the kernel
  (``benchmarks/compile_sm90.py`` reports it).
- **Heaviest blocks first, L2-friendly order.** Causal blocks near a sequence's end do the most
  work, so each sequence's blocks are launched last-first and the light ones fill the tail.
  Programs are grouped by sets of heads whose K/V fits in L2 (heads vary fastest), so the blocks
  reading one head's K/V run close together in time.
- **Empty rows.** A row that sees no key (an empty context chunk, a zero-length sequence) gets
  ``out = 0`` and ``lse = -inf``, never NaN. Rows past ``cu_seqlens_q[-1]`` (the padding of a CUDA
  graph's token budget) get ``lse = -inf`` from a few extra programs, so a later merge weighs them 0
  and writes ``out = 0`` there; their ``out`` here is left unwritten (the package leaves padding
  contents unspecified), because zeroing a large budget would cost as much as attending a small
  batch. No valid row ever reads a padding row.
"""

from __future__ import annotations

import functools
import os
from dataclasses import replace
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ..alloc import empty, template
from ..capture import current_cuda_device, on_device
from .configs import (
    CONFIG_ENV_VAR,
    AttentionConfig,
    attention_config,
    config_env_value,
    env_attention_config,
    head_dim_split,
    large_batch_attention_config,
    refuse_unproven_warp_specialization,
    shrink,
)
from .launch import CachedLaunch, FixedLaunch, KnownLayout, NativeLaunch, pointer_alignment, remember
from .programs import program_layout
from .triton_compat import gluon_triton_reason

try:  # Triton >= 3.3
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: pointer loads only
    TensorDescriptor = None

__all__ = ["LaunchPlan", "attention_triton", "head_dim_split", "launch_plan", "tma_supported"]

_LOG2E = 1.4426950408889634

#: Sequences scanned per vector pass when a program looks up its sequence.
_SEQ_CHUNK = 256

#: Lanes of one pass of the padding rows' LSE fill.
_PAD_FILL_BLOCK = 1024

#: Lazy rescaling (``AttentionConfig.lazy_rescale``) keeps a row's running max until the max grew
#: by more than this, in base 2: p stays <= 2^8, as in FlashAttention-4.
_RESCALE_THRESHOLD = tl.constexpr(8.0)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# --- kernel ---------------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    # Under TRITON_INTERPRET=1, tl.dot runs in numpy, which has no bfloat16, and a bf16 dot there
    # returns garbage; fp32 operands are exact there. On a GPU UPCAST is False and the tensor cores
    # take the 16-bit operands directly.
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _masked_softmax_step(s, m_i):
    """One online-softmax step over a tile of base-2 scores ``s`` (``-inf`` where masked): the tile's
    probabilities ``p``, the factor ``alpha`` that rescales the running sum and accumulator, and the
    new running max."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no visible key yet keeps m = -inf; shifting it by 0 instead keeps
    # exp2(-inf - -inf) = NaN out of p and alpha.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    return tl.math.exp2(s - m_use[:, None]), tl.math.exp2(m_i - m_use), m_new


@triton.jit
def _attend_tiles(
    acc,
    l_i,
    m_i,
    q_a,
    q_b,
    K,
    K2,
    V,
    k_tok0,
    h,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    lo,
    hi,
    len_k,
    q_pos,
    qk_scale,
    DQK: tl.constexpr,
    DV: tl.constexpr,
    D_A: tl.constexpr,
    D_B: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    SCALE_NONNEG: tl.constexpr,
    USE_TMA: tl.constexpr,
    UPCAST: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,
):
    """Fold the key tiles ``[lo, hi)`` of one sequence into the running (acc, l_i, m_i).

    ``LAZY_RESCALE`` (mask-free tiles only) keeps the running max until some row's max grew by more
    than ``_RESCALE_THRESHOLD`` (base 2), so most tiles skip rescaling the accumulator.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_da = tl.arange(0, D_A)
    offs_dv = tl.arange(0, D_V)
    for start_n in tl.range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        tok = k_tok0 + start_n  # int64: the tile's first key token in the packed tensors
        if MASKED:
            n_ok = (start_n + offs_n) < len_k
        # --- load K (and V below) ----------------------------------------------------------------
        if USE_TMA:
            k_a = K.load([tok.to(tl.int32), h * stride_kh])
        else:
            k_ptr = K + tok * stride_kt + h * stride_kh + offs_n[:, None] * stride_kt
            if MASKED:
                k_a = tl.load(k_ptr + offs_da[None, :], mask=n_ok[:, None], other=0.0)
            else:
                k_a = tl.load(k_ptr + offs_da[None, :])
        qk = _dot(q_a, tl.trans(k_a), None, UPCAST)
        if D_B > 0:
            offs_db = D_A + tl.arange(0, D_B)
            if USE_TMA:
                k_b = K2.load([tok.to(tl.int32), h * stride_kh + D_A])
            else:
                if MASKED:
                    kb_mask = n_ok[:, None]
                    if D_A + D_B != DQK:
                        kb_mask = kb_mask & (offs_db[None, :] < DQK)
                    k_b = tl.load(k_ptr + offs_db[None, :], mask=kb_mask, other=0.0)
                elif D_A + D_B != DQK:
                    k_b = tl.load(k_ptr + offs_db[None, :], mask=offs_db[None, :] < DQK, other=0.0)
                else:
                    k_b = tl.load(k_ptr + offs_db[None, :])
            qk = _dot(q_b, tl.trans(k_b), qk, UPCAST)
        # --- online softmax, base 2 --------------------------------------------------------------
        if MASKED:
            visible = n_ok[None, :]
            if CAUSAL:
                visible = visible & ((start_n + offs_n)[None, :] <= q_pos[:, None])
            s = tl.where(visible, qk * qk_scale, float("-inf"))
            p, alpha, m_new = _masked_softmax_step(s, m_i)
        elif LAZY_RESCALE:
            # Every score here is finite (no mask), so m_new is too. The block keeps its running max
            # m_i while no row's max grew by more than the threshold: p <= 2^threshold then, which
            # fp32 l/acc and the 16-bit P operand hold exactly enough, and acc skips its rescale. The
            # branch is uniform over the program. Rescaling to m_new is always exact; the threshold
            # only decides how often it happens, and the epilogue uses whichever m_i was kept.
            if SCALE_NONNEG:
                m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            else:
                m_new = tl.maximum(m_i, tl.max(qk * qk_scale, 1))
            if tl.max(m_new - m_i, 0) > _RESCALE_THRESHOLD:
                alpha = tl.math.exp2(m_i - m_new)
                l_i = l_i * alpha
                acc = acc * alpha[:, None]
                m_i = m_new
            m_new = m_i
            p = tl.math.exp2(qk * qk_scale - m_i[:, None])
        else:
            if SCALE_NONNEG:
                # max(qk) * scale == max(qk * scale) for scale >= 0, and the subtraction below fuses
                # into one FMA per score.
                m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
                p = tl.math.exp2(qk * qk_scale - m_new[:, None])
            else:
                s = qk * qk_scale
                m_new = tl.maximum(m_i, tl.max(s, 1))
                p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
        if MASKED or not LAZY_RESCALE:
            l_i = l_i * alpha
            acc = acc * alpha[:, None]
        l_i = l_i + tl.sum(p, 1)
        # --- P @ V ---------------------------------------------------------------------------------
        if USE_TMA:
            v = V.load([tok.to(tl.int32), h * stride_vh])
            if MASKED:
                # Keys past the sequence are other sequences' rows or a budget's padding, which may
                # hold NaN; p is 0 there but 0 * NaN is not, so zero them.
                v = tl.where(n_ok[:, None], v, 0.0).to(q_a.dtype)
        else:
            v_ptr = V + tok * stride_vt + h * stride_vh + offs_n[:, None] * stride_vt + offs_dv[None, :]
            if MASKED:
                if D_V != DV:
                    v = tl.load(v_ptr, mask=n_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
                else:
                    v = tl.load(v_ptr, mask=n_ok[:, None], other=0.0)
            elif D_V != DV:
                v = tl.load(v_ptr, mask=offs_dv[None, :] < DV, other=0.0)
            else:
                v = tl.load(v_ptr)
        acc = _dot(p.to(q_a.dtype), v, acc, UPCAST)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _qk_tile(
    q_a,
    q_b,
    K,
    K2,
    tok,
    h,
    stride_kt,
    stride_kh,
    n_valid,
    DQK: tl.constexpr,
    D_A: tl.constexpr,
    D_B: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    USE_TMA: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """The unscaled scores ``q @ k^T`` ``[BLOCK_M, BLOCK_N]`` of the key tile at packed row ``tok``.

    ``MASKED``: only the tile's first ``n_valid`` keys (maybe none, maybe all) are in the sequence;
    pointer loads read nothing past them, descriptor loads whatever is there (another sequence's
    rows, zeros past the tensor), and the caller masks those scores. Otherwise all are.
    The second part of the split is issued first and the first accumulates onto it (Triton 3.6 still
    waits for each before issuing the next).
    """
    offs_n = tl.arange(0, BLOCK_N)
    if MASKED:
        n_ok = offs_n[:, None] < n_valid
    if USE_TMA:
        k_a = K.load([tok.to(tl.int32), h * stride_kh])
    else:
        k_ptr = K + tok * stride_kt + h * stride_kh + offs_n[:, None] * stride_kt
        if MASKED:
            k_a = tl.load(k_ptr + tl.arange(0, D_A)[None, :], mask=n_ok, other=0.0)
        else:
            k_a = tl.load(k_ptr + tl.arange(0, D_A)[None, :])
    qk = None
    if D_B > 0:
        if USE_TMA:
            k_b = K2.load([tok.to(tl.int32), h * stride_kh + D_A])
        else:
            offs_db = D_A + tl.arange(0, D_B)
            if MASKED:
                k_b = tl.load(k_ptr + offs_db[None, :], mask=n_ok & (offs_db[None, :] < DQK), other=0.0)
            elif D_A + D_B != DQK:
                k_b = tl.load(k_ptr + offs_db[None, :], mask=offs_db[None, :] < DQK, other=0.0)
            else:
                k_b = tl.load(k_ptr + offs_db[None, :])
        qk = _dot(q_b, tl.trans(k_b), None, UPCAST)
    return _dot(q_a, tl.trans(k_a), qk, UPCAST)


@triton.jit
def _pv_tile(
    p,
    acc,
    V,
    tok,
    h,
    stride_vt,
    stride_vh,
    n_valid,
    DV: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    USE_TMA: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """``acc + p @ v`` for the value tile at packed row ``tok``; ``p`` (fp32 ``[BLOCK_M, BLOCK_N]``)
    is rounded to the values' dtype for the product. ``MASKED``: values past the tile's first
    ``n_valid`` keys read as 0 (``p`` is 0 there, but ``0 * NaN`` is not 0)."""
    offs_n = tl.arange(0, BLOCK_N)
    if USE_TMA:
        v = V.load([tok.to(tl.int32), h * stride_vh])
        if MASKED:
            v = tl.where(offs_n[:, None] < n_valid, v, 0.0).to(V.dtype)
    else:
        offs_dv = tl.arange(0, D_V)
        v_ptr = V + tok * stride_vt + h * stride_vh + offs_n[:, None] * stride_vt + offs_dv[None, :]
        if MASKED:
            v = tl.load(v_ptr, mask=(offs_n[:, None] < n_valid) & (offs_dv[None, :] < DV), other=0.0)
        elif D_V != DV:
            v = tl.load(v_ptr, mask=offs_dv[None, :] < DV, other=0.0)
        else:
            v = tl.load(v_ptr)
    return _dot(p.to(v.dtype), v, acc, UPCAST)


@triton.jit
def _softmax_tile(qk, l_i, m_i, qk_scale, visible, MASKED: tl.constexpr, SCALE_NONNEG: tl.constexpr):
    """One online-softmax step over a tile of unscaled scores ``qk``: ``(p, alpha, l_i, m_new)``, where
    ``alpha`` is the factor the accumulator still has to be rescaled by (``l_i`` already is).
    ``MASKED``: only the scores where ``visible`` (``[BLOCK_M, BLOCK_N]``) count."""
    if MASKED:
        p, alpha, m_new = _masked_softmax_step(tl.where(visible, qk * qk_scale, float("-inf")), m_i)
    else:
        if SCALE_NONNEG:
            # max(qk) * scale == max(qk * scale) for scale >= 0; the subtraction fuses into an FMA.
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        else:
            m_new = tl.maximum(m_i, tl.max(qk * qk_scale, 1))
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def _visible(start_n, hi, q_pos, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """``[BLOCK_M, BLOCK_N]``: which keys of the tile at ``start_n`` each query row sees (keys below
    ``hi``, which bounds the sequence's keys, and, causal, up to the row's position)."""
    keys = start_n + tl.arange(0, BLOCK_N)
    visible = (keys < hi)[None, :]
    if CAUSAL:
        visible = visible & (keys[None, :] <= q_pos[:, None])
    return visible


@triton.jit
def _attend_tiles_overlapped(
    acc,
    l_i,
    m_i,
    q_a,
    q_b,
    K,
    K2,
    V,
    k_tok0,
    h,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    full_hi,
    hi,
    q_pos,
    qk_scale,
    DQK: tl.constexpr,
    DV: tl.constexpr,
    D_A: tl.constexpr,
    D_B: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    SCALE_NONNEG: tl.constexpr,
    USE_TMA: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Fold every key tile ``[0, hi)`` of one sequence into the running (acc, l_i, m_i), each tile's
    softmax overlapping the previous tile's P @ V on the tensor cores (FlashAttention-3's
    intra-warpgroup overlap, one tile deep): a step issues the next tile's Q @ K^T, then this tile's
    P @ V, and computes the next tile's softmax while that product runs. Tiles below ``full_hi`` (a
    multiple of ``BLOCK_N``) are mask-free; the rest are masked by :func:`_visible`.

    The probabilities cross from one step to the next, and only the accumulator's product is in
    flight at a step's end, as in :func:`_attend_tiles`. No branch: the first tile is always
    computed, masked (all of it when ``hi`` is 0), and the last P @ V is masked the same way.
    An ``if`` around these loops makes ptxas serialise every wgmma of the kernel (its warning
    C7515), and so does carrying a product still in flight into the next step (C7514), which is
    why the scores are not what crosses the steps.
    """
    visible = _visible(0, hi, q_pos, BLOCK_N, CAUSAL)
    qk = _qk_tile(q_a, q_b, K, K2, k_tok0, h, stride_kt, stride_kh, hi, DQK, D_A, D_B, BLOCK_N, True, USE_TMA, UPCAST)
    p, alpha, l_i, m_i = _softmax_tile(qk, l_i, m_i, qk_scale, visible, True, SCALE_NONNEG)
    # The mask-free tiles after the first: the previous tile is mask-free too.
    for start_n in tl.range(BLOCK_N, full_hi, BLOCK_N):
        tok = k_tok0 + tl.multiple_of(start_n, BLOCK_N)
        qk = _qk_tile(q_a, q_b, K, K2, tok, h, stride_kt, stride_kh, hi, DQK, D_A, D_B, BLOCK_N, False, USE_TMA, UPCAST)
        acc = _pv_tile(
            p, acc * alpha[:, None], V, tok - BLOCK_N, h, stride_vt, stride_vh, hi, DV, D_V, BLOCK_N, False,
            USE_TMA, UPCAST,
        )  # fmt: skip
        p, alpha, l_i, m_i = _softmax_tile(qk, l_i, m_i, qk_scale, visible, False, SCALE_NONNEG)
    # The masked tiles (at most BLOCK_M / BLOCK_N causal, at most one otherwise); the previous tile
    # may be the first, which may be partial.
    for start_n in tl.range(tl.maximum(full_hi, BLOCK_N), hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        tok = k_tok0 + start_n
        qk = _qk_tile(
            q_a, q_b, K, K2, tok, h, stride_kt, stride_kh, hi - start_n, DQK, D_A, D_B, BLOCK_N, True,
            USE_TMA, UPCAST,
        )  # fmt: skip
        acc = _pv_tile(
            p, acc * alpha[:, None], V, tok - BLOCK_N, h, stride_vt, stride_vh, hi - start_n + BLOCK_N, DV, D_V,
            BLOCK_N, True, USE_TMA, UPCAST,
        )  # fmt: skip
        visible = _visible(start_n, hi, q_pos, BLOCK_N, CAUSAL)
        p, alpha, l_i, m_i = _softmax_tile(qk, l_i, m_i, qk_scale, visible, True, SCALE_NONNEG)
    last = tl.maximum(hi - 1, 0) // BLOCK_N * BLOCK_N
    acc = _pv_tile(
        p, acc * alpha[:, None], V, k_tok0 + last, h, stride_vt, stride_vh, hi - last, DV, D_V, BLOCK_N, True,
        USE_TMA, UPCAST,
    )  # fmt: skip
    return acc, l_i, m_i


@triton.jit
def _attend_tiles_ws(
    acc,
    l_i,
    m_i,
    q_a,
    q_b,
    K,
    K2,
    V,
    hi,
    last_key,
    qk_scale,
    D_B: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Fold the key tiles ``[0, hi)`` of one sequence into (acc, l_i, m_i) in one warp-specialised loop.

    ``K``, ``K2`` and ``V`` are device-side descriptors over this sequence's and head's rows only
    (:func:`_sequence_descriptors`): TMA fills the rows of a tile past the sequence's end with zeros,
    so no tile reads another sequence's keys or values, and a NaN or inf there cannot reach this
    sequence through ``0 * NaN`` in the PV product (V cannot be masked in registers here: it would stop
    being a TMA operand).

    On Hopper, Triton 3.6 turns this loop into a producer warp group issuing the TMA loads of K and V
    and two consumer warp groups of 64 query rows each (``num_warps=4`` per group). Its pass takes
    only one loop whose dot operands all come through descriptors, and no ``scf.if`` with an else
    branch anywhere in the kernel, so this loop differs from :func:`_attend_tiles`: one loop for
    every tile, each masked: row ``i`` sees key ``j`` when ``j <= last_key[i]`` (its causal limit,
    at most ``len_k - 1``). A mask-free loop followed by a masked one fails in the pass's code
    partitioning, and a mask applied under a branch is an ``if`` with an else branch.
    """
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(0, hi, BLOCK_N, warp_specialize=True):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        qk = _dot(q_a, tl.trans(K.load([start_n, 0])), None, UPCAST)
        if D_B > 0:
            qk = _dot(q_b, tl.trans(K2.load([start_n, 0])), qk, UPCAST)
        s = tl.where(offs_n[None, :] <= (last_key - start_n)[:, None], qk * qk_scale, float("-inf"))
        p, alpha, m_new = _masked_softmax_step(s, m_i)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = _dot(p.to(q_a.dtype), V.load([start_n, 0]), acc, UPCAST)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _sequence_descriptors(
    K,
    V,
    k_start,
    len_k,
    h,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    D_A: tl.constexpr,
    D_B: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Device-side TMA descriptors ``(K, K2, V)`` over rows ``[k_start, k_start + len_k)`` of head ``h``.

    ``K`` covers channels ``[0, D_A)``, ``K2`` channels ``[D_A, D_A + D_B)`` (``K`` again when
    ``D_B == 0``), ``V`` all ``D_V`` channels. Rows outside ``[0, len_k)`` of a descriptor read as
    zeros. TMA needs 16-byte aligned bases and row strides: the launcher takes this path only for
    tensors whose host-side descriptors would be valid, and then every row and head start is aligned
    too. Triton writes each descriptor into a global scratch buffer that its launcher allocates per
    launch (``mla_ops.kernels.launch.CachedLaunch`` supplies the allocator). A program without keys
    gets one-row descriptors (a TMA dimension cannot be 0) that it never loads from.
    """
    rows = tl.maximum(len_k, 1)
    k_base = K + k_start.to(tl.int64) * stride_kt + h * stride_kh
    k_desc = tl.make_tensor_descriptor(k_base, shape=[rows, D_A], strides=[stride_kt, 1], block_shape=[BLOCK_N, D_A])
    if D_B > 0:
        k2_desc = tl.make_tensor_descriptor(
            k_base + D_A, shape=[rows, D_B], strides=[stride_kt, 1], block_shape=[BLOCK_N, D_B]
        )
    else:
        k2_desc = k_desc
    v_base = V + k_start.to(tl.int64) * stride_vt + h * stride_vh
    v_desc = tl.make_tensor_descriptor(v_base, shape=[rows, D_V], strides=[stride_vt, 1], block_shape=[BLOCK_N, D_V])
    return k_desc, k2_desc, v_desc


@triton.jit
def _fill_padding_lse(
    Lse,
    cu_seqlens_q,
    num_seqs,
    num_tokens,
    num_heads,
    stride_lse_h,
    pad_pid,
    num_pad_programs,
    FILL: tl.constexpr,
):
    """Write lse = -inf into the rows past cu_seqlens_q[-1], spread over ``num_pad_programs`` programs.

    A negative ``pad_pid`` (a program of the main grid) writes nothing. There is no branch: the empty
    cases are empty loops, which is also what Triton's Hopper warp specialisation needs (it fails
    on this fill inside an ``if`` of the specialised kernel).
    """
    total = tl.load(cu_seqlens_q + num_seqs)
    npad = tl.maximum(num_tokens - total, 1)  # the divisor below; no rows when total == num_tokens
    offs = tl.arange(0, FILL)
    neg_inf = tl.full([FILL], float("-inf"), dtype=tl.float32)
    count = tl.where((pad_pid >= 0) & (total < num_tokens), num_heads * npad, 0)
    for i in range(tl.maximum(pad_pid, 0), tl.cdiv(count, FILL), num_pad_programs):
        idx = i * FILL + offs
        hh = idx // npad
        t = total + idx - hh * npad
        tl.store(Lse + hh.to(tl.int64) * stride_lse_h + t, neg_inf, mask=idx < count)


@triton.jit(
    do_not_specialize=[
        "stride_lse_h",
        "num_tokens_q",
        "num_seqs",
        "num_slots",
        "heads_per_group",
        "num_pad_programs",
    ]
)
def _attn_fwd_kernel(
    Q,
    QD,
    QD2,
    K,
    K2,
    V,
    Out,
    OD,
    Lse,
    cu_seqlens_q,
    cu_seqlens_k,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lse_h,
    num_tokens_q,
    num_heads,
    num_seqs,
    num_slots,
    heads_per_group,
    num_pad_programs,
    qk_scale,
    DQK: tl.constexpr,
    DV: tl.constexpr,
    D_A: tl.constexpr,
    D_B: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    SCALE_NONNEG: tl.constexpr,
    USE_TMA: tl.constexpr,
    QO_TMA: tl.constexpr,
    WARP_SPEC: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,
    OVERLAP: tl.constexpr,
    UPCAST: tl.constexpr,
    PAD_FILL: tl.constexpr,
    SEQ_CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    num_main = num_heads * num_slots
    if WARP_SPEC:
        # Triton's Hopper warp specialisation handles structured control flow only: no early return
        # (programs with no block run on with empty key ranges and masked stores, `live` below),
        # and the fill runs in every program (an empty loop in the main grid's).
        _fill_padding_lse(
            Lse, cu_seqlens_q, num_seqs, num_tokens_q, num_heads, stride_lse_h, pid - num_main, num_pad_programs,
            PAD_FILL,
        )  # fmt: skip
    elif pid >= num_main:
        _fill_padding_lse(
            Lse, cu_seqlens_q, num_seqs, num_tokens_q, num_heads, stride_lse_h, pid - num_main, num_pad_programs,
            PAD_FILL,
        )  # fmt: skip
        return

    # Program -> (head, slot). Heads form groups of `heads_per_group` whose K/V fits in L2; inside a
    # group the slots run in order and the heads fastest.
    group_size = heads_per_group * num_slots
    if WARP_SPEC:
        group_size = tl.maximum(group_size, 1)  # padding programs run on (below): no division by 0
    group = pid // group_size
    r = pid - group * group_size
    heads_here = tl.minimum(heads_per_group, num_heads - group * heads_per_group)
    if WARP_SPEC:
        heads_here = tl.maximum(heads_here, 1)  # a padding program's group is past the last head
    slot = r // heads_here
    h = group * heads_per_group + (r - slot * heads_here)

    # Slot -> sequence: b is the last sequence whose first slot cu_seqlens_q[b] // BLOCK_M + b is
    # <= slot. One vector pass per SEQ_CHUNK sequences (a single pass for typical batches).
    hits = tl.zeros([SEQ_CHUNK], dtype=tl.int32)
    for c in range(0, num_seqs, SEQ_CHUNK):
        idx = c + tl.arange(0, SEQ_CHUNK)
        starts = tl.load(cu_seqlens_q + idx, mask=idx < num_seqs, other=0)
        hits += ((starts // BLOCK_M + idx <= slot) & (idx < num_seqs)).to(tl.int32)
    b = tl.sum(hits, axis=0) - 1
    if WARP_SPEC:
        b = tl.minimum(tl.maximum(b, 0), tl.maximum(num_seqs - 1, 0))  # in bounds for padding programs

    q_start = tl.load(cu_seqlens_q + b)
    q_end = tl.load(cu_seqlens_q + tl.minimum(b + 1, num_seqs))
    len_q = q_end - q_start
    first_slot = q_start // BLOCK_M + b
    num_own = q_end // BLOCK_M - q_start // BLOCK_M + 1  # slots of sequence b (>= its block count)
    j = slot - first_slot
    # The constexpr test stays nested: with WARP_SPEC the whole `if` then holds no return.
    if j >= num_own:  # noqa: SIM102 - a slot past the last sequence's (only when q holds padding rows)
        if not WARP_SPEC:
            return
    start_m = num_own - 1 - j  # last block first: in causal attention it has the most keys
    m0 = start_m * BLOCK_M
    if m0 >= len_q:  # noqa: SIM102
        if not WARP_SPEC:
            return
    k_start = tl.load(cu_seqlens_k + b)
    len_k = tl.load(cu_seqlens_k + tl.minimum(b + 1, num_seqs)) - k_start
    if WARP_SPEC:
        # A program without a block (padding programs included) gets no key tile, no stored row,
        # and in-bounds coordinates.
        live = (pid < num_main) & (j < num_own) & (m0 < len_q)
        len_k = tl.where(live, len_k, 0)
        len_q = tl.where(live, len_q, 0)
        m0 = tl.where(live, m0, 0)
        h = tl.where(live, h, 0)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_ok = offs_m < len_q
    rows = tl.arange(0, BLOCK_M)
    offs_da = tl.arange(0, D_A)
    if QO_TMA:
        # A descriptor load cannot mask rows: the block's rows past this sequence are the next
        # sequence's or a budget's padding (which may hold NaN), so they are zeroed like a masked load.
        q_row = (q_start + m0).to(tl.int32)
        if WARP_SPEC:
            # Rows are independent and those past the sequence are never stored, so a NaN there
            # stays in its row; zeroing them would route Q through registers (more shared memory).
            q_a = QD.load([q_row, h * stride_qh])
            q_b = q_a  # unused unless D_B > 0
            if D_B > 0:
                q_b = QD2.load([q_row, h * stride_qh + D_A])
        else:
            q_a = tl.where(row_ok[:, None], QD.load([q_row, h * stride_qh]), 0.0).to(QD.dtype)
            if D_B > 0:
                q_b = tl.where(row_ok[:, None], QD2.load([q_row, h * stride_qh + D_A]), 0.0).to(QD.dtype)
            else:
                q_b = q_a  # unused
    else:
        q_ptr = Q + (q_start + m0).to(tl.int64) * stride_qt + h * stride_qh + rows[:, None] * stride_qt
        q_a = tl.load(q_ptr + offs_da[None, :], mask=row_ok[:, None], other=0.0)
        if D_B > 0:
            offs_db = D_A + tl.arange(0, D_B)
            if D_A + D_B != DQK:
                q_b = tl.load(q_ptr + offs_db[None, :], mask=row_ok[:, None] & (offs_db[None, :] < DQK), other=0.0)
            else:
                q_b = tl.load(q_ptr + offs_db[None, :], mask=row_ok[:, None], other=0.0)
        else:
            q_b = q_a  # unused

    # Key j is visible from query row i when j <= i + (len_k - len_q) (bottom-right causal
    # alignment; for new tokens len_k == len_q) and j < len_k.
    if CAUSAL:
        shift = len_k - len_q
        q_pos = offs_m + shift
        hi = tl.maximum(tl.minimum(len_k, m0 + BLOCK_M + shift), 0)
        full_hi = tl.maximum(tl.minimum(len_k, m0 + shift + 1), 0) // BLOCK_N * BLOCK_N
    else:
        q_pos = offs_m
        hi = len_k
        full_hi = len_k // BLOCK_N * BLOCK_N

    k_tok0 = k_start.to(tl.int64)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_V], dtype=tl.float32)
    if WARP_SPEC:
        # Row i's last visible key: its causal limit, or the sequence's last key.
        if CAUSAL:
            last_key = tl.minimum(q_pos, len_k - 1)
        else:
            last_key = tl.full([BLOCK_M], 0, tl.int32) + (len_k - 1)
        k_desc, k2_desc, v_desc = _sequence_descriptors(
            K, V, k_start, len_k, h, stride_kt, stride_kh, stride_vt, stride_vh, D_A, D_B, D_V, BLOCK_N
        )
        acc, l_i, m_i = _attend_tiles_ws(
            acc, l_i, m_i, q_a, q_b, k_desc, k2_desc, v_desc, hi, last_key, qk_scale, D_B, BLOCK_N, UPCAST
        )
    else:
        if OVERLAP:
            acc, l_i, m_i = _attend_tiles_overlapped(
                acc, l_i, m_i, q_a, q_b, K, K2, V, k_tok0, h, stride_kt, stride_kh, stride_vt, stride_vh,
                full_hi, hi, q_pos, qk_scale, DQK, DV, D_A, D_B, D_V, BLOCK_N, CAUSAL, SCALE_NONNEG, USE_TMA, UPCAST,
            )  # fmt: skip
        else:
            acc, l_i, m_i = _attend_tiles(
                acc, l_i, m_i, q_a, q_b, K, K2, V, k_tok0, h, stride_kt, stride_kh, stride_vt, stride_vh,
                0, full_hi, len_k, q_pos, qk_scale,
                DQK, DV, D_A, D_B, D_V, BLOCK_N, False, CAUSAL, SCALE_NONNEG, USE_TMA, UPCAST, LAZY_RESCALE,
            )  # fmt: skip
            acc, l_i, m_i = _attend_tiles(
                acc, l_i, m_i, q_a, q_b, K, K2, V, k_tok0, h, stride_kt, stride_kh, stride_vt, stride_vh,
                full_hi, hi, len_k, q_pos, qk_scale,
                DQK, DV, D_A, D_B, D_V, BLOCK_N, True, CAUSAL, SCALE_NONNEG, USE_TMA, UPCAST, False,
            )  # fmt: skip

    # Rows that saw no key have l = 0: out = 0 and lse = -inf instead of 0/0.
    empty = l_i == 0.0
    inv_l = 1.0 / tl.where(empty, 1.0, l_i)
    out = acc * inv_l[:, None]
    # m and log2(l) are in base 2; ln(2) turns the sum into the natural-log LSE of the contract.
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)

    offs_dv = tl.arange(0, D_V)
    o_ptr = Out + (q_start + m0).to(tl.int64) * stride_ot + h * stride_oh + rows[:, None] * stride_ot + offs_dv[None, :]
    if D_V != DV:
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    elif QO_TMA and not WARP_SPEC:
        # A descriptor store writes whole blocks: only a block inside its sequence takes it, the
        # sequence's last, partial block stores through masked pointers (a uniform branch). Warp
        # specialisation cannot have that else branch, nor a descriptor store at all: Triton 3.6
        # splits `out` between its two consumer warp groups, and a half block no longer matches
        # the descriptor's block (the IR verifier rejects it).
        if m0 + BLOCK_M <= len_q:
            OD.store([(q_start + m0).to(tl.int32), h * stride_oh], out.to(OD.dtype))
        else:
            tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    else:
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    tl.store(Lse + h.to(tl.int64) * stride_lse_h + q_start + offs_m, lse, mask=row_ok)


# --- launcher -------------------------------------------------------------------------------------


def tma_supported() -> bool:
    """Whether this Triton has host-side TMA tensor descriptors (``triton.tools.tensor_descriptor``)."""
    return TensorDescriptor is not None


def _descriptor_rows(t: torch.Tensor, block_rows: int, widths: tuple[int, ...]):
    """Descriptors over the packed ``[T, H*D]`` rows of ``t``, one per block width, or ``None``.

    Each views ``t`` as 2-D ``[tokens, columns]`` with the token stride as its row stride; head ``h``
    starts at column ``h * stride_h``. That covers strided ``v`` views of a wider ``kv`` tensor too.
    TMA needs a 16-byte aligned base and 16-byte aligned row and head strides.
    """
    elem = t.element_size()
    if t.data_ptr() % 16 or (t.stride(0) * elem) % 16 or (t.stride(1) * elem) % 16:
        return None
    cols = (t.shape[1] - 1) * t.stride(1) + t.shape[2]
    return tuple(TensorDescriptor(t, [t.shape[0], cols], [t.stride(0), 1], [block_rows, w]) for w in widths)


def _split_descriptors(
    qk: torch.Tensor, other: torch.Tensor, d_a: int, d_b: int, block_rows: int, anywhere: bool = False
):
    """``(QK, QK2, other)`` descriptors, or ``None`` if TMA cannot serve them: ``qk`` is q or k, read
    in the two split widths ``(d_a, d_b)``; ``other`` is v or out, read or written whole.

    The split widths must tile Dqk exactly (a padded second part would read the next head's
    channels) and Dv must be a power of two. ``anywhere`` builds them over CPU tensors too.
    """
    usable = TensorDescriptor is not None and qk.shape[0] > 0 and (qk.is_cuda or _interpreting() or anywhere)
    if not usable or d_a + d_b != qk.shape[-1] or (1 << (other.shape[-1] - 1).bit_length()) != other.shape[-1]:
        return None
    desc_qk = _descriptor_rows(qk, block_rows, (d_a, d_b) if d_b else (d_a,))
    desc_other = _descriptor_rows(other, block_rows, (other.shape[-1],))
    if desc_qk is None or desc_other is None:
        return None
    return desc_qk[0], desc_qk[-1], desc_other[0]


def _descriptor_key(descs) -> tuple | None:
    """What Triton may specialise a descriptor on: its block shape and dtype (fixed by the config),
    its strides and its shape (the token count only by divisibility; the width exactly)."""
    if descs is None:
        return None
    return tuple((d.shape[0] % 16 == 0, d.shape[0] == 1, d.shape[1], tuple(d.strides)) for d in descs)


#: The table's configuration per (device, Dqk, Dv, causal, dtype), after any step-down forced by the
#: compiler running out of shared memory or registers: one dict lookup per call.
_table_configs: dict[tuple, AttentionConfig] = {}

#: Below this many key rows times heads, a launch of a table configuration that asks for TMA
#: descriptors loads through pointers instead. Descriptors hold the tensors' addresses, so they are
#: built for every launch, and that costs about 55 µs of host time (H200 host, Triton 3.6: 82 µs per
#: eager context-chunk call with descriptors, 27 µs without), while TMA saves 8-14 % of device time
#: (device µs, pointers / TMA: 34.6 / 31.8 for 256 queries over 1024 keys at H=16, 60.0 / 53.2 for 512
#: over 2048, 111.8 / 96.6 for 1024 over 4096, 71.0 / 64.0 for 256 over 1024 at H=128; 2026-12-01).
#: So below about 4096 keys at H=16 (512 at H=128) the host is the bottleneck and pointers finish
#: first. The rule depends on shapes only, so an eager warm-up run and a later CUDA-graph capture of the
#: same shapes launch the same variant (a variant first met inside capture would compile there); inside
#: a graph small chunks give up that 8-14 % of device time. An explicit configuration (argument or
#: ``MLA_OPS_TRITON_CONFIG``) is launched as given.
TMA_MIN_KEY_ROWS = 1 << 16

#: The pointer-load twin of each table configuration that asks for descriptors.
_pointer_twins: dict[AttentionConfig, AttentionConfig] = {}

#: The large-batch configuration per (device, Dqk, Dv, causal, dtype), or None where none is tabled.
_large_configs: dict[tuple, AttentionConfig | None] = {}


@functools.cache
def _sm90_module():
    """:mod:`mla_ops.kernels.attention_sm90`, or ``None`` where this Triton has no Gluon to build it."""
    try:
        from . import attention_sm90
    except ImportError:
        return None
    return attention_sm90


def gluon_unsupported_reason(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, config: AttentionConfig
) -> str | None:
    """Why the Gluon kernel (``config.gluon``) cannot run on these inputs here, or ``None``."""
    if not q.is_cuda:
        return "it runs on CUDA devices only (not in Triton's interpreter)"
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return f"it runs on SM90 (Hopper) GPUs only, not on {torch.cuda.get_device_name(q.device)}"
    reason = gluon_triton_reason(triton.__version__)
    if reason is not None:
        return reason
    module = _sm90_module()
    if module is None:
        return f"Triton {triton.__version__} has no Gluon (triton.experimental.gluon)"
    reason = module.sm90_unsupported_reason(q, k, v, softmax_scale, config.block_n, config.num_stages)
    return None if reason is None else f"it does not cover {reason}"


def _pointer_twin(config: AttentionConfig) -> AttentionConfig:
    twin = _pointer_twins.get(config)
    if twin is None:
        twin = _pointer_twins[config] = replace(config, use_tma=False, qo_tma=False, warp_specialize=False)
    return twin


def attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    *,
    config: AttentionConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged (varlen) attention forward with the Triton kernel.

    Args:
        q: ``[Tq, H, Dqk]``, bfloat16 or float16, any strides with a last-dimension stride of 1.
        k: ``[Tk, H, Dqk]``, same dtype and strides rule.
        v: ``[Tk, H, Dv]``, same dtype; typically a strided view of a wider ``kv`` tensor.
        cu_seqlens_q: int32 ``[B+1]`` on q's device: sequence ``b`` is query rows
            ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``; rows past ``cu_seqlens_q[-1]`` are padding.
        cu_seqlens_k: int32 ``[B+1]``: its keys are rows ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` of k/v.
            For the new-tokens path pass ``cu_seqlens_q`` itself.
        max_seqlen_q: an upper bound of the longest query slice (may be loose; the grid is sized from
            Tq and B, so a loose bound costs nothing).
        max_seqlen_k: an upper bound of the longest key slice (only orders the programs for L2).
        softmax_scale: multiplier of ``q @ k^T``.
        causal: mask key ``j`` from query ``i`` of a sequence when ``j > i + len_k - len_q``; with
            ``cu_seqlens_k is cu_seqlens_q`` that is plain causal self-attention.
        config: launch configuration; by default ``MLA_OPS_TRITON_CONFIG`` or the table in
            :mod:`mla_ops.kernels.configs` for this device and ``(Dqk, Dv, causal, dtype)``, and for a
            call of at least :data:`TMA_MIN_KEY_ROWS` key rows times heads the large-batch table's
            entry (:func:`~mla_ops.kernels.configs.large_batch_attention_config`: the Gluon kernel on
            SM90) where the inputs suit it. A configuration with ``gluon`` runs
            :func:`mla_ops.kernels.attention_sm90.attention_sm90`; given explicitly, it raises
            ``ValueError`` with the reason where that kernel cannot run.

    Returns:
        ``out`` ``[Tq, H, Dv]`` contiguous in q's dtype and ``lse`` float32 ``[H, Tq]`` contiguous,
        natural log. Rows with no visible key get ``out = 0`` and ``lse = -inf``. Padding rows past
        ``cu_seqlens_q[-1]`` get ``lse = -inf``; their ``out`` is not written (unspecified).

    Nothing is read back to the host, so the call can be captured in a CUDA graph (once compiled).
    The kernel runs on q's device and that device's current stream, whichever device is current;
    the current device is the same after the call. Triton compiles and loads a kernel once per
    device, so warm up each device before capturing on it.
    """
    num_tokens, num_heads, dqk = q.shape
    dv = v.shape[-1]
    dtype = q.dtype
    if dtype not in (torch.bfloat16, torch.float16) or k.dtype != dtype or v.dtype != dtype:
        raise TypeError(
            f"attention_triton: q, k, v must all be bfloat16 or float16, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    q_stride, k_stride, v_stride = q.stride(), k.stride(), v.stride()
    usual = (
        dqk % 16 == 0 and 16 <= dqk <= 256 and dv % 16 == 0 and 16 <= dv <= 256
        and q_stride[-1] == 1 and k_stride[-1] == 1 and v_stride[-1] == 1
    )  # fmt: skip
    if not usual:  # find what is wrong (an empty tensor may have any strides)
        for name, d in (("Dqk", dqk), ("Dv", dv)):
            if d % 16 or not 16 <= d <= 256:
                raise ValueError(f"attention_triton: {name} must be a multiple of 16 from 16 to 256, got {d}")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.numel() and t.stride(-1) != 1:
                raise ValueError(f"attention_triton: {name} must have stride 1 in its last dimension, got {t.stride()}")

    device = q.device
    if num_tokens == 0 or num_heads == 0:
        return empty((num_tokens, num_heads, dv), dtype, device), empty((num_heads, num_tokens), torch.float32, device)

    layout, (p_q, p_k, p_v, p_cu_q, p_cu_k) = _layout(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, config
    )
    known = _known.get(layout)
    if known is not None and device.index == current_cuda_device():  # launches go to the current device
        out, lse = torch.empty_like(known.out_template), torch.empty_like(known.lse_template)
        known.launch(_pointer_addresses(p_q, p_k, p_v, out.data_ptr(), lse.data_ptr(), p_cu_q, p_cu_k))
        return out, lse
    out = empty((num_tokens, num_heads, dv), dtype, device)
    lse = empty((num_heads, num_tokens), torch.float32, device)
    addresses = _pointer_addresses(p_q, p_k, p_v, out.data_ptr(), lse.data_ptr(), p_cu_q, p_cu_k)
    if known is not None:  # q's device is not the current one
        with on_device(device):
            known.launch(addresses)
        return out, lse

    key = None
    if config is None:
        config = env_attention_config()
        if config is None:
            key = (device, dqk, dv, causal, dtype)
            config = _table_configs.get(key)
            if config is None:
                config = _table_configs[key] = attention_config(device, dqk, dv, causal, dtype)
            if k.shape[0] * num_heads >= TMA_MIN_KEY_ROWS:
                if key not in _large_configs:
                    _large_configs[key] = large_batch_attention_config(device, dqk, dv, causal, dtype)
                large = _large_configs[key]
                if large is not None and gluon_unsupported_reason(q, k, v, softmax_scale, large) is None:
                    config = large
    if config.gluon:
        if key is None:  # requested explicitly: refused with the reason, never replaced
            reason = gluon_unsupported_reason(q, k, v, softmax_scale, config)
            if reason is not None:
                raise ValueError(
                    f"attention_triton: the Triton attention config {config} asks for the Gluon kernel, but {reason}; "
                    f"drop the 'gluon' flag (e.g. from {CONFIG_ENV_VAR})"
                )
        with on_device(device):
            _sm90_module().attention_sm90(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, out, lse,
                block_n=config.block_n, stages=config.num_stages, overlap=config.overlap_softmax,
                pingpong=config.pingpong, persistent=config.persistent,
            )  # fmt: skip
        return out, lse
    while True:
        launched = config
        if key is not None and (config.use_tma or config.qo_tma) and k.shape[0] * num_heads < TMA_MIN_KEY_ROWS:
            launched = _pointer_twin(config)
        try:
            # Triton launches on the current device and its current stream, not on q's device.
            with on_device(device):
                fixed = _launch(
                    (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                     launched),
                )  # fmt: skip
            if fixed is not None:  # not for plans rebuilt per call (TMA descriptors)
                out_template = template(out.shape, dtype, device)
                lse_template = template(lse.shape, torch.float32, device)
                if out_template is not None and lse_template is not None:
                    remember(_known, layout, KnownLayout(fixed, out_template, lse_template, False))
            return out, lse
        except OutOfResources as exc:
            # The table is tuned for one GPU; on a smaller one, step down instead of failing. An
            # explicitly requested configuration is reported, not silently replaced.
            smaller = None if key is None else shrink(config)
            if smaller is None:
                raise RuntimeError(
                    f"Triton attention config {config} (BLOCK_M,BLOCK_N,num_warps,num_stages) does not fit this "
                    f"GPU for Dqk={dqk}, Dv={dv}: {exc}. Use a smaller BLOCK_N or num_stages (e.g. via "
                    f"{CONFIG_ENV_VAR})"
                ) from exc
            config = _table_configs[key] = smaller


def _layout(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, config):
    """``(layout, addresses)`` of a call of :func:`attention_triton` with these arguments: the key of its
    known launch, and the five inputs' device addresses.

    The layout is everything the launch depends on but the addresses (see :func:`launch_plan`): shapes,
    strides, the inputs' alignment and devices (the outputs are fresh, contiguous and aligned, on q's
    device), the scalars, and what chooses the configuration: an explicit one, else
    MLA_OPS_TRITON_CONFIG's text, else the table for these shapes (whose entry changes only when a
    launch fails, before any layout is remembered). A layout seen before is launched again with only the
    addresses replaced, and without resolving the configuration again. The addresses are passed as
    integers (see CachedLaunch.relaunch), so the layout records what Triton specialises on or checks in
    them: their 16-byte alignment and devices.
    """
    p_q, p_k, p_v = q.data_ptr(), k.data_ptr(), v.data_ptr()
    p_cu_q, p_cu_k = cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr()
    inputs = (
        p_q % 16 == 0, p_k % 16 == 0, p_v % 16 == 0, p_cu_q % 16 == 0, p_cu_k % 16 == 0,
        k.get_device(), v.get_device(), cu_seqlens_q.get_device(), cu_seqlens_k.get_device(),
    )  # fmt: skip
    chooser = config_env_value() if config is None else config
    layout = (
        q.shape, q.stride(), k.shape[0], k.stride(), v.shape[-1], v.stride(), cu_seqlens_q.shape[0],
        max_seqlen_q > 0, max_seqlen_k, softmax_scale, causal, q.dtype, q.device, chooser, inputs,
    )  # fmt: skip
    return layout, (p_q, p_k, p_v, p_cu_q, p_cu_k)


#: The tensor behind each leading argument of a pointer plan, in :func:`_pointer_addresses`'s order (q, q,
#: q, k, k, v, out, out, lse, cu_seqlens_q, cu_seqlens_k), as the native launch codes them
#: (``TensorCode`` in ``mla_ops/csrc/attention_launch.cpp``: q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k).
NATIVE_TENSOR_CODES = (0, 0, 0, 1, 1, 2, 3, 3, 4, 5, 6)


def known_native_launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
) -> NativeLaunch | None:
    """The launch that :func:`attention_triton` (with its default configuration) repeats for the layout of
    these arguments, in the form a launcher in C++ takes (:meth:`FixedLaunch.native_launch`, the tensors
    coded as :data:`NATIVE_TENSOR_CODES`); ``None`` where no launch of the layout is known (none made yet,
    a plan with TMA descriptors or the Gluon kernel) or it cannot be made natively."""
    layout, _ = _layout(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, None)
    known = _known.get(layout)
    return None if known is None else known.launch.native_launch(NATIVE_TENSOR_CODES)


def _launch(plan_args: tuple) -> FixedLaunch | None:
    """Launch the kernel for :func:`launch_plan`'s arguments (q, k, v, out, lse, ..., config); returns the
    :class:`FixedLaunch` to launch the same layout with new addresses, or ``None`` where there is none: the
    launch went through the JIT function, or the plan has TMA descriptors, which hold the tensors'
    addresses, so that a plan that uses them is built again for every call."""
    plan = launch_plan(*plan_args)
    device = plan_args[0].device
    fixed = _launcher(plan.key, device, plan.grid, plan.args, plan.constexprs, leading=_LEADING, **plan.options)
    return None if plan.descriptors else fixed


def _pointer_addresses(q: int, k: int, v: int, out: int, lse: int, cu_seqlens_q: int, cu_seqlens_k: int) -> tuple:
    """The kernel's first arguments, as device addresses, for a plan in which nothing goes through a TMA
    descriptor: each descriptor slot (``Q``, ``Q2``, ``K``, ``K2``, ``V``, ``OutDesc``) takes its tensor's
    address, as :func:`launch_plan` gives it the tensor itself."""
    return (q, q, q, k, k, v, out, out, lse, cu_seqlens_q, cu_seqlens_k)


#: How many leading kernel arguments change from call to call (tensors and descriptors).
_LEADING = 11


class LaunchPlan(NamedTuple):
    """Everything one launch of the attention kernel needs: ``kernel[grid](*args, **constexprs, **options)``.

    ``key`` names the compiled variant for :class:`~mla_ops.kernels.launch.CachedLaunch`;
    ``descriptors`` says which loads and stores go through TMA descriptors built on the host and passed
    in ``args`` (``"kv"``, ``"qo"``): they hold the tensors' addresses. ``device_descriptors`` says which
    go through descriptors the kernel builds itself (``"kv"`` in the warp-specialised loop).
    """

    key: tuple
    grid: tuple[int]
    args: tuple
    constexprs: dict
    options: dict
    descriptors: tuple[str, ...]
    device_descriptors: tuple[str, ...] = ()


def launch_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    config: AttentionConfig,
    descriptors_anywhere: bool = False,
) -> LaunchPlan:
    """The kernel's arguments, grid, constexprs and options for one call of :func:`attention_triton`.

    ``descriptors_anywhere`` builds TMA descriptors over CPU tensors too, for compiling a GPU variant
    ahead of time on a machine without one (``benchmarks/compile_sm90.py``); the tensors must then
    stand for the GPU ones in shape, strides and alignment.
    """
    if config.gluon:
        raise ValueError(f"launch_plan: {config} runs the Gluon kernel (mla_ops.kernels.attention_sm90), not this one")
    num_tokens, num_heads, dqk = q.shape
    dv = v.shape[-1]
    d_a, d_b = head_dim_split(dqk)
    d_v = 1 << (dv - 1).bit_length()
    block_m, block_n = config.block_m, config.block_n
    num_seqs = cu_seqlens_q.shape[0] - 1
    # max_seqlen_q only bounds the work, it does not size the grid (see the module docstring).
    programs = program_layout(
        num_tokens, num_heads, num_seqs, max_seqlen_q, max_seqlen_k, (dqk + dv) * q.element_size(), block_m
    )
    num_slots, heads_per_group, num_pad_programs = programs
    grid = programs.grid(num_heads)

    kv_descs = _split_descriptors(k, v, d_a, d_b, block_n, descriptors_anywhere) if config.use_tma else None
    qo_descs = _split_descriptors(q, out, d_a, d_b, block_m, descriptors_anywhere) if config.qo_tma else None
    # Warp specialisation needs every dot operand to come through TMA; without descriptors (an
    # input TMA cannot describe) the loop runs as the plain pipelined one.
    warp_spec = config.warp_specialize and kv_descs is not None and qo_descs is not None
    use_tma = kv_descs is not None
    if warp_spec:
        if not _interpreting():
            refuse_unproven_warp_specialization(config, q.device)
        # The warp-specialised loop builds its K/V descriptors on the device, one per sequence and
        # head (_sequence_descriptors), so it takes K and V as pointers; the host descriptors only
        # proved that TMA can serve these tensors.
        kv_descs = None
    k_arg, k2_arg, v_arg = kv_descs or (k, k, v)
    q_arg, q2_arg, o_arg = qo_descs or (q, q, out)
    constexprs = dict(
        DQK=dqk, DV=dv, D_A=d_a, D_B=d_b, D_V=d_v, BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=bool(causal), SCALE_NONNEG=softmax_scale >= 0, USE_TMA=use_tma, QO_TMA=qo_descs is not None,
        WARP_SPEC=warp_spec, LAZY_RESCALE=config.lazy_rescale, OVERLAP=config.overlap_softmax,
        UPCAST=_interpreting() and q.dtype == torch.bfloat16,
        PAD_FILL=_PAD_FILL_BLOCK, SEQ_CHUNK=_SEQ_CHUNK,
    )  # fmt: skip
    strides = (
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
    )
    args = (
        q, q_arg, q2_arg, k_arg, k2_arg, v_arg, out, o_arg, lse, cu_seqlens_q, cu_seqlens_k, *strides, lse.stride(0),
        num_tokens, num_heads, num_seqs, num_slots, heads_per_group, num_pad_programs, float(softmax_scale) * _LOG2E,
    )  # fmt: skip
    options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    # Every integer Triton specialises (the strides and the head count) by value, every pointer by
    # alignment, every descriptor by what _descriptor_key lists.
    key = (
        q.device.index, q.dtype, num_heads, strides, pointer_alignment(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k),
        tuple(constexprs.values()), config.num_warps, config.num_stages, _descriptor_key(kv_descs),
        _descriptor_key(qo_descs),
    )  # fmt: skip
    used = tuple(name for name, descs in (("kv", kv_descs), ("qo", qo_descs)) if descs is not None)
    return LaunchPlan(key, grid, args, constexprs, options, used, ("kv",) if warp_spec else ())


_launcher = CachedLaunch(_attn_fwd_kernel)
#: Layouts launched before (see attention_triton); past MAX_LAYOUTS the table starts over.
_known: dict[tuple, KnownLayout] = {}
