"""A warp-specialised varlen attention forward for Hopper in Gluon: the experiment behind issue-style
question "can Triton reach FlashAttention-3's structure on this GPU?", timed by ``probe_gluon_attention.py``.

FlashAttention-3's layout of a program, written out explicitly (Gluon has no compiler pass to derive it):

- a **producer** warp issues every TMA load: the program's 128 query rows once, then each key tile's K
  (split into its 128- and 64-channel parts for ``Dqk = 192``) and V into a ring of ``STAGES`` buffers,
  each guarded by a *ready* mbarrier (completed by the TMA) and an *empty* one (both consumers arrive);
- two **consumer** warpgroups of 64 query rows each, in partitions of their own, so that the warp
  schedulers run one's softmax while the other's products occupy the tensor cores (FA3's "ping-pong",
  here left to the schedulers rather than ordered by named barriers). A consumer issues both parts of
  ``Q @ K^T`` back to back and waits once, then the softmax, then ``P @ V`` from registers.

Scope of this experiment: ``Dqk = D_A + D_B`` with both powers of two (``D_B < D_A``), ``Dv`` a power of
two, bfloat16, ``[T, H, D]`` tensors with unit channel stride and 16-byte aligned rows; causal
(bottom-right aligned) or not; any ``cu_seqlens``. Key rows of a tile past the sequence are masked in
the scores, but their values are read as they are (another sequence's rows; zeros past the tensor), so a
NaN there would reach the output: the package's kernels zero them, this one does not. Padding rows past
``cu_seqlens_q[-1]`` get nothing written. One program per (128-row block, head, sequence), last block
first.

Imported only where Gluon exists (Triton 3.5 or newer).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

__all__ = ["attention_gluon"]

#: Query rows per consumer warpgroup; a program has two.
_HALF = gl.constexpr(64)
_LN2 = gl.constexpr(0.6931471805599453)
_LOG2E = 1.4426950408889634


@gluon.jit
def _producer(
    qa_desc, qb_desc, ka_desc, kb_desc, v_desc, q_smem_a, q_smem_b, k_smem_a, k_smem_b, v_smem,
    q_bar, ready, empty, q_row, k_row, col_q, col_k, col_v, num_tiles,
):  # fmt: skip
    BN: gl.constexpr = ka_desc.block_type.shape[0]
    D_A: gl.constexpr = ka_desc.block_type.shape[1]
    STAGES: gl.constexpr = k_smem_a.type.shape[0]
    kv_bytes: gl.constexpr = ka_desc.block_type.nbytes + kb_desc.block_type.nbytes + v_desc.block_type.nbytes
    mbarrier.expect(q_bar, 2 * (qa_desc.block_type.nbytes + qb_desc.block_type.nbytes))
    for c in gl.static_range(2):
        tma.async_copy_global_to_shared(qa_desc, [q_row + c * _HALF, col_q], q_bar, q_smem_a.index(c))
        tma.async_copy_global_to_shared(qb_desc, [q_row + c * _HALF, col_q + D_A], q_bar, q_smem_b.index(c))
    for i in range(num_tiles):
        stage = i % STAGES
        # A fresh mbarrier counts as having completed the phase before phase 0: the first round passes.
        mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)
        bar = ready.index(stage)
        mbarrier.expect(bar, kv_bytes)
        row = k_row + i * BN
        tma.async_copy_global_to_shared(ka_desc, [row, col_k], bar, k_smem_a.index(stage))
        tma.async_copy_global_to_shared(kb_desc, [row, col_k + D_A], bar, k_smem_b.index(stage))
        tma.async_copy_global_to_shared(v_desc, [row, col_v], bar, v_smem.index(stage))


@gluon.jit
def _scores(q_a, q_b, k_a, k_b, s_init):
    """``q @ k^T`` for one tile: both parts issued before one wait."""
    s = warpgroup_mma(q_a, k_a.permute((1, 0)), s_init, use_acc=False, is_async=True)
    s = warpgroup_mma(q_b, k_b.permute((1, 0)), s, is_async=True)
    return warpgroup_mma_wait(0, deps=(s,))


@gluon.jit
def _consumer(
    q_smem_a, q_smem_b, k_smem_a, k_smem_b, v_smem, q_bar, ready, empty, out_ptr, lse_ptr,
    q_start, len_q, len_k, m0, h, num_tiles, stride_ot, stride_lse_h, qk_scale,
    WG: gl.constexpr, CAUSAL: gl.constexpr,
):  # fmt: skip
    BN: gl.constexpr = k_smem_a.type.shape[1]
    D_V: gl.constexpr = v_smem.type.shape[2]
    STAGES: gl.constexpr = k_smem_a.type.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D_V, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    key_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

    first = m0 + WG * _HALF  # this warpgroup's first query row in the sequence
    rows = first + gl.arange(0, _HALF, row_layout)
    if CAUSAL:
        shift = len_k - len_q
        q_pos = rows + shift
        # Tiles every row sees in full, and the tiles any row of this warpgroup sees at all.
        full = gl.minimum(gl.maximum(gl.minimum(len_k, first + shift + 1), 0) // BN, num_tiles)
        mine = gl.minimum(gl.cdiv(gl.maximum(gl.minimum(len_k, first + _HALF + shift), 0), BN), num_tiles)
    else:
        q_pos = rows
        full = len_k // BN
        mine = num_tiles
    q_a = q_smem_a.index(WG)
    q_b = q_smem_b.index(WG)
    m_i = gl.full([_HALF], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([_HALF], gl.float32, row_layout)
    acc = gl.zeros([_HALF, D_V], gl.float32, o_layout)
    s_init = gl.zeros([_HALF, BN], gl.float32, s_layout)
    mbarrier.wait(q_bar, 0)
    for i in range(0, full):  # mask-free tiles
        stage = i % STAGES
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        s = _scores(q_a, q_b, k_smem_a.index(stage), k_smem_b.index(stage), s_init)
        # scale >= 0 (the launcher checks): max(s) * scale == max(s * scale), and the subtraction is an FMA.
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        p = gl.exp2(s * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        acc = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), p_layout), v_smem.index(stage), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index(stage), count=1)
        m_i = m_new
    for i in range(full, mine):  # tiles with a causal diagonal or the sequence's end
        stage = i % STAGES
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        s = _scores(q_a, q_b, k_smem_a.index(stage), k_smem_b.index(stage), s_init)
        keys = i * BN + gl.arange(0, BN, key_layout)
        visible = (keys < len_k)[None, :]
        if CAUSAL:
            visible = visible & (keys[None, :] <= q_pos[:, None])
        s = gl.where(visible, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key yet: no NaN
        p = gl.exp2(s - m_use[:, None])
        alpha = gl.exp2(m_i - m_use)
        l_i = l_i * alpha + gl.sum(p, 1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        acc = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), p_layout), v_smem.index(stage), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index(stage), count=1)
        m_i = m_new
    for i in range(mine, num_tiles):  # tiles only the other warpgroup's rows see: hand them back
        stage = i % STAGES
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        mbarrier.arrive(empty.index(stage), count=1)

    empty_row = l_i == 0.0
    lse = gl.where(empty_row, float("-inf"), (m_i + gl.log2(gl.where(empty_row, 1.0, l_i))) * _LN2)
    inv_l = gl.convert_layout(1.0 / gl.where(empty_row, 1.0, l_i), gl.SliceLayout(1, o_layout))
    out = (acc * inv_l[:, None]).to(gl.bfloat16)
    rows_o = first + gl.arange(0, _HALF, gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, D_V, gl.SliceLayout(0, o_layout))
    o_ptrs = out_ptr + (q_start + rows_o).to(gl.int64)[:, None] * stride_ot + h * D_V + cols[None, :]
    gl.store(o_ptrs, out, mask=(rows_o < len_q)[:, None])
    gl.store(lse_ptr + h.to(gl.int64) * stride_lse_h + q_start + rows, lse, mask=rows < len_q)


@gluon.jit
def _attention_kernel(
    qa_desc, qb_desc, ka_desc, kb_desc, v_desc, out_ptr, lse_ptr, cu_q, cu_k, stride_qh, stride_kh, stride_vh,
    stride_ot, stride_lse_h, qk_scale, CAUSAL: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    BN: gl.constexpr = ka_desc.block_type.shape[0]
    D_A: gl.constexpr = ka_desc.block_type.shape[1]
    D_B: gl.constexpr = kb_desc.block_type.shape[1]
    D_V: gl.constexpr = v_desc.block_type.shape[1]
    start_m = gl.num_programs(0) - 1 - gl.program_id(0)  # last block first: most keys under causal masking
    h = gl.program_id(1)
    b = gl.program_id(2)
    q_start = gl.load(cu_q + b)
    len_q = gl.load(cu_q + b + 1) - q_start
    k_start = gl.load(cu_k + b)
    len_k = gl.load(cu_k + b + 1) - k_start
    m0 = start_m * (2 * _HALF)
    if m0 < len_q:
        if CAUSAL:
            hi = gl.maximum(gl.minimum(len_k, m0 + 2 * _HALF + len_k - len_q), 0)
        else:
            hi = len_k
        num_tiles = gl.cdiv(hi, BN)
        q_smem_a = gl.allocate_shared_memory(qa_desc.dtype, [2, _HALF, D_A], qa_desc.layout)
        q_smem_b = gl.allocate_shared_memory(qb_desc.dtype, [2, _HALF, D_B], qb_desc.layout)
        k_smem_a = gl.allocate_shared_memory(ka_desc.dtype, [STAGES, BN, D_A], ka_desc.layout)
        k_smem_b = gl.allocate_shared_memory(kb_desc.dtype, [STAGES, BN, D_B], kb_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BN, D_V], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both consumers hand each buffer back
        gl.warp_specialize(
            [
                (_consumer, (q_smem_a, q_smem_b, k_smem_a, k_smem_b, v_smem, q_bar, ready, empty, out_ptr, lse_ptr,
                             q_start, len_q, len_k, m0, h, num_tiles, stride_ot, stride_lse_h, qk_scale, 0, CAUSAL)),
                (_consumer, (q_smem_a, q_smem_b, k_smem_a, k_smem_b, v_smem, q_bar, ready, empty, out_ptr, lse_ptr,
                             q_start, len_q, len_k, m0, h, num_tiles, stride_ot, stride_lse_h, qk_scale, 1, CAUSAL)),
                (_producer, (qa_desc, qb_desc, ka_desc, kb_desc, v_desc, q_smem_a, q_smem_b, k_smem_a, k_smem_b,
                             v_smem, q_bar, ready, empty, q_start + m0, k_start, h * stride_qh, h * stride_kh,
                             h * stride_vh, num_tiles)),
            ],
            [4, 1],
            [CONSUMER_REGS, 24],
        )  # fmt: skip


def _descriptor(t: torch.Tensor, rows: int, width: int) -> TensorDescriptor:
    """A descriptor over ``t`` ``[T, H, D]`` viewed as ``[T, H*D]`` rows, block ``[rows, width]``."""
    cols = (t.shape[1] - 1) * t.stride(1) + t.shape[2]
    layout = gl.NVMMASharedLayout.get_default_for([rows, width], gl.bfloat16)
    return TensorDescriptor(t, [t.shape[0], cols], [t.stride(0), 1], [rows, width], layout)


def attention_gluon(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    softmax_scale: float,
    causal: bool,
    *,
    block_n: int = 64,
    stages: int = 2,
    maxnreg: int = 168,
    consumer_regs: int = 240,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [Tq, H, Dv] bf16, lse [H, Tq] fp32, natural log)`` for the inputs this experiment covers
    (module docstring); ``max_seqlen_q`` must bound every query slice (it sizes the grid)."""
    num_tokens, num_heads, dqk = q.shape
    dv = v.shape[-1]
    d_a = 1 << (dqk.bit_length() - 1)
    d_b = dqk - d_a
    if q.dtype != torch.bfloat16 or not d_b or d_b & (d_b - 1) or dv & (dv - 1) or softmax_scale < 0:
        raise ValueError("attention_gluon covers bf16, Dqk = 2^a + 2^b (b < a), Dv = 2^c and a non-negative scale")
    out = torch.empty(num_tokens, num_heads, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(num_heads, num_tokens, dtype=torch.float32, device=q.device)
    qa, ka = _descriptor(q, _HALF.value, d_a), _descriptor(k, block_n, d_a)
    qb, kb = _descriptor(q, _HALF.value, d_b), _descriptor(k, block_n, d_b)
    grid = (triton.cdiv(max_seqlen_q, 2 * _HALF.value), num_heads, cu_seqlens_q.shape[0] - 1)
    _attention_kernel[grid](
        qa, qb, ka, kb, _descriptor(v, block_n, dv), out, lse, cu_seqlens_q, cu_seqlens_k, q.stride(1), k.stride(1),
        v.stride(1), out.stride(0), lse.stride(0), softmax_scale * _LOG2E, bool(causal), stages, consumer_regs,
        num_warps=4, maxnreg=maxnreg,
    )  # fmt: skip
    return out, lse
