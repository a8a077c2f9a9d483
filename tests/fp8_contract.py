"""The fp8 ops' accuracy contract, and the inputs it is checked on; shared by the CPU and GPU tests.

Modelled on FlashAttention-3's fp8 tests: against float64 attention over the *dequantised* inputs, an fp8 op's
largest error is at most 3 times that of PyTorch computing the same attention the way an fp8 kernel does (bf16
inputs and products, the probabilities rounded to e4m3 for ``P @ V``), plus twice the bf16 rounding of the
reference. README states it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from utils import cu_seqlens_of, dense_attention

import mla_ops

#: The contract's factor on PyTorch's own error (FlashAttention-3 uses 3 for fp8, 2 for bf16).
ERROR_MULTIPLE = 3


@dataclass
class Fp8Batch:
    """Quantised inputs of one call, the dequantised ones, and the bf16 ones they came from."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    descales: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    dequantised: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    bf16: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def deepseek_like(num_tokens: int, num_heads: int, dim: int, gen: torch.Generator, outliers: bool) -> torch.Tensor:
    """float32 ``[T, H, D]`` activations: N(0, 1), and with ``outliers`` a few channels four to eight times
    larger, as projections of DeepSeek-style hidden states have."""
    x = torch.randn(num_tokens, num_heads, dim, generator=gen)
    if outliers:
        channels = torch.randperm(dim, generator=gen)[:4]
        x[..., channels] *= torch.tensor([4.0, 5.0, 6.0, 8.0])
    return x


def fp8_batch(
    lengths: list[int],
    key_lengths: list[int] | None,
    num_heads: int,
    dims: tuple[int, int] = (192, 128),
    *,
    padding: int = 0,
    per_head: bool = True,
    outliers: bool = False,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> Fp8Batch:
    """A ragged batch quantised by :func:`mla_ops.quantize_fp8`: new tokens (``key_lengths`` None) or a context
    chunk of ``key_lengths``; ``v`` is a strided view of a wider ``kv``, ``padding`` rows follow the queries."""
    gen = torch.Generator().manual_seed(seed)
    dqk, dv = dims
    keys = lengths if key_lengths is None else key_lengths
    tq, tk = sum(lengths) + padding, sum(keys) + (padding if key_lengths is None else 0)
    q = deepseek_like(tq, num_heads, dqk, gen, outliers).to(device=device, dtype=torch.bfloat16)
    k = deepseek_like(tk, num_heads, dqk, gen, outliers).to(device=device, dtype=torch.bfloat16)
    v = deepseek_like(tk, num_heads, dqk + dv, gen, False).to(device=device, dtype=torch.bfloat16)[..., dqk:]
    quantised = [mla_ops.quantize_fp8(x, per_head=per_head) for x in (q, k, v)]
    # v as a strided view, as MLA's kv_b_proj output is split: quantise into a wider buffer and take the view.
    v8_wide = torch.zeros(tk, num_heads, dqk + dv, dtype=torch.float8_e4m3fn, device=device)
    v8_wide[..., dqk:] = quantised[2][0]
    (q8, dq), (k8, dk), (_, dvs) = quantised
    v8 = v8_wide[..., dqk:]
    dequantised = tuple(
        x.float() * d.reshape(-1, 1) if d.dim() else x.float() * d for x, d in ((q8, dq), (k8, dk), (v8, dvs))
    )
    cu_q = cu_seqlens_of(lengths, device)
    cu_k = cu_q if key_lengths is None else cu_seqlens_of(key_lengths, device)
    return Fp8Batch(
        q8, k8, v8, (dq, dk, dvs), dequantised, (q, k, v), cu_q, cu_k, max(lengths, default=0), max(keys, default=0)
    )


def run_fp8(batch: Fp8Batch, causal: bool, scale: float, out_dtype: torch.dtype = torch.bfloat16):
    """The fp8 op of the path on ``batch``, through the Python API."""
    if causal:
        return mla_ops.prefill_fp8(
            batch.q, batch.k, batch.v, batch.cu_seqlens_q, batch.max_seqlen_q, *batch.descales, scale, out_dtype
        )
    return mla_ops.prefill_context_chunk_fp8(
        batch.q, batch.k, batch.v, batch.cu_seqlens_q, batch.cu_seqlens_k, batch.max_seqlen_q, batch.max_seqlen_k,
        *batch.descales, scale, out_dtype,
    )  # fmt: skip


def contract_batch(lengths, key_lengths, heads: int, per_head: bool, outliers: bool, device: str):
    """``(batch, causal)`` of a GPU contract case: ``fp8_batch`` with 7 padding rows, the lengths quartered at
    H=128 (the float64 reference's memory and time, not a kernel's limit)."""
    if heads == 128:
        lengths = [n // 4 for n in lengths]
        key_lengths = None if key_lengths is None else [n // 4 for n in key_lengths]
    causal = key_lengths is None
    batch = fp8_batch(lengths, key_lengths, heads, padding=7, per_head=per_head, outliers=outliers, device=device)
    return batch, causal


def fp8_call(batch: Fp8Batch, causal: bool, scale: float):
    """``(VarlenCall, Fp8Scales)`` of ``batch`` for a backend's or kernel's ``attention_fp8``: a per-tensor factor
    as a stride-0 ``[H]`` view, as the fp8 ops pass it; bf16 output."""
    from mla_ops.backends.base import Fp8Scales, VarlenCall

    heads = batch.q.shape[1]
    scales = Fp8Scales(*(d.reshape(-1).expand(heads) for d in batch.descales), torch.bfloat16)
    call = VarlenCall(
        batch.q, batch.k, batch.v, batch.cu_seqlens_q, batch.cu_seqlens_k, batch.max_seqlen_q, batch.max_seqlen_k,
        scale, causal,
    )  # fmt: skip
    return call, scales


def _rounded_probability_attention(q, k, v, cu_q, cu_k, scale: float, causal: bool) -> torch.Tensor:
    """PyTorch's attention as an fp8 kernel computes it: bf16 inputs and products, fp32 softmax, the
    probabilities rounded to e4m3 for ``P @ V`` (FlashAttention-3's reference with ``intermediate_dtype``)."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64, device=q.device)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for b in range(len(bq) - 1):
        q0, q1, k0, k1 = bq[b], bq[b + 1], bk[b], bk[b + 1]
        if q1 == q0 or k1 == k0:
            continue
        qq, kk, vv = (x.bfloat16().transpose(0, 1) for x in (q[q0:q1], k[k0:k1], v[k0:k1]))
        s = (qq @ kk.transpose(1, 2)).float() * scale
        if causal:
            lq, lk = q1 - q0, k1 - k0
            visible = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)
            s = s.masked_fill(~visible, -math.inf)
        p = torch.nan_to_num(torch.softmax(s, dim=-1)).to(torch.float8_e4m3fn).to(torch.bfloat16)
        out[q0:q1] = (p @ vv).transpose(0, 1).double()
    return out


def contract_errors(batch: Fp8Batch, out: torch.Tensor, causal: bool, scale: float) -> tuple[float, float]:
    """``(error, bound)`` of the valid rows of ``out``: the largest error against float64 attention over the
    dequantised inputs, and what the contract allows (see the module docstring). Both references are computed on
    the batch's device (a GPU's float64 keeps long sequences quick)."""
    dq, dk, dv = batch.dequantised
    cu_q, cu_k = batch.cu_seqlens_q, batch.cu_seqlens_k
    rows = int(cu_q[-1])
    reference, _ = dense_attention(dq, dk, dv, cu_q, cu_k, scale, causal)
    torch_fp8 = _rounded_probability_attention(dq, dk, dv, cu_q, cu_k, scale, causal)
    reference, torch_fp8 = reference[:rows], torch_fp8[:rows]
    error = (out[:rows].double() - reference).abs().max().item()
    torch_error = (torch_fp8 - reference).abs().max().item()
    atol = 2 * (reference.bfloat16().double() + 0.3 - 0.3 - reference).abs().max().item()
    return error, ERROR_MULTIPLE * torch_error + atol
