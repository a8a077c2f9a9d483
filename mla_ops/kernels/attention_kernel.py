"""The ``tl.dot`` kernel of varlen flash-attention forward for MLA prefill, in Triton.

:func:`mla_ops.kernels.attention.attention_triton` launches it, on every GPU and in Triton's interpreter
(on Hopper, large batches go to :mod:`mla_ops.kernels.attention_sm90` instead, where it covers them).

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
- **Softmax overlapped with P @ V (``OVERLAP``: the configuration's ``ovl``).**
  :func:`_attend_tiles_overlapped` computes each tile's softmax while the previous tile's P @ V runs
  on the tensor cores, with no branch and no product in flight across a step's end: either makes
  ptxas serialise every wgmma of the kernel (``benchmarks/compile_sm90.py`` reports it).
- **Heaviest blocks first, L2-friendly order.** Causal blocks near a sequence's end do the most
  work, so each sequence's blocks are launched last-first and the light ones fill the tail.
  Programs are grouped by sets of heads whose K/V fits in L2 (heads vary fastest), so the blocks
  reading one head's K/V run close together in time.
- **fp8 (``FP8``).** ``q``, ``k`` and ``v`` are e4m3 with a descale factor per head (a stride-0 one for a
  per-tensor factor): the factors of ``q`` and ``k`` fold into the scale of the scores, the probabilities are
  rounded to e4m3 for ``P @ V`` (as FlashAttention-3 does), and ``v``'s factor scales the output once at the end.
  bf16 and fp16 launches pass ``None`` for the factors, which Triton compiles out.
- **Empty rows.** A row that sees no key (an empty context chunk, a zero-length sequence) gets
  ``out = 0`` and ``lse = -inf``, never NaN. Rows past ``cu_seqlens_q[-1]`` (the padding of a CUDA
  graph's token budget) get ``lse = -inf`` from a few extra programs, so a later merge weighs them 0
  and writes ``out = 0`` there; their ``out`` here is left unwritten (the package leaves padding
  contents unspecified), because zeroing a large budget would cost as much as attending a small
  batch. No valid row ever reads a padding row.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["PAD_FILL_BLOCK", "SEQ_CHUNK", "attn_fwd_kernel"]

#: Sequences scanned per vector pass when a program looks up its sequence.
SEQ_CHUNK = 256

#: Lanes of one pass of the padding rows' LSE fill.
PAD_FILL_BLOCK = 1024


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
def _masked_softmax_step(s, m_i, P_SHIFT: tl.constexpr):
    """One online-softmax step over a tile of base-2 scores ``s`` (``-inf`` where masked): the tile's
    probabilities ``p`` (times ``2**P_SHIFT``), the factor ``alpha`` that rescales the running sum and
    accumulator, and the new running max."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no visible key yet keeps m = -inf; shifting it by 0 instead keeps
    # exp2(-inf - -inf) = NaN out of p and alpha.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    return tl.math.exp2(s - (m_use - P_SHIFT)[:, None]), tl.math.exp2(m_i - m_use), m_new


@triton.jit
def _attend_tiles(
    acc,
    l_i,
    m_i,
    q_a,
    q_b,
    K,
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
    UPCAST: tl.constexpr,
    P_SHIFT: tl.constexpr,
):
    """Fold the key tiles ``[lo, hi)`` of one sequence into the running (acc, l_i, m_i); ``MASKED`` tiles
    hide keys past ``len_k`` and, causal, those after each row's diagonal. The probabilities, ``l_i`` and ``acc``
    are ``2**P_SHIFT`` times the true ones."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_da = tl.arange(0, D_A)
    offs_dv = tl.arange(0, D_V)
    for start_n in tl.range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        tok = k_tok0 + start_n  # int64: the tile's first key token in the packed tensors
        if MASKED:
            n_ok = (start_n + offs_n) < len_k
        # --- load K (and V below) ----------------------------------------------------------------
        k_ptr = K + tok * stride_kt + h * stride_kh + offs_n[:, None] * stride_kt
        if MASKED:
            k_a = tl.load(k_ptr + offs_da[None, :], mask=n_ok[:, None], other=0.0)
        else:
            k_a = tl.load(k_ptr + offs_da[None, :])
        qk = _dot(q_a, tl.trans(k_a), None, UPCAST)
        if D_B > 0:
            offs_db = D_A + tl.arange(0, D_B)
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
            p, alpha, m_new = _masked_softmax_step(s, m_i, P_SHIFT)
        else:
            if SCALE_NONNEG:
                # max(qk) * scale == max(qk * scale) for scale >= 0, and the subtraction below fuses
                # into one FMA per score.
                m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
                p = tl.math.exp2(qk * qk_scale - (m_new - P_SHIFT)[:, None])
            else:
                s = qk * qk_scale
                m_new = tl.maximum(m_i, tl.max(s, 1))
                p = tl.math.exp2(s - (m_new - P_SHIFT)[:, None])
            alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha
        acc = acc * alpha[:, None]
        l_i = l_i + tl.sum(p, 1)
        # --- P @ V ---------------------------------------------------------------------------------
        # Keys past the sequence are other sequences' rows or a budget's padding, which may hold NaN; p is
        # 0 there but 0 * NaN is not, so the masked loads read them as 0.
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
    UPCAST: tl.constexpr,
):
    """The unscaled scores ``q @ k^T`` ``[BLOCK_M, BLOCK_N]`` of the key tile at packed row ``tok``.

    ``MASKED``: only the tile's first ``n_valid`` keys (maybe none, maybe all) are in the sequence;
    the loads read nothing past them, and the caller masks those scores. Otherwise all are.
    The second part of the split is issued first and the first accumulates onto it (Triton 3.6 still
    waits for each before issuing the next).
    """
    offs_n = tl.arange(0, BLOCK_N)
    if MASKED:
        n_ok = offs_n[:, None] < n_valid
    k_ptr = K + tok * stride_kt + h * stride_kh + offs_n[:, None] * stride_kt
    if MASKED:
        k_a = tl.load(k_ptr + tl.arange(0, D_A)[None, :], mask=n_ok, other=0.0)
    else:
        k_a = tl.load(k_ptr + tl.arange(0, D_A)[None, :])
    qk = None
    if D_B > 0:
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
    UPCAST: tl.constexpr,
):
    """``acc + p @ v`` for the value tile at packed row ``tok``; ``p`` (fp32 ``[BLOCK_M, BLOCK_N]``)
    is rounded to the values' dtype for the product. ``MASKED``: values past the tile's first
    ``n_valid`` keys read as 0 (``p`` is 0 there, but ``0 * NaN`` is not 0)."""
    offs_n = tl.arange(0, BLOCK_N)
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
def _softmax_tile(
    qk, l_i, m_i, qk_scale, visible, MASKED: tl.constexpr, SCALE_NONNEG: tl.constexpr, P_SHIFT: tl.constexpr
):
    """One online-softmax step over a tile of unscaled scores ``qk``: ``(p, alpha, l_i, m_new)``, where
    ``alpha`` is the factor the accumulator still has to be rescaled by (``l_i`` already is) and ``p`` is
    ``2**P_SHIFT`` times the probabilities. ``MASKED``: only the scores where ``visible`` (``[BLOCK_M, BLOCK_N]``)
    count."""
    if MASKED:
        p, alpha, m_new = _masked_softmax_step(tl.where(visible, qk * qk_scale, float("-inf")), m_i, P_SHIFT)
    else:
        if SCALE_NONNEG:
            # max(qk) * scale == max(qk * scale) for scale >= 0; the subtraction fuses into an FMA.
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        else:
            m_new = tl.maximum(m_i, tl.max(qk * qk_scale, 1))
        p = tl.math.exp2(qk * qk_scale - (m_new - P_SHIFT)[:, None])
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
    UPCAST: tl.constexpr,
    P_SHIFT: tl.constexpr,
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
    qk = _qk_tile(q_a, q_b, K, k_tok0, h, stride_kt, stride_kh, hi, DQK, D_A, D_B, BLOCK_N, True, UPCAST)
    p, alpha, l_i, m_i = _softmax_tile(qk, l_i, m_i, qk_scale, visible, True, SCALE_NONNEG, P_SHIFT)
    # The mask-free tiles after the first: the previous tile is mask-free too.
    for start_n in tl.range(BLOCK_N, full_hi, BLOCK_N):
        tok = k_tok0 + tl.multiple_of(start_n, BLOCK_N)
        qk = _qk_tile(q_a, q_b, K, tok, h, stride_kt, stride_kh, hi, DQK, D_A, D_B, BLOCK_N, False, UPCAST)
        acc = _pv_tile(
            p, acc * alpha[:, None], V, tok - BLOCK_N, h, stride_vt, stride_vh, hi, DV, D_V, BLOCK_N, False, UPCAST,
        )  # fmt: skip
        p, alpha, l_i, m_i = _softmax_tile(qk, l_i, m_i, qk_scale, visible, False, SCALE_NONNEG, P_SHIFT)
    # The masked tiles (at most BLOCK_M / BLOCK_N causal, at most one otherwise); the previous tile
    # may be the first, which may be partial.
    for start_n in tl.range(tl.maximum(full_hi, BLOCK_N), hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        tok = k_tok0 + start_n
        qk = _qk_tile(
            q_a, q_b, K, tok, h, stride_kt, stride_kh, hi - start_n, DQK, D_A, D_B, BLOCK_N, True, UPCAST,
        )  # fmt: skip
        acc = _pv_tile(
            p, acc * alpha[:, None], V, tok - BLOCK_N, h, stride_vt, stride_vh, hi - start_n + BLOCK_N, DV, D_V,
            BLOCK_N, True, UPCAST,
        )  # fmt: skip
        visible = _visible(start_n, hi, q_pos, BLOCK_N, CAUSAL)
        p, alpha, l_i, m_i = _softmax_tile(qk, l_i, m_i, qk_scale, visible, True, SCALE_NONNEG, P_SHIFT)
    last = tl.maximum(hi - 1, 0) // BLOCK_N * BLOCK_N
    acc = _pv_tile(
        p, acc * alpha[:, None], V, k_tok0 + last, h, stride_vt, stride_vh, hi - last, DV, D_V, BLOCK_N, True, UPCAST,
    )  # fmt: skip
    return acc, l_i, m_i


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

    A negative ``pad_pid`` (a program of the main grid) writes nothing; the empty cases are empty loops.
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


@triton.jit
def head_and_slot(pid, num_heads, num_slots, heads_per_group):
    """Program ``pid < num_heads * num_slots`` -> ``(head, slot)``. Heads form groups of ``heads_per_group`` whose
    K/V fits in L2 (:func:`mla_ops.kernels.programs.program_layout`); inside a group the slots run in order and the
    heads fastest. The Gluon kernel (:mod:`mla_ops.kernels.attention_sm90`) numbers its work items so too."""
    group_size = heads_per_group * num_slots
    group = pid // group_size
    r = pid - group * group_size
    heads_here = tl.minimum(heads_per_group, num_heads - group * heads_per_group)
    slot = r // heads_here
    return group * heads_per_group + (r - slot * heads_here), slot


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
def attn_fwd_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    cu_seqlens_q,
    cu_seqlens_k,
    QDescale,
    KDescale,
    VDescale,
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
    stride_qd,
    stride_kd,
    stride_vd,
    DQK: tl.constexpr,
    DV: tl.constexpr,
    D_A: tl.constexpr,
    D_B: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    SCALE_NONNEG: tl.constexpr,
    OVERLAP: tl.constexpr,
    UPCAST: tl.constexpr,
    FP8: tl.constexpr,
    PAD_FILL: tl.constexpr,
    SEQ_CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    num_main = num_heads * num_slots
    if pid >= num_main:
        _fill_padding_lse(
            Lse, cu_seqlens_q, num_seqs, num_tokens_q, num_heads, stride_lse_h, pid - num_main, num_pad_programs,
            PAD_FILL,
        )  # fmt: skip
        return

    h, slot = head_and_slot(pid, num_heads, num_slots, heads_per_group)

    # Slot -> sequence: b is the last sequence whose first slot cu_seqlens_q[b] // BLOCK_M + b is
    # <= slot. One vector pass per SEQ_CHUNK sequences (a single pass for typical batches).
    hits = tl.zeros([SEQ_CHUNK], dtype=tl.int32)
    for c in range(0, num_seqs, SEQ_CHUNK):
        idx = c + tl.arange(0, SEQ_CHUNK)
        starts = tl.load(cu_seqlens_q + idx, mask=idx < num_seqs, other=0)
        hits += ((starts // BLOCK_M + idx <= slot) & (idx < num_seqs)).to(tl.int32)
    b = tl.sum(hits, axis=0) - 1

    q_start = tl.load(cu_seqlens_q + b)
    q_end = tl.load(cu_seqlens_q + tl.minimum(b + 1, num_seqs))
    len_q = q_end - q_start
    first_slot = q_start // BLOCK_M + b
    num_own = q_end // BLOCK_M - q_start // BLOCK_M + 1  # slots of sequence b (>= its block count)
    j = slot - first_slot
    if j >= num_own:  # a slot past the last sequence's (only when q holds padding rows)
        return
    start_m = num_own - 1 - j  # last block first: in causal attention it has the most keys
    m0 = start_m * BLOCK_M
    if m0 >= len_q:
        return
    k_start = tl.load(cu_seqlens_k + b)
    len_k = tl.load(cu_seqlens_k + tl.minimum(b + 1, num_seqs)) - k_start

    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_ok = offs_m < len_q
    rows = tl.arange(0, BLOCK_M)
    offs_da = tl.arange(0, D_A)
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

    # fp8: the probabilities are 2**P_SHIFT times the true ones until the end, so that small ones, rounded to e4m3
    # for P @ V, stay normal numbers (e4m3's smallest normal is 2**-6; the largest product is 2**8 < 448).
    P_SHIFT: tl.constexpr = 8 if FP8 else 0
    if FP8:  # dequantised scores: q's and k's factors of this head scale them with the softmax scale
        qk_scale = qk_scale * tl.load(QDescale + h * stride_qd) * tl.load(KDescale + h * stride_kd)
    k_tok0 = k_start.to(tl.int64)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_V], dtype=tl.float32)
    if OVERLAP:
        acc, l_i, m_i = _attend_tiles_overlapped(
            acc, l_i, m_i, q_a, q_b, K, V, k_tok0, h, stride_kt, stride_kh, stride_vt, stride_vh,
            full_hi, hi, q_pos, qk_scale, DQK, DV, D_A, D_B, D_V, BLOCK_N, CAUSAL, SCALE_NONNEG, UPCAST,
            P_SHIFT,
        )  # fmt: skip
    else:
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q_a, q_b, K, V, k_tok0, h, stride_kt, stride_kh, stride_vt, stride_vh,
            0, full_hi, len_k, q_pos, qk_scale, DQK, DV, D_A, D_B, D_V, BLOCK_N, False, CAUSAL, SCALE_NONNEG, UPCAST,
            P_SHIFT,
        )  # fmt: skip
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q_a, q_b, K, V, k_tok0, h, stride_kt, stride_kh, stride_vt, stride_vh,
            full_hi, hi, len_k, q_pos, qk_scale, DQK, DV, D_A, D_B, D_V, BLOCK_N, True, CAUSAL, SCALE_NONNEG, UPCAST,
            P_SHIFT,
        )  # fmt: skip

    # Rows that saw no key have l = 0: out = 0 and lse = -inf instead of 0/0.
    empty = l_i == 0.0
    inv_l = 1.0 / tl.where(empty, 1.0, l_i)
    if FP8:  # v's factor, once per row instead of once per value tile
        inv_l = inv_l * tl.load(VDescale + h * stride_vd)
    out = acc * inv_l[:, None]
    # m and log2(l) are in base 2; ln(2) turns the sum into the natural-log LSE of the contract.
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i)) - P_SHIFT) * 0.6931471805599453)

    offs_dv = tl.arange(0, D_V)
    o_ptr = Out + (q_start + m0).to(tl.int64) * stride_ot + h * stride_oh + rows[:, None] * stride_ot + offs_dv[None, :]
    if D_V != DV:
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    else:
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    tl.store(Lse + h.to(tl.int64) * stride_lse_h + q_start + offs_m, lse, mask=row_ok)
