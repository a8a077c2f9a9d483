"""Host-side planning for CUDA graphs.

:func:`plan_cuda_graph` tells the backends that plan on the host (FLASHINFER) the lengths in a graph's static
offsets buffers, before capture and before every replay; it is cheap for the others, so code can call it
unconditionally. :func:`release_cuda_graph_buffers` drops what they planned. Usage: README.md (torch.compile
and CUDA graphs); design: docs/design/flashinfer.md (CUDA graphs). For CUDA-graph trees see
:mod:`mla_ops.runtime.graph_trees`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..backends.registry import PrefillBackendEnum, created_backends
from .capture import is_capturing


def _check_offsets(name: str, cu: object) -> None:
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
        raise TypeError(f"plan_cuda_graph: {name} must be an int32 tensor [B+1], got {cu!r:.80}")


def plan_cuda_graph(cu_seqlens: torch.Tensor, cu_seqlens_k: Sequence[torch.Tensor] = ()) -> None:
    """Plan the static offset buffers of a CUDA graph for the batch they now hold.

    Call it after writing a batch's offsets into the buffers and before capturing, and again before
    each replay. A backend that plans on the host reads the buffers there (a device sync), so it must
    not be called inside capture.

    Args:
        cu_seqlens: the graph's static int32 ``[B+1]`` offsets of the new tokens (padding
            sequences at the end have length 0).
        cu_seqlens_k: the static int32 ``[B+1]`` offsets of each context chunk the graph reads.

    Raises:
        RuntimeError: inside CUDA-graph capture.
        TypeError: for offsets that are not int32 ``[B+1]`` tensors.
        ValueError: for offsets that do not start at 0 or decrease (found where they are read).
    """
    if is_capturing():
        raise RuntimeError(
            "mla_ops.plan_cuda_graph reads the offsets on the host and cannot run inside CUDA graph capture; "
            "call it before torch.cuda.graph(...) and before each replay"
        )
    chunks = list(cu_seqlens_k)
    _check_offsets("cu_seqlens", cu_seqlens)
    for i, cu in enumerate(chunks):
        _check_offsets(f"cu_seqlens_k[{i}]", cu)
    for member in PrefillBackendEnum:
        if member.backend_class().plans_on_host:
            member.backend().plan_cuda_graph(cu_seqlens, chunks)


def release_cuda_graph_buffers() -> None:
    """Forget every planned buffer, and let the backends drop the graph state they keep for them."""
    for backend in created_backends():
        backend.release_cuda_graph_state()
