"""Registration of the ``mla`` custom ops.

The ops are declared with ``torch.library.Library.define`` and given one kernel per dispatch key with
``impl``, which is the cheapest dispatch path PyTorch offers from Python (measured in DESIGN.md: about
10 us per call against 21 us for ``torch.library.custom_op``). The fake kernels come from
``mla_ops.meta``. They are forward-only: there is no autograd formula.

- ``Meta``/fake: :mod:`mla_ops.meta` (shapes), plus :func:`mla_ops.graph_trees.check_graph_trees`, which
  refuses a host-planning backend inside CUDA-graph trees at compile time.
- ``CPU``: the REFERENCE backend.
- ``CUDA``: whichever backend :func:`mla_ops.selector.backend_for` picks for the device, dtype and dims.
"""

from __future__ import annotations

import torch

from . import meta
from .backends.reference import ReferenceBackend, merge_attn_states_reference
from .graph_trees import check_graph_trees
from .meta.checks import check_attention_inputs, check_merge_inputs
from .selector import backend_for

NAMESPACE = "mla"

SCHEMAS = {
    "prefill": (
        "prefill(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, SymInt max_seqlen, float softmax_scale)"
        " -> (Tensor out, Tensor lse)"
    ),
    "prefill_context_chunk": (
        "prefill_context_chunk(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k,"
        " SymInt max_seqlen_q, SymInt max_seqlen_k, float softmax_scale) -> (Tensor out, Tensor lse)"
    ),
    "merge_attn_states": (
        "merge_attn_states(Tensor prefix_out, Tensor prefix_lse, Tensor suffix_out, Tensor suffix_lse)"
        " -> (Tensor out, Tensor lse)"
    ),
}

#: Twins of the two attention ops: the same schemas and kernels, tagged ``cudagraph_unsafe``. Under
#: CUDA-graph trees, the graph pass that :func:`mla_ops.compile_options` installs moves the calls whose
#: backend plans on the host to these, and Inductor then runs them between the graphs. They are not
#: part of the public contract; call the ops in ``SCHEMAS``.
HOST_PLANNED_TWINS = {"prefill": "prefill_host_planned", "prefill_context_chunk": "prefill_context_chunk_host_planned"}

# Older torch has no such tag; without it the twins exist untagged and compile_options refuses to use them.
GRAPH_UNSAFE_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()

_lib = torch.library.Library(NAMESPACE, "DEF")
for _schema in SCHEMAS.values():
    _lib.define(_schema)
for _name, _twin in HOST_PLANNED_TWINS.items():
    _lib.define(_twin + SCHEMAS[_name].removeprefix(_name), tags=GRAPH_UNSAFE_TAGS)


# --- CPU: the reference ---------------------------------------------------------------------------


def _prefill_cpu(q, k, v, cu_seqlens, max_seqlen, softmax_scale):
    check_attention_inputs(
        "mla.prefill", q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale, self_attention=True
    )
    return ReferenceBackend.prefill(q, k, v, cu_seqlens, max_seqlen, softmax_scale)


def _prefill_context_chunk_cpu(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale):
    check_attention_inputs(
        "mla.prefill_context_chunk", q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, self_attention=False
    )
    return ReferenceBackend.prefill_context_chunk(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale)


def _merge_cpu(prefix_out, prefix_lse, suffix_out, suffix_lse):
    check_merge_inputs(prefix_out, prefix_lse, suffix_out, suffix_lse)
    return merge_attn_states_reference(prefix_out, prefix_lse, suffix_out, suffix_lse)


# --- CUDA: the selected backend -------------------------------------------------------------------


def _prefill_cuda(q, k, v, cu_seqlens, max_seqlen, softmax_scale):
    check_attention_inputs(
        "mla.prefill", q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale, self_attention=True
    )
    return backend_for(q, v).prefill(q, k, v, cu_seqlens, max_seqlen, softmax_scale)


def _prefill_context_chunk_cuda(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale):
    check_attention_inputs(
        "mla.prefill_context_chunk", q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, self_attention=False
    )
    return backend_for(q, v).prefill_context_chunk(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale)


def _merge_cuda(prefix_out, prefix_lse, suffix_out, suffix_lse):
    check_merge_inputs(prefix_out, prefix_lse, suffix_out, suffix_lse)
    return merge_kernel()(prefix_out, prefix_lse, suffix_out, suffix_lse)


_merge_impl = None


def merge_kernel():
    """The function that merges on CUDA: the Triton kernel when Triton imports, else PyTorch math."""
    global _merge_impl
    if _merge_impl is None:
        try:
            from .kernels.merge import merge_attn_states_triton

            _merge_impl = merge_attn_states_triton
        except ImportError:
            _merge_impl = merge_attn_states_reference
    return _merge_impl


# --- fake: shapes from mla_ops.meta, plus the one check only compile time can make -----------------


def _prefill_fake(q, k, v, cu_seqlens, max_seqlen, softmax_scale):
    check_graph_trees("mla::prefill", q, v)
    return meta.prefill_fake(q, k, v, cu_seqlens, max_seqlen, softmax_scale)


def _prefill_context_chunk_fake(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale):
    check_graph_trees("mla::prefill_context_chunk", q, v)
    return meta.prefill_context_chunk_fake(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale)


# Each row: the op, its CPU and CUDA kernels, its fake, and the fake of its host-planned twin (which
# needs no graph-tree check: it exists to run between the graphs).
for _name, _cpu, _cuda, _fake, _twin_fake in (
    ("prefill", _prefill_cpu, _prefill_cuda, _prefill_fake, meta.prefill_fake),
    (
        "prefill_context_chunk",
        _prefill_context_chunk_cpu,
        _prefill_context_chunk_cuda,
        _prefill_context_chunk_fake,
        meta.prefill_context_chunk_fake,
    ),
    ("merge_attn_states", _merge_cpu, _merge_cuda, meta.merge_attn_states_fake, None),
):
    for _op, _op_fake in ((_name, _fake), (HOST_PLANNED_TWINS.get(_name), _twin_fake)):
        if _op is not None:
            _lib.impl(_op, _cpu, "CPU")
            _lib.impl(_op, _cuda, "CUDA")
            torch.library.register_fake(f"{NAMESPACE}::{_op}", _op_fake, lib=_lib)
