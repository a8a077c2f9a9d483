"""Two GPUs (``pytest -m gpu``; skipped with a reason where fewer than two are visible).

- Every CUDA backend on tensors of ``cuda:1`` while ``cuda:0`` is current: both paths and the merge
  against fp32 math, and a CUDA graph captured on a ``cuda:1`` stream and replayed with new lengths.
  ``cuda:0`` must still be current after every call, capture and replay.
- Inputs spread over two devices are refused with an error that names them.
- Tensor parallelism over NCCL (``tests/tp_worker.py`` under torchrun, one rank per GPU): TP=2 gives
  the unsplit layer's output eagerly, in float64, under ``torch.compile`` and replayed from a CUDA
  graph, on every backend.
"""

from __future__ import annotations

import pytest
import torch
from test_gpu_e2e import _require
from tp_worker import launch
from utils import DEEPSEEK_DIMS, assert_attention_close, cu_seqlens_of, make_batch

import mla_ops

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]

BACKENDS = ["TRITON", "FLASH_ATTN", "FLASHINFER"]
DQK, DV = DEEPSEEK_DIMS
SCALE = DQK**-0.5
BF16 = torch.bfloat16
OTHER = torch.device("cuda", 1)  # never the current device in these tests

# One torchrun run per backend: NCCL set-up, Inductor compiles on both ranks and, on a machine where
# they are not cached yet, FlashInfer's and Triton's just-in-time builds.
TP_TIMEOUT_S = 600


@pytest.fixture(autouse=True)
def _cuda0_current():
    with torch.cuda.device(0):
        yield
        _assert_cuda0_current("the test")


def _assert_cuda0_current(what: str) -> None:
    current = torch.cuda.current_device()
    assert current == 0, f"{what} left cuda:{current} current instead of cuda:0"


def _assert_matches_whole(out, lse, q, k, v, cu_seqlens, k_ctx, v_ctx, cu_seqlens_ctx) -> None:
    """``(out, lse)`` of the new tokens ``q``/``k``/``v`` over ``[context ; themselves]`` equals that
    attention computed in one piece. Factor 3: both partial outputs and the merge round to bf16."""
    new_bounds, ctx_bounds = cu_seqlens.tolist(), cu_seqlens_ctx.tolist()
    keys, values, lengths = [], [], []
    for b in range(len(new_bounds) - 1):
        c0, c1, n0, n1 = ctx_bounds[b], ctx_bounds[b + 1], new_bounds[b], new_bounds[b + 1]
        keys += [k_ctx[c0:c1], k[n0:n1]]
        values += [v_ctx[c0:c1], v[n0:n1]]
        lengths.append(c1 - c0 + n1 - n0)
    cu_whole = cu_seqlens_of(lengths, q.device)
    assert_attention_close(
        out, lse, q, torch.cat(keys), torch.cat(values), cu_seqlens, cu_whole, SCALE, causal=True, factor=3.0
    )


# --- ops on a device that is not the current one -----------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_both_paths_and_merge_on_a_non_current_device(backend: str) -> None:
    _require(backend)
    with mla_ops.prefill_backend(backend):
        new = make_batch([300, 0, 17, 1000, 1], 16, DQK, DV, BF16, OTHER, strided_v=True, padding=3, seed=1)
        ctx = make_batch([2000, 50, 0, 4097, 3], 16, DQK, DV, BF16, OTHER, strided_v=True, seed=2)

        out, lse = mla_ops.prefill(new.q, new.k, new.v, new.cu_seqlens, new.max_seqlen)
        _assert_cuda0_current("mla.prefill")
        assert out.device == OTHER and lse.device == OTHER
        assert_attention_close(out, lse, new.q, new.k, new.v, new.cu_seqlens, new.cu_seqlens, SCALE, causal=True)

        out_c, lse_c = mla_ops.prefill_context_chunk(
            new.q, ctx.k, ctx.v, new.cu_seqlens, ctx.cu_seqlens, new.max_seqlen, ctx.max_seqlen
        )
        _assert_cuda0_current("mla.prefill_context_chunk")
        assert_attention_close(out_c, lse_c, new.q, ctx.k, ctx.v, new.cu_seqlens, ctx.cu_seqlens, SCALE, causal=False)

        merged, merged_lse = mla_ops.merge_attn_states(out_c, lse_c, out, lse)
        _assert_cuda0_current("mla.merge_attn_states")
        assert merged.device == OTHER
        _assert_matches_whole(merged, merged_lse, new.q, new.k, new.v, new.cu_seqlens, ctx.k, ctx.v, ctx.cu_seqlens)


@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_cuda_graph_captured_and_replayed_on_a_non_current_device(backend: str) -> None:
    _require(backend)
    heads, budget, budget_k, max_batch = 16, 2048, 4200, 6
    q = torch.empty(budget, heads, DQK, dtype=BF16, device=OTHER)
    k = torch.empty_like(q)
    kv = torch.empty(budget, heads, DQK + DV, dtype=BF16, device=OTHER)
    v = kv[..., DQK:]  # a strided view, as MLA's kv_b_proj output is split
    k_c = torch.empty(budget_k, heads, DQK, dtype=BF16, device=OTHER)
    v_c = torch.empty(budget_k, heads, DV, dtype=BF16, device=OTHER)
    cu = torch.zeros(max_batch + 1, dtype=torch.int32, device=OTHER)
    cu_k = torch.zeros(max_batch + 1, dtype=torch.int32, device=OTHER)
    batches = [
        ([100, 0, 700, 5, 0, 0], [300, 0, 2000, 0, 1, 0]),
        ([1, 17, 127, 1000, 0, 0], [4097, 1, 0, 17, 0, 0]),
        ([1024, 1024, 0, 0, 0, 0], [0] * 6),  # the whole budget, and a chunk with no keys at all
    ]
    gen = torch.Generator().manual_seed(3)

    def load(lengths: list[int], context: list[int]) -> None:
        for t in (q, k, kv, k_c, v_c):  # written from cuda:0's side: the copies go to cuda:1's stream
            t.copy_(torch.randn(t.shape, generator=gen))
        cu.copy_(cu_seqlens_of(lengths))
        cu_k.copy_(cu_seqlens_of(context))
        mla_ops.plan_cuda_graph(cu, cu_seqlens_k=[cu_k])

    def step(offsets: torch.Tensor, offsets_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = mla_ops.ContextChunk(k_c, v_c, offsets_k, budget_k)
        return mla_ops.prefill_with_context(q, k, v, offsets, budget, [chunk])

    with mla_ops.prefill_backend(backend):
        load(*batches[0])
        step(cu, cu_k)  # eager warm-up: compiles for cuda:1 and plans FlashInfer's graph wrappers
        _assert_cuda0_current("the warm-up call")
        torch.cuda.synchronize(OTHER)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=torch.cuda.Stream(OTHER)):  # capture on a stream of cuda:1
            out, lse = step(cu, cu_k)
        _assert_cuda0_current("capture")
        for lengths, context in batches:
            load(lengths, context)
            graph.replay()
            _assert_cuda0_current("replay")
            n = sum(lengths)
            _assert_matches_whole(out, lse, q, k, v, cu, k_c, v_c, cu_k)
            # Eager calls on copies of the offsets (not registered for graphs: the eager path) agree.
            eager, eager_lse = step(cu.clone(), cu_k.clone())
            torch.testing.assert_close(out[:n], eager[:n])
            torch.testing.assert_close(lse[:, :n], eager_lse[:, :n])
    mla_ops.release_cuda_graph_buffers()


def test_inputs_on_two_devices_are_refused() -> None:
    b = make_batch([5, 0, 3], 2, DQK, DV, BF16, "cuda:0")
    cu, n = b.cu_seqlens, b.max_seqlen
    with pytest.raises(ValueError, match=r"mla\.prefill: k is on cuda:1 but q is on cuda:0; q, k and v must share"):
        mla_ops.prefill(b.q, b.k.to(OTHER), b.v, cu, n)
    with pytest.raises(ValueError, match=r"mla\.prefill: cu_seqlens is on cuda:1 but q is on cuda:0; move it to"):
        mla_ops.prefill(b.q, b.k, b.v, cu.to(OTHER), n)
    with pytest.raises(ValueError, match=r"mla\.prefill_context_chunk: v is on cuda:1 but q is on cuda:0"):
        mla_ops.prefill_context_chunk(b.q, b.k, b.v.to(OTHER), cu, cu, n, n)
    with pytest.raises(ValueError, match=r"mla\.prefill_context_chunk: cu_seqlens_k is on cuda:1 but q is on cuda:0"):
        mla_ops.prefill_context_chunk(b.q, b.k, b.v, cu, cu.to(OTHER), n, n)
    out, lse = mla_ops.prefill(b.q, b.k, b.v, cu, n)
    with pytest.raises(
        ValueError, match=r"mla\.merge_attn_states: suffix_lse is on cuda:1 but prefix_out is on cuda:0"
    ):
        mla_ops.merge_attn_states(out, lse, out, lse.to(OTHER))


# --- tensor parallelism over NCCL ------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_parallel_layer_on_two_gpus_matches_the_dense_layer(backend: str) -> None:
    _require(backend)
    checks = ["eager", "fp64", "compile", "graph"]
    output = launch(["--device", "cuda", "--backend", backend, "--checks", *checks], timeout=TP_TIMEOUT_S)
    assert output.count(f"passed: {' '.join(checks)} on {backend}") == 2, output
