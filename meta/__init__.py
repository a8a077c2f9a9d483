"""Fake (meta) kernels of the ``mla`` ops, installed as ``mla_ops.meta``.

They validate metadata and allocate outputs with ``new_empty``: no device query, no data access, no
GPU library. ``torch.compile`` and ``FakeTensorMode`` use them to propagate shapes.
Design: docs/design/ops.md (Registration, Validation).
"""

from __future__ import annotations

from typing import Any

import torch

from .checks import (
    AttentionInputs,
    check_argument_types,
    check_attention_inputs,
    check_chunk_values,
    check_cu_seqlens_values,
    check_fp8_scales,
    check_merge_inputs,
)

__all__ = [
    "AttentionInputs",
    "check_argument_types",
    "check_attention_inputs",
    "check_chunk_values",
    "check_cu_seqlens_values",
    "check_fp8_scales",
    "check_merge_inputs",
    "merge_attn_states_fake",
    "prefill_context_chunk_fake",
    "prefill_context_chunk_fp8_fake",
    "prefill_fake",
    "prefill_fp8_fake",
    "prefill_with_chunk_fake",
]


def _attention_outputs(
    q: torch.Tensor, v: torch.Tensor, out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_heads, _ = q.shape
    out = q.new_empty((num_tokens, num_heads, v.shape[-1]), dtype=out_dtype or q.dtype)
    lse = q.new_empty((num_heads, num_tokens), dtype=torch.float32)
    return out, lse


def prefill_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fake ``mla::prefill``: ``out`` ``[T, H, Dv]`` (dtype of ``q``), ``lse`` float32 ``[H, T]``."""
    check_attention_inputs(
        "mla.prefill", (q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale), self_attention=True
    )
    return _attention_outputs(q, v)


def prefill_context_chunk_fake(*inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Fake ``mla::prefill_context_chunk``, called with the op's arguments in its schema's order
    (:data:`AttentionInputs`): ``out`` ``[Tq, H, Dv]``, ``lse`` float32 ``[H, Tq]``."""
    check_attention_inputs("mla.prefill_context_chunk", inputs, self_attention=False)
    q, _, v, *_ = inputs
    return _attention_outputs(q, v)


def merge_attn_states_fake(
    prefix_out: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_out: torch.Tensor,
    suffix_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fake ``mla::merge_attn_states``: ``out`` like ``prefix_out``, ``lse`` like ``prefix_lse``."""
    check_merge_inputs(prefix_out, prefix_lse, suffix_out, suffix_lse)
    return prefix_out.new_empty(prefix_out.shape), prefix_lse.new_empty(prefix_lse.shape)


def prefill_with_chunk_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    k_chunk: torch.Tensor,
    v_chunk: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_k: int,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fake ``mla::prefill_with_chunk`` (the new tokens, one context chunk and their merge): each part
    checked by its op's fake; ``out`` ``[T, H, Dv]``, ``lse`` float32 ``[H, T]``."""
    out, lse = prefill_fake(q, k, v, cu_seqlens, max_seqlen, softmax_scale)
    prefill_context_chunk_fake(q, k_chunk, v_chunk, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k, softmax_scale)
    check_chunk_values(v, v_chunk)
    return out, lse


def _fp8_fake(op: str, args: tuple, self_attention: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if self_attention:
        q, k, v, cu, max_seqlen, *descales, softmax_scale, out_dtype = args
        inputs = (q, k, v, cu, cu, max_seqlen, max_seqlen, softmax_scale)
    else:
        q, k, v, cu_q, cu_k, max_q, max_k, *descales, softmax_scale, out_dtype = args
        inputs = (q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale)
    check_attention_inputs(op, inputs, self_attention, fp8=True)
    check_fp8_scales(op, q, descales, out_dtype)
    return _attention_outputs(q, v, out_dtype)


def prefill_fp8_fake(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Fake ``mla::prefill_fp8``, called with the op's arguments in its schema's order: ``out`` ``[T, H, Dv]`` in
    ``out_dtype``, ``lse`` float32 ``[H, T]``."""
    return _fp8_fake("mla.prefill_fp8", args, self_attention=True)


def prefill_context_chunk_fp8_fake(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Fake ``mla::prefill_context_chunk_fp8``, called with the op's arguments in its schema's order: ``out``
    ``[Tq, H, Dv]`` in ``out_dtype``, ``lse`` float32 ``[H, Tq]``."""
    return _fp8_fake("mla.prefill_context_chunk_fp8", args, self_attention=False)
