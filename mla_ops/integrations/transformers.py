"""Hugging Face transformers models with their attention computed by the ``mla`` ops.

Importing this module registers an attention function and a mask function under the name ``"mla_ops"``
in transformers' ``AttentionInterface`` and ``AttentionMaskInterface``::

    import mla_ops.integrations.transformers  # noqa: F401  (registers "mla_ops")
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16, attn_implementation="mla_ops")

What is supported: README.md (Hugging Face transformers). How a call is laid out for the ops, and when it
reads anything back to the host: docs/design/transformers.md.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .. import api
from ..runtime.capture import is_capturing, version_of
from ..specs import SUPPORTED_DTYPES

INSTALL_HINT = "pip install 'mla_ops[transformers]'"

try:
    import transformers
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as exc:
    raise ImportError(
        f"mla_ops.integrations.transformers needs Hugging Face transformers 5 or newer: {INSTALL_HINT}"
    ) from exc

if int(transformers.__version__.split(".", 1)[0]) < 5:
    raise ImportError(
        f"mla_ops.integrations.transformers needs transformers 5 or newer, found {transformers.__version__}: "
        f"{INSTALL_HINT}"
    )

__all__ = ["LAYOUTS", "NAME", "LayoutCache", "mla_ops_attention_forward", "mla_ops_mask", "register"]

#: The ``attn_implementation`` name this module registers.
NAME = "mla_ops"

logger = logging.getLogger("mla_ops")

_SDPA_HINT = "load the model with attn_implementation='sdpa' instead"


# --- the batch layout: which rows go to the ops, with which offsets -------------------------------


class _Layout(NamedTuple):
    """How the ``[B, S]`` query positions of a call map onto the ops' packed rows.

    ``rows`` is ``None`` when the packed rows are the positions in order (``B * S`` of them);
    otherwise it holds the ``(batch, position)`` of each packed row, real tokens first and the
    padding positions after ``cu_q[-1]``, and ``dest`` the packed row of each flattened position.
    ``valid`` marks the real query tokens (``None``: all). ``prefix_rows``/``cu_p`` describe the
    cached prefix the same way (``None`` rows: positions in order; ``cu_p`` ``None``: no prefix).
    """

    rows: tuple[torch.Tensor, torch.Tensor] | None
    dest: torch.Tensor | None
    valid: torch.Tensor | None
    cu_q: torch.Tensor
    max_q: int
    prefix_rows: tuple[torch.Tensor, torch.Tensor] | None
    cu_p: torch.Tensor | None


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    """int32 ``[n+1]`` offsets, starting at 0, of consecutive slices of the given lengths."""
    return torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))


def _uniform_offsets(batch: int, length: int, device: torch.device) -> torch.Tensor:
    return torch.arange(batch + 1, dtype=torch.int32, device=device) * length


def _partition(valid: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Stable partition of the positions of a ``[B, S]`` bool mask: the true ones first, in order.

    Returns the ``(batch, position)`` of each packed row and, for each flattened position, its row.
    """
    flat = valid.reshape(-1)
    order = torch.argsort((~flat).to(torch.uint8), stable=True)
    dest = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    length = valid.shape[1]
    return (order // length, order % length), dest


def _sequence_starts(position_ids: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """Flattened ``[B*S]`` bool: where a packed sequence starts. As transformers'
    ``find_packed_sequence_indices``, a position that is not its predecessor's plus one starts one."""
    pos = position_ids.expand(batch, length)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    return starts.reshape(-1)


class _Call(NamedTuple):
    """What the layout of one attention call depends on: the shapes (``q_len`` queries, the last of
    ``kv_len`` keys) and at most one tensor, the one that tells the real tokens or the packed sequences
    apart (see :func:`_call_of`)."""

    mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    cu_seq_lens_q: torch.Tensor | None
    max_length_q: int | torch.Tensor | None
    batch: int
    q_len: int
    kv_len: int
    device: torch.device


def _call_of(
    mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    cu_seq_lens_q: torch.Tensor | None,
    cu_seq_lens_k: torch.Tensor | None,
    max_length_q: int | torch.Tensor | None,
    batch: int,
    q_len: int,
    kv_len: int,
    device: torch.device,
) -> _Call:
    """Keep the one input that decides the layout: the padding mask if there is one, else the packed
    offsets if both are given (as FlashAttention's integration does), else ``position_ids`` when they
    can describe packed sequences (2-D, one per query, no cached prefix)."""
    if mask is not None:
        return _Call(mask, None, None, None, batch, q_len, kv_len, device)
    if cu_seq_lens_q is not None and cu_seq_lens_k is not None:
        if kv_len != q_len or cu_seq_lens_k.shape != cu_seq_lens_q.shape:
            raise NotImplementedError(
                "attn_implementation='mla_ops' takes cu_seq_lens_q/cu_seq_lens_k for packed sequences without a "
                "cached prefix only (cu_seq_lens_k equal to cu_seq_lens_q, as many keys as queries)"
            )
        return _Call(None, None, cu_seq_lens_q, max_length_q, batch, q_len, kv_len, device)
    if kv_len != q_len or position_ids is None or position_ids.dim() != 2 or position_ids.shape[-1] != q_len:
        position_ids = None
    return _Call(None, position_ids, None, None, batch, q_len, kv_len, device)


def _build_layout(call: _Call, exact: bool) -> _Layout:
    """The layout of one call; ``exact`` allows the one host read (the count of packed sequences)."""
    mask, position_ids, cu_seq_lens_q, max_length_q, batch, q_len, kv_len, device = call
    prefix = kv_len - q_len
    if mask is not None:
        mask_q, mask_p = mask[:, prefix:], mask[:, :prefix]
        rows, dest = _partition(mask_q)
        cu_q = _offsets(mask_q.sum(1, dtype=torch.int32))
        prefix_rows = cu_p = None
        if prefix:
            prefix_rows, _ = _partition(mask_p)
            cu_p = _offsets(mask_p.sum(1, dtype=torch.int32))
        return _Layout(rows, dest, mask_q, cu_q, q_len, prefix_rows, cu_p)
    if cu_seq_lens_q is not None:
        # A packed sequence may span the rows of the batch, so the bound is the token count.
        max_q = max_length_q if isinstance(max_length_q, int) else batch * q_len
        return _Layout(None, None, None, cu_seq_lens_q.to(torch.int32), max_q, None, None)
    if position_ids is not None:
        starts = _sequence_starts(position_ids, batch, q_len)
        # The count of sequences decides the size of the offsets: read it eagerly (the documented
        # sync); under tracing or capture use the bound of one sequence per token instead.
        count = int(starts.sum()) if exact else batch * q_len
        seq = torch.cumsum(starts, 0) - 1
        ones = torch.ones_like(seq, dtype=torch.int32)
        lengths = torch.zeros(count, dtype=torch.int32, device=device).scatter_add_(0, seq, ones)
        return _Layout(None, None, None, _offsets(lengths), q_len, None, None)
    cu_p = _uniform_offsets(batch, prefix, device) if prefix else None
    return _Layout(None, None, None, _uniform_offsets(batch, q_len, device), q_len, None, cu_p)


class LayoutCache:
    """The layouts of the last few calls, so that the layers of one forward pass share one: one instance,
    :data:`LAYOUTS`, which computes a layout with its ``build`` (:func:`_build_layout`; tests wrap it to count).

    Keyed on the call's shapes and on the identity and version counter of the tensors the layout is
    computed from (the mask, ``position_ids``, ``cu_seq_lens_q``); an entry holds those tensors, so
    their ``id`` cannot be reused while it lives, and an in-place write bumps the version and misses.
    Tensors without a version counter (made under ``torch.inference_mode``) are never cached: an
    in-place write to them could not be seen.
    """

    def __init__(self, capacity: int = 8, build: Callable[[_Call, bool], _Layout] = _build_layout) -> None:
        self.capacity = capacity
        self.build = build
        self._entries: OrderedDict[tuple, tuple[tuple[torch.Tensor, ...], _Layout]] = OrderedDict()

    def get(self, tensors: tuple[torch.Tensor, ...], shape_key: tuple, build: Callable[[], _Layout]) -> _Layout:
        versions = tuple(version_of(t) for t in tensors)
        if None in versions:
            return build()
        key = (*shape_key, *((id(t), v) for t, v in zip(tensors, versions)))
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            return entry[1]
        layout = build()
        self._entries[key] = (tensors, layout)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return layout

    def clear(self) -> None:
        """Forget every layout."""
        self._entries.clear()


#: This process's layouts of recent calls.
LAYOUTS = LayoutCache()


def _layout_for(call: _Call) -> _Layout:
    """The call's layout (:data:`LAYOUTS`' ``build``), shared by the layers of a forward pass when running eagerly."""
    layouts = LAYOUTS
    if torch.compiler.is_compiling() or (call.device.type == "cuda" and is_capturing()):
        # Traced or captured: no host read, and nothing kept across calls (a captured graph must not
        # read tensors that a cache may free).
        return layouts.build(call, False)
    tensors = (call.mask, call.position_ids, call.cu_seq_lens_q)
    # Which one is present is part of the key: a mask and a position_ids tensor are told apart.
    shape_key = (
        call.device,
        call.batch,
        call.q_len,
        call.kv_len,
        call.max_length_q if isinstance(call.max_length_q, int) else None,
        *(t is not None for t in tensors),
    )
    return layouts.get(tuple(t for t in tensors if t is not None), shape_key, lambda: layouts.build(call, True))


# --- packing and unpacking ------------------------------------------------------------------------


def _pack(
    x: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor] | None, start: int, length: int, num_heads: int
) -> torch.Tensor:
    """``x[:, :, start:start+length]`` (``[B, Hx, S, D]``) as packed rows ``[N, H, D]``.

    ``rows`` (``None``: positions in order) selects and orders them; ``Hx`` heads that serve groups
    of query heads (GQA/MQA) are repeated to ``H`` as transformers' ``repeat_kv`` does.
    """
    xt = x.transpose(1, 2)  # [B, S, Hx, D]: a view, the head channels stay contiguous
    if rows is None:
        # A view when B == 1 (strided rows, which the ops accept); a copy otherwise.
        packed = xt[:, start : start + length].reshape(-1, x.shape[1], x.shape[3])
    else:
        batch_idx, pos_idx = rows
        packed = xt[batch_idx, pos_idx + start if start else pos_idx]
    groups = num_heads // x.shape[1]
    if groups > 1:
        n, kv_heads, dim = packed.shape
        packed = packed[:, :, None].expand(n, kv_heads, groups, dim).reshape(n, num_heads, dim)
    return packed


def _unpack(out: torch.Tensor, layout: _Layout, batch: int, q_len: int) -> torch.Tensor:
    """Packed ``[N, H, Dv]`` back to ``[B, S, H, Dv]``; padding positions get 0."""
    if layout.rows is None:
        return out.view(batch, q_len, *out.shape[1:])
    full = out[layout.dest].view(batch, q_len, *out.shape[1:])
    return full.masked_fill_(~layout.valid[:, :, None, None], 0)


# --- checks ---------------------------------------------------------------------------------------


def _compute_dtype(query: torch.Tensor) -> torch.dtype:
    if query.dtype in SUPPORTED_DTYPES:
        return query.dtype
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        autocast = torch.get_autocast_dtype(device_type)
        if autocast in SUPPORTED_DTYPES:
            return autocast
    raise TypeError(
        f"attn_implementation='mla_ops' computes attention in bfloat16 or float16, but the model runs in "
        f"{str(query.dtype).removeprefix('torch.')}; load it with dtype=torch.bfloat16 (or float16), or run it "
        "under torch.autocast with one of those dtypes"
    )


def _refuse_unsupported(
    module: torch.nn.Module,
    dropout: float,
    sliding_window: int | None,
    softcap: float | None,
    s_aux: torch.Tensor | None,
    kwargs: dict[str, Any],
) -> None:
    layer = type(module).__name__
    unsupported = {
        "attention dropout": dropout != 0.0,
        "sliding-window attention": sliding_window is not None,
        "logit soft-capping (softcap)": softcap is not None,
        "attention sinks (s_aux)": s_aux is not None,
        "a position bias": kwargs.get("position_bias") is not None,
    }
    for feature, used in unsupported.items():
        if used:
            raise NotImplementedError(
                f"attn_implementation='mla_ops' does not support {feature} ({layer}); {_SDPA_HINT}"
            )


_warned_output_attentions = False


# --- the attention function -----------------------------------------------------------------------


def mla_ops_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | torch.Tensor | None = None,
    max_length_k: int | torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface, computed by the ``mla`` ops.

    Args:
        module: the attention layer (``is_causal`` is read from it when not passed).
        query: ``[B, H, Sq, Dqk]``, bfloat16 or float16 (float32 only under autocast to one of them).
        key: ``[B, Hkv, Sk, Dqk]`` with ``H % Hkv == 0`` (GQA/MQA heads are repeated) and
            ``Sk >= Sq``: with a KV cache the queries are the last ``Sq`` tokens of the keys.
        value: ``[B, Hkv, Sk, Dv]``; ``Dv`` may differ from ``Dqk`` (DeepSeek-V3: 128 and 192) and
            ``value`` may be a strided view.
        attention_mask: what :func:`mla_ops_mask` returned: ``None``, or the 2-D padding mask
            ``[B, L]`` (true or 1 for real tokens). ``L < Sk`` (a static cache) ignores the keys past
            ``L``; ``L > Sk`` keeps the last ``Sk`` columns.
        scaling: the softmax scale; ``1/sqrt(Dqk)`` when ``None``.
        is_causal: ``False`` gives bidirectional attention over the real tokens.
        position_ids: ``[B, Sq]`` or ``[1, Sq]``; with no mask and no cached prefix, positions that
            restart split a row into packed sequences.
        cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k: packed sequences given directly
            (``[n+1]`` offsets into the ``B*Sq`` flattened tokens), as transformers passes them to
            FlashAttention. ``cu_seq_lens_k`` must equal ``cu_seq_lens_q`` (no cached prefix).
        dropout, sliding_window, softcap, s_aux: must be unused (0 or ``None``); they raise
            ``NotImplementedError`` otherwise.

    Returns:
        ``(attn_output, None)``: ``attn_output`` ``[B, Sq, H, Dv]`` in the compute dtype (0 at padding
        positions); attention weights are never materialised.

    Host synchronisation: none, except that packed sequences found through ``position_ids`` are
    counted on the host once per forward pass when running eagerly (see the module docstring).
    """
    global _warned_output_attentions
    _refuse_unsupported(module, dropout, sliding_window, softcap, s_aux, kwargs)
    if kwargs.get("output_attentions", False) and not _warned_output_attentions:
        _warned_output_attentions = True
        logger.warning("attn_implementation='mla_ops' does not return attention weights (output_attentions=True)")
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        raise RuntimeError(
            "attn_implementation='mla_ops' is forward-only (the mla ops have no backward): run the model under "
            f"torch.no_grad() or torch.inference_mode() (generate() does), or, to train, {_SDPA_HINT}"
        )
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            "attn_implementation='mla_ops' expects query [B, H, Sq, Dqk], key [B, Hkv, Sk, Dqk] and value "
            f"[B, Hkv, Sk, Dv]; got {tuple(query.shape)}, {tuple(key.shape)} and {tuple(value.shape)}"
        )
    batch, num_heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if key.shape[0] != batch or value.shape[:3] != key.shape[:3] or key.shape[3] != head_dim:
        raise ValueError(
            f"attn_implementation='mla_ops': query {tuple(query.shape)}, key {tuple(key.shape)} and value "
            f"{tuple(value.shape)} do not match ([B, H, Sq, Dqk], [B, Hkv, Sk, Dqk], [B, Hkv, Sk, Dv])"
        )
    if num_heads % kv_heads:
        raise ValueError(
            f"attn_implementation='mla_ops': {num_heads} query heads cannot share {kv_heads} key/value heads evenly"
        )

    mask = None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                f"attn_implementation='mla_ops' takes the 2-D padding mask [B, L], got a {attention_mask.dim()}-D "
                "mask; pass the tokenizer's attention_mask and let the model build its mask (a custom 4-D mask "
                f"is not supported: {_SDPA_HINT})"
            )
        mask = attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0
        if mask.shape[1] > kv_len:
            mask = mask[:, -kv_len:]
        elif mask.shape[1] < kv_len:  # a static cache: the slots past the mask hold no token yet
            kv_len = mask.shape[1]
            key, value = key[:, :, :kv_len], value[:, :, :kv_len]
    if kv_len < q_len:
        raise ValueError(
            f"attn_implementation='mla_ops': {q_len} queries but only {kv_len} keys; with a KV cache the queries "
            "are the last tokens of the keys"
        )
    prefix = kv_len - q_len
    call = _call_of(mask, position_ids, cu_seq_lens_q, cu_seq_lens_k, max_length_q, batch, q_len, kv_len, query.device)

    dtype = _compute_dtype(query)
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(head_dim)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)

    layout = _layout_for(call)
    q = _pack(query, layout.rows, 0, q_len, num_heads)
    k = _pack(key, layout.rows, prefix, q_len, num_heads)
    v = _pack(value, layout.rows, prefix, q_len, num_heads)
    if causal:
        out, lse = api.prefill(q, k, v, layout.cu_q, layout.max_q, scale)
    else:
        out, lse = api.prefill_context_chunk(q, k, v, layout.cu_q, layout.cu_q, layout.max_q, layout.max_q, scale)
    if prefix:
        k_p = _pack(key, layout.prefix_rows, 0, prefix, num_heads)
        v_p = _pack(value, layout.prefix_rows, 0, prefix, num_heads)
        out_p, lse_p = api.prefill_context_chunk(q, k_p, v_p, layout.cu_q, layout.cu_p, layout.max_q, prefix, scale)
        out, _ = api.merge_attn_states(out_p, lse_p, out, lse)
    return _unpack(out, layout, batch, q_len), None


# --- the mask function ----------------------------------------------------------------------------


def mla_ops_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """transformers' mask-function interface: the 2-D padding mask, or ``None``; never a 4-D mask.

    As for FlashAttention, the attention function needs only which tokens are real: it returns
    ``attention_mask[:, -kv_length:]`` (``[B, L]`` bool), or ``None`` when there is no padding mask.
    Causality and packed sequences are handled by the attention function itself; reading nothing
    back, this costs no host synchronisation.

    Raises ``NotImplementedError`` for mask patterns the ops cannot express (custom overlays of the
    causal mask, chunked attention), and ``ValueError`` when a cache holds slots that no mask says
    are empty (a static cache called without ``attention_mask``).
    """
    config = kwargs.get("config")
    if kwargs.get("use_vmap", False) or getattr(mask_function, "__name__", "") == "or_mask":
        # transformers sets use_vmap exactly when a model overlays its own mask function
        # (or_mask_function/and_mask_function), and combines block overlays with or_masks.
        raise NotImplementedError(
            "attn_implementation='mla_ops' supports causal (or bidirectional) attention with padding and packed "
            f"sequences only; this model overlays a custom mask pattern: {_SDPA_HINT}"
        )
    if getattr(config, "attention_chunk_size", None) is not None:
        raise NotImplementedError(f"attn_implementation='mla_ops' does not support chunked attention: {_SDPA_HINT}")
    if attention_mask is not None:
        return attention_mask[:, -kv_length:]
    if isinstance(q_offset, torch.Tensor) or kv_offset != 0 or kv_length != q_offset + q_length:
        raise ValueError(
            "attn_implementation='mla_ops' needs the 2-D attention_mask with this cache (a static or sliding "
            "cache has slots that hold no token yet); pass attention_mask= to the model (generate() does)"
        )
    return None


def register() -> None:
    """Register ``"mla_ops"`` with transformers (done on import; calling it again is harmless)."""
    AttentionInterface.register(NAME, mla_ops_attention_forward)
    AttentionMaskInterface.register(NAME, mla_ops_mask)


register()
