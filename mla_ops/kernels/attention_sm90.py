"""Varlen flash-attention forward for Hopper (SM90) in Gluon, with FlashAttention-3's structure.

A TMA producer warp and two consumer warpgroups per program, overlapping each tile's softmax with the previous
tile's P @ V (``ovl``), in persistent programs (``pers``), optionally taking turns on the tensor cores (``pp``), with
the same contract and program numbering as :mod:`mla_ops.kernels.attention_kernel`. :func:`sm90_unsupported_reason`
says which inputs it does not cover. Design: docs/design/triton-kernels.md (The Gluon kernel). With ``FP8`` it takes
e4m3 inputs (``scales`` of :func:`attention_sm90`), which large fp8 calls route to: docs/design/fp8.md (The Gluon
kernel's fp8 variant).
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..backends.base import Fp8Scales, VarlenCall
from ..runtime.alloc import empty, template
from .attention_kernel import head_and_slot
from .configs import head_dim_split
from .launch import NATIVE_COUNTER_CODE, FixedLaunch, LaunchPlan, NativeLaunch, TorchScratch, pointer_alignment
from .programs import program_layout
from .transpose import KEY_ALIGNMENT, copy_relaunch, transposed_values
from .triton_compat import COMPILE_OPTIONS, lean_registers, tma_load

__all__ = [
    "SM90_LEADING",
    "SM90_LEADING_FP8",
    "CountedRelaunch",
    "DirectRelaunch",
    "TransposedRelaunch",
    "attention_sm90",
    "sm90_launch",
    "sm90_shared_memory",
    "sm90_unsupported_reason",
    "values_read_directly",
]

#: Query rows per consumer warpgroup; a program has two, so its block is 128 rows.
_HALF = gl.constexpr(64)
BLOCK_M = 2 * _HALF.value
_LN2 = gl.constexpr(0.6931471805599453)
_LOG2E = 1.4426950408889634
#: Registers per thread of the consumer warpgroups and of the producer warp (``setmaxnreg``); the
#: kernel's ``maxnreg`` (168) times its 12 warps is the register file. FlashAttention-3 splits it 240 for
#: each consumer and 24 for the producer (whose warpgroup holds it four times); here the producer decodes
#: every work item itself, which spills in 24, so it gets 40 and the consumers 232, which still compile
#: without spills (``benchmarks/compile_sm90.py``). With Triton >= 3.8 no split fits the code as written
#: (224 or 240 for the consumers spill more); :data:`_LEAN` makes it fit this one instead.
_MAXNREG = 168
_CONSUMER_REGS = gl.constexpr(232)
_PRODUCER_REGS = gl.constexpr(40)
#: Shared memory one block may use on SM90 (227 KiB): the Q tiles, the K/V ring and the mbarriers.
_SM90_SHARED_BYTES = 227 * 1024
_PAD_FILL = gl.constexpr(1024)

#: Gluon's TMA copy into shared memory, under this release's name (mla_ops.kernels.triton_compat).
_tma_load = tma_load()

#: Whether to take the register-lean spellings (mla_ops.kernels.triton_compat.lean_registers): with Triton
#: >= 3.8 the partitions are a few registers over their budgets otherwise; 3.6 and 3.7 keep the code
#: measured on the GPU.
_LEAN = gl.constexpr(lean_registers(triton.__version__))

#: How many leading kernel arguments change from call to call: q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k (as
#: the ``tl.dot`` kernel's) and the work counter; for an fp8 call also the three descale factors after them (as the
#: ``tl.dot`` kernel's fp8 calls add them after its seven).
SM90_LEADING = 8
SM90_LEADING_FP8 = 11

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv}
#: fp8: the probabilities are ``2**_P_SHIFT`` times the true ones until the end (the shift is folded into the running
#: max), so that small ones, rounded to e4m3 for ``P @ V``, stay normal numbers: e4m3's smallest normal is 2**-6 and
#: the largest shifted probability, 2**8, is below its largest value, 448 (as the ``tl.dot`` kernel's ``P_SHIFT``).
_P_SHIFT = gl.constexpr(8.0)
#: fp8: each sequence's first key starts a column of the transposed values that is a multiple of this
#: (mla_ops.kernels.transpose.KEY_ALIGNMENT).
_KEY_ALIGN = gl.constexpr(KEY_ALIGNMENT)


@gluon.jit
def _sequence_of_slot(cu_seqlens_q, num_seqs, slot, WARPS: gl.constexpr):
    """The last sequence ``b`` whose first slot ``cu_seqlens_q[b] // BLOCK_M + b`` is ``<= slot``, computed by
    ``WARPS`` warps."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    CHUNK: gl.constexpr = 64 * WARPS  # two sequences per thread: the producer warp has few registers
    hits = gl.zeros([CHUNK], gl.int32, layout)
    for c in range(0, num_seqs, CHUNK):
        idx = c + gl.arange(0, CHUNK, layout)
        starts = gl.load(cu_seqlens_q + idx, mask=idx < num_seqs, other=0)
        hits += ((starts // (2 * _HALF) + idx <= slot) & (idx < num_seqs)).to(gl.int32)
    return gl.sum(hits, axis=0) - 1


#: The work item's hand-off goes through named barriers, two per consumer warpgroup ``WG`` of 160 threads each (the
#: producer warp and the warpgroup): ``_ITEM_WRITTEN + WG``, on which the producer arrives once it wrote an item and
#: the warpgroup waits before it reads it, and ``_ITEM_READ + WG``, the other way round before the next item is
#: written. The Q mbarrier already orders the hand-off, but compute-sanitizer's racecheck sees only its arriving
#: thread's stores ordered; named barriers order every thread's, as the tool sees (docs/design/triton-kernels.md,
#: Under compute-sanitizer). Triton's own barriers in this kernel take ids 0 to 2 under Triton 3.6 to 3.9
#: (benchmarks/compile_sm90.py checks that they stay off these).
_ITEM_WRITTEN = 12
_ITEM_READ = 14
_HANDOFF_THREADS = 32 + 4 * 32


def _barrier_ptx(op: str, bar: int | str, threads: int) -> gl.constexpr:
    """Inline PTX of ``bar.<op>`` (``sync`` or ``arrive``) on named barrier ``bar`` (an id, or ``"$1"``: the id is the
    operand) for ``threads`` threads; it passes its operand through, so that data can depend on it."""
    return gl.constexpr(f"bar.{op} {bar}, {threads}; mov.b32 $0, $1;")


#: The barriers' PTX per warpgroup.
_WAIT_WRITTEN_0 = _barrier_ptx("sync", _ITEM_WRITTEN, _HANDOFF_THREADS)
_WAIT_WRITTEN_1 = _barrier_ptx("sync", _ITEM_WRITTEN + 1, _HANDOFF_THREADS)
_SIGNAL_WRITTEN_0 = _barrier_ptx("arrive", _ITEM_WRITTEN, _HANDOFF_THREADS)
_SIGNAL_WRITTEN_1 = _barrier_ptx("arrive", _ITEM_WRITTEN + 1, _HANDOFF_THREADS)
_WAIT_READ_0 = _barrier_ptx("sync", _ITEM_READ, _HANDOFF_THREADS)
_WAIT_READ_1 = _barrier_ptx("sync", _ITEM_READ + 1, _HANDOFF_THREADS)
_SIGNAL_READ_0 = _barrier_ptx("arrive", _ITEM_READ, _HANDOFF_THREADS)
_SIGNAL_READ_1 = _barrier_ptx("arrive", _ITEM_READ + 1, _HANDOFF_THREADS)


@gluon.jit
def _named_barrier(x, ASM: gl.constexpr):
    """``x`` (int32) through ``ASM``, a named barrier's inline PTX, which every thread of the partition runs once
    (``x`` holds one element per thread); not pure, so that shared-memory accesses stay on their side of it."""
    return gl.inline_asm_elementwise(ASM, "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _wait_both_read(token):
    """``token`` (int32, one element per thread of the producer warp) once both warpgroups have signalled the last
    item read."""
    return _named_barrier(_named_barrier(token, _WAIT_READ_0), _WAIT_READ_1)


@gluon.jit
def _put_item(item_smem, w, seq_smem, b, n):
    """Write the ``n``-th work item ``w`` (and, where :data:`_LEAN`, its sequence ``b`` into ``seq_smem``) where
    the consumers read it (:func:`_get_item`): once both warpgroups have read the previous one, and signalled
    to each when written. The producer's last call (the ``-1`` that ends the consumers) is followed by
    :func:`_await_last_read`."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    token = gl.full([1], 0, gl.int32, layout)
    if n > 0:
        token = _wait_both_read(token)
    item_smem.store(gl.full([1], w, gl.int32, layout) + token)  # the token (0) keeps the store after the waits
    if _LEAN:
        seq_smem.store(gl.full([1], b, gl.int32, layout) + token)
    _named_barrier(_named_barrier(token, _SIGNAL_WRITTEN_0), _SIGNAL_WRITTEN_1)


@gluon.jit
def _await_last_read():
    """Wait until both warpgroups have read the last item written, as :func:`_put_item` would before another: each
    warpgroup's barriers then end the launch with every arrival waited for."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    _wait_both_read(gl.full([1], 0, gl.int32, layout))


#: fp8: the rings' buffers and the consumers' turns go through named barriers instead of mbarrier arrivals (the
#: ``k_empty``, ``v_empty`` and ``turns`` mbarriers are then not allocated). Triton (3.6 to 3.9) puts a barrier of the
#: whole warpgroup before each ``mbarrier.arrive`` of one thread: in the fp8 kernel's loop, four of its six such
#: barriers a tile; a named barrier's ``bar.arrive`` by every thread needs none (docs/design/fp8.md, The
#: synchronisation). ``_RING_FREE + s``: both consumer warpgroups are done with buffer ``s`` of the key and value
#: rings (at most 4 buffers), which the producer waits for before loading it again; ``_TURN + WG``: warpgroup
#: ``WG``'s turn on the tensor cores, given by the other (FlashAttention-3's warp-scheduler barriers).
_RING_FREE = 4
_MAX_FP8_STAGES = 4
_TURN = _RING_FREE + _MAX_FP8_STAGES
_RING_ASM_SYNC = _barrier_ptx("sync", "$1", 32 + 2 * 128)
_RING_ASM_ARRIVE = _barrier_ptx("arrive", "$1", 32 + 2 * 128)
_TURN_ASM_SYNC = _barrier_ptx("sync", "$1", 2 * 128)
_TURN_ASM_ARRIVE = _barrier_ptx("arrive", "$1", 2 * 128)
_RING_FREE_C = gl.constexpr(_RING_FREE)
_TURN_C = gl.constexpr(_TURN)


@gluon.jit
def _on_barrier(bar_id, ASM: gl.constexpr, WARPS: gl.constexpr):
    """Every thread of a partition of ``WARPS`` warps runs ``ASM`` on named barrier ``bar_id`` (an int32 scalar)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    _named_barrier(gl.full([1], 0, gl.int32, layout) + bar_id, ASM)


@gluon.jit
def _get_item(item_smem, seq_smem, WG: gl.constexpr):
    """The work item the producer last wrote and, where :data:`_LEAN`, its sequence (else 0), as consumer warpgroup
    ``WG`` reads them: once the producer has signalled them written, then signalling them read."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    token = gl.full([1], 0, gl.int32, layout)
    if WG == 0:
        token = _named_barrier(token, _WAIT_WRITTEN_0)
    else:
        token = _named_barrier(token, _WAIT_WRITTEN_1)
    w = item_smem.load(layout) + token
    if _LEAN:
        b = seq_smem.load(layout) + token
    else:
        b = token
    read = w + b  # the signal takes both loaded values: the loads are done before the warpgroup signals them read
    if WG == 0:
        _named_barrier(read, _SIGNAL_READ_0)
    else:
        _named_barrier(read, _SIGNAL_READ_1)
    return gl.max(w, axis=0), gl.max(b, axis=0)


@gluon.jit
def _work_item(w, cu_seqlens_q, cu_seqlens_k, num_seqs, num_heads, num_slots, heads_per_group, b_given,
               B_GIVEN: gl.constexpr, CAUSAL: gl.constexpr, BN: gl.constexpr, WARPS: gl.constexpr):  # fmt: skip
    """Work item ``w < num_heads * num_slots``: ``(real, h, q_start, len_q, k_start, len_k, m0, num_tiles)``:
    head ``h``, the query rows ``m0`` on of the sequence at ``q_start`` (``len_q`` rows), its keys
    (``len_k`` rows from ``k_start``) and its ``num_tiles`` key tiles; ``real`` is false for the slots no
    block fills."""
    h, slot = head_and_slot(w, num_heads, num_slots, heads_per_group)  # the tl.dot kernel's numbering
    if B_GIVEN:
        b = b_given
    else:
        b = _sequence_of_slot(cu_seqlens_q, num_seqs, slot, WARPS)
    q_start = gl.load(cu_seqlens_q + b)
    q_end = gl.load(cu_seqlens_q + gl.minimum(b + 1, num_seqs))
    len_q = q_end - q_start
    num_own = q_end // (2 * _HALF) - q_start // (2 * _HALF) + 1  # slots of sequence b
    j = slot - (q_start // (2 * _HALF) + b)
    m0 = (num_own - 1 - j) * (2 * _HALF)  # last block first: under causal masking it has the most keys
    real = (j < num_own) & (m0 < len_q)
    k_start = gl.load(cu_seqlens_k + b)
    len_k = gl.load(cu_seqlens_k + gl.minimum(b + 1, num_seqs)) - k_start
    if CAUSAL:
        hi = gl.maximum(gl.minimum(len_k, m0 + 2 * _HALF + len_k - len_q), 0)
    else:
        hi = len_k
    return real, h, q_start, len_q, k_start, len_k, m0, gl.cdiv(hi, BN), b


@gluon.jit
def _load_keys(ka_desc, kb_desc, k_smem_a, k_smem_b, k_ready, k_empty, g, row, col_k, FP8: gl.constexpr):
    """Tile ``g`` (counted over the program's work items) of the key ring: both parts of rows ``row`` on. ``FP8``:
    once both consumers are done with the buffer's last tile, keys and values (:data:`_RING_FREE`), so that
    :func:`_load_values` of the same tile need not wait again."""
    D_A: gl.constexpr = ka_desc.block_type.shape[1]
    STAGES: gl.constexpr = k_smem_a.type.shape[0]
    stage = g % STAGES
    if FP8:
        if g >= STAGES:  # the first round's buffers are free
            _on_barrier(_RING_FREE_C + stage, _RING_ASM_SYNC, 1)
    else:
        # A fresh mbarrier counts as having completed the phase before phase 0: the first round passes.
        mbarrier.wait(k_empty.index(stage), ((g // STAGES) & 1) ^ 1)
    mbarrier.expect(k_ready.index(stage), ka_desc.block_type.nbytes + kb_desc.block_type.nbytes)
    _tma_load(ka_desc, [row, col_k], k_ready.index(stage), k_smem_a.index(stage))
    _tma_load(kb_desc, [row, col_k + D_A], k_ready.index(stage), k_smem_b.index(stage))


@gluon.constexpr_function
def _value_width(v_smem_type, fp8):
    """``D_V`` of the value ring, from its type: ``[STAGES, BN, D_V]``, or with ``fp8`` the transposed tiles
    ``[STAGES, D_V, BN]`` (keys contiguous), as :func:`_attn_fwd_sm90` allocates it. The producer and the
    consumers read it alike."""
    return v_smem_type.shape[1] if fp8 else v_smem_type.shape[2]


@gluon.jit
def _load_values(v_desc, v_smem, v_ready, v_empty, g, row, FP8: gl.constexpr):
    """Tile ``g`` of the value ring: rows ``row`` on of ``v_desc`` (one sequence's and head's values); ``FP8``: columns
    ``row`` on of ``v_desc`` over the transposed values (a ``[D_V, BN]`` tile)."""
    STAGES: gl.constexpr = v_smem.type.shape[0]
    TILE_BYTES: gl.constexpr = v_smem.type.shape[1] * v_smem.type.shape[2] * v_smem.dtype.primitive_bitwidth // 8
    stage = g % STAGES
    if not FP8:  # (fp8: the tile's keys waited for the buffer)
        mbarrier.wait(v_empty.index(stage), ((g // STAGES) & 1) ^ 1)
    mbarrier.expect(v_ready.index(stage), TILE_BYTES)
    if FP8:
        _tma_load(v_desc, [0, row], v_ready.index(stage), v_smem.index(stage))
    else:
        _tma_load(v_desc, [row, 0], v_ready.index(stage), v_smem.index(stage))


@gluon.jit
def _produce_item(
    qa_desc, qb_desc, ka_desc, kb_desc, V, q_smem_a, q_smem_b, k_smem_a, k_smem_b, v_smem, q_bar, q_empty,
    k_ready, k_empty, v_ready, v_empty, item_smem, seq_smem, w, b, t, n, h, q_row, k_start, len_k, num_tiles, stride_qh,
    stride_kh, stride_vt, stride_vh, V_LAYOUT: gl.constexpr, FP8: gl.constexpr, V_DIRECT: gl.constexpr,
):  # fmt: skip
    """One work item's loads, the program's ``n``-th (``w``), its tiles ``t`` onwards of the rings: Q, then
    every key tile's K (both parts) and V, each into its own ring. ``FP8``: ``V`` is the transposed values
    ``[H, D_V, width]`` (:func:`mla_ops.kernels.transpose.transposed_values`, sequence ``b``'s keys from column
    ``BN + sequence_column(k_start, b)``), ``stride_vh`` its head stride and ``stride_vt`` its channel stride; with
    ``V_DIRECT``, the call's own key-major ``v`` of one sequence, its key ``j`` at column ``j`` of each channel."""
    BN: gl.constexpr = ka_desc.block_type.shape[0]
    D_A: gl.constexpr = ka_desc.block_type.shape[1]
    D_V: gl.constexpr = _value_width(v_smem.type, FP8)
    STAGES: gl.constexpr = k_smem_a.type.shape[0]
    col_k = h * stride_kh
    if num_tiles > 0:  # the first keys before Q, which waits for the previous item's last scores
        _load_keys(ka_desc, kb_desc, k_smem_a, k_smem_b, k_ready, k_empty, t, k_start, col_k, FP8)
    mbarrier.wait(q_empty, (n & 1) ^ 1)
    _put_item(item_smem, w, seq_smem, b, n)
    mbarrier.expect(q_bar, 2 * (qa_desc.block_type.nbytes + qb_desc.block_type.nbytes))
    col_q = h * stride_qh
    for c in gl.static_range(2):
        _tma_load(qa_desc, [q_row + c * _HALF, col_q], q_bar, q_smem_a.index(c))
        _tma_load(qb_desc, [q_row + c * _HALF, col_q + D_A], q_bar, q_smem_b.index(c))
    if num_tiles > 0:
        # The previous items' value loads go through the descriptor written below: let them land first.
        # The last STAGES loads are the only ones that can be in flight (each earlier one was waited for
        # before its buffer was loaded again), and no load came after them, so their ready barriers are
        # still in those phases.
        for s in gl.static_range(STAGES):
            g = t - 1 - s
            if g >= 0:
                mbarrier.wait(v_ready.index(g % STAGES), (g // STAGES) & 1)
        if FP8:
            # The head's transposed values up to this sequence's last key, loaded from its first: keys past it
            # read as 0, never as a neighbour's NaN. A TMA load must start on a 16-byte boundary in the
            # contiguous dimension (elsewhere: an illegal instruction), so each sequence's keys start on an aligned
            # column, sequence_column in mla_ops.kernels.transpose, after BN lead columns: a descriptor may not be
            # narrower than its block.
            if V_DIRECT:
                # The call's v itself, key-major, one sequence whose keys start at 0 (cu_seqlens start at 0):
                # the descriptor starts BN columns before each channel's first key, as the copy's lead columns
                # do, and no load reads a column before BN.
                v_col = BN + k_start
                v_base = V + h.to(gl.int64) * stride_vh - BN
            else:
                v_col = BN + (k_start + _KEY_ALIGN - 1) // _KEY_ALIGN * _KEY_ALIGN + _KEY_ALIGN * b
                v_base = V + h.to(gl.int64) * stride_vh
            v_desc = tma.make_tensor_descriptor(
                v_base, shape=[D_V, v_col + len_k], strides=[stride_vt, 1], block_shape=[D_V, BN], layout=V_LAYOUT,
            )  # fmt: skip
        else:
            # Values through a descriptor over this sequence's and head's rows only: rows past them read as
            # 0, never as a neighbour's NaN.
            v_desc = tma.make_tensor_descriptor(
                V + k_start.to(gl.int64) * stride_vt + h * stride_vh, shape=[gl.maximum(len_k, 1), D_V],
                strides=[stride_vt, 1], block_shape=[BN, D_V], layout=V_LAYOUT,
            )  # fmt: skip
            v_col = 0
        _load_values(v_desc, v_smem, v_ready, v_empty, t, v_col, FP8)
        for i in range(1, num_tiles):
            # Keys and values have rings of their own because they are let go at different times: a tile's
            # keys once its scores are in, its values once P @ V is (a step later where the two overlap); fp8 lets
            # both go at once, after P @ V (_RING_FREE).
            _load_keys(ka_desc, kb_desc, k_smem_a, k_smem_b, k_ready, k_empty, t + i, k_start + i * BN, col_k, FP8)
            _load_values(v_desc, v_smem, v_ready, v_empty, t + i, v_col + i * BN, FP8)


@gluon.jit
def _row_descriptor(T, rows, cols, stride_t, smem):
    """A TMA descriptor over ``T`` ``[tokens, H, D]`` as 2-D rows ``[rows, cols]`` (row stride ``stride_t``; head
    ``h`` from column ``h * stride_h``, its two parts side by side), in blocks of one buffer of ``smem``
    (``[buffers, block rows, width]``, ``width`` one part of a head), in its layout."""
    return tma.make_tensor_descriptor(
        T, shape=[rows, cols], strides=[stride_t, 1], block_shape=[smem.type.shape[1], smem.type.shape[2]],
        layout=smem.type.layout,
    )  # fmt: skip


@gluon.jit
def _producer(
    Q, K, V, q_smem_a, q_smem_b, k_smem_a, k_smem_b, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty,
    item_smem, seq_smem, Counter, cu_seqlens_q, cu_seqlens_k, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
    stride_vh, num_tokens_q, q_cols, k_rows, k_cols, num_seqs, num_heads, num_slots, heads_per_group, worker,
    num_workers,
    V_LAYOUT: gl.constexpr, CAUSAL: gl.constexpr, FP8: gl.constexpr, V_DIRECT: gl.constexpr,
):  # fmt: skip
    """The producer warp: every work item its program takes, ``worker`` first, then the next one not yet
    taken by any program (``Counter``, zero at launch, counts those taken), until none is left. It hands
    each item's number to the consumers with the item's Q and ends with ``-1``. Tiles are counted over all
    the items (``t``), so the rings' phases run on from one item to the next and an item's first tiles load
    while the previous one is finishing."""
    # Q and K through descriptors built here, on the device, as V's are: a launch then passes only addresses
    # and integers, so that a layout's later calls relaunch without Triton's dispatch (mla_ops.kernels.launch).
    # Each covers the tensor as 2-D rows [tokens, columns], head h from column h * stride_h (its two parts
    # side by side); the smem tiles' shapes and layouts give the blocks. The launcher passes the extents:
    # computed here from the head count and strides, they held registers past this warp's 40 on Triton 3.8
    # and 3.9 (52-72 bytes spilled).
    qa_desc = _row_descriptor(Q, num_tokens_q, q_cols, stride_qt, q_smem_a)
    qb_desc = _row_descriptor(Q, num_tokens_q, q_cols, stride_qt, q_smem_b)
    ka_desc = _row_descriptor(K, k_rows, k_cols, stride_kt, k_smem_a)
    kb_desc = _row_descriptor(K, k_rows, k_cols, stride_kt, k_smem_b)
    BN: gl.constexpr = ka_desc.block_type.shape[0]
    num_items = num_heads * num_slots
    t = worker * 0  # tiles loaded so far
    n = worker * 0  # items loaded so far
    w = worker
    while w < num_items:
        real, h, q_start, _len_q, k_start, len_k, m0, num_tiles, b = _work_item(
            w, cu_seqlens_q, cu_seqlens_k, num_seqs, num_heads, num_slots, heads_per_group, 0, False, CAUSAL, BN, 1
        )
        if real:
            _produce_item(
                qa_desc, qb_desc, ka_desc, kb_desc, V, q_smem_a, q_smem_b, k_smem_a, k_smem_b, v_smem, q_bar,
                q_empty, k_ready, k_empty, v_ready, v_empty, item_smem, seq_smem, w, b, t, n, h, q_start + m0, k_start,
                len_k, num_tiles, stride_qh, stride_kh, stride_vt, stride_vh, V_LAYOUT, FP8, V_DIRECT,
            )  # fmt: skip
            t += num_tiles
            n += 1
        # Items are taken in order, as the hardware would start programs of their own: the costly
        # causal blocks first, and whoever is free takes the next.
        w = num_workers + gl.atomic_add(Counter, 1)
    mbarrier.wait(q_empty, (n & 1) ^ 1)
    _put_item(item_smem, -1, seq_smem, 0, n)
    mbarrier.arrive(q_bar, count=1)  # no transfer: the phase completes on the arrival alone
    _await_last_read()
    if FP8:  # the consumers' last releases of each buffer, which no load waited for: every arrival is matched
        STAGES: gl.constexpr = k_smem_a.type.shape[0]
        for s in gl.static_range(STAGES):
            g = t - STAGES + s
            if g >= 0:
                _on_barrier(_RING_FREE_C + g % STAGES, _RING_ASM_SYNC, 1)


@gluon.jit
def _register_q(q_smem, s_layout: gl.constexpr):
    """fp8 under Triton 3.6 and 3.7: a warpgroup's Q tile ``[64, D]`` (one part of the head), loaded from shared
    memory into registers as the A operand of ``Q @ K^T`` (whose accumulator has ``s_layout``).

    Every key tile's product reads its A operand again; from shared memory that is 12 KiB a tile and warpgroup,
    a fifth of what its products read there, and at the power cap bytes moved cost clock. In registers it takes
    24 a thread for the whole item, and needs no keeping alive (``warpgroup_mma_wait``'s deps, which take no
    8-bit values) since nothing writes it before the item ends. Under Triton 3.6 and 3.7 the partitions keep
    their budgets with 0 spills (``compile_sm90.py --dtype float8_e4m3fn``); under 3.9 the chunk's would spill 52
    bytes, so the register-lean spellings (:func:`~mla_ops.kernels.triton_compat.lean_registers`, Triton 3.8 on)
    keep Q in shared memory. The 16-bit Q would take 48 registers and spill. Design: docs/design/fp8.md."""
    return q_smem.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=4))


@gluon.jit
def _issue_scores(q_a, q_b, k_a, k_b, s_init):
    """Start ``q @ k^T`` of one tile, unscaled, as two asynchronous products (both parts of the head); ``q_a`` and
    ``q_b`` are shared-memory tiles, or (fp8) register operands (:func:`_register_q`)."""
    s = warpgroup_mma(q_a, k_a.permute((1, 0)), s_init, use_acc=False, is_async=True)
    return warpgroup_mma(q_b, k_b.permute((1, 0)), s, is_async=True)


@gluon.jit
def _softmax(s, m_i, l_i, keys, start, len_k, q_pos, qk_scale, MASKED: gl.constexpr, CAUSAL: gl.constexpr,
             SCALE_NONNEG: gl.constexpr, FP8: gl.constexpr):  # fmt: skip
    """One tile's online-softmax step on its raw scores ``s``: ``(p, alpha, m_new, l_new)``, ``p`` the
    tile's probabilities (fp32, base 2; ``FP8``: ``2**_P_SHIFT`` times them, and so is ``l_new``) and ``alpha``
    the factor that rescales the running output.

    ``MASKED`` tiles hide keys past ``len_k`` and, causal, those after each row's diagonal (``keys`` the
    tile's key positions, ``q_pos`` the rows' positions among the keys); a row with no visible key yet
    keeps ``m = -inf`` and gets ``p = 0``, ``alpha = 0`` instead of NaN."""
    if MASKED:
        if _LEAN and CAUSAL:
            # keys < min(len_k, q_pos + 1), spelled so that no key position need stay in a register: in the
            # wgmma layout a thread's columns are 2 * (lane % 4) (bits 1-2) plus constants (bits 0, 3-6),
            # so each compare becomes a constant against one value per row.
            lane = keys & 6
            lim = gl.minimum(q_pos + 1, len_k) - start
            visible = (keys - lane)[None, :] < (lim[:, None] - lane[None, :])
        else:
            keys = keys + start
            visible = (keys < len_k)[None, :]
            if CAUSAL:
                visible = visible & (keys[None, :] <= q_pos[:, None])
        s = gl.where(visible, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # no visible key yet: exp2(-inf - 0), not NaN
        if FP8:
            p = gl.exp2(s - (m_use - _P_SHIFT)[:, None])
        else:
            p = gl.exp2(s - m_use[:, None])
        alpha = gl.exp2(m_i - m_use)
    else:
        if SCALE_NONNEG:
            # max(s) * scale == max(s * scale) for scale >= 0, and the subtraction below is one FMA.
            m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        else:
            m_new = gl.maximum(m_i, gl.max(s * qk_scale, 1))
        if FP8:
            p = gl.exp2(s * qk_scale - (m_new - _P_SHIFT)[:, None])
        else:
            p = gl.exp2(s * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _rescale(acc, alpha):
    """``acc * alpha`` row by row (``alpha`` in the scores' row layout)."""
    return acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]


@gluon.jit
def _operand(p, dtype: gl.constexpr, o_layout: gl.constexpr):
    """Probabilities as the register operand of ``P @ V``."""
    return gl.convert_layout(p.to(dtype), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))


@gluon.jit
def _stage_probabilities(p_smem, p):
    """fp8: probabilities ``p`` (fp32 ``[64, BN]``, the scores' layout) rounded to e4m3 into ``p_smem``, the
    shared-memory A operand of ``P @ V``.

    Not the register operand the 16-bit path takes: a register operand has to be kept alive until its product
    retires by passing it to ``warpgroup_mma_wait``, whose lowering takes only 16- to 64-bit values ("Unexpected
    bitwidth in WGMMAWaitGroupOp: 8"), and a shared-memory operand needs nothing kept alive."""
    p_smem.store(p.to(p_smem.dtype))
    fence_async_shared()  # the stores (generic proxy) before wgmma's reads (async proxy)


@gluon.jit
def _free_tile(g, STAGES: gl.constexpr):
    """fp8: this warpgroup is done with ring tile ``g``, keys and values; the producer may load the buffer again."""
    _on_barrier(_RING_FREE_C + g % STAGES, _RING_ASM_ARRIVE, 4)


@gluon.jit
def _take_turn(turns, g, WG: gl.constexpr, PINGPONG: gl.constexpr, FP8: gl.constexpr):
    """Ping-pong (``PINGPONG``, FlashAttention-3's warp scheduling): wait until the other warpgroup has issued its
    products of ring tile ``g - 1`` (``WG == 1``: of tile ``g``), so that the two take turns on the tensor cores and
    one's softmax runs under the other's products. Warpgroup 0 passes its first turn on the fresh barrier (phase
    -1 counts as completed). ``FP8``: on named barriers (:data:`_TURN`), warpgroup 0 skipping its program's first
    turn and, after its last item, taking the one warpgroup 1 gave last (:func:`_consumer`). Without ``PINGPONG``
    nothing."""
    if PINGPONG:
        if FP8:  # named barriers: warpgroup 0's first turn of the program is its own
            if WG == 0:
                if g > 0:
                    _on_barrier(_TURN_C, _TURN_ASM_SYNC, 4)
            else:
                _on_barrier(_TURN_C + 1, _TURN_ASM_SYNC, 4)
        else:
            mbarrier.wait(turns.index(WG), (g & 1) ^ (1 - WG))


@gluon.jit
def _end_turn(turns, WG: gl.constexpr, PINGPONG: gl.constexpr, FP8: gl.constexpr):
    """Ping-pong: this warpgroup has issued its products of the tile; the other one's turn."""
    if PINGPONG:
        if FP8:
            _on_barrier(_TURN_C + 1 - WG, _TURN_ASM_ARRIVE, 4)
        else:
            mbarrier.arrive(turns.index(1 - WG), count=1)


@gluon.jit
def _step(
    i, t0, q_a, q_b, k_smem_a, k_smem_b, v_smem, k_ready, k_empty, v_ready, v_empty, turns, s_init,
    p, m_i, l_i, acc, keys0, len_k, q_pos, qk_scale,
    WG: gl.constexpr, MASKED: gl.constexpr, CAUSAL: gl.constexpr, SCALE_NONNEG: gl.constexpr, FP8: gl.constexpr,
    PINGPONG: gl.constexpr,
):  # fmt: skip
    """Tile ``i`` of the item (``t0 + i`` of the rings) with the previous tile's ``P @ V`` in flight
    (FlashAttention-3's intra-warpgroup overlap): issue ``S_i = Q K_i^T`` and ``O += P_{i-1} V_{i-1}``, wait
    for ``S_i`` alone, run its softmax while the tensor cores finish ``P_{i-1} V_{i-1}``, then rescale ``O``.
    ``p`` holds ``P_{i-1}`` as the product's operand; returns ``(P_i, m, l, O)``.

    ``FP8``: ``p`` is the warpgroup's two shared-memory buffers of probabilities ``[2, 64, BN]`` (returned as
    they are): tile ``g`` of the rings stages its ``P`` in buffer ``g % 2``, so ``P_i`` is stored while
    ``P_{i-1} V_{i-1}`` still reads the other, and ``V``'s tiles are ``[D_V, BN]`` (transposed, keys contiguous),
    which the product takes as its K-major B operand (the only one fp8 wgmma takes)."""
    BN: gl.constexpr = k_smem_a.type.shape[1]
    STAGES: gl.constexpr = k_smem_a.type.shape[0]
    g = t0 + i
    stage = g % STAGES
    prev = (g - 1) % STAGES
    mbarrier.wait(k_ready.index(stage), (g // STAGES) & 1)
    mbarrier.wait(v_ready.index(prev), ((g - 1) // STAGES) & 1)
    _take_turn(turns, g, WG, PINGPONG, FP8)
    s_tok = _issue_scores(q_a, q_b, k_smem_a.index(stage), k_smem_b.index(stage), s_init)
    if FP8:
        acc_tok = warpgroup_mma(p.index((g - 1) % 2), v_smem.index(prev).permute((1, 0)), acc, is_async=True)
    else:
        acc_tok = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
    _end_turn(turns, WG, PINGPONG, FP8)
    s = warpgroup_mma_wait(1, deps=(s_tok,))  # products retire in order: both parts of S_i are done
    if not FP8:  # (fp8: the buffer's keys go with its values)
        mbarrier.arrive(k_empty.index(stage), count=1)
    p_i, alpha, m_i, l_i = _softmax(
        s, m_i, l_i, keys0, i * BN, len_k, q_pos, qk_scale, MASKED, CAUSAL, SCALE_NONNEG, FP8
    )  # fmt: skip
    o_layout: gl.constexpr = acc.type.layout
    if FP8:
        _stage_probabilities(p.index(g % 2), p_i)
        acc = warpgroup_mma_wait(0, deps=(acc_tok,))
        p_i = p
    else:
        p_i = _operand(p_i, v_smem.dtype, o_layout)
        acc, p = warpgroup_mma_wait(0, deps=(acc_tok, p))
    if FP8:
        _free_tile(g - 1, STAGES)
    else:
        mbarrier.arrive(v_empty.index(prev), count=1)
    return p_i, m_i, l_i, _rescale(acc, alpha)


@gluon.jit
def _consume_item(
    q_smem_a, q_smem_b, k_smem_a, k_smem_b, v_smem, p_smem, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty, turns,
    Out, Lse, QDescale, KDescale, VDescale, t0, n, h, q_start, len_q, len_k, m0, num_tiles, stride_ot, stride_oh,
    stride_lse_h, qk_scale, stride_qd, stride_kd, stride_vd, WG: gl.constexpr, CAUSAL: gl.constexpr,
    SCALE_NONNEG: gl.constexpr, FP8: gl.constexpr, PINGPONG: gl.constexpr,
):  # fmt: skip
    """Consumer warpgroup ``WG`` on one work item, the program's ``n``-th with a Q, whose tiles are
    ``t0`` onwards of the rings: query rows ``m0 + 64 * WG`` onwards, over every tile of the item.

    ``FP8``: e4m3 inputs whose descale factors of head ``h`` are ``QDescale[h * stride_qd]`` (q's; k's and v's
    alike, fp32); ``p_smem`` ``[2, 64, BN]`` e4m3 is the warpgroup's own pair of probability buffers
    (:func:`_step`). Otherwise those are ``None``. ``PINGPONG``: the warpgroups take turns issuing each tile's
    products through the pair of mbarriers ``turns`` (:func:`_take_turn`), one turn per tile of the item, the tiles
    it hands back included, so that both take as many; otherwise ``turns`` is ``None``."""
    BN: gl.constexpr = k_smem_a.type.shape[1]
    D_V: gl.constexpr = _value_width(v_smem.type, FP8)
    STAGES: gl.constexpr = k_smem_a.type.shape[0]
    # wgmma's K per instruction: 32 bytes of each operand row (16 for 16-bit inputs, 32 for e4m3).
    K_MMA: gl.constexpr = 256 // v_smem.dtype.primitive_bitwidth
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, K_MMA]
    )  # fmt: skip
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D_V, K_MMA]
    )  # fmt: skip
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)

    first = m0 + WG * _HALF  # this warpgroup's first query row in the sequence
    rows = first + gl.arange(0, _HALF, row_layout)
    # Key j is visible from row i when j < len_k and, causal, j <= i + len_k - len_q (bottom-right).
    if CAUSAL:
        shift = len_k - len_q
        q_pos = rows + shift
        full = gl.minimum(gl.maximum(gl.minimum(len_k, first + shift + 1), 0) // BN, num_tiles)
        mine = gl.minimum(gl.cdiv(gl.maximum(gl.minimum(len_k, first + _HALF + shift), 0), BN), num_tiles)
    else:
        q_pos = rows
        full = len_k // BN
        mine = num_tiles
    keys0 = gl.arange(0, BN, gl.SliceLayout(0, s_layout))
    q_a = q_smem_a.index(WG)
    q_b = q_smem_b.index(WG)
    if FP8 and not _LEAN:  # Q as the register operand of Q @ K^T, read from shared memory once an item
        mbarrier.wait(q_bar, n & 1)
        q_a = _register_q(q_a, s_layout)
        q_b = _register_q(q_b, s_layout)
    m_i = gl.full([_HALF], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([_HALF], gl.float32, row_layout)
    acc = gl.zeros([_HALF, D_V], gl.float32, o_layout)
    s_init = gl.zeros([_HALF, BN], gl.float32, s_layout)
    if FP8:  # dequantised scores: this head's factors of q and k scale them with the softmax scale
        qk_scale = qk_scale * gl.load(QDescale + h * stride_qd) * gl.load(KDescale + h * stride_kd)
    if not FP8 or _LEAN:  # (fp8 under Triton 3.6 and 3.7 waited for Q above)
        mbarrier.wait(q_bar, n & 1)
    if FP8:
        p = p_smem
    else:
        p = _operand(s_init, v_smem.dtype, o_layout)
    if mine > 0:  # the first tile alone: its scores and softmax, no product in flight yet
        s0 = t0 % STAGES
        mbarrier.wait(k_ready.index(s0), (t0 // STAGES) & 1)
        _take_turn(turns, t0, WG, PINGPONG, FP8)
        s_tok = _issue_scores(q_a, q_b, k_smem_a.index(s0), k_smem_b.index(s0), s_init)
        _end_turn(turns, WG, PINGPONG, FP8)
        s = warpgroup_mma_wait(0, deps=(s_tok,))
        if not FP8:
            mbarrier.arrive(k_empty.index(s0), count=1)
        # The output is still zero: nothing to rescale.
        p0, _, m_i, l_i = _softmax(s, m_i, l_i, keys0, 0, len_k, q_pos, qk_scale, True, CAUSAL, SCALE_NONNEG, FP8)
        if FP8:  # the previous item's last P @ V, the buffers' last reader, has retired
            _stage_probabilities(p.index(t0 % 2), p0)
        else:
            p = _operand(p0, v_smem.dtype, o_layout)
    for i in range(1, full):  # tiles every row of this warpgroup sees whole: no mask
        p, m_i, l_i, acc = _step(
            i, t0, q_a, q_b, k_smem_a, k_smem_b, v_smem, k_ready, k_empty, v_ready, v_empty, turns, s_init,
            p, m_i, l_i, acc, keys0, len_k, q_pos, qk_scale, WG, False, CAUSAL, SCALE_NONNEG, FP8, PINGPONG,
        )  # fmt: skip
    for i in range(gl.maximum(full, 1), mine):  # tiles with the causal diagonal or the sequence's end
        p, m_i, l_i, acc = _step(
            i, t0, q_a, q_b, k_smem_a, k_smem_b, v_smem, k_ready, k_empty, v_ready, v_empty, turns, s_init,
            p, m_i, l_i, acc, keys0, len_k, q_pos, qk_scale, WG, True, CAUSAL, SCALE_NONNEG, FP8, PINGPONG,
        )  # fmt: skip
    # Every score of the item is in: the producer may load the next item's Q under what is left.
    mbarrier.arrive(q_empty, count=1)
    if _LEAN:  # from values live anyway: no predicate kept across the loops
        has_last = t0 + mine - 1 >= t0
    else:
        has_last = mine > 0
    if has_last:  # the last tile's P @ V
        last = t0 + mine - 1
        mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
        if FP8:
            v_t = v_smem.index(last % STAGES).permute((1, 0))
            acc_tok = warpgroup_mma(p.index(last % 2), v_t, acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc_tok,))
        else:
            acc_tok = warpgroup_mma(p, v_smem.index(last % STAGES), acc, is_async=True)
            acc, p = warpgroup_mma_wait(0, deps=(acc_tok, p))
        if FP8:
            _free_tile(last, STAGES)
        else:
            mbarrier.arrive(v_empty.index(last % STAGES), count=1)
    for i in range(mine, num_tiles):  # tiles only the other warpgroup's rows see: hand them back
        g = t0 + i
        stage = g % STAGES
        _take_turn(turns, g, WG, PINGPONG, FP8)  # and keep taking turns, so that the other is never left waiting
        _end_turn(turns, WG, PINGPONG, FP8)
        # Loaded before it is handed back: else this warpgroup's arrival could count for the buffer's previous tile.
        mbarrier.wait(k_ready.index(stage), (g // STAGES) & 1)
        if FP8:
            mbarrier.wait(v_ready.index(stage), (g // STAGES) & 1)
            _free_tile(g, STAGES)
        else:
            mbarrier.arrive(k_empty.index(stage), count=1)
            mbarrier.wait(v_ready.index(stage), (g // STAGES) & 1)
            mbarrier.arrive(v_empty.index(stage), count=1)

    # Rows that saw no key have l = 0: out = 0 and lse = -inf instead of 0/0. m and log2(l) are base 2.
    no_key = l_i == 0.0
    if FP8:  # l is 2**_P_SHIFT times the sum; v's factor scales each row once instead of each value tile
        lse = gl.where(no_key, float("-inf"), (m_i + gl.log2(gl.where(no_key, 1.0, l_i)) - _P_SHIFT) * _LN2)
        inv_l = gl.convert_layout(1.0 / gl.where(no_key, 1.0, l_i) * gl.load(VDescale + h * stride_vd), o_rows)
    else:
        lse = gl.where(no_key, float("-inf"), (m_i + gl.log2(gl.where(no_key, 1.0, l_i))) * _LN2)
        inv_l = gl.convert_layout(1.0 / gl.where(no_key, 1.0, l_i), o_rows)
    out = (acc * inv_l[:, None]).to(Out.dtype.element_ty)
    rows_o = first + gl.arange(0, _HALF, o_rows)
    cols = gl.arange(0, D_V, gl.SliceLayout(0, o_layout))
    o_ptrs = Out + (q_start + rows_o).to(gl.int64)[:, None] * stride_ot + h * stride_oh + cols[None, :]
    gl.store(o_ptrs, out, mask=(rows_o < len_q)[:, None])
    gl.store(Lse + h.to(gl.int64) * stride_lse_h + q_start + rows, lse, mask=rows < len_q)


@gluon.jit
def _consumer(
    q_smem_a, q_smem_b, k_smem_a, k_smem_b, v_smem, p_smem, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty,
    turns, item_smem, seq_smem, Out, Lse, QDescale, KDescale, VDescale, cu_seqlens_q, cu_seqlens_k, num_seqs,
    num_heads, num_slots, heads_per_group, stride_ot, stride_oh, stride_lse_h, qk_scale, stride_qd, stride_kd,
    stride_vd, WG: gl.constexpr, CAUSAL: gl.constexpr, SCALE_NONNEG: gl.constexpr, FP8: gl.constexpr,
    PINGPONG: gl.constexpr,
):  # fmt: skip
    """Consumer warpgroup ``WG`` on each work item the producer hands over, in its order, until it hands over
    ``-1`` (``FP8``, ``PINGPONG`` and their arguments: :func:`_consume_item`)."""
    BN: gl.constexpr = k_smem_a.type.shape[1]
    t = num_seqs * 0  # tiles of the rings consumed so far
    n = num_seqs * 0  # items so far
    mbarrier.wait(q_bar, 0)
    w, b_given = _get_item(item_smem, seq_smem, WG)  # _LEAN: the producer's sequence, no search over four warps here
    while w >= 0:
        _, h, q_start, len_q, _k_start, len_k, m0, num_tiles, _b = _work_item(
            w, cu_seqlens_q, cu_seqlens_k, num_seqs, num_heads, num_slots, heads_per_group, b_given, _LEAN, CAUSAL,
            BN, 4,
        )  # fmt: skip
        _consume_item(
            q_smem_a, q_smem_b, k_smem_a, k_smem_b, v_smem, p_smem, q_bar, q_empty, k_ready, k_empty, v_ready,
            v_empty, turns, Out, Lse, QDescale, KDescale, VDescale, t, n, h, q_start, len_q, len_k, m0, num_tiles,
            stride_ot, stride_oh, stride_lse_h, qk_scale, stride_qd, stride_kd, stride_vd, WG, CAUSAL, SCALE_NONNEG,
            FP8, PINGPONG,
        )  # fmt: skip
        t += num_tiles
        n += 1
        mbarrier.wait(q_bar, n & 1)
        w, b_given = _get_item(item_smem, seq_smem, WG)
    # Warpgroup 1's last turn given, which no turn of this one took (the constexprs apart from the runtime test).
    if PINGPONG and FP8 and WG == 0:  # noqa: SIM102
        if t > 0:
            _on_barrier(_TURN_C, _TURN_ASM_SYNC, 4)


@gluon.jit
def _fill_padding_lse(Lse, cu_seqlens_q, num_seqs, num_tokens, num_heads, stride_lse_h, pad_pid, num_pad_programs):
    """``lse = -inf`` in the rows past ``cu_seqlens_q[-1]``, spread over ``num_pad_programs`` programs."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    total = gl.load(cu_seqlens_q + num_seqs)
    npad = gl.maximum(num_tokens - total, 1)  # the divisor below; no rows when total == num_tokens
    count = gl.where(total < num_tokens, num_heads * npad, 0)
    neg_inf = gl.full([_PAD_FILL], float("-inf"), gl.float32, layout)
    for i in range(pad_pid, gl.cdiv(count, _PAD_FILL), num_pad_programs):
        idx = i * _PAD_FILL + gl.arange(0, _PAD_FILL, layout)
        hh = idx // npad
        gl.store(Lse + hh.to(gl.int64) * stride_lse_h + total + idx - hh * npad, neg_inf, mask=idx < count)


@gluon.jit(
    do_not_specialize=[
        "stride_lse_h", "num_tokens_q", "q_cols", "k_rows", "k_cols", "num_heads", "num_seqs", "num_slots",
        "heads_per_group", "num_workers", "num_pad_programs",
    ]
)  # fmt: skip
def _attn_fwd_sm90(
    Q, K, V, Out, Lse, cu_seqlens_q, cu_seqlens_k, Counter, QDescale, KDescale, VDescale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lse_h,
    num_tokens_q, q_cols, k_rows, k_cols, num_heads, num_seqs, num_slots, heads_per_group, num_workers,
    num_pad_programs, qk_scale, stride_qd, stride_kd, stride_vd,
    D_A: gl.constexpr, D_B: gl.constexpr, D_V: gl.constexpr, BN: gl.constexpr, Q_LAYOUT_A: gl.constexpr,
    Q_LAYOUT_B: gl.constexpr, K_LAYOUT_A: gl.constexpr, K_LAYOUT_B: gl.constexpr, V_LAYOUT: gl.constexpr,
    CAUSAL: gl.constexpr, SCALE_NONNEG: gl.constexpr, STAGES: gl.constexpr, FP8: gl.constexpr,
    P_LAYOUT: gl.constexpr, PINGPONG: gl.constexpr, V_DIRECT: gl.constexpr,
):  # fmt: skip
    """The kernel (arguments: :func:`sm90_launch`). ``FP8``: e4m3 ``Q``, ``K`` and transposed values ``V``
    ``[H, D_V, width]`` with their descale factors (``QDescale`` ... with strides ``stride_qd`` ..., 0 for one
    factor for every head), ``V_LAYOUT`` that of ``[D_V, BN]`` tiles and ``P_LAYOUT`` the shared-memory layout of the
    probabilities' buffers; otherwise the factors, their strides and ``P_LAYOUT`` are ``None`` and compile out,
    leaving the 16-bit kernel as it was. ``PINGPONG``: the consumers take turns issuing their products
    (:func:`_take_turn`); without it the turns' barriers are not allocated and the code is as before. ``V_DIRECT``
    (fp8): ``V`` is the call's key-major values of one sequence, not the transposed copy
    (:func:`values_read_directly`)."""
    pid = gl.program_id(0)
    if pid >= num_workers:
        _fill_padding_lse(Lse, cu_seqlens_q, num_seqs, num_tokens_q, num_heads, stride_lse_h, pid - num_workers,
                          num_pad_programs)  # fmt: skip
    else:
        # Each partition decodes the work items the producer takes (_work_item).
        dtype: gl.constexpr = Q.dtype.element_ty
        q_smem_a = gl.allocate_shared_memory(dtype, [2, _HALF, D_A], Q_LAYOUT_A)
        q_smem_b = gl.allocate_shared_memory(dtype, [2, _HALF, D_B], Q_LAYOUT_B)
        k_smem_a = gl.allocate_shared_memory(dtype, [STAGES, BN, D_A], K_LAYOUT_A)
        k_smem_b = gl.allocate_shared_memory(dtype, [STAGES, BN, D_B], K_LAYOUT_B)
        if FP8:
            # Transposed value tiles (keys contiguous), and each consumer's pair of probability buffers.
            v_smem = gl.allocate_shared_memory(dtype, [STAGES, D_V, BN], V_LAYOUT)
            p_smem_0 = gl.allocate_shared_memory(dtype, [2, _HALF, BN], P_LAYOUT)
            p_smem_1 = gl.allocate_shared_memory(dtype, [2, _HALF, BN], P_LAYOUT)
        else:
            v_smem = gl.allocate_shared_memory(dtype, [STAGES, BN, D_V], V_LAYOUT)
            p_smem_0: gl.constexpr = None  # (a constexpr: the partitions' arguments must have types)
            p_smem_1: gl.constexpr = None
        item_smem = gl.allocate_shared_memory(gl.int32, [1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        if _LEAN:
            seq_smem = gl.allocate_shared_memory(gl.int32, [1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        else:
            seq_smem = item_smem
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        # fp8 frees the rings' buffers and passes the turns on named barriers (_RING_FREE, _TURN): no k_empty,
        # v_empty or turns mbarriers. (The 16-bit variants allocate and initialise in the order they always did.)
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        if FP8:
            k_empty: gl.constexpr = None
        else:
            k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        if FP8:
            v_empty: gl.constexpr = None
        else:
            v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        mbarrier.init(q_empty, count=2)  # both consumers are done with an item's Q
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            if not FP8:
                mbarrier.init(k_empty.index(i), count=2)  # both consumers hand each buffer back
                mbarrier.init(v_empty.index(i), count=2)
        if PINGPONG and not FP8:
            turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(2):
                mbarrier.init(turns.index(i), count=1)  # warpgroup i's turn: the other one arrives
        else:
            turns: gl.constexpr = None
        gl.warp_specialize(
            [
                (_consumer, (q_smem_a, q_smem_b, k_smem_a, k_smem_b, v_smem, p_smem_0, q_bar, q_empty, k_ready,
                             k_empty, v_ready, v_empty, turns, item_smem, seq_smem, Out, Lse, QDescale, KDescale,
                             VDescale, cu_seqlens_q, cu_seqlens_k, num_seqs, num_heads, num_slots, heads_per_group,
                             stride_ot, stride_oh, stride_lse_h, qk_scale, stride_qd, stride_kd, stride_vd, 0,
                             CAUSAL, SCALE_NONNEG, FP8, PINGPONG)),
                (_consumer, (q_smem_a, q_smem_b, k_smem_a, k_smem_b, v_smem, p_smem_1, q_bar, q_empty, k_ready,
                             k_empty, v_ready, v_empty, turns, item_smem, seq_smem, Out, Lse, QDescale, KDescale,
                             VDescale, cu_seqlens_q, cu_seqlens_k, num_seqs, num_heads, num_slots, heads_per_group,
                             stride_ot, stride_oh, stride_lse_h, qk_scale, stride_qd, stride_kd, stride_vd, 1,
                             CAUSAL, SCALE_NONNEG, FP8, PINGPONG)),
                (_producer, (Q, K, V, q_smem_a, q_smem_b, k_smem_a, k_smem_b, v_smem, q_bar, q_empty, k_ready,
                             k_empty, v_ready, v_empty, item_smem, seq_smem, Counter, cu_seqlens_q, cu_seqlens_k,
                             stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, num_tokens_q,
                             q_cols, k_rows, k_cols, num_seqs, num_heads, num_slots, heads_per_group, pid,
                             num_workers, V_LAYOUT, CAUSAL, FP8, V_DIRECT)),
            ],
            [4, 1],
            [_CONSUMER_REGS, _PRODUCER_REGS],
        )  # fmt: skip


# --- launcher -------------------------------------------------------------------------------------


def sm90_shared_memory(
    dqk: int, dv: int, block_n: int, stages: int, elem_bytes: int = 2, pingpong: bool = False
) -> int:
    """Bytes of shared memory one program takes: the block's Q and ``stages`` K/V buffers, plus the mbarriers
    (``pingpong``: the two of the consumers' turns too) and the work item's number and sequence (the sequence only
    where :data:`_LEAN`; counted always). ``elem_bytes`` 1 (e4m3) adds each consumer's two buffers of probabilities
    (``[64, block_n]`` e4m3 each) and frees buffers and passes turns on named barriers, which take no shared memory:
    its mbarriers are Q's two and each buffer's ready one."""
    fp8 = elem_bytes == 1
    probabilities = 2 * BLOCK_M * block_n if fp8 else 0
    barriers = 8 * (2 + 2 * stages) if fp8 else 8 * (2 + 4 * stages + (2 if pingpong else 0))
    return elem_bytes * (BLOCK_M * dqk + stages * block_n * (dqk + dv)) + probabilities + barriers + 32


def values_read_directly(v: torch.Tensor, num_seqs: int) -> bool:
    """Whether the fp8 variant reads ``v`` ``[Tk, H, Dv]`` e4m3 as it is, without :func:`sm90_launch`'s transposed
    copy: ``v`` is key-major (unit stride over the keys, as ``mla_ops.quantize_fp8(v, key_major=True)`` makes it),
    its data and channel and head strides 16-byte aligned (TMA), and the call has one sequence, whose keys start at
    row 0 as ``cu_seqlens`` do, so on an aligned column (TMA loads must start on one: docs/design/fp8.md). Other
    key-major values are made token-major first (:func:`mla_ops.kernels.attention.attention_triton`)."""
    return (
        num_seqs == 1
        and v.shape[0] > 0
        and v.stride(0) == 1
        and v.data_ptr() % 16 == 0
        and v.stride(1) % 16 == 0
        and v.stride(2) % 16 == 0
    )


def _aligned(t: torch.Tensor) -> bool:
    elem = t.element_size()
    return t.data_ptr() % 16 == 0 and (t.stride(0) * elem) % 16 == 0 and (t.stride(1) * elem) % 16 == 0


def sm90_unsupported_reason(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, block_n: int, stages: int
) -> str | None:
    """Why :func:`attention_sm90` cannot take these inputs (a phrase for a message), or ``None``. For
    ``float8_e4m3fn`` inputs: why its fp8 variant cannot (which large fp8 calls route to where it can:
    :func:`mla_ops.kernels.attention.gluon_unsupported_reason`)."""
    dqk, dv = q.shape[-1], v.shape[-1]
    d_a, d_b = head_dim_split(dqk)
    if q.dtype not in _GL_DTYPES:
        return f"dtype {q.dtype} (it computes in bfloat16, float16 or float8_e4m3fn)"
    fp8 = q.dtype == torch.float8_e4m3fn
    # Both parts load as whole TMA blocks (no padding: a padded part would read the next head) and each
    # is a wgmma K dimension, a multiple of 32 bytes: 16 16-bit values, 32 e4m3 ones.
    min_log = 5 if fp8 else 4
    if d_a + d_b != dqk or d_b < (1 << min_log) or dv & (dv - 1) or dv > 256:
        return (
            f"head sizes (Dqk, Dv) = ({dqk}, {dv}) "
            f"(it needs Dqk = 2^a + 2^b with a > b >= {min_log} and Dv = 2^c <= 256)"
        )
    if sm90_shared_memory(dqk, dv, block_n, stages, q.element_size()) > _SM90_SHARED_BYTES:
        return f"head sizes ({dqk}, {dv}) with {stages} stages of {block_n} keys, which overflow shared memory"
    if fp8 and stages > _MAX_FP8_STAGES:
        return f"{stages} stages in fp8 (its rings' named barriers cover at most {_MAX_FP8_STAGES})"
    if softmax_scale < 0:
        return "a negative softmax scale"
    if not (q.is_cuda and k.device == q.device and v.device == q.device):
        return "tensors that are not all on one CUDA device"
    # fp8 values are copied transposed before the launch (sm90_launch): only that copy is loaded through TMA.
    if not (_aligned(q) and _aligned(k) and (fp8 or _aligned(v))):
        return "tensors whose data, token or head strides are not 16-byte aligned (TMA needs them)"
    return None


@functools.cache
def _shared_layout(rows: int, width: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The shared-memory layout of a ``[rows, width]`` TMA block; cached, since building one per launch is a
    good part of the launch's host time and the layout depends on nothing else."""
    return gl.NVMMASharedLayout.get_default_for([rows, width], _GL_DTYPES[dtype])


def _columns(t: torch.Tensor) -> int:
    """The columns of ``t`` ``[T, H, D]`` seen as 2-D rows (head ``h`` from column ``h * stride_h``): the extent of
    the kernel's Q and K descriptors."""
    return (t.shape[1] - 1) * t.stride(1) + t.shape[2]


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm90_launch(
    call: VarlenCall,
    out: torch.Tensor,
    lse: torch.Tensor,
    block_n: int,
    stages: int,
    num_sms: int | None = None,
    scales: Fp8Scales | None = None,
    pingpong: bool = False,
) -> LaunchPlan:
    """One launch of the kernel on ``call``'s inputs (:class:`~mla_ops.backends.base.VarlenCall`) into ``out`` and
    ``lse``: ``_attn_fwd_sm90[plan.grid](*plan.args, **plan.constexprs, **plan.options)``
    (:class:`~mla_ops.kernels.launch.LaunchPlan`), with global scratch for the descriptors the kernel builds.

    One program per multiprocessor (``num_sms``, by default q's device's count), at most one per work
    item, takes work items until none is left; the items are counted through a zeroed int32 allocated
    here (a ``torch.zeros`` on q's device and current stream, so inside CUDA-graph capture a memset node
    of the graph), the eighth of the plan's leading arguments: a relaunch passes a fresh one
    (:class:`CountedRelaunch`). The tensors may be CPU stand-ins with the GPU tensors' shapes, strides and
    alignment (for compiling ahead of time: ``benchmarks/compile_sm90.py``, which then gives ``num_sms``).

    ``scales`` (:class:`~mla_ops.backends.base.Fp8Scales`): ``float8_e4m3fn`` inputs and their descale factors
    (float32 ``[H]``, stride 0 for one factor), the fp8 variant. Its values are first copied transposed, to
    ``[H, Dv, width]`` with each channel's keys contiguous, each sequence's from an aligned column after ``block_n``
    lead columns (:func:`mla_ops.kernels.transpose.transposed_values`, on q's device and current stream): fp8
    wgmma takes its B operand only K-major, and in ``P @ V`` K is the keys. A key-major ``v`` of a one-sequence call
    is read as it is instead (:func:`values_read_directly`; the plan's third argument is then ``v``).
    The copy is the plan's third argument (held by ``plan.args`` until the launch has been issued; the stream
    orders it before the kernel), and the three descale factors follow the counter among the leading arguments
    (``plan.leading`` is :data:`SM90_LEADING_FP8`); bf16/fp16 launches pass ``None`` for those, which Triton compiles
    out, as the ``tl.dot`` kernel's do (:func:`mla_ops.kernels.attention.launch_plan`).

    ``pingpong``: the consumer warpgroups take turns issuing their products (the ``pp`` flag of
    :class:`~mla_ops.kernels.configs.AttentionConfig`).
    """
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal = call
    num_tokens, num_heads, dqk = q.shape
    dv = v.shape[-1]
    num_seqs = cu_seqlens_q.shape[0] - 1
    d_a, d_b = head_dim_split(dqk)
    num_slots, heads_per_group, num_pad_programs = program_layout(
        num_tokens, num_heads, num_seqs, max_seqlen_q, max_seqlen_k, (dqk + dv) * q.element_size(), BLOCK_M
    )
    # One program fits a multiprocessor (its 12 warps at 168 registers take the register file; the bf16 table's
    # also 208 KiB of shared memory, fp8's 216.5): as many programs as those.
    num_workers = min(num_heads * num_slots, num_sms or _multiprocessors(q.device.index))
    counter = torch.zeros(1, dtype=torch.int32, device=q.device)
    dtype = q.dtype
    if scales is None:
        values, v_shape, p_layout, leading, direct = v, (block_n, dv), None, SM90_LEADING, False
        # bf16/fp16: no descale factors and no strides of theirs: None, which Triton compiles out, so these
        # variants have the kernel parameters and code they had before the fp8 variant existed.
        descales, descale_strides = (None, None, None), (None, None, None)
    else:
        direct = values_read_directly(v, num_seqs)
        # Value descriptors start a block early, in the copy's lead columns or (direct) before v's first key.
        values = v if direct else transposed_values(v, cu_seqlens_k, lead=block_n)
        # [Dv, keys] tiles of the transposed values, and each consumer's [64, keys] tiles of probabilities.
        v_shape, p_layout, leading = (dv, block_n), _shared_layout(_HALF.value, block_n, dtype), SM90_LEADING_FP8
        descales = tuple(scales[:3])
        descale_strides = tuple(d.stride(0) for d in descales)
    constexprs = dict(
        D_A=d_a, D_B=d_b, D_V=dv, BN=block_n, Q_LAYOUT_A=_shared_layout(BLOCK_M // 2, d_a, dtype),
        Q_LAYOUT_B=_shared_layout(BLOCK_M // 2, d_b, dtype), K_LAYOUT_A=_shared_layout(block_n, d_a, dtype),
        K_LAYOUT_B=_shared_layout(block_n, d_b, dtype), V_LAYOUT=_shared_layout(*v_shape, dtype),
        CAUSAL=bool(causal), SCALE_NONNEG=softmax_scale >= 0, STAGES=stages, FP8=scales is not None,
        P_LAYOUT=p_layout, PINGPONG=bool(pingpong), V_DIRECT=direct,
    )  # fmt: skip
    # fp8: the transposed values' (or key-major v's) channel and head strides are the kernel's (stride_vt,
    # stride_vh).
    if scales is None:
        v_strides = (v.stride(0), v.stride(1))
    elif direct:
        v_strides = (v.stride(2), v.stride(1))
    else:
        v_strides = (values.stride(1), values.stride(0))
    strides = (
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), *v_strides, out.stride(0), out.stride(1), lse.stride(0),
    )  # fmt: skip
    args = (
        q, k, values, out, lse, cu_seqlens_q, cu_seqlens_k, counter, *descales, *strides,
        num_tokens, _columns(q), max(k.shape[0], 1), _columns(k), num_heads, num_seqs, num_slots, heads_per_group,
        num_workers, num_pad_programs,
        float(softmax_scale) * _LOG2E, *descale_strides,
    )  # fmt: skip
    # Triton specialises the strides by value and the pointers by alignment; the other integers it does not.
    alignment = pointer_alignment(q, k, values, out, lse, cu_seqlens_q, cu_seqlens_k, counter, *descales)
    key = (q.device.index, dtype, out.dtype, strides, descale_strides, alignment, tuple(constexprs.values()))
    options = dict(num_warps=4, maxnreg=_MAXNREG)
    return LaunchPlan(key, (num_workers + num_pad_programs,), args, constexprs, options, leading)


class CountedRelaunch:
    """A layout's :class:`~mla_ops.kernels.launch.FixedLaunch` of this kernel, relaunched as the ``tl.dot`` kernel's
    are, with the seven addresses (a :class:`~mla_ops.kernels.launch.Relaunch`): it adds a fresh zeroed work counter
    on ``device``, the plan's eighth leading argument. In C++ too: its native launch codes the counter as a fresh
    zeroed int32 (``NATIVE_COUNTER_CODE``) and passes the kernel's global scratch (``NativeLaunch.scratch_bytes``)."""

    __slots__ = ("device", "fixed")

    def __init__(self, fixed: FixedLaunch, device: torch.device) -> None:
        self.fixed = fixed
        self.device = device

    def __call__(self, leading: tuple) -> None:
        # The counter is held until the launch is queued: freed earlier, its block could become the kernel's
        # scratch, which the launch allocates.
        counter = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.fixed((*leading, counter.data_ptr()))

    def native_launch(self, leading_codes: tuple[int, ...]) -> NativeLaunch | None:
        return self.fixed.native_launch((*leading_codes, NATIVE_COUNTER_CODE))


class DirectRelaunch(CountedRelaunch):
    """A layout's :class:`~mla_ops.kernels.launch.FixedLaunch` of the fp8 variant on key-major values read as they
    are (:func:`values_read_directly`), relaunched with the ten addresses of an fp8 call (as
    :class:`TransposedRelaunch`), with a fresh zeroed work counter after the seventh and no copy. Not in C++, as
    the other fp8 relaunch."""

    __slots__ = ()

    def __call__(self, leading: tuple) -> None:
        counter = torch.zeros(1, dtype=torch.int32, device=self.device)  # held until the launch is queued
        self.fixed((*leading[:7], counter.data_ptr(), *leading[7:]))

    def native_launch(self, leading_codes: tuple[int, ...]) -> NativeLaunch | None:
        return None


class TransposedRelaunch:
    """A layout's :class:`~mla_ops.kernels.launch.FixedLaunch` of the fp8 variant, relaunched with the ten addresses
    of an fp8 call of the ``tl.dot`` kernel's form (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k and the three
    descale factors; a :class:`~mla_ops.kernels.launch.Relaunch`): it first copies ``v`` transposed into a fresh
    buffer of the layout's shape with the copy's own ``FixedLaunch``
    (:func:`mla_ops.kernels.transpose.copy_relaunch`), then launches the kernel on that buffer with a fresh zeroed
    work counter, as :func:`sm90_launch` does. Not in C++ (:meth:`native_launch` is ``None``): the native launcher
    makes no copy."""

    __slots__ = ("copy", "device", "fixed", "lead", "values_template")

    def __init__(
        self, fixed: FixedLaunch, copy: FixedLaunch, values_template: torch.Tensor, lead: int, device: torch.device
    ) -> None:
        self.fixed = fixed
        self.copy = copy
        self.values_template = values_template
        self.lead = lead  # bytes (one e4m3 value each) before the first key's column of each row
        self.device = device

    @classmethod
    def of(
        cls, fixed: FixedLaunch, call: VarlenCall, plan: LaunchPlan, block_n: int, device: torch.device
    ) -> TransposedRelaunch | DirectRelaunch | None:
        """The relaunch of ``fixed``, the fp8 launch of ``plan`` (:func:`sm90_launch` of ``call`` with ``block_n``),
        or ``None`` where the copy's variant has not been launched directly or its buffer cannot be templated. A
        launch that read key-major values directly (:func:`values_read_directly`) makes no copy: its relaunch is a
        :class:`DirectRelaunch`."""
        if plan.constexprs["V_DIRECT"]:  # no copy: v's address goes to the kernel as it is
            return DirectRelaunch(fixed, device)
        values = plan.args[2]  # the transposed copy the kernel read, of this layout's shape
        # block_n lead columns, as sm90_launch copies them and the kernel's value descriptors expect (BN + ...).
        copy = copy_relaunch(call.v, call.cu_seqlens_k, values, block_n)
        values_template = template(values.shape, values.dtype, device)
        if copy is None or values_template is None:
            return None
        return cls(fixed, copy, values_template, block_n, device)

    def __call__(self, leading: tuple) -> None:
        p_q, p_k, p_v, p_out, p_lse, p_cu_q, p_cu_k, p_dq, p_dk, p_dv = leading
        # Both are held until the launches are queued on the stream, which orders the copy before the kernel.
        values = torch.empty_like(self.values_template)
        counter = torch.zeros(1, dtype=torch.int32, device=self.device)
        p_values = values.data_ptr()
        self.copy((p_v, p_values + self.lead, p_cu_k))
        self.fixed((p_q, p_k, p_values, p_out, p_lse, p_cu_q, p_cu_k, counter.data_ptr(), p_dq, p_dk, p_dv))

    def native_launch(self, leading_codes: tuple[int, ...]) -> NativeLaunch | None:
        return None


def attention_sm90(
    call: VarlenCall,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    *,
    block_n: int = 128,
    stages: int = 2,
    scales: Fp8Scales | None = None,
    pingpong: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged attention forward on Hopper of ``call`` (:class:`~mla_ops.backends.base.VarlenCall`); results as
    :func:`mla_ops.kernels.attention.attention_triton`'s (which launches this kernel, through its own
    relaunch cache, for the inputs and configurations it covers: :func:`sm90_unsupported_reason` is
    ``None``), with the device of ``q`` current.

    ``out`` (``[Tq, H, Dv]`` contiguous, q's dtype, ``scales.out_dtype`` for fp8) and ``lse`` (float32 ``[H, Tq]``
    contiguous) are written if given, else allocated. ``block_n`` keys per tile and ``stages`` buffers in each of
    the K and V rings (fp8: ``SM90_GLUON_FP8_ATTENTION`` in :mod:`mla_ops.kernels.configs` is the configuration
    compiled and tested).
    ``scales`` (:class:`~mla_ops.backends.base.Fp8Scales`): ``float8_e4m3fn`` ``q``, ``k``, ``v`` and their descale
    factors, the fp8 variant (:func:`sm90_launch`), which :func:`~mla_ops.kernels.attention.attention_triton` routes
    large fp8 calls to. ``pingpong``: the consumer warpgroups take turns issuing their products (:func:`sm90_launch`).
    Launched through Triton's own dispatch, with the device-side descriptors' global scratch from PyTorch's
    allocator.
    """
    q, v = call.q, call.v
    num_tokens, num_heads, dv = q.shape[0], q.shape[1], v.shape[-1]
    if out is None:
        out = empty((num_tokens, num_heads, dv), q.dtype if scales is None else scales.out_dtype, q.device)
    if lse is None:
        lse = empty((num_heads, num_tokens), torch.float32, q.device)
    if num_tokens == 0 or num_heads == 0:
        return out, lse
    plan = sm90_launch(call, out, lse, block_n, stages, scales=scales, pingpong=pingpong)
    with TorchScratch():
        _attn_fwd_sm90[plan.grid](*plan.args, **plan.constexprs, **plan.options, **COMPILE_OPTIONS)
    return out, lse
