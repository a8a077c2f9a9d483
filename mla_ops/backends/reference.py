"""REFERENCE: plain PyTorch attention with fp32 accumulation.

This is the CPU path of every op and the ground truth of the tests. It reads ``cu_seqlens`` on the
host, so on CUDA it synchronises and cannot be captured in a CUDA graph; use it there only to debug.
Design: docs/design/backends.md.
"""

from __future__ import annotations

import math

import torch

from ..meta.checks import check_cu_seqlens_values
from ..runtime.capture import is_capturing
from ..specs import FP8_DTYPE, SUPPORTED_DTYPES, DeviceCapability, SelectorConfig
from .base import Fp8Scales, MergeCall, MergeCheck, PrefillBackend, VarlenCall

_CHUNK = "mla.prefill_context_chunk"
_LN2 = math.log(2.0)

# Scores of one block of query rows are materialised in fp32; this bounds that block's size.
_MAX_SCORE_ELEMENTS = 1 << 26


def _host_bounds(cu_seqlens: torch.Tensor) -> list[int]:
    if cu_seqlens.is_cuda and is_capturing():
        raise RuntimeError(
            "the REFERENCE MLA prefill backend reads cu_seqlens on the host and cannot run inside CUDA "
            "graph capture; select a CUDA backend (TRITON, FLASH_ATTN or FLASHINFER) for captured graphs"
        )
    return cu_seqlens.tolist()


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged attention computed with fp32 accumulation.

    Args:
        q: ``[Tq, H, Dqk]``, bf16 or fp16, any strides.
        k: ``[Tk, H, Dqk]``, same dtype.
        v: ``[Tk, H, Dv]``, same dtype.
        cu_seqlens_q: int32 ``[B+1]`` offsets of the sequences in ``q``.
        cu_seqlens_k: int32 ``[B+1]`` offsets of the sequences in ``k``/``v``.
        softmax_scale: multiplier of ``q @ k^T`` before the softmax.
        causal: mask key ``j`` from query ``i`` when ``j > i + (len_k - len_q)``: bottom-right
            alignment, which for the self-attention of new tokens (``len_k == len_q``) is plain
            causal masking.

    Returns:
        ``out`` ``[Tq, H, Dv]`` in the dtype of ``q`` and ``lse`` float32 ``[H, Tq]`` (natural log).
        Rows with no key to attend to (an empty chunk, or padding past ``cu_seqlens_q[-1]``) get
        ``out = 0`` and ``lse = -inf``.
    """
    num_tokens, num_heads, _ = q.shape
    out = torch.zeros(num_tokens, num_heads, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full((num_heads, num_tokens), -math.inf, dtype=torch.float32, device=q.device)
    bounds_q = _host_bounds(cu_seqlens_q)
    bounds_k = bounds_q if cu_seqlens_k is cu_seqlens_q else _host_bounds(cu_seqlens_k)
    for b in range(len(bounds_q) - 1):
        q0, q1 = bounds_q[b], bounds_q[b + 1]
        k0, k1 = bounds_k[b], bounds_k[b + 1]
        len_q, len_k = q1 - q0, k1 - k0
        if len_q == 0 or len_k == 0:
            continue
        keys = k[k0:k1].float().transpose(0, 1)  # [H, len_k, Dqk]
        values = v[k0:k1].float().transpose(0, 1)  # [H, len_k, Dv]
        rows = max(1, _MAX_SCORE_ELEMENTS // (num_heads * len_k))
        for r0 in range(0, len_q, rows):
            r1 = min(len_q, r0 + rows)
            queries = q[q0 + r0 : q0 + r1].float().transpose(0, 1)  # [H, r, Dqk]
            scores = torch.matmul(queries, keys.transpose(1, 2)) * softmax_scale
            if causal:
                i = torch.arange(r0, r1, device=q.device)[:, None]
                j = torch.arange(len_k, device=q.device)[None, :]
                scores.masked_fill_(j > i + (len_k - len_q), -math.inf)
            row_lse = torch.logsumexp(scores, dim=-1)  # [H, r]
            # A fully masked row has lse -inf; shifting by 0 there keeps exp() at 0 instead of NaN.
            probs = torch.exp(scores - torch.where(torch.isinf(row_lse), 0.0, row_lse)[..., None])
            out[q0 + r0 : q0 + r1] = torch.matmul(probs, values).transpose(0, 1).to(q.dtype)
            lse[:, q0 + r0 : q0 + r1] = row_lse
    return out, lse


def merge_attn_states_reference(
    call: MergeCall, *, check: MergeCheck | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results (:class:`~mla_ops.backends.base.MergeCall`) through their
    log-sum-exp, in fp32. ``-inf`` and ``+inf`` LSEs both mean "this side attended to no key" and give it zero
    weight; a base-2 side is converted (``lse * ln 2``) first. ``check``, when given, is called with the four
    tensors first (it raises for inputs it refuses), as :func:`mla_ops.kernels.merge.merge_attn_states_triton`
    takes it.

    Returns:
        ``out`` ``[T, H, Dv]`` in the dtype of ``prefix_out`` and ``lse`` float32 ``[H, T]``. When
        both sides are empty the row is ``out = 0``, ``lse = -inf``: never NaN. A NaN LSE on either
        side makes the row NaN in ``out`` and ``lse``.
    """
    prefix_out, prefix_lse, suffix_out, suffix_lse, prefix_lse_base2, suffix_lse_base2 = call
    if check is not None:
        check(prefix_out, prefix_lse, suffix_out, suffix_lse)
    if prefix_lse_base2:
        prefix_lse = prefix_lse * _LN2
    if suffix_lse_base2:
        suffix_lse = suffix_lse * _LN2
    neg_inf = torch.tensor(-math.inf, dtype=torch.float32, device=prefix_lse.device)
    a = torch.where(torch.isposinf(prefix_lse), neg_inf, prefix_lse.float())
    b = torch.where(torch.isposinf(suffix_lse), neg_inf, suffix_lse.float())
    m = torch.maximum(a, b)  # NaN if either side is NaN, and it stays NaN through every step below
    m = torch.where(torch.isneginf(m), 0.0, m)
    wa = torch.exp(a - m)
    wb = torch.exp(b - m)
    total = wa + wb
    lse = torch.log(total) + m
    # [H, T] -> [T, H, 1]. A side of weight exactly 0 is dropped, not scaled (its output may hold
    # anything); a NaN weight is kept, so that a NaN in either LSE makes the row NaN, never a valid 0.
    unit = torch.where(total == 0, 1.0, total)
    wa_t = (wa / unit).t().unsqueeze(-1)
    wb_t = (wb / unit).t().unsqueeze(-1)
    merged = torch.where(wa_t == 0, 0.0, prefix_out.float() * wa_t) + torch.where(
        wb_t == 0, 0.0, suffix_out.float() * wb_t
    )
    return merged.to(prefix_out.dtype).contiguous(), lse.contiguous()


class ReferenceBackend(PrefillBackend):
    """PyTorch math with fp32 accumulation; valid on every device, fast on none."""

    name = "REFERENCE"
    dtypes = (*SUPPORTED_DTYPES, FP8_DTYPE)
    runs_on_cpu = True
    # Each sequence is computed alone, in blocks of rows sized by its own length and the heads only.
    batch_invariant = True

    def capability_reasons(self, capability: DeviceCapability) -> list[str]:
        return []

    def describe(self, capability: DeviceCapability | None, config: SelectorConfig) -> str:
        return "PyTorch matmul/logsumexp, fp32 accumulation (host-synchronising, not capturable)"

    def attention(self, call: VarlenCall) -> tuple[torch.Tensor, torch.Tensor]:
        _check_offsets(call, "mla.prefill" if call.causal else _CHUNK)
        q, k, v, cu_seqlens_q, cu_seqlens_k, _, _, softmax_scale, causal = call
        return attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)

    def attention_fp8(self, call: VarlenCall, scales: Fp8Scales) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantise ``q``, ``k`` and ``v`` to float32 with their factors, then :func:`attention_reference`."""
        _check_offsets(call, "mla.prefill_fp8" if call.causal else "mla.prefill_context_chunk_fp8")
        q, k, v, cu_seqlens_q, cu_seqlens_k, _, _, softmax_scale, causal = call
        q, k, v = (x.float() * d[:, None] for x, d in zip((q, k, v), scales[:3]))
        out, lse = attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
        return out.to(scales.out_dtype), lse


def _check_offsets(call: VarlenCall, op: str) -> None:
    """Check the call's offsets' values (read on the host), naming ``op`` and the arguments as the op does."""
    if call.causal:
        check_cu_seqlens_values(op, call.cu_seqlens_q, call.q.shape[0], call.max_seqlen_q, "cu_seqlens")
    else:
        check_cu_seqlens_values(op, call.cu_seqlens_q, call.q.shape[0], call.max_seqlen_q, "cu_seqlens_q")
        check_cu_seqlens_values(op, call.cu_seqlens_k, call.k.shape[0], call.max_seqlen_k, "cu_seqlens_k")
