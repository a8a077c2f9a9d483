"""FLASHINFER-specific behaviour on a CUDA GPU, with the real library (``pytest -m gpu``).

The contract every backend keeps is checked for FLASHINFER by tests/test_backend_contract.py. Here: one
plan per batch with no host sync on planned calls, a captured graph that never plans and replays what
eager calls compute, and capture without ``mla_ops.plan_cuda_graph`` refused with the remedy. Each test
forces the process's FLASHINFER backend and is skipped, with the reason, when FlashInfer cannot serve
DeepSeek's dims here. The first call per dtype may wait for FlashInfer's just-in-time build (``python -m
mla_ops warmup`` does it ahead of time).
"""

from __future__ import annotations

import pytest
import torch
from utils import DEEPSEEK_DIMS, GraphBuffers, assert_attention_close, cu_seqlens_of, make_batch

import mla_ops
from mla_ops import DeviceCapability, PrefillBackendEnum, SelectorConfig

pytestmark = pytest.mark.gpu

DQK, DV = DEEPSEEK_DIMS
SCALE = mla_ops.default_softmax_scale(DQK)
BF16 = torch.bfloat16
CUDA = "cuda"


@pytest.fixture
def flashinfer():
    """The process's FLASHINFER backend, forced for the test."""
    backend = PrefillBackendEnum.FLASHINFER.backend()
    reasons = backend.reasons(DeviceCapability.of(torch.device(CUDA)), SelectorConfig(BF16))
    if reasons:
        pytest.skip(f"FLASHINFER cannot run here: {'; '.join(reasons)}")
    with mla_ops.prefill_backend("FLASHINFER"):
        yield backend
    mla_ops.release_cuda_graph_buffers()


def _chunks(context: list[int], parts: int, num_heads: int, seed: int) -> list[mla_ops.ContextChunk]:
    """Each sequence's context cut into ``parts`` chunks."""
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
    return chunks


def test_one_plan_per_batch_and_no_sync_on_planned_calls(flashinfer):
    b = make_batch([300, 17, 0, 1000], 16, DQK, DV, BF16, CUDA, seed=11)
    chunks = _chunks([500, 0, 64, 2000], 2, 16, seed=12)
    mla_ops.prefill(b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen)  # plans (reads the offsets: one sync)
    before = flashinfer.plan_count
    torch.cuda.set_sync_debug_mode("error")  # any host sync in the 60 planned calls raises
    try:
        results = [mla_ops.prefill(b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen) for _ in range(60)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert flashinfer.plan_count == before
    assert_attention_close(*results[-1], b.q, b.k, b.v, b.cu_seqlens, b.cu_seqlens, SCALE, causal=True)
    for _ in range(60):  # sixty layers with two context chunks: one plan per chunk, once
        mla_ops.prefill_with_context(b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen, chunks)
    assert flashinfer.plan_count == before + 2
    nb = make_batch([5, 900, 0, 40], 16, DQK, DV, BF16, CUDA, seed=13)
    for _ in range(60):
        out, lse = mla_ops.prefill(nb.q, nb.k, nb.v, nb.cu_seqlens, nb.max_seqlen)
    assert flashinfer.plan_count == before + 3
    assert_attention_close(out, lse, nb.q, nb.k, nb.v, nb.cu_seqlens, nb.cu_seqlens, SCALE, causal=True)


@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=["bf16", "fp16"])
def test_replayed_kernel_calls_give_run_s_results_bit_for_bit(flashinfer, dtype):
    # A plan's first eager call goes through the wrapper's run() and records its kernel call; the later
    # ones replay it (mla_ops.backends.flashinfer_replay). Both must write the same bits, on both paths,
    # with a strided v and with padding rows past the last sequence.
    b = make_batch([300, 17, 0, 1000], 16, DQK, DV, dtype, CUDA, strided_v=True, padding=5, seed=21)
    c = make_batch([64, 0, 9, 700], 16, DQK, DV, dtype, CUDA, seed=22)
    for call in (
        lambda: mla_ops.prefill(b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen),
        lambda: mla_ops.prefill_context_chunk(b.q, c.k, c.v, b.cu_seqlens, c.cu_seqlens, b.max_seqlen, c.max_seqlen),
    ):
        first = call()
        later = [call() for _ in range(3)]
        for out, lse in later:
            assert torch.equal(out[:1317].view(torch.int16), first[0][:1317].view(torch.int16))
            assert torch.equal(lse.view(torch.int32), first[1].view(torch.int32))
    plans = [plan for group in flashinfer._batches.values() for plan in group.plans.values()]
    # The trtllm-gen kernel (SM100, bf16) is a function call, not a wrapper's module call: nothing to replay.
    recorded = [plan for plan in plans if plan.wrapper is not None and plan.kernel != "trtllm-gen"]
    assert plans and all(plan.recorded and plan.replay is not None for plan in recorded)
    assert_attention_close(*later[-1], b.q, c.k, c.v, b.cu_seqlens, c.cu_seqlens, SCALE, causal=False)


def test_captured_graph_never_plans_and_replays_what_eager_calls_compute(flashinfer):
    bufs = GraphBuffers(16, DQK, DV, BF16, budget=2048, budget_k=4200, max_batch=6, seed=14)
    q, k, v, kc, vc, cu, cu_k = bufs.q, bufs.k, bufs.v, bufs.kc, bufs.vc, bufs.cu, bufs.cu_k
    # Zero-length sequences pad the batch to max_batch; the chunk has empty slices.
    batches = [
        ([100, 0, 700, 5, 0, 0], [300, 0, 2000, 0, 1, 0]),
        ([1, 17, 127, 1000, 0, 0], [4097, 1, 0, 17, 0, 0]),
        ([1024, 1024, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]),  # the whole budget; a chunk with no keys at all
        ([0, 0, 0, 0, 0, 0], [5, 0, 0, 0, 0, 0]),  # no tokens: every row is padding
    ]

    def load(lengths: list[int], context: list[int]) -> None:
        bufs.load(lengths, context)
        mla_ops.plan_cuda_graph(cu, cu_seqlens_k=[cu_k])

    def step():
        return (
            mla_ops.prefill(q, k, v, cu, bufs.budget),
            mla_ops.prefill_context_chunk(q, kc, vc, cu, cu_k, bufs.budget, bufs.budget_k),
        )

    load(*batches[0])
    step()  # the eager warm-up plans FlashInfer's graph wrappers
    torch.cuda.synchronize()
    plans = flashinfer.plan_count
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (out, lse), (out_c, lse_c) = step()
    assert flashinfer.plan_count == plans, "capture must not plan"

    for lengths, context in batches:
        load(lengths, context)
        graph.replay()
        torch.cuda.synchronize()
        n = sum(lengths)
        # Eager calls on copies of the offsets (not registered: the eager path) give the same rows.
        eager, eager_lse = mla_ops.prefill(q, k, v, cu.clone(), bufs.budget)
        eager_c, eager_lse_c = mla_ops.prefill_context_chunk(
            q, kc, vc, cu.clone(), cu_k.clone(), bufs.budget, bufs.budget_k
        )
        torch.testing.assert_close(out[:n], eager[:n])
        torch.testing.assert_close(lse[:, :n], eager_lse[:, :n])
        torch.testing.assert_close(out_c[:n], eager_c[:n])
        torch.testing.assert_close(lse_c[:, :n], eager_lse_c[:, :n])


def test_capture_without_plan_raises(flashinfer):
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


def test_hopper_keeps_fa3_where_blackwell_gets_the_trtllm_kernel(flashinfer):
    """FlashInfer's trtllm-gen DeepSeek kernel is the SM100 path only: on an SM90 device both paths plan fa3,
    whether or not the installed FlashInfer has ``trtllm_ragged_attention_deepseek``."""
    capability = DeviceCapability.of(torch.device(CUDA))
    if capability != DeviceCapability(9, 0):
        pytest.skip(f"checks an SM90 device; this one has compute capability {capability}")
    assert flashinfer.eager_kernel(capability, DQK, DV, BF16) == "fa3"
    assert flashinfer.describe(capability, SelectorConfig(BF16)).endswith("backend fa3 on SM90")
    b = make_batch([300, 17, 0], 16, DQK, DV, BF16, CUDA, seed=31)
    c = make_batch([64, 0, 5], 16, DQK, DV, BF16, CUDA, seed=32)
    mla_ops.prefill(b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen)
    mla_ops.prefill_context_chunk(b.q, c.k, c.v, b.cu_seqlens, c.cu_seqlens, b.max_seqlen, c.max_seqlen)
    plans = [plan for group in flashinfer._batches.values() for plan in group.plans.values()]
    assert plans and {plan.kernel for plan in plans if plan.wrapper is not None} == {"fa3"}
