"""End to end on a GPU: the MLA layer eagerly, under torch.compile, and replayed from CUDA graphs,
for every CUDA backend. Each result is checked against a float64 computation of the same layer."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

import mla_ops
from mla_ops.backends.registry import PrefillBackendEnum
from mla_ops.config import DeviceCapability, SelectorConfig
from mla_ops.demo import attention_fp64
from mla_ops.model import LatentChunk, MLAAttention, MLABatch, MLAConfig, random_batch

pytestmark = pytest.mark.gpu

BACKENDS = ["TRITON", "FLASH_ATTN", "FLASHINFER"]
CONFIG = MLAConfig(hidden_size=1024, num_heads=16)
REL_TOL = 2e-2  # bf16 activations through four projections; see mla_ops.demo.REL_TOLERANCE


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
    _require(backend)
    layer, truth = layers
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with mla_ops.prefill_backend(backend):
        compiled = torch.compile(layer, fullgraph=True, dynamic=True)
        for batch in _batches(layer, 10):
            want = _truth(truth, batch)
            eager = layer(*_args(batch))
            out = compiled(*_args(batch))
            _assert_close_to_truth(eager, want)
            _assert_close_to_truth(out, want)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    variants = len(_debug_get_cache_entry_list(layer.forward.__code__))
    assert variants <= 2, f"{variants - 1} recompiles over 10 batches"


def _recorded_graphs() -> int:
    """How many CUDA graphs the tree manager of the current device has recorded."""
    from torch._inductor.cudagraph_trees import get_manager

    manager = get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    if manager is None:
        return 0
    nodes = [node for roots in manager.roots.values() for node in roots]
    count = 0
    while nodes:
        node = nodes.pop()
        count += 1
        nodes.extend(child for children in node.children.values() for child in children)
    return count


@pytest.mark.parametrize("backend", ["TRITON", "FLASH_ATTN"])
@torch.no_grad()
def test_compile_reduce_overhead(backend, layers) -> None:
    # The backends that read the offsets on the device, forced, run inside the graphs. FLASHINFER plans on
    # the host: forced, it is refused there (test_flashinfer_is_refused_inside_cudagraph_trees); selected
    # automatically, the calls are routed (test_reduce_overhead_routes_around_auto_selected_flashinfer).
    _require(backend)
    layer, truth = layers
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with mla_ops.prefill_backend(backend):
        compiled = torch.compile(layer, fullgraph=True, mode="reduce-overhead")
        batches = list(_batches(layer, 3))
        for _ in range(3):  # warm-up, record, then replays
            for batch in batches:
                _assert_close_to_truth(compiled(*_args(batch)).clone(), _truth(truth, batch))
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0
    assert _recorded_graphs() >= len(batches), "the layer was not replayed from CUDA graphs"


# --- manual CUDA graph over a token budget ---------------------------------------------------------

BUDGET, MAX_SEQS, CHUNK_BUDGET = 8192, 16, 4096
REPLAYS = [
    ([1000, 17, 1, 0, 0, 0], [0, 300, 5, 0, 0, 0]),
    ([4097, 127], [2000, 0]),
    ([5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 0], [100] * 16),
    ([0] * 15 + [8000], [0] * 15 + [4000]),
    ([2048, 0, 2048, 0, 1024], [1024, 0, 0, 3000, 0]),
]


class StaticBatch:
    """Static buffers a captured graph reads: a token budget, a sequence budget and one context chunk."""

    def __init__(self, layer: MLAAttention) -> None:
        c, dev, dt = layer.config, "cuda", torch.bfloat16
        self.hidden = torch.zeros(BUDGET, c.hidden_size, device=dev, dtype=dt)
        self.positions = torch.zeros(BUDGET, device=dev, dtype=torch.int64)
        self.cu_seqlens = torch.zeros(MAX_SEQS + 1, device=dev, dtype=torch.int32)
        self.kv_c = torch.zeros(CHUNK_BUDGET, c.kv_lora_rank, device=dev, dtype=dt)
        self.k_pe = torch.zeros(CHUNK_BUDGET, c.qk_rope_head_dim, device=dev, dtype=dt)
        self.cu_seqlens_k = torch.zeros(MAX_SEQS + 1, device=dev, dtype=torch.int32)

    def load(self, batch: MLABatch) -> None:
        """Copy a batch in; unused sequences become zero-length padding at the end."""
        t, tk = batch.hidden.shape[0], batch.context[0].kv_c.shape[0] if batch.context else 0
        pad = MAX_SEQS + 1 - batch.cu_seqlens.shape[0]
        self.hidden[:t] = batch.hidden
        self.positions[:t] = batch.positions
        self.cu_seqlens.copy_(torch.cat([batch.cu_seqlens, batch.cu_seqlens[-1:].expand(pad)]))
        if batch.context:
            chunk = batch.context[0]
            self.kv_c[:tk] = chunk.kv_c
            self.k_pe[:tk] = chunk.k_pe
            self.cu_seqlens_k.copy_(torch.cat([chunk.cu_seqlens_k, chunk.cu_seqlens_k[-1:].expand(pad)]))
        else:
            self.cu_seqlens_k.zero_()

    def args(self):
        chunk = LatentChunk(self.kv_c, self.k_pe, self.cu_seqlens_k, CHUNK_BUDGET)
        return self.hidden, self.positions, self.cu_seqlens, BUDGET, [chunk]


def _replay_batch(layer: MLAAttention, lengths, context, seed: int) -> MLABatch:
    batch = random_batch(
        layer, lengths, context, chunk_size=CHUNK_BUDGET, generator=torch.Generator().manual_seed(seed)
    )
    if not batch.context:  # keep one (empty) chunk so every replay has the captured structure
        empty = torch.zeros(len(lengths) + 1, dtype=torch.int32, device="cuda")
        batch.context = [LatentChunk(batch.hidden.new_zeros(0, 512), batch.hidden.new_zeros(0, 64), empty, 0)]
    return batch


@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_manual_cuda_graph_replays_new_lengths(backend, layers) -> None:
    _require(backend)
    layer, truth = layers
    static = StaticBatch(layer)
    with mla_ops.prefill_backend(backend):
        first = _replay_batch(layer, *REPLAYS[0], seed=0)
        static.load(first)
        mla_ops.plan_cuda_graph(static.cu_seqlens, [static.cu_seqlens_k])
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # eager warm-up: JIT compiles and graph plans happen here
            layer(*static.args())
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(*static.args())
        for seed, (lengths, context) in enumerate(REPLAYS):
            batch = _replay_batch(layer, lengths, context, seed)
            static.load(batch)
            mla_ops.plan_cuda_graph(static.cu_seqlens, [static.cu_seqlens_k])
            graph.replay()
            rows = sum(lengths)
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
    static.load(_replay_batch(layer, *REPLAYS[1], seed=1))
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
    batches = [_replay_batch(layer, lengths, context, seed) for seed, (lengths, context) in enumerate(REPLAYS)]
    eager = [layer(*_args(batch)) for batch in batches]  # FLASHINFER
    want = [_truth(truth, batch) for batch in batches]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
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
    assert _recorded_graphs() >= 1, "the layer was not replayed from CUDA graphs"


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
