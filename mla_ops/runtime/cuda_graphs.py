"""Host-side planning for CUDA graphs.

A captured graph replays kernels with the arguments they were captured with, so every ragged batch
it serves must live in the same static buffers: ``q``/``k``/``v`` sized for a token budget and
``cu_seqlens`` sized for a maximum batch (unused sequences have length 0). Backends that read
``cu_seqlens`` on the device (TRITON, FLASH_ATTN) need nothing more. FLASHINFER plans its work on the
host, so it must be told the lengths before capture and again before every replay:

.. code-block:: python

    mla_ops.plan_cuda_graph(cu_seqlens, cu_seqlens_k=[chunk.cu_seqlens_k for chunk in chunks])
    model(...)                       # one eager warm-up call, outside capture
    with torch.cuda.graph(graph):
        model(...)
    ...
    cu_seqlens.copy_(next_offsets)   # a new batch in the same buffers
    mla_ops.plan_cuda_graph(cu_seqlens, cu_seqlens_k=[...])
    graph.replay()

Calling :func:`plan_cuda_graph` is cheap when no backend that plans on the host is in use, so code
can call it unconditionally. Each backend keeps what it plans (see
:meth:`mla_ops.backends.base.PrefillBackend.plan_cuda_graph`).

For ``torch.compile``'s CUDA-graph trees see :mod:`mla_ops.runtime.graph_trees`.
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
