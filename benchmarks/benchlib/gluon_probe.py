"""A minimal attention loop in Gluon, Triton's explicit-layout language, for ``probe_warp_specialize.py``.

One program attends ``BM`` query rows to every key of one head (non-causal, no mask), ``D`` channels
for Q, K and V. K and V tiles arrive through TMA into a ring of ``STAGES`` shared-memory buffers, each
guarded by a *ready* mbarrier (the TMA completes it) and an *empty* one (the consumer arrives on it);
both products are wgmma (``warpgroup_mma``). With ``WS`` the loads are issued by a one-warp producer
partition of ``gl.warp_specialize`` while the default partition computes: the explicit form of what
``tl.range(..., warp_specialize=True)`` asks Triton's compiler to derive. Without it the compute loop
issues each buffer's next load itself once it has consumed the buffer (the control).

Imported only by the probe's child process: importing it needs Triton 3.5 or newer with Gluon.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

__all__ = ["attention_probe_kernel"]


@gluon.jit
def _load_tile(k_desc, v_desc, k_buf, v_buf, ready, tile, pred):
    """Issue the TMA loads of key/value tile ``tile`` into one ring buffer; ``ready`` completes with them."""
    BN: gl.constexpr = k_desc.block_type.shape[0]
    mbarrier.expect(ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(k_desc, [tile * BN, 0], ready, k_buf, pred=pred)
    tma.async_copy_global_to_shared(v_desc, [tile * BN, 0], ready, v_buf, pred=pred)


@gluon.jit
def _compute(
    q_smem, k_smem, v_smem, ready, empty, num_tiles, qk_scale, k_desc, v_desc,
    s_layout: gl.constexpr, o_layout: gl.constexpr, LOADS: gl.constexpr,
):  # fmt: skip
    """Online softmax over every key tile; returns the unnormalised output ``[BM, D]`` and the row sums.

    ``LOADS``: this partition also refills each buffer it has consumed (no producer partition);
    otherwise it hands the buffer back by arriving on its *empty* mbarrier.
    """
    BM: gl.constexpr = q_smem.type.shape[0]
    BN: gl.constexpr = k_smem.type.shape[1]
    D: gl.constexpr = v_smem.type.shape[2]
    STAGES: gl.constexpr = k_smem.type.shape[0]
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    m_i = gl.full([BM], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BM], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BM, D], gl.float32, o_layout)
    s_init = gl.zeros([BM, BN], gl.float32, s_layout)
    for i in range(num_tiles):
        stage = i % STAGES
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        k_buf = k_smem.index(stage)
        v_buf = v_smem.index(stage)
        s = warpgroup_mma(q_smem, k_buf.permute((1, 0)), s_init, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,)) * qk_scale
        m_new = gl.maximum(m_i, gl.max(s, 1))
        p = gl.exp2(s - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        acc = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), p_layout), v_buf, acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        if LOADS:
            _load_tile(k_desc, v_desc, k_buf, v_buf, ready.index(stage), i + STAGES, i + STAGES < num_tiles)
        else:
            mbarrier.arrive(empty.index(stage), count=1)
        m_i = m_new
    return acc, l_i


@gluon.jit
def _producer(k_desc, v_desc, k_smem, v_smem, ready, empty, num_tiles):
    """The warp-specialised producer: fill each buffer once the consumer has handed it back."""
    STAGES: gl.constexpr = k_smem.type.shape[0]
    for i in range(num_tiles):
        stage = i % STAGES
        # A fresh mbarrier counts as having completed the phase before phase 0, so the first
        # round of waits passes at once.
        mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)
        _load_tile(k_desc, v_desc, k_smem.index(stage), v_smem.index(stage), ready.index(stage), i, True)


@gluon.jit
def attention_probe_kernel(
    q_desc, k_desc, v_desc, out_ptr, N, qk_scale, WS: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr
):
    """``out[m0:m0+BM] = softmax(q k^T * scale) v`` for program ``m0 // BM``; bfloat16 ``[N, D]`` tensors,
    ``qk_scale`` in base 2 (``log2(e)`` folded in), ``N`` a multiple of both block sizes."""
    BM: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    BN: gl.constexpr = k_desc.block_type.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, D, 16]
    )
    m0 = gl.program_id(0) * BM
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BM, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BN, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BN, D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [m0, 0], q_bar, q_smem)
    mbarrier.wait(q_bar, 0)
    num_tiles = gl.cdiv(N, BN)
    if WS:
        acc, l_i = gl.warp_specialize(
            [
                (_compute, (q_smem, k_smem, v_smem, ready, empty, num_tiles, qk_scale, k_desc, v_desc,
                            s_layout, o_layout, False)),
                (_producer, (k_desc, v_desc, k_smem, v_smem, ready, empty, num_tiles)),
            ],
            [1],
            [24],
        )  # fmt: skip
    else:
        for i in gl.static_range(STAGES):
            _load_tile(k_desc, v_desc, k_smem.index(i), v_smem.index(i), ready.index(i), i, i < num_tiles)
        acc, l_i = _compute(
            q_smem, k_smem, v_smem, ready, empty, num_tiles, qk_scale, k_desc, v_desc, s_layout, o_layout, True
        )
    out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    rows = m0 + gl.arange(0, BM, gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, D, gl.SliceLayout(0, o_layout))
    gl.store(out_ptr + rows[:, None] * D + cols[None, :], out.to(gl.bfloat16))
