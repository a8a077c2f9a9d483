"""The Python API: thin wrappers over the ``mla`` ops that fill in defaults.

Every function here is traceable by ``torch.compile(fullgraph=True)``: it only calls the ops and
reads static shapes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from . import ops  # noqa: F401  (registers torch.ops.mla)
from .meta.checks import check_argument_types


class ContextChunk(NamedTuple):
    """One chunk of cached context for :func:`prefill_with_context`.

    ``k`` ``[Tk, H, Dqk]`` and ``v`` ``[Tk, H, Dv]`` hold each sequence's slice of the chunk, packed
    as ``cu_seqlens_k`` (int32 ``[B+1]``, one entry per sequence of the new tokens, slices may be
    empty) describes; ``max_seqlen_k`` bounds the longest slice.
    """

    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_k: int


def default_softmax_scale(head_dim_qk: int) -> float:
    """``1 / sqrt(Dqk)``, the scale used when none is given."""
    return 1.0 / math.sqrt(head_dim_qk)


def _scale(q: torch.Tensor, softmax_scale: float | None) -> float:
    if softmax_scale is not None:
        return float(softmax_scale)
    if not isinstance(q, torch.Tensor) or q.dim() == 0:
        raise TypeError(f"q must be a torch.Tensor [T, H, Dqk], got {type(q).__name__}")
    return default_softmax_scale(q.shape[-1])


def prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    softmax_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of each sequence's new tokens over themselves.

    Args:
        q: ``[T, H, Dqk]``, bfloat16 or float16; the last dimension must have stride 1.
        k: ``[T, H, Dqk]``, same dtype and device.
        v: ``[T, H, Dv]``, same dtype and device; may be a strided view (e.g. of ``kv_nope``).
        cu_seqlens: int32 ``[B+1]`` on the same device: sequence ``b`` is rows
            ``cu_seqlens[b]:cu_seqlens[b+1]``. Rows past ``cu_seqlens[-1]`` are padding.
        max_seqlen: an upper bound of the longest sequence.
        softmax_scale: defaults to ``1 / sqrt(Dqk)``.

    Returns:
        ``(out, lse)``: ``out`` ``[T, H, Dv]`` in the dtype of ``q``; ``lse`` float32 ``[H, T]``,
        natural log.
    """
    check_argument_types("mla.prefill", {"q": q, "k": k, "v": v, "cu_seqlens": cu_seqlens}, {"max_seqlen": max_seqlen})
    return torch.ops.mla.prefill(q, k, v, cu_seqlens, max_seqlen, _scale(q, softmax_scale))


def prefill_context_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal attention of each sequence's new tokens over its chunk of cached context.

    Args:
        q: ``[Tq, H, Dqk]``, bfloat16 or float16.
        k: ``[Tk, H, Dqk]``; v: ``[Tk, H, Dv]``: the chunk's keys and values.
        cu_seqlens_q, cu_seqlens_k: int32 ``[B+1]`` each, one entry per sequence; a sequence may
            have no context in this chunk (equal consecutive offsets), and then its rows get
            ``out = 0`` and ``lse = -inf``.
        max_seqlen_q, max_seqlen_k: upper bounds of the longest query and key slices.
        softmax_scale: defaults to ``1 / sqrt(Dqk)``.

    Returns:
        ``(out, lse)``: ``out`` ``[Tq, H, Dv]``; ``lse`` float32 ``[H, Tq]``, natural log.
    """
    check_argument_types(
        "mla.prefill_context_chunk",
        {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k},
        {"max_seqlen_q": max_seqlen_q, "max_seqlen_k": max_seqlen_k},
    )
    return torch.ops.mla.prefill_context_chunk(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, _scale(q, softmax_scale)
    )


def merge_attn_states(
    prefix_out: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_out: torch.Tensor,
    suffix_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint key sets through their log-sum-exp.

    Args:
        prefix_out, suffix_out: ``[T, H, Dv]``, bfloat16 or float16.
        prefix_lse, suffix_lse: float32 ``[H, T]``. ``-inf`` or ``+inf`` marks a side with no keys.

    Returns:
        ``(out, lse)`` as if attention had run over both key sets at once. A row empty on both sides
        gives ``out = 0`` and ``lse = -inf``, never NaN.
    """
    check_argument_types(
        "mla.merge_attn_states",
        {"prefix_out": prefix_out, "prefix_lse": prefix_lse, "suffix_out": suffix_out, "suffix_lse": suffix_lse},
        {},
    )
    return torch.ops.mla.merge_attn_states(prefix_out, prefix_lse, suffix_out, suffix_lse)


def prefill_with_context(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    chunks: Sequence[ContextChunk | tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]],
    softmax_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the new tokens over their cached context (in chunks) and over themselves.

    Runs :func:`prefill` on the new tokens, :func:`prefill_context_chunk` on each chunk and merges
    the partial results, which equals one causal attention over ``[context ; new tokens]``.

    Args:
        q, k, v, cu_seqlens, max_seqlen: as for :func:`prefill`.
        chunks: :class:`ContextChunk` items, or ``(k, v, cu_seqlens_k, max_seqlen_k)`` tuples.
        softmax_scale: defaults to ``1 / sqrt(Dqk)``.

    Returns:
        ``(out, lse)``: ``out`` ``[T, H, Dv]``; ``lse`` float32 ``[H, T]``.
    """
    scale = _scale(q, softmax_scale)
    out, lse = prefill(q, k, v, cu_seqlens, max_seqlen, scale)
    for i, chunk in enumerate(chunks):
        if len(chunk) != 4:
            raise TypeError(
                f"prefill_with_context: chunks[{i}] must be (k, v, cu_seqlens_k, max_seqlen_k), got {len(chunk)} items"
            )
        k_c, v_c, cu_seqlens_k, max_seqlen_k = chunk
        out_c, lse_c = prefill_context_chunk(q, k_c, v_c, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k, scale)
        out, lse = merge_attn_states(out_c, lse_c, out, lse)
    return out, lse
