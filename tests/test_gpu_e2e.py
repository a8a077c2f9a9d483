"""End to end on a GPU: the MLA layer eagerly, under torch.compile, and replayed from CUDA graphs,
for every CUDA backend. Each result is checked against a float64 computation of the same layer."""

from __future__ import annotations

import contextlib
import copy
import importlib.util

import pytest
import torch
from benchlib.methods import recorded_graphs
from graph_replays import REPLAYS, StaticBatch, capture, replay_batch, replays
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from utils import reset_compile

import mla_ops
from mla_ops.backends.registry import PrefillBackendEnum
from mla_ops.cli.demo import attention_fp64
from mla_ops.model import MLAAttention, MLABatch, MLAConfig, random_batch
from mla_ops.specs import DeviceCapability, SelectorConfig

pytestmark = pytest.mark.gpu

BACKENDS = ["TRITON", "FLASH_ATTN", "FLASHINFER"]
CONFIG = MLAConfig(hidden_size=1024, num_heads=16)
REL_TOL = 2e-2  # bf16 activations through four projections; see mla_ops.cli.demo.REL_TOLERANCE


def _require(backend: str) -> None:
    if backend == "FLASHINFER" and importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer is not installed (pip install 'mla_ops[flashinfer]')")
    if backend == "TRITON" and importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")


@pytest.fixture(scope="module")
def layers():
    torch.manual_seed(0)
    layer = MLAAttention(CONFIG, device="cuda", dtype=torch.bfloat16)
    truth = copy.deepcopy(layer).double()
    truth.attention = attention_fp64
    return layer, truth


def _args(batch: MLABatch):
    return batch.hidden, batch.positions, batch.cu_seqlens, batch.max_seqlen, batch.context


@torch.no_grad()
def _truth(truth: MLAAttention, batch: MLABatch) -> torch.Tensor:
    context = [c._replace(kv_c=c.kv_c.double(), k_pe=c.k_pe.double()) for c in batch.context]
    return truth(batch.hidden.double(), batch.positions, batch.cu_seqlens, batch.max_seqlen, context)


def _assert_close_to_truth(out: torch.Tensor, want: torch.Tensor, rows: int | None = None) -> None:
    out, want = out[:rows].double(), want[:rows]
    assert not torch.isnan(out).any()
    rel = ((out - want).norm() / want.norm()).item()
    assert rel <= REL_TOL, f"relative error {rel:.3e} vs float64 exceeds {REL_TOL:.0e}"


@contextlib.contextmanager
def _compiled_with(backend: str, layer: MLAAttention, **options):
    """``layer`` under ``torch.compile(fullgraph=True, **options)`` with ``backend`` forced for the block, on
    fresh Dynamo state and counters (skips where ``backend``'s library is missing)."""
    _require(backend)
    reset_compile()
    with mla_ops.prefill_backend(backend):
        yield torch.compile(layer, fullgraph=True, **options)


def _assert_close_to_eager(out: torch.Tensor, eager: torch.Tensor, tol: float) -> None:
    diff = ((out.float() - eager.float()).norm() / eager.float().norm()).item()
    assert diff <= tol, f"compiled or replayed output differs from eager by {diff:.2e} (relative), over {tol:.0e}"


def _batches(layer: MLAAttention, count: int):
    """Ragged batches with two context chunks each (the chunk count is part of a compiled graph)."""
    gen = torch.Generator().manual_seed(1)
    for i in range(count):
        n = 2 + i % 4
        lengths = [3 + (97 * i + 41 * j) % 700 for j in range(n)]
        lengths[-1] = 0 if i % 3 == 0 else lengths[-1]  # some batches carry a zero-length sequence
        context = [(211 * i + 67 * j) % 1500 for j in range(n)]
        context[0] = 1100 + i  # at least two chunks of 1024
        batch = random_batch(layer, lengths, context, chunk_size=1024, generator=gen)
        assert len(batch.context) == 2
        yield batch


@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_compile_fullgraph_dynamic(backend, layers) -> None:
    layer, truth = layers
    with _compiled_with(backend, layer, dynamic=True) as compiled:
        for batch in _batches(layer, 10):
            want = _truth(truth, batch)
            eager = layer(*_args(batch))
            out = compiled(*_args(batch))
            _assert_close_to_truth(eager, want)
            _assert_close_to_truth(out, want)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    variants = len(_debug_get_cache_entry_list(layer.forward.__code__))
    assert variants <= 2, f"{variants - 1} recompiles over 10 batches"


@pytest.mark.parametrize("backend", ["TRITON", "FLASH_ATTN"])
@torch.no_grad()
def test_compile_reduce_overhead(backend, layers) -> None:
    # The backends that read the offsets on the device, forced, run inside the graphs. FLASHINFER plans on
    # the host: forced, it is refused there (test_flashinfer_is_refused_inside_cudagraph_trees); selected
    # automatically, the calls are routed (test_reduce_overhead_routes_around_auto_selected_flashinfer).
    layer, truth = layers
    with _compiled_with(backend, layer, mode="reduce-overhead") as compiled:
        batches = list(_batches(layer, 3))
        for _ in range(3):  # warm-up, record, then replays
            for batch in batches:
                _assert_close_to_truth(compiled(*_args(batch)).clone(), _truth(truth, batch))
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0
    assert recorded_graphs(torch.device("cuda")) >= len(batches), "the layer was not replayed from CUDA graphs"


# --- manual CUDA graph over a token budget (buffers, batches, capture: graph_replays.py) -----------


@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_manual_cuda_graph_replays_new_lengths(backend, layers) -> None:
    _require(backend)
    layer, truth = layers
    static = StaticBatch(layer)
    with mla_ops.prefill_backend(backend):
        graph, out = capture(layer, static, replay_batch(layer, *REPLAYS[0], seed=0))
        for _, batch, rows in replays(graph, static, layer):
            eager = layer(*_args(batch))
            want = _truth(truth, batch)
            _assert_close_to_truth(eager, want)
            _assert_close_to_truth(out, want, rows)
            # Same kernels on the same rows; only the projections' GEMM algorithms may differ with the
            # row count, so the replay must agree with eager far more closely than with float64.
            _assert_close_to_eager(out[:rows], eager, 1e-2)
    mla_ops.release_cuda_graph_buffers()


@torch.no_grad()
def test_capture_without_plan_fails_clearly_for_flashinfer(layers) -> None:
    _require("FLASHINFER")
    layer, _ = layers
    mla_ops.release_cuda_graph_buffers()
    static = StaticBatch(layer)
    static.load(replay_batch(layer, *REPLAYS[1], seed=1))
    with mla_ops.prefill_backend("FLASHINFER"):
        layer(*static.args())  # eager is fine: it plans by itself
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="plan_cuda_graph"), torch.cuda.graph(graph):
            layer(*static.args())


@torch.no_grad()
def test_reduce_overhead_routes_around_auto_selected_flashinfer(layers) -> None:
    """FLASHINFER selected automatically (no override): the layer compiled with the plain
    mode="reduce-overhead" runs its attention inside the CUDA-graph trees on the best backend that reads
    the offsets on the device, and replays one recorded graph for batches of new lengths."""
    _require("FLASHINFER")
    capability = DeviceCapability.of(torch.device("cuda"))
    config = SelectorConfig(torch.bfloat16, CONFIG.mla_dimensions)
    chosen = mla_ops.select_backend(capability, config).name
    if chosen != "FLASHINFER":
        pytest.skip(f"FLASHINFER is not the automatic choice on this device ({chosen} is)")
    layer, truth = layers
    flashinfer = PrefillBackendEnum.FLASHINFER.backend()
    static = StaticBatch(layer)
    batches = [replay_batch(layer, lengths, context, seed) for seed, (lengths, context) in enumerate(REPLAYS)]
    eager = [layer(*_args(batch)) for batch in batches]  # FLASHINFER
    want = [_truth(truth, batch) for batch in batches]
    reset_compile()
    compiled = torch.compile(layer, fullgraph=True, mode="reduce-overhead")
    for _ in range(2):  # warm-up and recording in the first round; every later call replays
        for batch, eager_out, want_out in zip(batches, eager, want):
            static.load(batch)
            planned = flashinfer.plan_count
            out = compiled(*static.args()).clone()
            assert flashinfer.plan_count == planned, "FLASHINFER ran inside the CUDA-graph tree"
            rows = sum(batch.new_lengths)
            _assert_close_to_truth(out, want_out, rows)
            _assert_close_to_eager(out[:rows], eager_out, REL_TOL)  # another attention kernel than eager's
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0
    assert recorded_graphs(torch.device("cuda")) >= 1, "the layer was not replayed from CUDA graphs"


@torch.no_grad()
def test_flashinfer_is_refused_inside_cudagraph_trees(layers) -> None:
    # A tree replays without running Python, so FlashInfer's host plan could not follow a new batch.
    # Forced, it is refused, never replaced: the layer's calls (through mla_ops' Python API) raise
    # ValueError at the first compiled call, and a direct torch.ops.mla.prefill call is refused by its
    # fake kernel at compile time. Both say what to do instead.
    _require("FLASHINFER")
    layer, _ = layers
    torch._dynamo.reset()
    with mla_ops.prefill_backend("FLASHINFER"):
        compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
        batch = next(_batches(layer, 1))
        remedy = r"Clear the override .* capture torch\.cuda\.CUDAGraph yourself and call mla_ops\.plan_cuda_graph"
        with pytest.raises(ValueError, match=r"FLASHINFER cannot run inside CUDA-graph trees.*" + remedy):
            compiled(*_args(batch))
        torch._dynamo.reset()
        q = torch.randn(64, CONFIG.num_heads, CONFIG.qk_nope_head_dim + CONFIG.qk_rope_head_dim, device="cuda")
        v = torch.randn(64, CONFIG.num_heads, CONFIG.v_head_dim, device="cuda")
        q, v = q.bfloat16(), v.bfloat16()
        cu = torch.tensor([0, 40, 64], dtype=torch.int32, device="cuda")
        direct = torch.compile(lambda q, v, cu: torch.ops.mla.prefill(q, q, v, cu, 40, 0.1), mode="reduce-overhead")
        remedy = r"are routed automatically inside CUDA-graph trees .* call those instead of torch\.ops\.mla\.prefill"
        with pytest.raises(Exception, match=remedy):
            direct(q, v, cu)
