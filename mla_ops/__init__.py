"""MLA prefill attention as ``torch.library`` custom ops.

Importing this package registers ``torch.ops.mla.prefill``, ``torch.ops.mla.prefill_context_chunk``,
``torch.ops.mla.merge_attn_states`` and the fp8 ops ``torch.ops.mla.prefill_fp8`` and
``torch.ops.mla.prefill_context_chunk_fp8``. The Python API below wraps them with defaults.
"""

from __future__ import annotations

from . import ops  # noqa: F401  (registers torch.ops.mla.*)
from .api import (
    ContextChunk,
    default_softmax_scale,
    merge_attn_states,
    pack_chunks,
    prefill,
    prefill_context_chunk,
    prefill_context_chunk_fp8,
    prefill_fp8,
    prefill_with_context,
)
from .backends.registry import PrefillBackendEnum
from .quantize import quantize_fp8
from .runtime.cuda_graphs import plan_cuda_graph, release_cuda_graph_buffers
from .runtime.graph_trees import compile_options
from .selector import (
    batch_invariant,
    clear_cache,
    prefill_backend,
    select_backend,
    set_batch_invariant,
    set_prefill_backend,
)
from .specs import DEEPSEEK_V3, DeviceCapability, MLADimensions, SelectorConfig
from .version import __version__

__all__ = [
    "DEEPSEEK_V3",
    "ContextChunk",
    "DeviceCapability",
    "MLADimensions",
    "PrefillBackendEnum",
    "SelectorConfig",
    "__version__",
    "batch_invariant",
    "clear_cache",
    "compile_options",
    "default_softmax_scale",
    "merge_attn_states",
    "pack_chunks",
    "plan_cuda_graph",
    "prefill",
    "prefill_backend",
    "prefill_context_chunk",
    "prefill_context_chunk_fp8",
    "prefill_fp8",
    "prefill_with_context",
    "quantize_fp8",
    "release_cuda_graph_buffers",
    "select_backend",
    "set_batch_invariant",
    "set_prefill_backend",
]
