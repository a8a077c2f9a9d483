"""The Python API: thin wrappers over the ``mla`` ops that fill in defaults.

:func:`prefill`, :func:`prefill_context_chunk`, :func:`merge_attn_states`, :func:`prefill_with_context` and
:func:`pack_chunks`, all traceable by ``torch.compile(fullgraph=True)``. Under ``torch.compile`` they validate
in Python first, and inside CUDA-graph trees the attention wrappers call the ops' in-graph twins.
Design: docs/design/ops.md and docs/design/graph-trees.md.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from . import ops  # noqa: F401  (registers torch.ops.mla)
from .meta.checks import (
    DESCALE_NAMES,
    MAX_SEQLEN_LIMIT,
    check_argument_types,
    check_attention_inputs,
    check_cu_seqlens_values,
    check_max_seqlen,
    check_merge_inputs,
    check_out_dtype,
)
from .runtime.graph_trees import IN_GRAPH_TWINS, routes_in_graph


def _overload_callable(overload: torch._ops.OpOverload) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """What the eager fast paths call: the default overload's C++ callable, which ``OpOverload.__call__``
    only forwards to (one Python frame less per call); the overload itself where a torch has none."""
    return getattr(overload, "_op", overload)


# The ops' default overloads, which the eager fast paths call directly: the OpOverloadPacket's __call__
# costs a microsecond more, and every Python frame on this path costs more again between a model's other
# calls, where the path is out of the CPU's caches. (Traced calls keep the packet, as graphs have always
# shown it.)
_PREFILL = _overload_callable(torch.ops.mla.prefill.default)
_PREFILL_CONTEXT_CHUNK = _overload_callable(torch.ops.mla.prefill_context_chunk.default)
_MERGE_ATTN_STATES = _overload_callable(torch.ops.mla.merge_attn_states.default)
_PREFILL_WITH_CHUNK = _overload_callable(torch.ops.mla.prefill_with_chunk.default)
_Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling

# The ops' twins for calls inside CUDA-graph trees: same schemas, routed with in_graph=True.
_PREFILL_IN_GRAPH = getattr(torch.ops.mla, IN_GRAPH_TWINS["prefill"])
_PREFILL_CONTEXT_CHUNK_IN_GRAPH = getattr(torch.ops.mla, IN_GRAPH_TWINS["prefill_context_chunk"])

#: Up to this many context chunks, :func:`prefill_with_context` merges each chunk into the running
#: result with the ``mla.merge_attn_states`` op (one bf16/fp16 rounding per merge, a few percent of the
#: rounding error of one attention per chunk); beyond it, it accumulates every partial result in fp32
#: and rounds once, so the error does not grow with the number of chunks.
SEQUENTIAL_MERGE_MAX_CHUNKS = 4

#: The fewest rows a chunk made by :func:`pack_chunks` has (and the least ``max_seqlen_k``), because
#: ``torch.compile`` specialises sizes 0 and 1, which would compile one more graph.
MIN_PACKED_ROWS = 2


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


def _scale(op: str, q: torch.Tensor, softmax_scale: object) -> float:
    if softmax_scale is None:
        if not isinstance(q, torch.Tensor) or q.dim() == 0:
            raise TypeError(f"{op}: q must be a torch.Tensor [T, H, Dqk], got {type(q).__name__}")
        # int(): a head dim is static; under torch.compile this keeps the scale a plain float.
        return default_softmax_scale(int(q.shape[-1]))
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        kind = type(softmax_scale).__name__
        raise TypeError(f"{op}: softmax_scale must be a float, got {kind} {softmax_scale!r:.40}")
    return float(softmax_scale)


def _plain_scale(q: torch.Tensor, softmax_scale: object) -> float | None:
    """The scale for the eager fast path: a float as given, the default for a 3-D ``q``, else ``None``
    (the full checks then say what is wrong)."""
    if type(softmax_scale) is float:
        return softmax_scale
    if softmax_scale is None and q.dim() == 3:
        return default_softmax_scale(q.shape[2])
    return None


def _length(op: str, name: str, value: object) -> int:
    """``value`` as an int: Python ints and ``SymInt`` pass through, NumPy integers are converted."""
    if isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool):
        return value
    if not isinstance(value, (bool, float, str)) and hasattr(value, "__index__"):
        try:
            return operator.index(value)
        except TypeError:  # e.g. a float tensor, which has __index__ but refuses it
            pass
    raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__} {value!r:.40}")


_CHUNK_FORM = "ContextChunk or (k, v, cu_seqlens_k, max_seqlen_k) tuples"


def _chunk_list(op: str, chunks: object, name: str = "chunks", form: str = _CHUNK_FORM) -> Sequence[object]:
    """``chunks`` where it is a list or tuple (of chunks), else a ``TypeError`` saying what to pass."""
    if isinstance(chunks, (list, tuple)):
        return chunks
    raise TypeError(
        f"{op}: {name} must be a list of {form} ([] for no context), got {type(chunks).__name__} {chunks!r:.40}"
    )


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
        max_seqlen: an upper bound of the longest sequence (an int, NumPy integers accepted).
        softmax_scale: defaults to ``1 / sqrt(Dqk)``.

    Returns:
        ``(out, lse)``: ``out`` ``[T, H, Dv]`` in the dtype of ``q``; ``lse`` float32 ``[H, T]``,
        natural log.

    Inside torch.compile's CUDA-graph trees (``mode="reduce-overhead"``), the call runs the best backend
    that reads the offsets on the device (:mod:`mla_ops.runtime.graph_trees`).
    """
    # The eager fast path: straight to the op, whose kernel validates everything. The checks below add
    # what the dispatcher would reject with messages that name no argument (other types, ints beyond the
    # schema's int64) and what torch.compile needs; is_compiling() comes first, so that Dynamo, for which
    # it is a constant, looks no further. One expression, no helper call: this runs on every eager call.
    if (
        not _is_compiling()
        and type(max_seqlen) is int
        and 0 <= max_seqlen <= MAX_SEQLEN_LIMIT
        and isinstance(q, _Tensor)
        and isinstance(k, _Tensor)
        and isinstance(v, _Tensor)
        and isinstance(cu_seqlens, _Tensor)
    ):
        scale = softmax_scale if type(softmax_scale) is float else _plain_scale(q, softmax_scale)
        if scale is not None:
            return _PREFILL(q, k, v, cu_seqlens, max_seqlen, scale)
    op = "mla.prefill"
    max_seqlen = _length(op, "max_seqlen", max_seqlen)
    check_argument_types(op, {"q": q, "k": k, "v": v, "cu_seqlens": cu_seqlens}, {"max_seqlen": max_seqlen})
    scale = _scale(op, q, softmax_scale)
    if torch.compiler.is_compiling():  # the scale's type is checked above; its value may be symbolic here
        check_attention_inputs(op, (q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 1.0), True)
        if routes_in_graph():
            return _PREFILL_IN_GRAPH(q, k, v, cu_seqlens, max_seqlen, scale)
    return torch.ops.mla.prefill(q, k, v, cu_seqlens, max_seqlen, scale)


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

    Inside torch.compile's CUDA-graph trees, routed as :func:`prefill` is.
    """
    if (  # the eager fast path, as in prefill
        not _is_compiling()
        and type(max_seqlen_q) is int
        and type(max_seqlen_k) is int
        and 0 <= max_seqlen_q <= MAX_SEQLEN_LIMIT
        and 0 <= max_seqlen_k <= MAX_SEQLEN_LIMIT
        and isinstance(q, _Tensor)
        and isinstance(k, _Tensor)
        and isinstance(v, _Tensor)
        and isinstance(cu_seqlens_q, _Tensor)
        and isinstance(cu_seqlens_k, _Tensor)
    ):
        scale = softmax_scale if type(softmax_scale) is float else _plain_scale(q, softmax_scale)
        if scale is not None:
            return _PREFILL_CONTEXT_CHUNK(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale)
    op = "mla.prefill_context_chunk"
    max_seqlen_q = _length(op, "max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _length(op, "max_seqlen_k", max_seqlen_k)
    check_argument_types(
        op,
        {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k},
        {"max_seqlen_q": max_seqlen_q, "max_seqlen_k": max_seqlen_k},
    )
    scale = _scale(op, q, softmax_scale)
    if torch.compiler.is_compiling():  # the scale's type is checked above; its value may be symbolic here
        check_attention_inputs(op, (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 1.0), False)
        if routes_in_graph():
            return _PREFILL_CONTEXT_CHUNK_IN_GRAPH(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale
            )
    return torch.ops.mla.prefill_context_chunk(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale)


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
        gives ``out = 0`` and ``lse = -inf``; a NaN LSE on either side gives NaN in ``out`` and ``lse``.
    """
    if (  # the eager fast path, as in prefill
        not _is_compiling()
        and isinstance(prefix_out, _Tensor)
        and isinstance(prefix_lse, _Tensor)
        and isinstance(suffix_out, _Tensor)
        and isinstance(suffix_lse, _Tensor)
    ):
        return _MERGE_ATTN_STATES(prefix_out, prefix_lse, suffix_out, suffix_lse)
    op = "mla.merge_attn_states"
    check_argument_types(
        op,
        {"prefix_out": prefix_out, "prefix_lse": prefix_lse, "suffix_out": suffix_out, "suffix_lse": suffix_lse},
        {},
    )
    if torch.compiler.is_compiling():
        check_merge_inputs(prefix_out, prefix_lse, suffix_out, suffix_lse)
    return torch.ops.mla.merge_attn_states(prefix_out, prefix_lse, suffix_out, suffix_lse)


def _as_chunk(
    index: int, chunk: object, q: torch.Tensor, v: torch.Tensor, op: str = "prefill_with_context"
) -> ContextChunk:
    """``chunk`` as a :class:`ContextChunk`, with its shapes checked against the new tokens'."""
    where = f"{op}: chunks[{index}]"
    if not isinstance(chunk, (tuple, list)) or len(chunk) != 4:
        got = f"{len(chunk)} items" if isinstance(chunk, (tuple, list)) else type(chunk).__name__
        raise TypeError(f"{where} must be (k, v, cu_seqlens_k, max_seqlen_k), got {got}")
    k_c, v_c, cu_seqlens_k, max_seqlen_k = chunk
    for name, t, like in (("k", k_c, q), ("v", v_c, v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3 or t.shape[1:] != like.shape[1:]:
            raise ValueError(
                f"{where}: {name} has shape {tuple(t.shape)}, but the new tokens' {name} has [T, H, D] = "
                f"{tuple(like.shape)}; a chunk's {name} must be [Tk, {like.shape[1]}, {like.shape[2]}]"
            )
    return ContextChunk(k_c, v_c, cu_seqlens_k, _length(where, "max_seqlen_k", max_seqlen_k))


def _plain_chunk(chunk: object, heads: int, dqk: int, v_heads: int, dv: int) -> ContextChunk | None:
    """``chunk`` as a :class:`ContextChunk` when it already is one, or a 4-tuple, of two tensors whose dims
    are the ones :func:`_as_chunk` accepts (the new tokens' ``q`` ``[.., heads, dqk]`` and ``v``
    ``[.., v_heads, dv]``) and an int bound; else ``None``, for :func:`_as_chunk`'s checks and messages.
    Compares the dims one by one, which costs a fraction of slicing and comparing ``torch.Size`` objects."""
    kind = type(chunk)
    if not (kind is ContextChunk or (kind is tuple and len(chunk) == 4)):
        return None
    k_c, v_c, cu_k, max_k = chunk
    if not (isinstance(k_c, _Tensor) and isinstance(v_c, _Tensor) and type(max_k) is int):
        return None
    ks, vcs = k_c.shape, v_c.shape
    dims_match = len(ks) == 3 and len(vcs) == 3 and ks[1] == heads and ks[2] == dqk
    if not (dims_match and vcs[1] == v_heads and vcs[2] == dv):
        return None
    return chunk if kind is ContextChunk else ContextChunk(k_c, v_c, cu_k, max_k)


def _fused_arguments(q, k, v, cu_seqlens, max_seqlen, chunk, scale) -> tuple | None:
    """The fused op's arguments for an eager :func:`prefill_with_context` call with this one chunk (and
    the float ``scale``), or ``None`` unless every argument is of the plain types and the chunk's dims
    are the ones :func:`_as_chunk` accepts: anything else takes the general path, whose checks name what
    is wrong. What is left to check, the fused op's kernel checks as the three ops would."""
    plain = (
        type(max_seqlen) is int
        and 0 <= max_seqlen <= MAX_SEQLEN_LIMIT
        and isinstance(q, _Tensor)
        and isinstance(k, _Tensor)
        and isinstance(v, _Tensor)
        and isinstance(cu_seqlens, _Tensor)
    )
    if not plain:
        return None
    qs, vs = q.shape, v.shape
    if len(qs) != 3 or len(vs) != 3:
        return None
    chunk = _plain_chunk(chunk, qs[1], qs[2], vs[1], vs[2])
    if chunk is None or not isinstance(chunk.cu_seqlens_k, _Tensor):
        return None
    if not 0 <= chunk.max_seqlen_k <= MAX_SEQLEN_LIMIT:
        return None
    return q, k, v, cu_seqlens, max_seqlen, *chunk, scale


def _as_chunks(chunks: Sequence[object], q: torch.Tensor, v: torch.Tensor) -> list[ContextChunk]:
    """Every chunk as a :class:`ContextChunk`: :func:`_plain_chunk` for the common case, else
    :func:`_as_chunk`'s checks and messages. :func:`prefill_with_context` calls it once per call that does
    not take the fused op."""
    _, heads, dqk = q.shape
    _, v_heads, dv = v.shape
    return [_plain_chunk(chunk, heads, dqk, v_heads, dv) or _as_chunk(i, chunk, q, v) for i, chunk in enumerate(chunks)]


def _scaled_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, H, D]`` times ``weight`` ``[H, T]`` per row, with rows of weight 0 set to 0.

    ``where(w == 0, 0, x * w)``: a side without keys is dropped even if its ``x`` holds NaN, while a NaN
    weight (from a NaN LSE) still turns the row into NaN.
    """
    w = weight.t()[..., None]
    return torch.where(w == 0, 0.0, x * w)


def _merge_in_fp32(partials: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``(out [T, H, Dv], lse [H, T])`` partial results with one rounding at the end.

    A running log-sum-exp merge whose accumulator stays in fp32. ``+inf`` and ``-inf`` LSEs mark a
    partial without keys (its ``out`` is not read), rows empty everywhere give ``out = 0`` and
    ``lse = -inf``, and a NaN LSE makes its row NaN.
    """
    first_out, first_lse = partials[0]
    acc = torch.zeros(first_out.shape, dtype=torch.float32, device=first_out.device)
    total = torch.zeros_like(first_lse, dtype=torch.float32)
    running_max = torch.full_like(first_lse, -math.inf, dtype=torch.float32)
    shift = running_max
    for out, lse in partials:
        lse = lse.float().masked_fill(torch.isposinf(lse), -math.inf)
        new_max = torch.maximum(running_max, lse)
        shift = torch.where(torch.isneginf(new_max), 0.0, new_max)
        old_weight = torch.exp(running_max - shift)
        weight = torch.exp(lse - shift)
        acc = _scaled_rows(acc, old_weight) + _scaled_rows(out.float(), weight)
        total = total * old_weight + weight
        running_max = new_max
    rows_total = total.t()[..., None]
    out = torch.where(rows_total == 0, 0.0, acc / rows_total)
    lse = torch.where(total == 0, -math.inf, shift + torch.log(total))
    return out.to(first_out.dtype), lse


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
    the partial results, which equals one causal attention over ``[context ; new tokens]``. Up to
    :data:`SEQUENTIAL_MERGE_MAX_CHUNKS` chunks are merged one by one with :func:`merge_attn_states`;
    more are accumulated in fp32 and rounded once, so the error does not grow with their number.
    Eagerly, one chunk runs as one call of the internal op ``mla.prefill_with_chunk``, which does the
    three ops' work with their checks and returns exactly what they return, with one dispatch and one
    routing instead of three (:mod:`mla_ops.ops`).

    Under ``torch.compile`` the number of chunks is part of the compiled graph: pack them into one
    with :func:`pack_chunks` outside the compiled function, and every count runs the same graph.

    Args:
        q, k, v, cu_seqlens, max_seqlen: as for :func:`prefill`.
        chunks: :class:`ContextChunk` items, or ``(k, v, cu_seqlens_k, max_seqlen_k)`` tuples.
        softmax_scale: defaults to ``1 / sqrt(Dqk)``.

    Returns:
        ``(out, lse)``: ``out`` ``[T, H, Dv]``; ``lse`` float32 ``[H, T]``.
    """
    scale = softmax_scale if type(softmax_scale) is float else _scale("prefill_with_context", q, softmax_scale)
    if not _is_compiling() and type(chunks) in (list, tuple) and len(chunks) == 1:
        # The common eager layer, one chunk: the three ops' work in one op call (mla_ops.ops.FUSED_SCHEMA), the
        # same results. Only for arguments of the plain types, which the fused kernel validates in full.
        fused = _fused_arguments(q, k, v, cu_seqlens, max_seqlen, chunks[0], scale)
        if fused is not None:
            return _PREFILL_WITH_CHUNK(*fused)
    chunks = _chunk_list("prefill_with_context", chunks)
    out, lse = prefill(q, k, v, cu_seqlens, max_seqlen, scale)
    chunks = _as_chunks(chunks, q, v)
    partials = (
        prefill_context_chunk(q, k_c, v_c, cu_seqlens, cu_k, max_seqlen, max_k, scale)
        for k_c, v_c, cu_k, max_k in chunks
    )
    if len(chunks) <= SEQUENTIAL_MERGE_MAX_CHUNKS:
        for out_c, lse_c in partials:
            out, lse = merge_attn_states(out_c, lse_c, out, lse)
        return out, lse
    return _merge_in_fp32([(out, lse), *partials])


def packing_index(offsets: Sequence[torch.Tensor], rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each row goes when several chunks are packed into one, computed on the device (no sync).

    Args:
        offsets: each chunk's int32 ``[B+1]`` offsets (one per sequence, all on one device).
        rows: each chunk's row count (its key tensors' first dimension; rows past ``offsets[c][-1]``
            belong to no sequence).

    Returns:
        ``(source, cu_seqlens)``: int64 ``[sum(rows)]`` and int32 ``[B+1]``. Row ``i`` of the packed
        chunk is row ``source[i]`` of the chunks concatenated in order; sequence ``b`` owns packed rows
        ``cu_seqlens[b]:cu_seqlens[b+1]``, which hold its rows of chunk 0, then of chunk 1, and so on;
        rows that no sequence uses come last.
    """
    cu = torch.stack([o.long() for o in offsets])  # [N, B+1]
    lengths = cu[:, 1:] - cu[:, :-1]  # [N, B]
    num_seqs = lengths.shape[1]
    packed = torch.zeros(num_seqs + 1, dtype=torch.long, device=cu.device)
    packed[1:] = lengths.sum(0).cumsum(0)
    starts = packed[:-1] + lengths.cumsum(0) - lengths  # [N, B]: chunk c's slice of sequence b
    spare = torch.cat([cu.new_zeros(1), (torch.tensor(list(rows), device=cu.device) - cu[:, -1]).cumsum(0)])
    destinations = []
    for c, count in enumerate(rows):
        r = torch.arange(count, device=cu.device)
        b = torch.searchsorted(cu[c, 1:], r, right=True)  # the sequence of row r; B for rows past the end
        seq = b.clamp(max=max(num_seqs - 1, 0))
        used = starts[c, seq] + r - cu[c, seq] if num_seqs else r
        unused = packed[-1] + spare[c] + r - cu[c, -1]
        destinations.append(torch.where(b < num_seqs, used, unused))
    destination = torch.cat(destinations)
    source = torch.empty_like(destination)
    source[destination] = torch.arange(destination.numel(), device=cu.device)
    return source, packed.to(torch.int32)


def pack_chunks(
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunks: Sequence[ContextChunk | tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]],
) -> ContextChunk:
    """All context chunks as one, for a single ``prefill_context_chunk`` call and a single merge.

    Non-causal attention over a sequence's context does not depend on how the context is split, so one
    chunk that holds every sequence's keys of every chunk gives the same result as the chunks merged
    one by one, with one merge rounding instead of one per chunk. Under ``torch.compile`` it also keeps
    the number of chunks out of the compiled graph: call this outside the compiled function and pass
    ``[pack_chunks(...)]`` to :func:`prefill_with_context`, and any number of chunks, 0 included, runs
    the same graph. The packed chunk always has at least two rows and a ``max_seqlen_k`` of at least 2
    (``torch.compile`` specialises sizes 0 and 1). It is a copy: memory for the chunks' keys and values
    once more.

    Args:
        k, v: the new tokens' keys ``[T, H, Dqk]`` and values ``[T, H, Dv]``: only their head count,
            head dims, dtype and device are read.
        cu_seqlens: the new tokens' offsets, int32 ``[B+1]``.
        chunks: as for :func:`prefill_with_context`.

    Returns:
        One :class:`ContextChunk` with contiguous ``k``/``v``.
    """
    chunks = [_as_chunk(i, chunk, k, v, "pack_chunks") for i, chunk in enumerate(_chunk_list("pack_chunks", chunks))]
    check_packing("pack_chunks", cu_seqlens, [(("k", c.k, k), ("v", c.v, v)) for c in chunks], chunks)
    keys, values, offsets = pack_rows(
        [(c.k, c.v) for c in chunks], (k, v), [c.cu_seqlens_k for c in chunks], cu_seqlens
    )
    return ContextChunk(keys, values, offsets, max(sum(int(c.max_seqlen_k) for c in chunks), MIN_PACKED_ROWS))


def check_packing(
    op: str,
    cu_seqlens: object,
    tensors: Sequence[tuple[tuple[str, torch.Tensor, torch.Tensor], tuple[str, torch.Tensor, torch.Tensor]]],
    chunks: Sequence[tuple],
    name: str = "chunks",
) -> None:
    """Validate what :func:`pack_rows` packs, naming the chunk at fault (``chunks[c]``, after ``name``).

    ``tensors[c]`` holds chunk ``c``'s two per-row tensors as ``(name, tensor, like)``: each must have the
    dtype and device of ``like`` (the new tokens' counterpart), and both the same row count. ``chunks[c]``
    ends with the chunk's offsets and its ``max_seqlen_k`` (already an int). The offsets must be int32
    ``[B+1]`` like ``cu_seqlens`` (float offsets are refused, never rounded); where they are on the CPU their
    values are checked too: from 0, non-decreasing, within the chunk's rows and ``max_seqlen_k``. Offsets on a
    GPU are not read here, which would wait for the device, as the CUDA kernels do not read them on the host.
    """
    device = tensors[0][0][2].device if tensors else getattr(cu_seqlens, "device", None)
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{op}: cu_seqlens must be an int32 torch.Tensor [B+1], got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(
            f"{op}: cu_seqlens must be an int32 tensor [B+1], got {str(cu_seqlens.dtype).removeprefix('torch.')} "
            f"of shape {tuple(cu_seqlens.shape)}"
        )
    entries = cu_seqlens.shape[0]
    for c, (pair, chunk) in enumerate(zip(tensors, chunks)):
        where = f"{op}: {name}[{c}]"
        for part, t, like in pair:
            if t.dtype != like.dtype or t.device != like.device:
                raise ValueError(
                    f"{where}: {part} is {str(t.dtype).removeprefix('torch.')} on {t.device}, but the new tokens' "
                    f"{part} is {str(like.dtype).removeprefix('torch.')} on {like.device}; pass the chunk in that "
                    "dtype, on that device"
                )
        (first, a, _), (second, b, _) = pair
        if a.shape[0] != b.shape[0]:
            raise ValueError(f"{where}: {first} has {a.shape[0]} rows but {second} has {b.shape[0]}; they must match")
        cu_k, max_k = chunk[-2], chunk[-1]
        offsets = f"{where}.cu_seqlens_k"
        if not isinstance(cu_k, torch.Tensor):
            raise TypeError(f"{offsets} must be an int32 torch.Tensor [B+1], got {type(cu_k).__name__}")
        if cu_k.dtype != torch.int32:
            raise TypeError(
                f"{offsets} must have dtype int32, got {str(cu_k.dtype).removeprefix('torch.')}; offsets count rows: "
                f"pass them as integers (e.g. torch.tensor([...], dtype=torch.int32))"
            )
        if cu_k.dim() != 1 or cu_k.shape[0] != entries:
            raise ValueError(
                f"{offsets} must be a 1-D tensor of {entries} entries (one per sequence of cu_seqlens, and 0 first), "
                f"got shape {tuple(cu_k.shape)}"
            )
        if cu_k.device != device:
            raise ValueError(f"{offsets} is on {cu_k.device} but the new tokens are on {device}; move it there")
        check_max_seqlen(f"{where}", "max_seqlen_k", max_k)
        if cu_k.device.type == "cpu":  # the values, as the ops' CPU kernels check them
            check_cu_seqlens_values(where, cu_k, a.shape[0], max_k, "cu_seqlens_k")


def pack_rows(
    tensors: Sequence[tuple[torch.Tensor, torch.Tensor]],
    like: tuple[torch.Tensor, torch.Tensor],
    offsets: Sequence[torch.Tensor],
    cu_seqlens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packing behind :func:`pack_chunks` and :func:`mla_ops.model.pack_context`.

    ``tensors[c]`` are chunk ``c``'s two per-row tensors (keys and values, or latent rows), ``offsets[c]``
    its offsets. Returns the two packed tensors (at least two rows; shaped like ``like``'s tensors past
    the first dimension when there is no chunk) and their int32 ``[B+1]`` offsets.
    """
    if not tensors:
        first, second = (t.new_zeros((MIN_PACKED_ROWS, *t.shape[1:])) for t in like)
        return first, second, torch.zeros_like(cu_seqlens)
    source, packed_offsets = packing_index(offsets, [a.shape[0] for a, _ in tensors])
    packed = []
    for part in zip(*tensors):
        rows = torch.cat(part).index_select(0, source)
        if rows.shape[0] < MIN_PACKED_ROWS:
            rows = torch.cat([rows, rows.new_zeros((MIN_PACKED_ROWS - rows.shape[0], *rows.shape[1:]))])
        packed.append(rows)
    return packed[0], packed[1], packed_offsets


def _fp8_arguments(
    op: str, q, tensors: dict[str, object], descales: tuple, ints: dict[str, object], out_dtype, softmax_scale
) -> float:
    """The softmax scale of an fp8 call, after the checks that must come before the dispatcher (whose own errors
    name no argument): the tensors' types, ``descales``' among them, the ints and ``out_dtype``."""
    check_argument_types(op, {**tensors, **dict(zip(DESCALE_NAMES, descales))}, ints)
    check_out_dtype(op, out_dtype)
    return _scale(op, q, softmax_scale)


def prefill_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    q_descale: torch.Tensor,
    k_descale: torch.Tensor,
    v_descale: torch.Tensor,
    softmax_scale: float | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`prefill` on fp8 inputs: causal attention of each sequence's new tokens over themselves.

    Args:
        q, k: ``[T, H, Dqk]``, ``float8_e4m3fn``; v: ``[T, H, Dv]``, ``float8_e4m3fn``, may be a strided view,
            or key-major (unit stride over the tokens, as ``quantize_fp8(v, key_major=True)`` makes it): on Hopper
            TRITON reads a one-sequence call's key-major ``v`` without copying it transposed first, and every other
            call makes it token-major (a copy). :func:`mla_ops.quantize_fp8` makes them from bf16 tensors, with
            their factors.
        cu_seqlens, max_seqlen: as for :func:`prefill`.
        q_descale, k_descale, v_descale: float32 factors that dequantise each input (real value = fp8 value *
            factor), of shape ``[]`` or ``[1]`` (one for every head) or ``[H]`` (one per head), on q's device.
            Finite and positive: checked on CPU, not read on a GPU.
        softmax_scale: defaults to ``1 / sqrt(Dqk)``; it applies to the dequantised scores.
        out_dtype: the dtype of ``out``, bfloat16 (default) or float16.

    Returns:
        ``(out, lse)``: ``out`` ``[T, H, Dv]`` in ``out_dtype``; ``lse`` float32 ``[H, T]``, natural log, which
        :func:`merge_attn_states` merges with the bf16 ops' results.
    """
    op = "mla.prefill_fp8"
    max_seqlen = _length(op, "max_seqlen", max_seqlen)
    tensors = {"q": q, "k": k, "v": v, "cu_seqlens": cu_seqlens}
    descales = (q_descale, k_descale, v_descale)
    scale = _fp8_arguments(op, q, tensors, descales, {"max_seqlen": max_seqlen}, out_dtype, softmax_scale)
    return torch.ops.mla.prefill_fp8(q, k, v, cu_seqlens, max_seqlen, q_descale, k_descale, v_descale, scale, out_dtype)


def prefill_context_chunk_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    q_descale: torch.Tensor,
    k_descale: torch.Tensor,
    v_descale: torch.Tensor,
    softmax_scale: float | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`prefill_context_chunk` on fp8 inputs: non-causal attention of each sequence's new tokens over its
    chunk of cached context. ``q``, ``k``, ``v`` are ``float8_e4m3fn``; the other arguments and the result are
    as for :func:`prefill_context_chunk` and :func:`prefill_fp8`."""
    op = "mla.prefill_context_chunk_fp8"
    max_seqlen_q = _length(op, "max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _length(op, "max_seqlen_k", max_seqlen_k)
    tensors = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}
    descales = (q_descale, k_descale, v_descale)
    ints = {"max_seqlen_q": max_seqlen_q, "max_seqlen_k": max_seqlen_k}
    scale = _fp8_arguments(op, q, tensors, descales, ints, out_dtype, softmax_scale)
    return torch.ops.mla.prefill_context_chunk_fp8(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q_descale, k_descale, v_descale, scale,
        out_dtype,
    )  # fmt: skip
