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

Calling :func:`plan_cuda_graph` is cheap when the selected backend does not plan, so code can call
it unconditionally.

For ``torch.compile``'s CUDA-graph trees see :mod:`mla_ops.graph_trees`.
"""

from __future__ import annotations

import importlib
import itertools
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .backends.registry import PrefillBackendEnum


@dataclass
class GraphBuffer:
    """A static ``cu_seqlens`` buffer registered for CUDA graphs, with the offsets last planned."""

    device_offsets: torch.Tensor
    host_offsets: torch.Tensor
    version: int | None
    generation: int


_buffers: dict[int, GraphBuffer] = {}
_generation = 0


def is_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (``False`` on a CPU-only build of torch)."""
    try:
        return torch.cuda.is_current_stream_capturing()
    except RuntimeError:  # a CPU-only build of torch cannot capture
        return False


def version_of(t: torch.Tensor) -> int | None:
    """The tensor's version counter, or ``None`` for tensors made under ``torch.inference_mode``
    (which have none, so in-place writes to them cannot be detected)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _host_offsets(name: str, cu: torch.Tensor) -> torch.Tensor:
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
        raise TypeError(f"plan_cuda_graph: {name} must be an int32 tensor [B+1], got {cu!r:.80}")
    host = cu.cpu()
    bounds = host.tolist()
    if bounds[0] != 0 or any(b < a for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"plan_cuda_graph: {name} must start at 0 and be non-decreasing, got {bounds}")
    return host


def plan_cuda_graph(cu_seqlens: torch.Tensor, cu_seqlens_k: Sequence[torch.Tensor] = ()) -> None:
    """Plan the static offset buffers of a CUDA graph for the batch they now hold.

    Call it after writing a batch's offsets into the buffers and before capturing, and again before
    each replay. It reads the buffers on the host (a device sync), so it must not be called inside
    capture.

    Args:
        cu_seqlens: the graph's static int32 ``[B+1]`` offsets of the new tokens (padding
            sequences at the end have length 0).
        cu_seqlens_k: the static int32 ``[B+1]`` offsets of each context chunk the graph reads.
    """
    global _generation
    if is_capturing():
        raise RuntimeError(
            "mla_ops.plan_cuda_graph reads the offsets on the host and cannot run inside CUDA graph capture; "
            "call it before torch.cuda.graph(...) and before each replay"
        )
    _generation += 1
    planned = []
    for name, cu in [("cu_seqlens", cu_seqlens)] + [(f"cu_seqlens_k[{i}]", c) for i, c in enumerate(cu_seqlens_k)]:
        host = _host_offsets(name, cu)
        entry = GraphBuffer(cu, host, version_of(cu), _generation)
        _buffers[cu.data_ptr()] = entry
        planned.append(entry)
    for backend in _loaded_backends():
        backend.plan_cuda_graph(planned[0], planned[1:])


def graph_buffer(cu_seqlens: torch.Tensor) -> GraphBuffer | None:
    """The registration of ``cu_seqlens`` as a graph buffer, or ``None`` if it was never planned."""
    entry = _buffers.get(cu_seqlens.data_ptr())
    if entry is None or entry.device_offsets.device != cu_seqlens.device:
        return None
    return entry


def release_cuda_graph_buffers() -> None:
    """Forget every registered buffer (and let backends drop the state they keep for them)."""
    _buffers.clear()
    for backend in _loaded_backends():
        backend.release_cuda_graph_state()


def _loaded_backends():
    # Only backends already imported can hold graph state; importing the others here would pull in
    # their libraries for nothing.
    for member in PrefillBackendEnum:
        module_name, _, class_name = member.value.partition(":")
        if module_name in sys.modules:
            yield getattr(importlib.import_module(module_name), class_name)
