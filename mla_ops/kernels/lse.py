"""A base-2 ``[n, H]`` log-sum-exp into the package's natural-log ``[H, n]`` one, in Triton.

FLASHINFER's conversion of its LSE: the multiply of ``torch.mul(lse.t(), ln2, out=out)`` bit for bit,
launched through :class:`~mla_ops.kernels.launch.CachedLaunch` to spare the per-call TensorIterator (its launch
state is :data:`LAUNCHES`). Design: docs/design/triton-kernels.md (The merge and LSE kernels).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..runtime.capture import current_cuda_device, on_device
from .launch import CachedLaunch, FixedLaunch, LaunchCache, pointer_alignment, remember

__all__ = ["LAUNCHES", "LseLaunches", "lse_base2_to_natural_triton"]

_BLOCK_T = 64
_MAX_BLOCK_H = 64


@triton.jit(do_not_specialize=["num_rows", "stride_src_t", "stride_dst_h"])
def _lse_to_natural_kernel(
    Src,
    Dst,
    num_rows,
    num_heads,
    stride_src_t,
    stride_src_h,
    stride_dst_h,
    stride_dst_t,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    offs_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    offs_h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    mask = (offs_t < num_rows)[:, None] & (offs_h < num_heads)[None, :]
    x = tl.load(Src + offs_t[:, None] * stride_src_t + offs_h[None, :] * stride_src_h, mask=mask)
    # One fp32 multiply by fp32(ln 2), as torch.mul(lse, math.log(2)) makes; -inf and NaN stay as they are.
    tl.store(Dst + offs_h[None, :] * stride_dst_h + offs_t[:, None] * stride_dst_t, x * 0.6931471805599453, mask=mask)


def lse_base2_to_natural_triton(lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write ``lse * ln 2``, transposed, into ``out``; returns ``out``.

    Args:
        lse: float32 ``[n, H]``, base 2 (``log2`` of each row's sum), any strides.
        out: float32 ``[H, n]`` on ``lse``'s device, any strides (a padded batch passes a view of a
            wider buffer).

    The result is ``torch.mul(lse.t(), math.log(2), out=out)`` bit for bit. The kernel runs on the
    tensors' device and its current stream, whichever device is current; nothing is read back.
    """
    num_rows, num_heads = lse.shape
    if num_rows == 0 or num_heads == 0:
        return out
    if out.shape != (num_heads, num_rows) or lse.dtype != torch.float32 or out.dtype != torch.float32:
        raise ValueError(
            f"lse_base2_to_natural_triton: expected a float32 lse [n, H] and a float32 out [H, n], got lse "
            f"{lse.dtype} {tuple(lse.shape)} and out {out.dtype} {tuple(out.shape)}"
        )
    p_src, p_dst = lse.data_ptr(), out.data_ptr()
    device = lse.device
    # What the launch depends on but the two addresses: shapes, strides, devices and 16-byte alignment.
    layout = (
        num_rows, num_heads, lse.stride(), out.stride(), device, out.get_device(),
        (p_src | p_dst) % 16 == 0 or (p_src % 16 == 0, p_dst % 16 == 0),
    )  # fmt: skip
    launches = LAUNCHES
    known = launches.known.get(layout)
    if known is not None and device.index == current_cuda_device():  # launches go to the current device
        known((p_src, p_dst))  # the addresses as integers (see mla_ops.kernels.launch)
        return out
    with on_device(device):
        if known is not None:
            known((p_src, p_dst))
        else:
            fixed = launches.launch(lse, out)
            if fixed is not None:
                remember(launches.known, layout, fixed)
    return out


class LseLaunches(LaunchCache):
    """What :func:`lse_base2_to_natural_triton` keeps between calls in this process: one instance,
    :data:`LAUNCHES`. ``known``: the layouts launched before, their :class:`FixedLaunch`; past ``MAX_LAYOUTS``
    the table starts over. ``launcher``: the kernel's :class:`CachedLaunch`."""

    def __init__(self) -> None:
        super().__init__()
        self.known: dict[tuple, FixedLaunch] = {}
        self.launcher = CachedLaunch(_lse_to_natural_kernel)

    def launch(self, lse: torch.Tensor, out: torch.Tensor) -> FixedLaunch | None:
        """Launch the conversion through :class:`CachedLaunch`; returns its :class:`FixedLaunch`, or ``None``
        where the launch went through the JIT function."""
        num_rows, num_heads = lse.shape
        block_h = min(triton.next_power_of_2(num_heads), _MAX_BLOCK_H)
        grid = (triton.cdiv(num_rows, _BLOCK_T), triton.cdiv(num_heads, block_h))
        strides = (*lse.stride(), *out.stride())
        constexprs = dict(BLOCK_T=_BLOCK_T, BLOCK_H=block_h)
        # Triton specialises num_heads and the strides not marked do_not_specialize by value, the pointers
        # by alignment.
        key = (lse.device.index, num_heads, strides[1], strides[3], pointer_alignment(lse, out), block_h)
        args = (lse, out, num_rows, num_heads, *strides)
        return self.launcher(key, lse.device, grid, args, constexprs, num_warps=4, leading=2)


#: This process's launch state of :func:`lse_base2_to_natural_triton`.
LAUNCHES = LseLaunches()
