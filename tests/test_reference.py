"""The CPU path (REFERENCE) against independent float64 math, the merge rules, and split invariance."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from utils import assert_attention_close, cu_seqlens_of, dense_attention, make_batch, make_qkv

import mla_ops

DTYPES = [torch.bfloat16, torch.float16]
DIMS = [(192, 128), (64, 64), (128, 128)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("lengths", [[1], [17], [5, 0, 33, 1], [0, 0]])
def test_prefill_matches_float64(dtype, dims, lengths) -> None:
    dqk, dv = dims
    b = make_batch(lengths, 3, dqk, dv, dtype, strided_v=True, padding=2)
    out, lse = mla_ops.prefill(b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen)
    assert_attention_close(out, lse, b.q, b.k, b.v, b.cu_seqlens, b.cu_seqlens, dqk**-0.5, causal=True)


def test_reference_is_close_to_float64_in_absolute_terms() -> None:
    # The tolerance helper compares against fp32; check the fp32-accumulating reference against fp64.
    b = make_batch([40, 7], 4, 192, 128, torch.bfloat16, seed=3)
    out, lse = mla_ops.prefill(b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen, 0.1)
    ref_out, ref_lse = dense_attention(b.q, b.k, b.v, b.cu_seqlens, b.cu_seqlens, 0.1, True)
    # Rounding the output to bf16 is the only large error: half an ulp of the output's magnitude.
    assert (out.double() - ref_out).abs().max() <= 2**-8 * ref_out.abs().max()
    assert (lse.double() - ref_lse).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("context", [[3, 0, 9], [0, 0, 0], [12, 5, 1]])
def test_context_chunk_matches_float64(dtype, context) -> None:
    b = make_batch([4, 6, 0], 2, 192, 128, dtype)
    _, k_c, v_c = make_qkv(sum(context), 2, 192, 128, dtype)
    cu_k = cu_seqlens_of(context)
    out, lse = mla_ops.prefill_context_chunk(b.q, k_c, v_c, b.cu_seqlens, cu_k, b.max_seqlen, max(context))
    assert_attention_close(out, lse, b.q, k_c, v_c, b.cu_seqlens, cu_k, 192**-0.5, causal=False)


def test_empty_chunk_rows_are_zero_with_lse_minus_inf() -> None:
    b = make_batch([3, 2], 2, 192, 128, torch.bfloat16)
    _, k_c, v_c = make_qkv(4, 2, 192, 128, torch.bfloat16)
    out, lse = mla_ops.prefill_context_chunk(b.q, k_c, v_c, b.cu_seqlens, cu_seqlens_of([0, 4]), 3, 4)
    assert torch.all(out[:3] == 0)
    assert torch.all(torch.isneginf(lse[:, :3]))
    assert torch.all(torch.isfinite(lse[:, 3:]))


# --- merge ------------------------------------------------------------------------------------------

INF = math.inf


def _merge_case(lse_a: float, lse_b: float, out_a: float = 1.0, out_b: float = 3.0):
    shape = (1, 1, 4)
    return (
        torch.full(shape, out_a, dtype=torch.bfloat16),
        torch.tensor([[lse_a]], dtype=torch.float32),
        torch.full(shape, out_b, dtype=torch.bfloat16),
        torch.tensor([[lse_b]], dtype=torch.float32),
    )


@pytest.mark.parametrize(
    ("lse_a", "lse_b", "want_out", "want_lse"),
    [
        (-INF, 0.0, 3.0, 0.0),
        (0.0, -INF, 1.0, 0.0),
        (INF, 0.0, 3.0, 0.0),  # +inf from a kernel means "no keys", exactly like -inf
        (0.0, INF, 1.0, 0.0),
        (-INF, -INF, 0.0, -INF),
        (INF, INF, 0.0, -INF),
        (INF, -INF, 0.0, -INF),
        (0.0, 0.0, 2.0, math.log(2.0)),
        (math.log(3.0), 0.0, 1.5, math.log(4.0)),
    ],
)
def test_merge_rules(lse_a, lse_b, want_out, want_lse) -> None:
    out, lse = mla_ops.merge_attn_states(*_merge_case(lse_a, lse_b))
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.float(), torch.full((1, 1, 4), want_out), rtol=0, atol=2e-2)
    if math.isinf(want_lse):
        assert lse.item() == want_lse
    else:
        assert lse.item() == pytest.approx(want_lse, abs=1e-6)


def test_merge_ignores_nan_output_of_an_empty_side() -> None:
    out, lse = mla_ops.merge_attn_states(*_merge_case(-INF, 0.5, out_a=math.nan))
    assert torch.all(out.float() == 3.0) and lse.item() == pytest.approx(0.5)
    out, lse = mla_ops.merge_attn_states(*_merge_case(INF, INF, out_a=math.nan, out_b=math.nan))
    assert torch.all(out == 0) and lse.item() == -INF


def test_merge_is_symmetric_and_accurate() -> None:
    gen = torch.Generator().manual_seed(1)
    a_out, b_out = (torch.randn(9, 3, 128, generator=gen).bfloat16() for _ in range(2))
    a_lse, b_lse = (torch.randn(3, 9, generator=gen) * 4 for _ in range(2))
    out_ab, lse_ab = mla_ops.merge_attn_states(a_out, a_lse, b_out, b_lse)
    out_ba, lse_ba = mla_ops.merge_attn_states(b_out, b_lse, a_out, a_lse)
    torch.testing.assert_close(lse_ab, lse_ba)
    torch.testing.assert_close(out_ab, out_ba)
    wa = torch.exp(a_lse.double()).t()[..., None]
    wb = torch.exp(b_lse.double()).t()[..., None]
    want = (a_out.double() * wa + b_out.double() * wb) / (wa + wb)
    assert (out_ab.double() - want).abs().max() <= 2**-8 * want.abs().max()
    torch.testing.assert_close(lse_ab.double(), torch.logaddexp(a_lse.double(), b_lse.double()))


# --- split-context invariance -----------------------------------------------------------------------


def _split_context(context_lengths, num_chunks, heads, dqk, dv, dtype, seed):
    """Context K/V per sequence, cut into ``num_chunks`` chunks (later chunks may be empty)."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [make_qkv(n, heads, dqk, dv, dtype, generator=gen)[1:] for n in context_lengths]
    chunks = []
    for c in range(num_chunks):
        ks, vs, lengths = [], [], []
        for (k, v), n in zip(per_seq, context_lengths):
            lo, hi = n * c // num_chunks, n * (c + 1) // num_chunks
            ks.append(k[lo:hi])
            vs.append(v[lo:hi])
            lengths.append(hi - lo)
        chunks.append(mla_ops.ContextChunk(torch.cat(ks), torch.cat(vs), cu_seqlens_of(lengths), max(lengths)))
    return per_seq, chunks


def _full_attention(b, per_seq, scale):
    """Causal attention of the new tokens over [context ; new] in float64, sequence by sequence."""
    outs, lses = [], []
    bounds = b.cu_seqlens.tolist()
    for i, (k_c, v_c) in enumerate(per_seq):
        q0, q1 = bounds[i], bounds[i + 1]
        k = torch.cat([k_c, b.k[q0:q1]])
        v = torch.cat([v_c, b.v[q0:q1]])
        cu_q, cu_k = cu_seqlens_of([q1 - q0]), cu_seqlens_of([k.shape[0]])
        out, lse = dense_attention(b.q[q0:q1], k, v, cu_q, cu_k, scale, causal=True)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


@pytest.mark.parametrize("num_chunks", [1, 2, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_split_context_equals_unsplit_attention(num_chunks, dtype) -> None:
    b = make_batch([7, 1, 0, 12], 2, 192, 128, dtype, strided_v=True, seed=5)
    context_lengths = [9, 0, 4, 2]  # the second sequence has no context: every chunk is empty for it
    per_seq, chunks = _split_context(context_lengths, num_chunks, 2, 192, 128, dtype, seed=6)
    out, lse = mla_ops.prefill_with_context(b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen, chunks)
    want_out, want_lse = _full_attention(b, per_seq, 192**-0.5)
    # Each merge rounds the partial output to the dtype once more; allow that many output ulps.
    ulps = (num_chunks + 1) * torch.finfo(dtype).eps
    assert (out.double() - want_out).abs().max() <= ulps * want_out.abs().max()
    assert (lse.double() - want_lse).abs().max() < 1e-5


# --- fuzzing ----------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=5),
    context=st.lists(st.integers(0, 10), min_size=5, max_size=5),
    heads=st.integers(1, 3),
    dims=st.sampled_from(DIMS),
    dtype=st.sampled_from(DTYPES),
    padding=st.integers(0, 3),
    strided=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fuzz_ragged_batches(lengths, context, heads, dims, dtype, padding, strided, seed) -> None:
    dqk, dv = dims
    b = make_batch(lengths, heads, dqk, dv, dtype, strided_v=strided, padding=padding, seed=seed)
    max_seqlen = b.max_seqlen + seed % 3  # an upper bound is legal
    out, lse = mla_ops.prefill(b.q, b.k, b.v, b.cu_seqlens, max_seqlen)
    assert_attention_close(out, lse, b.q, b.k, b.v, b.cu_seqlens, b.cu_seqlens, dqk**-0.5, causal=True)
    context = context[: len(lengths)]
    _, k_c, v_c = make_qkv(sum(context), heads, dqk, dv, dtype, generator=torch.Generator().manual_seed(seed + 1))
    cu_k = cu_seqlens_of(context)
    out, lse = mla_ops.prefill_context_chunk(b.q, k_c, v_c, b.cu_seqlens, cu_k, max_seqlen, max(context))
    assert_attention_close(out, lse, b.q, k_c, v_c, b.cu_seqlens, cu_k, dqk**-0.5, causal=False)
