"""The contract of :meth:`mla_ops.backends.base.PrefillBackend.attention`, kept by every backend.

One suite, run against each backend instance (the ``target``):

- on CPU: REFERENCE; TRITON in Triton's interpreter (small shapes only: it runs every program in
  numpy); FLASHINFER around the ``flashinfer`` stand-in on a simulated SM90 (the ragged wrapper) and
  SM100 (eager bf16 calls through the trtllm-gen DeepSeek kernel's stand-in); FLASH_ATTN around each
  FlashAttention stand-in on its own (FA4, FA3, FA2, PyTorch's bundled FA2);
- on a GPU (``pytest -m gpu``): TRITON, FLASHINFER and FLASH_ATTN with the real libraries, each
  skipped with the reason when it cannot serve the case here.

What is checked: both paths (causal new tokens; a non-causal context chunk); awkward lengths;
zero-length sequences and empty chunks (``lse = -inf``, ``out = 0``); strided ``v``; padding rows past
``cu_seqlens[-1]``; that merging a split context equals unsplit attention; the output conventions
(shape, dtype, contiguity, a natural-log LSE); bf16 and fp16; several head dims; and on a GPU, CUDA-graph
capture and replay with changed lengths. Every result goes through ``utils.assert_attention_close``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import standins
import torch
from utils import DEEPSEEK_DIMS, GraphBuffers, RaggedBatch, assert_attention_close, cu_seqlens_of, make_batch, make_qkv

import mla_ops
from mla_ops import DeviceCapability, MLADimensions, SelectorConfig
from mla_ops.backends.base import MergeCall, PrefillBackend, VarlenCall
from mla_ops.backends.flash_attn import FlashAttnBackend
from mla_ops.backends.flashinfer import FlashInferBackend
from mla_ops.backends.reference import ReferenceBackend
from mla_ops.backends.triton import TritonBackend
from mla_ops.selector import backend_installed

SM90, SM100 = DeviceCapability(9, 0), DeviceCapability(10, 0)
BF16, FP16 = torch.bfloat16, torch.float16


@dataclass(frozen=True)
class Target:
    """A backend instance to hold to the contract, and where it runs."""

    id: str
    build: Callable[[], PrefillBackend]
    device: str
    #: Triton's interpreter: every program runs in numpy, so only small shapes are affordable.
    interpreted: bool = False

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"


def _fa(name: str) -> Callable[[], PrefillBackend]:
    return lambda: FlashAttnBackend(libraries=standins.flash_attn_libraries(name))


CPU_TARGETS = [
    Target("REFERENCE", ReferenceBackend, "cpu"),
    Target("TRITON-interpreter", TritonBackend, "cpu", interpreted=True),
    Target(
        "FLASHINFER-standin",
        lambda: FlashInferBackend(library=standins.flashinfer_module(), workspace_bytes=1 << 20, capability=SM90),
        "cpu",
    ),
    Target(
        "FLASHINFER-trtllm-standin",
        lambda: FlashInferBackend(library=standins.flashinfer_module(), workspace_bytes=1 << 20, capability=SM100),
        "cpu",
    ),
    Target("FLASH_ATTN-fa4-standin", _fa("flash_attn.cute"), "cpu"),
    Target("FLASH_ATTN-fa3-standin", _fa("flash_attn_interface"), "cpu"),
    Target("FLASH_ATTN-fa2-standin", _fa("flash_attn"), "cpu"),
    Target("FLASH_ATTN-bundled-standin", _fa("torch.ops.aten._flash_attention_forward"), "cpu"),
]
GPU_TARGETS = [
    Target("TRITON", TritonBackend, "cuda"),
    Target("FLASHINFER", FlashInferBackend, "cuda"),
    Target("FLASH_ATTN", FlashAttnBackend, "cuda"),
]


def cases(*, cpu: list[tuple] | None = None, gpu: list[tuple] | None = None, targets: str = "all") -> list:
    """``pytest.param(target, *values)`` for every target of each kind with each tuple of values."""
    params = []
    for group, values in ((CPU_TARGETS, cpu), (GPU_TARGETS, gpu)):
        for target in group if values is not None else ():
            marks = [pytest.mark.gpu] if target.gpu else []
            for v in values:
                vid = "-".join(_value_id(x) for x in v)
                params.append(pytest.param(target, *v, marks=marks, id=f"{target.id}-{vid}" if vid else target.id))
    return params


def _value_id(value: object) -> str:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, tuple):
        return "x".join(map(str, value))
    return str(value)


# --- the backend under test -----------------------------------------------------------------------------

_gpu_instances: dict[str, PrefillBackend] = {}


@dataclass
class Installed:
    """The target's backend, installed as the process's instance of its registry entry."""

    target: Target
    backend: PrefillBackend

    @property
    def device(self) -> str:
        return self.target.device

    def require(self, dtype: torch.dtype, dims: tuple[int, int]) -> None:
        """Skip, saying why, when this backend cannot serve ``(dtype, Dqk, Dv)`` on this machine's device."""
        if not self.target.gpu:
            return
        config = SelectorConfig(dtype, MLADimensions.from_head_dims(*dims))
        reasons = self.backend.reasons(DeviceCapability.of(torch.device(self.device)), config)
        if reasons:
            pytest.skip(f"{self.backend.name} cannot serve {config} here: {'; '.join(reasons)}")

    def attention(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
        if causal:
            assert cu_k is cu_q, "the new-tokens path passes one offsets tensor for both"
        return self.backend.attention(VarlenCall(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal))


@pytest.fixture
def installed(target: Target) -> Iterator[Installed]:
    if target.interpreted:
        pytest.importorskip("triton", reason="the TRITON backend needs triton (pip install 'mla_ops[triton]')")
        if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            pytest.skip("Triton's interpreter is off (a CUDA device is present): the TRITON GPU target covers it")
    if target.gpu:
        # One instance per backend for the whole module: FlashInfer's workspaces and plans, and the
        # kernels each library compiles, are kept across cases as they would be in a server.
        backend = _gpu_instances.get(target.id)
        if backend is None:
            backend = _gpu_instances[target.id] = target.build()
    else:
        backend = target.build()
    with backend_installed(backend):
        yield Installed(target, backend)
        mla_ops.release_cuda_graph_buffers()  # while installed: it releases the registry's instances


# --- inputs ---------------------------------------------------------------------------------------------


def _heads(target: Target) -> int:
    return 16 if target.gpu else 2


def make_chunk(lengths, heads, dqk, dv, dtype, device, strided_v=False, seed=100) -> RaggedBatch:
    """A context chunk: ``k``/``v`` packed as ``cu_seqlens`` says (a batch whose ``q`` goes unused)."""
    return make_batch(lengths, heads, dqk, dv, dtype, device, strided_v, seed=seed)


def check_path(run: Installed, path: str, batch, chunk: RaggedBatch | None, scale: float, slack: int = 0):
    """Run ``path`` (``"causal"`` or ``"chunk"``) and check it; returns ``(out, lse)``."""
    max_q = batch.max_seqlen + slack
    if path == "causal":
        k, v, cu_k, max_k = batch.k, batch.v, batch.cu_seqlens, max_q
    else:
        k, v, cu_k, max_k = chunk.k, chunk.v, chunk.cu_seqlens, chunk.max_seqlen + slack
    out, lse = run.attention(batch.q, k, v, batch.cu_seqlens, cu_k, max_q, max_k, scale, path == "causal")
    assert_attention_close(out, lse, batch.q, k, v, batch.cu_seqlens, cu_k, scale, path == "causal")
    return out, lse


def check_empty_rows(out: torch.Tensor, lse: torch.Tensor, rows: slice) -> None:
    """Rows that attend to no key: ``out = 0`` and ``lse = -inf``, never NaN."""
    assert torch.equal(out[rows], torch.zeros_like(out[rows])), "rows without keys must be zero"
    assert torch.isneginf(lse[:, rows]).all(), "rows without keys must have lse -inf"


# --- awkward lengths, both paths ------------------------------------------------------------------------

# The chunk path pairs each query length with a key length that is awkward in another way.
_KEY_LENGTH = {1: 127, 17: 1, 127: 17, 1000: 4097, 4097: 1000}


@pytest.mark.parametrize(
    ("target", "path", "length", "heads"),
    cases(
        cpu=[(p, n, 2) for p in ("causal", "chunk") for n in (1, 17, 127)],
        gpu=[(p, n, h) for p in ("causal", "chunk") for n in (1, 17, 127, 1000, 4097) for h in (16, 128)],
    ),
)
def test_awkward_lengths(installed, path, length, heads):
    dqk, dv = DEEPSEEK_DIMS
    installed.require(BF16, DEEPSEEK_DIMS)
    batch = make_batch([length], heads, dqk, dv, BF16, installed.device, seed=length)
    chunk = make_chunk([_KEY_LENGTH[length]], heads, dqk, dv, BF16, installed.device, seed=length + 1)
    check_path(installed, path, batch, chunk, dqk**-0.5)


# --- ragged batches: empty sequences and slices, padding rows, loose bounds, dtypes and dims ------------

_CPU_DIMS = [DEEPSEEK_DIMS, (128, 128), (64, 64)]
_GPU_DIMS = [DEEPSEEK_DIMS, (128, 128), (64, 64)]


def _ragged(target: Target) -> tuple[list[int], list[int]]:
    """New-token lengths and one chunk's slices; zeros are empty sequences and empty slices."""
    if target.gpu:
        return [17, 0, 1000, 1, 127, 0, 300], [300, 33, 0, 1, 1000, 5, 0]
    return [9, 0, 17, 1, 0, 5], [4, 13, 0, 1, 7, 0]


@pytest.mark.parametrize(
    ("target", "path", "dtype", "dims", "heads"),
    cases(
        cpu=[(p, dt, d, 2) for p in ("causal", "chunk") for dt in (BF16, FP16) for d in _CPU_DIMS],
        gpu=[(p, dt, d, h) for p in ("causal", "chunk") for dt in (BF16, FP16) for d in _GPU_DIMS for h in (16, 128)],
    ),
)
def test_ragged_batch(installed, path, dtype, dims, heads):
    dqk, dv = dims
    installed.require(dtype, dims)
    lengths, slices = _ragged(installed.target)
    padding = 5  # rows past cu_seqlens[-1], as under a CUDA graph's token budget
    batch = make_batch(lengths, heads, dqk, dv, dtype, installed.device, padding=padding, seed=3)
    chunk = make_chunk(slices, heads, dqk, dv, dtype, installed.device, seed=4)
    # max_seqlen is an upper bound: a loose one (a graph's budget) must give the same result.
    out, lse = check_path(installed, path, batch, chunk, 0.8 * dqk**-0.5, slack=40)
    if path == "chunk":
        bounds = batch.cu_seqlens.tolist()
        for b, (n, c) in enumerate(zip(lengths, slices)):
            if n and not c:
                check_empty_rows(out, lse, slice(bounds[b], bounds[b + 1]))


# --- empty inputs --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("target",), cases(cpu=[()], gpu=[()]))
def test_chunk_without_any_key(installed):
    """A chunk in which no sequence has context: every row is ``out = 0``, ``lse = -inf``."""
    dqk, dv = DEEPSEEK_DIMS
    installed.require(BF16, DEEPSEEK_DIMS)
    heads = _heads(installed.target)
    batch = make_batch([4, 6], heads, dqk, dv, BF16, installed.device, padding=2)
    chunk = make_chunk([0, 0], heads, dqk, dv, BF16, installed.device)
    out, lse = installed.attention(batch.q, chunk.k, chunk.v, batch.cu_seqlens, chunk.cu_seqlens, 6, 0, 0.1, False)
    assert out.shape == (12, heads, dv) and lse.shape == (heads, 12)
    check_empty_rows(out, lse, slice(0, 10))


@pytest.mark.parametrize(("target", "path"), cases(cpu=[("causal",), ("chunk",)], gpu=[("causal",), ("chunk",)]))
def test_no_rows_to_compute(installed, path):
    """No tokens at all, no sequences, and only empty sequences: the right shapes and no error."""
    dqk, dv = DEEPSEEK_DIMS
    installed.require(BF16, DEEPSEEK_DIMS)
    heads, device = _heads(installed.target), installed.device
    for lengths, tokens in (([], 0), ([0], 0), ([], 3), ([0, 0], 3)):
        q, k, v = make_qkv(tokens, heads, dqk, dv, BF16, device)
        cu = cu_seqlens_of(lengths, device)
        cu_k = cu if path == "causal" else cu_seqlens_of([0] * len(lengths), device)
        out, lse = installed.attention(q, k, v, cu, cu_k, 0, 0, 0.1, path == "causal")
        assert out.shape == (tokens, heads, dv) and out.dtype == BF16
        assert lse.shape == (heads, tokens) and lse.dtype == torch.float32


# --- strided v ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("target", "path"), cases(cpu=[("causal",), ("chunk",)], gpu=[("causal",), ("chunk",)]))
def test_strided_v(installed, path):
    """``v`` as MLA produces it: ``kv_nope[..., nope:]``, a view of a wider ``[T, H, nope + Dv]`` tensor."""
    dqk, dv = DEEPSEEK_DIMS
    installed.require(BF16, DEEPSEEK_DIMS)
    heads, device = _heads(installed.target), installed.device
    lengths, slices = _ragged(installed.target)
    batch = make_batch(lengths, heads, dqk, dv, BF16, device, strided_v=True, padding=3, seed=5)
    chunk = make_chunk(slices, heads, dqk, dv, BF16, device, strided_v=True, seed=6)
    v = batch.v if path == "causal" else chunk.v
    assert v.stride(0) == heads * (dqk + dv), "v must be a view of a wider tensor"
    check_path(installed, path, batch, chunk, dqk**-0.5)


# --- conventions ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "path", "dtype"),
    cases(
        cpu=[(p, dt) for p in ("causal", "chunk") for dt in (BF16, FP16)],
        gpu=[(p, dt) for p in ("causal", "chunk") for dt in (BF16, FP16)],
    ),
)
def test_output_conventions(installed, path, dtype):
    """``out`` ``[T, H, Dv]`` contiguous in q's dtype; ``lse`` float32 ``[H, T]`` contiguous, natural log."""
    dqk, dv = DEEPSEEK_DIMS
    installed.require(dtype, DEEPSEEK_DIMS)
    heads, device = _heads(installed.target), installed.device
    batch = make_batch([7, 12], heads, dqk, dv, dtype, device, padding=2, seed=7)
    chunk = make_chunk([9, 3], heads, dqk, dv, dtype, device, seed=8)
    # A large scale spreads the LSE far from 0, where a wrong base is far off.
    scale = 4 * dqk**-0.5
    out, lse = check_path(installed, path, batch, chunk, scale)
    tokens = batch.q.shape[0]  # the padding rows included
    assert out.shape == (tokens, heads, dv) and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == (heads, tokens) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert out.device == batch.q.device and lse.device == batch.q.device
    # The same numbers with a base-2 LSE (what FlashInfer's kernels return) must be caught.
    k, v, cu_k = (batch.k, batch.v, batch.cu_seqlens) if path == "causal" else (chunk.k, chunk.v, chunk.cu_seqlens)
    with pytest.raises(AssertionError, match="lse error"):
        assert_attention_close(out, lse / math.log(2.0), batch.q, k, v, batch.cu_seqlens, cu_k, scale, path == "causal")


# --- split context -----------------------------------------------------------------------------------------


def _split_sizes(target: Target) -> tuple[list[int], list[int]]:
    if target.gpu:
        return [300, 0, 17, 1000, 1], [2000, 50, 0, 4097, 3]
    return [5, 0, 9, 3], [12, 4, 0, 7]


@pytest.mark.parametrize(
    ("target", "pieces", "heads"),
    cases(cpu=[(1, 2), (2, 2), (3, 2)], gpu=[(1, 16), (2, 16), (3, 16), (3, 128)]),
)
def test_split_context_merges_to_unsplit_attention(installed, pieces, heads):
    """New tokens over themselves, merged with each chunk of their context through ``mla.merge_attn_states``,
    equal one causal attention over ``[context ; new tokens]`` (bottom-right aligned). A wrong LSE base
    or layout weights the pieces wrongly and misses by orders of magnitude."""
    dqk, dv = DEEPSEEK_DIMS
    installed.require(BF16, DEEPSEEK_DIMS)
    device = installed.device
    new_lengths, context = _split_sizes(installed.target)
    full_lengths = [c + n for c, n in zip(context, new_lengths)]
    whole = make_batch(full_lengths, heads, dqk, dv, BF16, device, strided_v=True, seed=9)
    starts = whole.cu_seqlens.tolist()

    def gather(ranges):
        index = [torch.arange(lo, hi) for lo, hi in ranges]
        return torch.cat(index).to(device) if index else torch.zeros(0, dtype=torch.long, device=device)

    new_rows = gather([(s + c, s + f) for s, c, f in zip(starts, context, full_lengths)])
    q = make_batch(new_lengths, heads, dqk, dv, BF16, device, seed=10).q
    cu_new = cu_seqlens_of(new_lengths, device)
    scale = dqk**-0.5
    out, lse = installed.attention(
        q, whole.k[new_rows], whole.v[new_rows], cu_new, cu_new, max(new_lengths), max(new_lengths), scale, True
    )
    for p in range(pieces):
        bounds = [(c * p // pieces, c * (p + 1) // pieces) for c in context]
        rows = gather([(s + lo, s + hi) for s, (lo, hi) in zip(starts, bounds)])
        slices = [hi - lo for lo, hi in bounds]
        out_c, lse_c = installed.attention(
            q, whole.k[rows], whole.v[rows], cu_new, cu_seqlens_of(slices, device), max(new_lengths),
            max(slices), scale, False,
        )  # fmt: skip
        out, lse = mla_ops.merge_attn_states(out_c, lse_c, out, lse)
    # Each merge rounds a partial output to bf16 once more than one-piece attention does.
    assert_attention_close(out, lse, q, whole.k, whole.v, cu_new, whole.cu_seqlens, scale, True, factor=2.0 + pieces)


@pytest.mark.parametrize(("target",), cases(cpu=[()], gpu=[()]))
def test_attention_for_merge_merges_to_what_attention_merges_to(installed):
    """``attention_for_merge`` (what the fused layer op calls) may hand the merge another LSE form, flagged
    base 2, but never another result: on a batch seen before (where a planning backend takes its fast
    path), merging its two parts gives bit for bit what merging :meth:`attention`'s gives."""
    from mla_ops.runtime.merge_dispatch import merge_kernel

    dqk, dv = DEEPSEEK_DIMS
    installed.require(BF16, DEEPSEEK_DIMS)
    heads, device = _heads(installed.target), installed.device
    batch = make_batch([5, 0, 19, 2], heads, dqk, dv, BF16, device, strided_v=True)
    chunk = make_chunk([7, 3, 0, 12], heads, dqk, dv, BF16, device)
    scale = dqk**-0.5
    calls = [
        (batch.q, chunk.k, chunk.v, batch.cu_seqlens, chunk.cu_seqlens, batch.max_seqlen, 12, scale, False),
        (batch.q, batch.k, batch.v, batch.cu_seqlens, batch.cu_seqlens, batch.max_seqlen, batch.max_seqlen, scale,
         True),
    ]  # fmt: skip
    merge = merge_kernel(torch.device(device))
    want = merge(MergeCall(*(t for args in calls for t in installed.attention(*args))))
    parts = [installed.backend.attention_for_merge(VarlenCall(*args)) for args in calls]
    (out_c, lse_c, base2_c), (out, lse, base2) = parts
    assert lse_c.shape == lse.shape == want[1].shape and lse_c.dtype == lse.dtype == torch.float32
    got = merge(MergeCall(out_c, lse_c, out, lse, base2_c, base2))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# --- CUDA graphs (GPU) ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("target",), cases(gpu=[()]))
def test_cuda_graph_replay_with_changed_lengths(installed):
    """Capture both paths once with ``max_seqlen`` = the token budget, then replay batches of other lengths
    written into the same buffers. FLASHINFER plans on the host: ``mla_ops.plan_cuda_graph`` before the
    capture and before every replay; the others read the offsets on the device and need nothing."""
    dqk, dv = DEEPSEEK_DIMS
    installed.require(BF16, DEEPSEEK_DIMS)
    backend, device = installed.backend, torch.device("cuda")
    heads = 16
    backend.warmup(device, SelectorConfig(BF16), heads)
    bufs = GraphBuffers(heads, dqk, dv, BF16, budget=2048, budget_k=3072, max_batch=6, seed=11)
    q, k, v, kc, vc, cu, cu_k = bufs.q, bufs.k, bufs.v, bufs.kc, bufs.vc, bufs.cu, bufs.cu_k
    scale = dqk**-0.5

    def load(new: list[int], ctx: list[int]) -> None:
        bufs.load(new, ctx)
        if backend.plans_on_host:
            mla_ops.plan_cuda_graph(cu, cu_seqlens_k=[cu_k])

    def step():
        return (
            *installed.attention(q, k, v, cu, cu, bufs.budget, bufs.budget, scale, True),
            *installed.attention(q, kc, vc, cu, cu_k, bufs.budget, bufs.budget_k, scale, False),
        )

    load([500, 0, 1000, 3], [64, 9, 0, 2000])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # the eager warm-up, outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse, out_c, lse_c = step()
    batches = [
        ([500, 0, 1000, 3], [64, 9, 0, 2000]),
        ([2048], [3072]),
        ([1, 1, 1, 1, 1, 1], [0, 1, 0, 1, 0, 1]),
        ([17, 1200, 0, 0, 0, 311], [300, 0, 0, 0, 5, 1000]),
        ([], []),  # every sequence is padding: nothing to check but that nothing faults
    ]
    for new, ctx in batches:
        load(new, ctx)
        graph.replay()
        torch.cuda.synchronize()
        if sum(new):
            assert_attention_close(out, lse, q, k, v, cu, cu, scale, causal=True)
            assert_attention_close(out_c, lse_c, q, kc, vc, cu, cu_k, scale, causal=False)
