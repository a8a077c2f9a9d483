"""Which function merges two partial attention results on a device.

CPU tensors use the PyTorch reference; CUDA tensors use the Triton kernel when Triton imports, else
the reference (PyTorch ops, which run on CUDA too).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .backends.reference import merge_attn_states_reference

#: ``(prefix_out, prefix_lse, suffix_out, suffix_lse, *, prefix_lse_base2=False, suffix_lse_base2=False,
#: check=None) -> (out, lse)``: both merge functions take the keywords that mark a side's LSE as base 2, and
#: an input check to call first (the Triton kernel calls it once per layout of its inputs).
MergeFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

_cuda_merge: MergeFn | None = None


def merge_kernel(device: torch.device) -> MergeFn:
    """The merge function for tensors on ``device``: ``(prefix_out, prefix_lse, suffix_out, suffix_lse)``, with
    the keywords ``prefix_lse_base2`` and ``suffix_lse_base2`` for a side whose LSE is in base 2 and ``check``
    for an input check (see :data:`MergeFn`)."""
    global _cuda_merge
    if device.type != "cuda":
        return merge_attn_states_reference
    if _cuda_merge is None:
        try:
            from .kernels.merge import merge_attn_states_triton

            _cuda_merge = merge_attn_states_triton
        except ImportError:
            _cuda_merge = merge_attn_states_reference
    return _cuda_merge
