"""GPU tests of the FLASHINFER backend through the public API (``mla_ops.prefill`` and friends).

Every test forces the backend with ``mla_ops.prefill_backend("FLASHINFER")`` and is skipped, with
the reason, when FlashInfer cannot be imported. The first test of each dtype waits for FlashInfer's
just-in-time build of its kernel (about 80 s on a bare machine; ``python -m mla_ops warmup`` does
it ahead of time). Dims are DeepSeek's (192, 128); bf16 throughout, plus one fp16 case.
"""

from __future__ import annotations

import pytest
import torch
from utils import DEEPSEEK_DIMS, assert_attention_close, cu_seqlens_of, make_batch

import mla_ops
from mla_ops.backends import flashinfer as fib

DQK, DV = DEEPSEEK_DIMS
SCALE = mla_ops.default_softmax_scale(DQK)
BF16 = torch.bfloat16
CUDA = "cuda"


@pytest.fixture(autouse=True)
def _flashinfer_selected():
    reason = fib.FlashInferBackend.unavailable_reason()
    if reason is not None:
        pytest.skip(f"FLASHINFER backend unavailable: {reason}")
    with mla_ops.prefill_backend("FLASHINFER"):
        yield
    mla_ops.release_cuda_graph_buffers()


LENGTHS = {
    "1": [1],
    "17": [17],
    "127": [127],
    "1000": [1000],
    "4097": [4097],
    "ragged_with_empty": [0, 17, 0, 1000, 1, 127, 0],
}

# (new-token lengths, this chunk's context lengths per sequence); zeros are empty slices.
CHUNKS = {
    "q1_k4097": ([1], [4097]),
    "q17_k1000": ([17], [1000]),
    "q127_k127": ([127], [127]),
    "q1000_k17": ([1000], [17]),
    "q4097_k1": ([4097], [1]),
    "ragged_with_empty": ([5, 0, 1000, 17, 1, 127], [0, 33, 4097, 0, 1, 500]),
    "all_empty": ([17, 5], [0, 0]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("case", list(LENGTHS))
def test_prefill_matches_reference(case: str, num_heads: int):
    lengths = LENGTHS[case]
    padding = 5 if len(lengths) > 1 else 0  # rows past cu_seqlens[-1], as under a token budget
    b = make_batch(lengths, num_heads, DQK, DV, BF16, CUDA, padding=padding, seed=len(lengths))
    out, lse = mla_ops.prefill(b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen)
    assert_attention_close(out, lse, b.q, b.k, b.v, b.cu_seqlens, b.cu_seqlens, SCALE, causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("case", list(CHUNKS))
def test_context_chunk_matches_reference(case: str, num_heads: int):
    q_lengths, k_lengths = CHUNKS[case]
    padding = 3 if len(q_lengths) > 1 else 0
    b = make_batch(q_lengths, num_heads, DQK, DV, BF16, CUDA, padding=padding, seed=1)
    c = make_batch(k_lengths, num_heads, DQK, DV, BF16, CUDA, seed=2)
    out, lse = mla_ops.prefill_context_chunk(b.q, c.k, c.v, b.cu_seqlens, c.cu_seqlens, b.max_seqlen, c.max_seqlen)
    assert_attention_close(out, lse, b.q, c.k, c.v, b.cu_seqlens, c.cu_seqlens, SCALE, causal=False)
    if not any(k_lengths):
        assert bool(torch.isneginf(lse).all()) and bool((out == 0).all())


def _split_context(context: list[int], parts: int, num_heads: int, seed: int):
    """Each sequence's context cut into ``parts`` chunks; returns the chunks and the whole context."""
    whole = make_batch(context, num_heads, DQK, DV, BF16, CUDA, seed=seed)
    bounds = whole.cu_seqlens.tolist()
    chunks = []
    for p in range(parts):
        ks, vs, lengths = [], [], []
        for b, n in enumerate(context):
            start, stop = bounds[b] + n * p // parts, bounds[b] + n * (p + 1) // parts
            ks.append(whole.k[start:stop])
            vs.append(whole.v[start:stop])
            lengths.append(stop - start)
        chunks.append(mla_ops.ContextChunk(torch.cat(ks), torch.cat(vs), cu_seqlens_of(lengths, CUDA), max(lengths)))
    return chunks, whole


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [16, 128])
def test_split_context_merge_equals_unsplit_attention(num_heads: int):
    lengths, context = [300, 0, 17, 1000, 1], [2000, 50, 0, 4097, 3]
    new = make_batch(lengths, num_heads, DQK, DV, BF16, CUDA, seed=5)
    chunks, whole = _split_context(context, 2, num_heads, seed=6)
    out, lse = mla_ops.prefill_with_context(new.q, new.k, new.v, new.cu_seqlens, new.max_seqlen, chunks)
    # The same attention in one piece: each sequence attends causally over [context ; new tokens].
    ctx_bounds, new_bounds = whole.cu_seqlens.tolist(), new.cu_seqlens.tolist()
    keys, values = [], []
    for b in range(len(lengths)):
        keys += [whole.k[ctx_bounds[b] : ctx_bounds[b + 1]], new.k[new_bounds[b] : new_bounds[b + 1]]]
        values += [whole.v[ctx_bounds[b] : ctx_bounds[b + 1]], new.v[new_bounds[b] : new_bounds[b + 1]]]
    cu_full = cu_seqlens_of([c + n for c, n in zip(context, lengths)], CUDA)
    # factor 3: each of the three partial outputs is rounded to bf16 before the merge. A wrong LSE
    # base or layout makes the merge weights wrong and misses this by orders of magnitude.
    assert_attention_close(
        out, lse, new.q, torch.cat(keys), torch.cat(values), new.cu_seqlens, cu_full, SCALE, causal=True, factor=3.0
    )


@pytest.mark.gpu
def test_strided_v_on_both_paths():
    b = make_batch([17, 0, 1000, 127], 16, DQK, DV, BF16, CUDA, strided_v=True, seed=7)
    c = make_batch([40, 3, 0, 900], 16, DQK, DV, BF16, CUDA, strided_v=True, seed=8)
    assert not b.v.is_contiguous() and not c.v.is_contiguous()
    out, lse = mla_ops.prefill(b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen)
    assert_attention_close(out, lse, b.q, b.k, b.v, b.cu_seqlens, b.cu_seqlens, SCALE, causal=True)
    out, lse = mla_ops.prefill_context_chunk(b.q, c.k, c.v, b.cu_seqlens, c.cu_seqlens, b.max_seqlen, c.max_seqlen)
    assert_attention_close(out, lse, b.q, c.k, c.v, b.cu_seqlens, c.cu_seqlens, SCALE, causal=False)


@pytest.mark.gpu
def test_fp16_both_paths():
    b = make_batch([0, 17, 1000, 1, 127], 16, DQK, DV, torch.float16, CUDA, padding=4, seed=9)
    c = make_batch([300, 0, 2000, 1, 5], 16, DQK, DV, torch.float16, CUDA, seed=10)
    out, lse = mla_ops.prefill(b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen)
    assert_attention_close(out, lse, b.q, b.k, b.v, b.cu_seqlens, b.cu_seqlens, SCALE, causal=True)
    out, lse = mla_ops.prefill_context_chunk(b.q, c.k, c.v, b.cu_seqlens, c.cu_seqlens, b.max_seqlen, c.max_seqlen)
    assert_attention_close(out, lse, b.q, c.k, c.v, b.cu_seqlens, c.cu_seqlens, SCALE, causal=False)


@pytest.mark.gpu
def test_one_plan_per_batch_and_no_sync_on_planned_calls():
    b = make_batch([300, 17, 0, 1000], 16, DQK, DV, BF16, CUDA, seed=11)
    chunks, _ = _split_context([500, 0, 64, 2000], 2, 16, seed=12)
    mla_ops.prefill(b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen)  # plans (reads the offsets: one sync)
    before = fib.plan_count()
    torch.cuda.set_sync_debug_mode("error")  # any host sync in the 60 planned calls raises
    try:
        results = [mla_ops.prefill(b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen) for _ in range(60)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert fib.plan_count() == before
    assert_attention_close(*results[-1], b.q, b.k, b.v, b.cu_seqlens, b.cu_seqlens, SCALE, causal=True)
    for _ in range(60):  # sixty layers with two context chunks: one plan per chunk, once
        mla_ops.prefill_with_context(b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen, chunks)
    assert fib.plan_count() == before + 2
    nb = make_batch([5, 900, 0, 40], 16, DQK, DV, BF16, CUDA, seed=13)
    for _ in range(60):
        out, lse = mla_ops.prefill(nb.q, nb.k, nb.v, nb.cu_seqlens, nb.max_seqlen)
    assert fib.plan_count() == before + 3
    assert_attention_close(out, lse, nb.q, nb.k, nb.v, nb.cu_seqlens, nb.cu_seqlens, SCALE, causal=True)


@pytest.mark.gpu
def test_cuda_graph_replay_after_lengths_change():
    num_heads, budget, budget_k, max_batch = 16, 2048, 4200, 6
    torch.manual_seed(14)
    q = torch.empty(budget, num_heads, DQK, dtype=BF16, device=CUDA)
    k, v = torch.empty_like(q), torch.empty(budget, num_heads, DV, dtype=BF16, device=CUDA)
    kc = torch.empty(budget_k, num_heads, DQK, dtype=BF16, device=CUDA)
    vc = torch.empty(budget_k, num_heads, DV, dtype=BF16, device=CUDA)
    cu = torch.zeros(max_batch + 1, dtype=torch.int32, device=CUDA)
    cu_k = torch.zeros(max_batch + 1, dtype=torch.int32, device=CUDA)
    # Zero-length sequences pad the batch to max_batch; the chunk has empty slices.
    batches = [
        ([100, 0, 700, 5, 0, 0], [300, 0, 2000, 0, 1, 0]),
        ([1, 17, 127, 1000, 0, 0], [4097, 1, 0, 17, 0, 0]),
        ([1024, 1024, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]),  # the whole budget; a chunk with no keys at all
        ([0, 0, 0, 0, 0, 0], [5, 0, 0, 0, 0, 0]),  # no tokens: every row is padding
    ]

    def load(lengths: list[int], context: list[int]) -> None:
        for t in (q, k, v, kc, vc):
            t.copy_(torch.randn(t.shape, device=CUDA))
        cu.copy_(cu_seqlens_of(lengths, CUDA))
        cu_k.copy_(cu_seqlens_of(context, CUDA))
        mla_ops.plan_cuda_graph(cu, cu_seqlens_k=[cu_k])

    def step():
        return (
            mla_ops.prefill(q, k, v, cu, budget),
            mla_ops.prefill_context_chunk(q, kc, vc, cu, cu_k, budget, budget_k),
        )

    load(*batches[0])
    step()  # the eager warm-up plans FlashInfer's graph wrappers
    torch.cuda.synchronize()
    plans = fib.plan_count()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (out, lse), (out_c, lse_c) = step()
    assert fib.plan_count() == plans, "capture must not plan"

    for lengths, context in batches:
        load(lengths, context)
        graph.replay()
        torch.cuda.synchronize()
        n = sum(lengths)
        assert_attention_close(out, lse, q, k, v, cu, cu, SCALE, causal=True)
        assert_attention_close(out_c, lse_c, q, kc, vc, cu, cu_k, SCALE, causal=False)
        # Eager calls on copies of the offsets (not registered: the eager path) give the same rows.
        eager, eager_lse = mla_ops.prefill(q, k, v, cu.clone(), budget)
        eager_c, eager_lse_c = mla_ops.prefill_context_chunk(q, kc, vc, cu.clone(), cu_k.clone(), budget, budget_k)
        torch.testing.assert_close(out[:n], eager[:n])
        torch.testing.assert_close(lse[:, :n], eager_lse[:, :n])
        torch.testing.assert_close(out_c[:n], eager_c[:n])
        torch.testing.assert_close(lse_c[:, :n], eager_lse_c[:, :n])


@pytest.mark.gpu
def test_capture_without_plan_raises():
    b = make_batch([64, 0, 30], 16, DQK, DV, BF16, CUDA, padding=10, seed=15)
    mla_ops.prefill(b.q, b.k, b.v, b.cu_seqlens, 64)  # eager: fine, and warms the selector
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with (
        pytest.raises(RuntimeError, match=r"not registered.*mla_ops\.plan_cuda_graph\(.*warm-up"),
        torch.cuda.graph(graph),
    ):
        mla_ops.prefill(b.q, b.k, b.v, b.cu_seqlens, 64)
    mla_ops.plan_cuda_graph(b.cu_seqlens)  # registered, but no eager warm-up call yet
    graph = torch.cuda.CUDAGraph()
    with (
        pytest.raises(RuntimeError, match=r"no FlashInfer graph wrapper is planned.*warm-up"),
        torch.cuda.graph(graph),
    ):
        mla_ops.prefill(b.q, b.k, b.v, b.cu_seqlens, 64)
