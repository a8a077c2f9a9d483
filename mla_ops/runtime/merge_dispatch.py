"""Which function merges two partial attention results on a device.

CPU tensors use the PyTorch reference. CUDA tensors use the native merge (:mod:`mla_ops.native`, built
and loaded by the first CUDA call outside CUDA-graph capture), else the Triton kernel when Triton
imports, else the reference (PyTorch ops, which run on CUDA too). Design: docs/design/native.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .. import native
from ..backends.reference import merge_attn_states_reference
from .capture import is_capturing

#: ``(call: MergeCall, *, check=None) -> (out, lse)``: every merge function takes the two results in one
#: :class:`~mla_ops.backends.base.MergeCall`, and an input check to call first (the Triton kernel calls it
#: once per layout of its inputs).
MergeFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def merge_kernel(device: torch.device) -> MergeFn:
    """The merge function for tensors on ``device``: it takes a :class:`~mla_ops.backends.base.MergeCall`, and
    the keyword ``check`` for an input check (see :data:`MergeFn`).

    The first call for a CUDA device outside CUDA-graph capture builds and loads the native merge
    (:func:`mla_ops.native.load`, which compiles once per machine); a call during capture, before that,
    gets the Triton kernel and leaves the choice to a later call.
    """
    if device.type != "cuda":
        return merge_attn_states_reference
    if native.LOADER.loaded is None and is_capturing():
        return _triton_or_reference()
    return native.merge if native.load() else _triton_or_reference()


@functools.cache
def _triton_or_reference() -> MergeFn:
    try:
        from ..kernels.merge import merge_attn_states_triton
    except ImportError:
        return merge_attn_states_reference
    return merge_attn_states_triton


def merge_description() -> str:
    """What a CUDA merge runs now, in words (for ``python -m mla_ops info``); builds nothing."""
    fallback = "PyTorch math" if _triton_or_reference() is merge_attn_states_reference else "Triton kernel"
    return native.status(fallback)
