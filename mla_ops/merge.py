"""Which function merges two partial attention results on a device.

CPU tensors use the PyTorch reference; CUDA tensors use the Triton kernel when Triton imports, else
the reference (PyTorch ops, which run on CUDA too).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .backends.reference import merge_attn_states_reference

MergeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

_cuda_merge: MergeFn | None = None


def merge_kernel(device: torch.device) -> MergeFn:
    """The merge function for tensors on ``device``: ``(prefix_out, prefix_lse, suffix_out, suffix_lse)``."""
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
