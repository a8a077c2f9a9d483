"""Merge of two partial attention results through their log-sum-exp, in Triton.

For each token ``t`` and head ``h``, with ``a = prefix_lse[h, t]`` and ``b = suffix_lse[h, t]``::

    m   = max(a, b)
    out = (prefix_out * exp(a - m) + suffix_out * exp(b - m)) / (exp(a - m) + exp(b - m))
    lse = m + log(exp(a - m) + exp(b - m))

``+inf`` and ``-inf`` mark a side without keys (weight 0, not read); a NaN LSE gives NaN. Two signatures over
one body: with strides, and without for all-contiguous inputs; their launch state is :data:`LAUNCHES`.
Design: docs/design/triton-kernels.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backends.base import MergeCall, MergeCheck
from ..runtime.alloc import empty, template
from ..runtime.capture import current_cuda_device, on_device
from .configs import merge_config
from .launch import CachedLaunch, FixedLaunch, KnownLayout, LaunchCache, pointer_alignment, remember

__all__ = ["LAUNCHES", "MergeLaunches", "merge_attn_states_triton"]


@triton.jit(do_not_specialize=["num_tokens", "stride_pl_h", "stride_sl_h"])
def _merge_kernel(
    PrefixOut,
    PrefixLse,
    SuffixOut,
    SuffixLse,
    Out,
    Lse,
    num_tokens,
    stride_po_t,
    stride_po_h,
    stride_so_t,
    stride_so_h,
    stride_pl_h,
    stride_pl_t,
    stride_sl_h,
    stride_sl_t,
    DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PREFIX_LOG2: tl.constexpr,
    SUFFIX_LOG2: tl.constexpr,
):
    # The outputs are fresh and contiguous: out [T, H, DV] and lse [H, T], one head per program column.
    h = tl.program_id(1)
    stride_o_h = DV
    stride_o_t = tl.num_programs(1) * DV
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < num_tokens
    t64 = offs_t.to(tl.int64)
    a = tl.load(PrefixLse + h * stride_pl_h + t64 * stride_pl_t, mask=t_ok, other=float("-inf"))
    b = tl.load(SuffixLse + h * stride_sl_h + t64 * stride_sl_t, mask=t_ok, other=float("-inf"))
    # A base-2 LSE (a library's own, handed over unconverted) becomes natural log here: the same one fp32
    # multiply a separate conversion would make, and it keeps +-inf and NaN as they are.
    if PREFIX_LOG2:
        a = a * 0.6931471805599453
    if SUFFIX_LOG2:
        b = b * 0.6931471805599453
    # +inf marks an empty side too (some kernels write it for rows without keys).
    a = tl.where(a == float("inf"), float("-inf"), a)
    b = tl.where(b == float("inf"), float("-inf"), b)
    m = tl.maximum(a, b)
    m = tl.where(m == float("-inf"), 0.0, m)  # both empty: exp(-inf - 0) = 0, not NaN
    wa = tl.exp(a - m)
    wb = tl.exp(b - m)
    total = wa + wb
    # `total == 0` (not `total > 0`), so that a NaN LSE on either side gives a NaN row, never -inf.
    empty = total == 0.0
    lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, total)))
    inv = 1.0 / tl.where(empty, 1.0, total)
    sa = wa * inv
    sb = wb * inv
    tl.store(Lse + h * num_tokens + t64, lse, mask=t_ok)

    offs_d = tl.arange(0, BLOCK_D)
    po_ptr = PrefixOut + t64[:, None] * stride_po_t + h * stride_po_h + offs_d[None, :]
    so_ptr = SuffixOut + t64[:, None] * stride_so_t + h * stride_so_h + offs_d[None, :]
    o_ptr = Out + t64[:, None] * stride_o_t + h * stride_o_h + offs_d[None, :]
    # A side of weight 0 is not loaded at all (it may hold NaN, and it saves its bandwidth); a NaN
    # weight still reaches the sum below (0 * NaN), so a NaN LSE makes the row NaN.
    use_a = (t_ok & (sa != 0.0))[:, None]
    use_b = (t_ok & (sb != 0.0))[:, None]
    store_ok = t_ok[:, None]
    if BLOCK_D != DV:
        # A channel mask only where Dv is not a power of two: a mask that varies along the row would
        # stop the compiler from using 16-byte vector loads, and this kernel is bandwidth-bound.
        d_ok = (offs_d < DV)[None, :]
        use_a = use_a & d_ok
        use_b = use_b & d_ok
        store_ok = store_ok & d_ok
    po = tl.load(po_ptr, mask=use_a, other=0.0)
    so = tl.load(so_ptr, mask=use_b, other=0.0)
    out = po.to(tl.float32) * sa[:, None] + so.to(tl.float32) * sb[:, None]
    tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=store_ok)


@triton.jit(do_not_specialize=["num_tokens"])
def _merge_contiguous_kernel(
    PrefixOut,
    PrefixLse,
    SuffixOut,
    SuffixLse,
    Out,
    Lse,
    num_tokens,
    DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PREFIX_LOG2: tl.constexpr,
    SUFFIX_LOG2: tl.constexpr,
):
    # Every input contiguous, as the ops return them: the strides follow from the shapes, and a launch
    # passes 7 arguments instead of 15 (the launcher's host time grows with the argument count).
    row = tl.num_programs(1) * DV
    _merge_kernel(
        PrefixOut, PrefixLse, SuffixOut, SuffixLse, Out, Lse, num_tokens,
        row, DV, row, DV, num_tokens, 1, num_tokens, 1,
        DV, BLOCK_D, BLOCK_T, PREFIX_LOG2, SUFFIX_LOG2,
    )  # fmt: skip


def merge_attn_states_triton(
    call: MergeCall,
    *,
    block_t: int | None = None,
    num_warps: int | None = None,
    check: MergeCheck | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint key sets.

    Args:
        call: the two results (:class:`~mla_ops.backends.base.MergeCall`). A side marked with no keys
            (``-inf`` or ``+inf`` LSE) is not read (its output may hold NaN). A base-2 LSE is converted as it
            is loaded, with the same result, bit for bit, as converting first (``lse * ln 2``) in fp32.
        block_t, num_warps: launch overrides (tests and tuning); by default from
            :func:`mla_ops.kernels.configs.merge_config`.
        check: an input check, called with the four tensors before anything is launched; it raises for
            inputs it refuses. It must depend on nothing but the tensors' shapes, strides, dtypes and
            devices and on whether autograd would record the call: a layout it accepted once (those
            properties, all part of the layout) is not checked again. ``mla.merge_attn_states`` passes
            :func:`mla_ops.meta.checks.check_merge_inputs`.

    Returns:
        ``out`` ``[T, H, Dv]`` contiguous in prefix_out's dtype and ``lse`` float32 ``[H, T]``
        contiguous. Rows empty on both sides give ``out = 0``, ``lse = -inf``. The kernel runs on the
        tensors' device and its current stream, whichever device is current.
    """
    # Everything the launch and `check` depend on but the addresses: the four tensors' shapes, strides,
    # dtypes and devices, their 16-byte alignment (one test when all are aligned), the LSE bases, the
    # overrides, and whether autograd would record the call (which the op's check refuses). The outputs
    # are fresh, contiguous and aligned. A layout launched before is launched again with the addresses
    # passed as integers (see mla_ops.kernels.launch).
    prefix_out, prefix_lse, suffix_out, suffix_lse, prefix_lse_base2, suffix_lse_base2 = call
    p_po, p_pl, p_so, p_sl = prefix_out.data_ptr(), prefix_lse.data_ptr(), suffix_out.data_ptr(), suffix_lse.data_ptr()
    device_index = prefix_out.get_device()
    layout = (
        prefix_out.shape, prefix_lse.shape, suffix_out.shape, suffix_lse.shape,
        prefix_out.stride(), prefix_lse.stride(), suffix_out.stride(), suffix_lse.stride(),
        prefix_out.dtype, prefix_lse.dtype, suffix_out.dtype, suffix_lse.dtype,
        device_index, prefix_lse.get_device(), suffix_out.get_device(), suffix_lse.get_device(),
        (p_po | p_pl | p_so | p_sl) % 16 == 0 or (p_po % 16 == 0, p_pl % 16 == 0, p_so % 16 == 0, p_sl % 16 == 0),
        prefix_lse_base2, suffix_lse_base2, block_t, num_warps,
        check is not None and torch.is_grad_enabled() and (prefix_out.requires_grad or suffix_out.requires_grad),
    )  # fmt: skip
    launches = LAUNCHES
    known = launches.known.get(layout)
    if known is not None:
        if check is not None and not known.checked:
            check(prefix_out, prefix_lse, suffix_out, suffix_lse)
            known.checked = True
        if device_index == current_cuda_device():
            out = torch.empty_like(known.out_template)
            lse = torch.empty_like(known.lse_template)
            known.launch((p_po, p_pl, p_so, p_sl, out.data_ptr(), lse.data_ptr()))
            return out, lse
    elif check is not None:
        check(prefix_out, prefix_lse, suffix_out, suffix_lse)
    num_tokens, num_heads, dv = prefix_out.shape
    device = prefix_out.device
    out = empty((num_tokens, num_heads, dv), prefix_out.dtype, device)
    lse = empty((num_heads, num_tokens), torch.float32, device)
    if num_tokens == 0 or num_heads == 0 or dv == 0:
        return out, lse
    # Triton launches on the current device and its current stream, not on the tensors' device.
    with on_device(device):
        if known is not None:
            known.launch((p_po, p_pl, p_so, p_sl, out.data_ptr(), lse.data_ptr()))
            return out, lse
        fixed = launches.launch(
            prefix_out, prefix_lse, suffix_out, suffix_lse, out, lse,
            (prefix_lse_base2, suffix_lse_base2), block_t, num_warps,
        )  # fmt: skip
    if fixed is not None:
        out_template, lse_template = template(out.shape, out.dtype, device), template(lse.shape, lse.dtype, device)
        if out_template is not None and lse_template is not None:
            remember(launches.known, layout, KnownLayout(fixed, out_template, lse_template, check is not None))
    return out, lse


class MergeLaunches(LaunchCache):
    """What :func:`merge_attn_states_triton` keeps between calls in this process: one instance, :data:`LAUNCHES`.

    ``known``: the layouts launched before (see :func:`merge_attn_states_triton`), their :class:`KnownLayout`;
    past ``MAX_LAYOUTS`` the table starts over. ``launcher`` and ``contiguous_launcher``: the
    :class:`CachedLaunch` of the kernel with strides and of the one without.
    """

    def __init__(self) -> None:
        super().__init__()
        self.known: dict[tuple, KnownLayout] = {}
        self.launcher = CachedLaunch(_merge_kernel)
        self.contiguous_launcher = CachedLaunch(_merge_contiguous_kernel)

    def launch(
        self,
        prefix_out: torch.Tensor,
        prefix_lse: torch.Tensor,
        suffix_out: torch.Tensor,
        suffix_lse: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        lse_base2: tuple[bool, bool],
        block_t: int | None,
        num_warps: int | None,
    ) -> FixedLaunch | None:
        """Launch the merge through :class:`CachedLaunch`; returns its :class:`FixedLaunch`, or ``None`` where
        the launch went through the JIT function. Contiguous inputs take the kernel without stride arguments."""
        num_tokens, num_heads, dv = prefix_out.shape
        config = merge_config(prefix_out.device)
        block_t = block_t or config.block_t
        num_warps = num_warps or config.num_warps
        grid = (triton.cdiv(num_tokens, block_t), num_heads)
        constexprs = dict(
            DV=dv,
            BLOCK_D=triton.next_power_of_2(dv),
            BLOCK_T=block_t,
            PREFIX_LOG2=lse_base2[0],
            SUFFIX_LOG2=lse_base2[1],
        )
        inputs = (prefix_out, prefix_lse, suffix_out, suffix_lse)
        alignment = pointer_alignment(*inputs, out, lse)
        if all(t.is_contiguous() for t in inputs):
            key = (prefix_out.device.index, prefix_out.dtype, alignment, tuple(constexprs.values()), num_warps)
            args = (*inputs, out, lse, num_tokens)
            return self.contiguous_launcher(
                key, prefix_out.device, grid, args, constexprs, num_warps=num_warps, leading=6
            )
        strides = (
            prefix_out.stride(0), prefix_out.stride(1), suffix_out.stride(0), suffix_out.stride(1),
            prefix_lse.stride(0), prefix_lse.stride(1), suffix_lse.stride(0), suffix_lse.stride(1),
        )  # fmt: skip
        # Every integer Triton specialises (the strides but the head strides of the LSEs, which grow with the
        # token count and are marked do_not_specialize) by value, every pointer by alignment.
        specialised = tuple(stride for i, stride in enumerate(strides) if i not in (4, 6))
        key = (prefix_out.device.index, prefix_out.dtype, specialised, alignment, tuple(constexprs.values()), num_warps)
        args = (*inputs, out, lse, num_tokens, *strides)
        return self.launcher(key, prefix_out.device, grid, args, constexprs, num_warps=num_warps, leading=6)


#: This process's launch state of :func:`merge_attn_states_triton`.
LAUNCHES = MergeLaunches()
