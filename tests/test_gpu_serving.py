"""Serving robustness on a GPU, for every CUDA backend: inference-only ops, NaN through the Triton
merge, and packed context under torch.compile (one graph for any number of chunks)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from utils import cu_seqlens_of

import mla_ops
from mla_ops.cli.demo import attention_fp64
from mla_ops.model import MLAAttention, MLAConfig, pack_context, random_batch
from mla_ops.selector import validate_backend
from mla_ops.specs import DeviceCapability, MLADimensions, SelectorConfig

pytestmark = pytest.mark.gpu

BACKENDS = ["TRITON", "FLASH_ATTN", "FLASHINFER"]


def _require(name: str) -> None:
    config = SelectorConfig(torch.bfloat16, MLADimensions(128, 64, 128))
    _, reasons = validate_backend(mla_ops.PrefillBackendEnum[name], DeviceCapability.of(torch.device("cuda")), config)
    if reasons:
        pytest.skip(f"{name} cannot run here: {reasons}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_ops_refuse_autograd_on_cuda(backend: str) -> None:
    _require(backend)
    cu = cu_seqlens_of([5, 9], "cuda")
    q = torch.randn(14, 4, 192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(14, 4, 192, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(14, 4, 128, device="cuda", dtype=torch.bfloat16)
    with mla_ops.prefill_backend(backend):
        with pytest.raises(RuntimeError, match=r"mla\.prefill is inference-only .* q requires grad"):
            mla_ops.prefill(q, k, v, cu, 9)
        with pytest.raises(RuntimeError, match=r"mla\.prefill_context_chunk is inference-only"):
            mla_ops.prefill_context_chunk(q, k, v, cu, cu, 9, 9)
        with torch.no_grad():
            out, _ = mla_ops.prefill(q, k, v, cu, 9)
    assert out.shape == (14, 4, 128)


def test_the_cuda_merge_keeps_nan() -> None:
    gen = torch.Generator().manual_seed(0)
    prefix, suffix = (torch.randn(8, 4, 128, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    prefix_lse, suffix_lse = (torch.randn(4, 8, generator=gen).cuda() for _ in range(2))
    prefix_lse[1, 2] = math.nan
    out, lse = mla_ops.merge_attn_states(prefix, prefix_lse, suffix, suffix_lse)
    assert torch.isnan(lse[1, 2]) and torch.isnan(out[2, 1]).all()
    keep = torch.ones_like(lse, dtype=torch.bool)
    keep[1, 2] = False
    assert not torch.isnan(lse[keep]).any()


@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_packed_context_compiles_once_on_cuda(backend: str) -> None:
    _require(backend)
    torch.manual_seed(0)
    layer = MLAAttention(MLAConfig(hidden_size=512, num_heads=16), device="cuda", dtype=torch.bfloat16)
    truth = copy.deepcopy(layer).double()
    truth.attention = attention_fp64
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    gen = torch.Generator().manual_seed(3)
    shapes = [([300, 17, 45], [700, 0, 90]), ([5, 400], [33, 1500]), ([64, 64, 64, 9], [2000, 0, 10, 300])]
    with mla_ops.prefill_backend(backend):
        for new_lengths, context_lengths in shapes:
            batch = random_batch(layer, new_lengths, context_lengths, chunk_size=128, generator=gen)
            packed = [pack_context(layer, batch.cu_seqlens, batch.context)]
            out = compiled(batch.hidden, batch.positions, batch.cu_seqlens, batch.max_seqlen, packed)
            context = [c._replace(kv_c=c.kv_c.double(), k_pe=c.k_pe.double()) for c in batch.context]
            want = truth(batch.hidden.double(), batch.positions, batch.cu_seqlens, batch.max_seqlen, context)
            rel = ((out.double() - want).norm() / want.norm()).item()
            assert rel <= 2e-2, (backend, new_lengths, rel)
    assert counters["stats"]["unique_graphs"] - before == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_one_chunk_layer_runs_the_fused_op_with_the_three_ops_results(backend: str) -> None:
    """prefill_with_context with one chunk runs eagerly as mla::prefill_with_chunk: bit for bit what the three
    ops return on this backend, zero-length sequences and empty chunk slices included. (Capture and replay of a
    layer with one chunk, which takes the same op, is test_gpu_e2e's manual CUDA-graph test.)"""
    _require(backend)
    gen = torch.Generator().manual_seed(7)
    lengths, context = [5, 0, 130, 17], [33, 4, 0, 260]
    cu, cu_k = cu_seqlens_of(lengths, "cuda"), cu_seqlens_of(context, "cuda")
    q, k = (torch.randn(sum(lengths), 16, 192, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    v = torch.randn(sum(lengths), 16, 256, generator=gen).to("cuda", torch.bfloat16)[..., 128:]  # strided
    k_c = torch.randn(sum(context), 16, 192, generator=gen).to("cuda", torch.bfloat16)
    v_c = torch.randn(sum(context), 16, 256, generator=gen).to("cuda", torch.bfloat16)[..., :128]
    with mla_ops.prefill_backend(backend), torch.no_grad():
        out, lse = mla_ops.prefill_with_context(q, k, v, cu, max(lengths), [(k_c, v_c, cu_k, max(context))])
        new = mla_ops.prefill(q, k, v, cu, max(lengths))
        chunk = mla_ops.prefill_context_chunk(q, k_c, v_c, cu, cu_k, max(lengths), max(context))
        want_out, want_lse = mla_ops.merge_attn_states(*chunk, *new)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    chunks = [mla_ops.ContextChunk(k_c, v_c, cu_k, max(context))]
    ref_out, ref_lse = attention_fp64(q, k, v, cu, max(lengths), chunks, 192**-0.5)
    assert ((out.double() - ref_out).norm() / ref_out.norm()).item() < 1e-2
    assert (lse.double() - ref_lse).abs().max().item() < 1e-2
