"""Merge of two partial attention results through their log-sum-exp, in Triton.

For each token ``t`` and head ``h``, with ``a = prefix_lse[h, t]`` and ``b = suffix_lse[h, t]``::

    m   = max(a, b)
    out = (prefix_out * exp(a - m) + suffix_out * exp(b - m)) / (exp(a - m) + exp(b - m))
    lse = m + log(exp(a - m) + exp(b - m))

``+inf`` and ``-inf`` both mark a side that attended to no key: it gets weight 0 and its output is
not even read (so NaN there cannot leak). Both sides empty gives ``out = 0`` and ``lse = -inf``. A
NaN LSE on either side gives NaN in ``out`` and ``lse``: a NaN must never look like a valid zero.

The kernel is memory-bound: each program handles ``BLOCK_T`` tokens of one head, so its ``lse`` loads
are contiguous along ``T`` and each output row is one contiguous ``Dv``-wide (256-byte for bf16
``Dv = 128``) vector load and store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..alloc import empty
from ..capture import on_device
from .configs import merge_config
from .launch import CachedLaunch, pointer_alignment

__all__ = ["merge_attn_states_triton"]


@triton.jit(do_not_specialize=["num_tokens", "stride_pl_h", "stride_sl_h", "stride_l_h"])
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
    stride_o_t,
    stride_o_h,
    stride_l_h,
    DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PREFIX_LOG2: tl.constexpr,
    SUFFIX_LOG2: tl.constexpr,
):
    h = tl.program_id(1)
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
    tl.store(Lse + h * stride_l_h + t64, lse, mask=t_ok)

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


def merge_attn_states_triton(
    prefix_out: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_out: torch.Tensor,
    suffix_lse: torch.Tensor,
    *,
    prefix_lse_base2: bool = False,
    suffix_lse_base2: bool = False,
    block_t: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint key sets.

    Args:
        prefix_out, suffix_out: ``[T, H, Dv]``, bfloat16 or float16, last-dimension stride 1.
        prefix_lse, suffix_lse: float32 ``[H, T]``, natural log, any strides. ``-inf`` or ``+inf``
            marks a side with no keys; that side's output is ignored (it may hold NaN).
        prefix_lse_base2, suffix_lse_base2: that side's LSE is in base 2 (``log2`` of the sum), as
            some libraries return it; the kernel converts it as it loads it. The result is the same,
            bit for bit, as converting first (``lse * ln 2`` in fp32).
        block_t, num_warps: launch overrides (tests and tuning); by default from
            :func:`mla_ops.kernels.configs.merge_config`.

    Returns:
        ``out`` ``[T, H, Dv]`` contiguous in prefix_out's dtype and ``lse`` float32 ``[H, T]``
        contiguous. Rows empty on both sides give ``out = 0``, ``lse = -inf``. The kernel runs on the
        tensors' device and its current stream, whichever device is current.
    """
    num_tokens, num_heads, dv = prefix_out.shape
    device = prefix_out.device
    out = empty((num_tokens, num_heads, dv), prefix_out.dtype, device)
    lse = empty((num_heads, num_tokens), torch.float32, device)
    if num_tokens == 0 or num_heads == 0 or dv == 0:
        return out, lse
    # Everything the launch depends on but the addresses: the shapes, the inputs' strides, 16-byte
    # alignment and devices (the outputs are fresh, contiguous and aligned), the dtype, the device, the LSE
    # bases and the overrides. A relaunch passes the addresses as integers (see CachedLaunch.relaunch).
    p_po, p_pl, p_so, p_sl = prefix_out.data_ptr(), prefix_lse.data_ptr(), suffix_out.data_ptr(), suffix_lse.data_ptr()
    layout = (
        prefix_out.shape, prefix_out.stride(), suffix_out.stride(), prefix_lse.stride(), suffix_lse.stride(),
        prefix_out.dtype, device, prefix_lse_base2, suffix_lse_base2, block_t, num_warps,
        p_po % 16 == 0, p_pl % 16 == 0, p_so % 16 == 0, p_sl % 16 == 0,
        prefix_lse.get_device(), suffix_out.get_device(), suffix_lse.get_device(),
    )  # fmt: skip
    addresses = (p_po, p_pl, p_so, p_sl, out.data_ptr(), lse.data_ptr())
    if _launcher.relaunch(layout, device, addresses):  # only when the tensors' device is the current one
        return out, lse
    # Triton launches on the current device and its current stream, not on the tensors' device.
    with on_device(device):
        if not _launcher.relaunch(layout, device, addresses):
            _launch(
                prefix_out, prefix_lse, suffix_out, suffix_lse, out, lse,
                (prefix_lse_base2, suffix_lse_base2), block_t, num_warps, layout,
            )  # fmt: skip
    return out, lse


def _launch(
    prefix_out: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_out: torch.Tensor,
    suffix_lse: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    lse_base2: tuple[bool, bool],
    block_t: int | None,
    num_warps: int | None,
    layout: tuple,
) -> None:
    num_tokens, num_heads, dv = prefix_out.shape
    config = merge_config(prefix_out.device)
    block_t = block_t or config.block_t
    num_warps = num_warps or config.num_warps
    grid = (triton.cdiv(num_tokens, block_t), num_heads)
    strides = (
        prefix_out.stride(0), prefix_out.stride(1), suffix_out.stride(0), suffix_out.stride(1),
        prefix_lse.stride(0), prefix_lse.stride(1), suffix_lse.stride(0), suffix_lse.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
    )  # fmt: skip
    constexprs = dict(
        DV=dv, BLOCK_D=triton.next_power_of_2(dv), BLOCK_T=block_t, PREFIX_LOG2=lse_base2[0], SUFFIX_LOG2=lse_base2[1]
    )
    # Every integer Triton specialises (the strides but the head strides of the LSEs, which grow with the
    # token count and are marked do_not_specialize) by value, every pointer by alignment.
    specialised = tuple(stride for i, stride in enumerate(strides) if i not in (4, 6, 10))
    key = (
        prefix_out.device.index, prefix_out.dtype, specialised,
        pointer_alignment(prefix_out, prefix_lse, suffix_out, suffix_lse, out, lse),
        tuple(constexprs.values()), num_warps,
    )  # fmt: skip
    args = (prefix_out, prefix_lse, suffix_out, suffix_lse, out, lse, num_tokens, *strides)
    _launcher(key, prefix_out.device, grid, args, constexprs, num_warps=num_warps, layout=layout, leading=6)


_launcher = CachedLaunch(_merge_kernel)
