"""Serving-shaped robustness, on CPU: any number of context chunks under torch.compile, accuracy over
many chunks, inference-only ops, NaN through the merge, the graph-tree refusal, and argument errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from utils import cu_seqlens_of

import mla_ops
from mla_ops.api import SEQUENTIAL_MERGE_MAX_CHUNKS
from mla_ops.backends.base import MergeCall
from mla_ops.backends.reference import ReferenceBackend, merge_attn_states_reference
from mla_ops.cli.demo import attention_fp64
from mla_ops.runtime import graph_trees
from mla_ops.selector import backend_installed

BF16 = torch.bfloat16
# Head count and lengths are chosen so that no two sizes coincide at the first trace: torch.compile
# "duck-sizes" equal sizes into one symbol, which would cost a recompile when they later differ.
H, DQK, DV = 3, 192, 128


def _randn(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(BF16)


def _batch(num_chunks: int, seed: int, lengths=(5, 9, 7)):
    """New tokens of three sequences and ``num_chunks`` chunks of context, some rows unused."""
    gen = torch.Generator().manual_seed(seed)
    cu = cu_seqlens_of(lengths)
    total = int(cu[-1])
    q, k, v = _randn(total, H, DQK, gen=gen), _randn(total, H, DQK, gen=gen), _randn(total, H, DV, gen=gen)
    chunks = []
    for _ in range(num_chunks):
        slices = torch.randint(0, 5, (len(lengths),), generator=gen).tolist()
        rows = sum(slices) + int(torch.randint(0, 3, (), generator=gen))  # rows past cu_k[-1] are unused
        chunks.append(
            mla_ops.ContextChunk(
                _randn(rows, H, DQK, gen=gen), _randn(rows, H, DV, gen=gen), cu_seqlens_of(slices), max(slices)
            )
        )
    return q, k, v, cu, max(lengths), chunks


def _rel_error(out: torch.Tensor, q, k, v, cu, max_seqlen, chunks) -> float:
    ref, _ = attention_fp64(q, k, v, cu, max_seqlen, chunks, 1.0 / math.sqrt(DQK))
    return ((out.double() - ref).norm() / ref.norm()).item()


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


# --- any number of chunks, one graph -----------------------------------------------------------------


@torch.no_grad()
def test_packed_chunks_compile_one_graph_for_any_count() -> None:
    torch._dynamo.reset()
    compiled = torch.compile(mla_ops.prefill_with_context, fullgraph=True, dynamic=True, backend="eager")
    before = _unique_graphs()
    for seed, count in enumerate([0, 1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 64, 100, 129, 200, 256]):
        q, k, v, cu, max_seqlen, chunks = _batch(count, seed)
        packed = mla_ops.pack_chunks(k, v, cu, chunks)
        out, _ = compiled(q, k, v, cu, max_seqlen, [packed])
        unpacked, _ = mla_ops.prefill_with_context(q, k, v, cu, max_seqlen, chunks)
        # One merge instead of one per chunk: at least as close to float64 as the unpacked chunks.
        assert (
            _rel_error(out, q, k, v, cu, max_seqlen, chunks)
            <= 1.5 * _rel_error(unpacked, q, k, v, cu, max_seqlen, chunks) + 1e-4
        ), count
    assert _unique_graphs() - before == 1


def test_an_unpacked_chunk_list_compiles_per_count() -> None:
    # What pack_chunks avoids: the list's length is part of the compiled graph.
    torch._dynamo.reset()
    compiled = torch.compile(mla_ops.prefill_with_context, fullgraph=True, dynamic=True, backend="eager")
    before = _unique_graphs()
    with torch.no_grad():
        for seed, count in enumerate([1, 2, 3]):
            compiled(*_batch(count, seed))
    assert _unique_graphs() - before == 3


def test_packing_layout() -> None:
    # Two chunks of two sequences; chunk 0 has one unused row at its end.
    cu_a, cu_b = cu_seqlens_of([2, 1]), cu_seqlens_of([0, 3])
    source, cu = mla_ops.api.packing_index([cu_a, cu_b], [4, 3])
    # Rows: chunk 0 = [a0 a1 | a2 | unused a3], chunk 1 = [| b0 b1 b2] (concatenated: indices 0..6).
    # Packed: sequence 0 = a0 a1; sequence 1 = a2 b0 b1 b2; then the unused row a3.
    assert source.tolist() == [0, 1, 2, 4, 5, 6, 3]
    assert cu.tolist() == [0, 2, 6] and cu.dtype == torch.int32


def test_no_chunks_pack_into_an_empty_two_row_chunk() -> None:
    q, k, v, cu, max_seqlen, _ = _batch(0, seed=3)
    packed = mla_ops.pack_chunks(k, v, cu, [])
    assert packed.k.shape == (2, H, DQK) and packed.v.shape == (2, H, DV)
    assert packed.cu_seqlens_k.tolist() == [0] * cu.numel() and packed.max_seqlen_k == 2
    with torch.no_grad():
        out, lse = mla_ops.prefill_with_context(q, k, v, cu, max_seqlen, [packed])
        ref_out, ref_lse = mla_ops.prefill(q, k, v, cu, max_seqlen)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


# --- accuracy over many chunks -------------------------------------------------------------------------


def _many_chunks(num_chunks: int, rows_per_sequence: int = 4):
    """Two sequences of 16 new tokens over ``num_chunks`` chunks of context, drawn from one generator."""
    gen = torch.Generator().manual_seed(11)
    q, k, v = _randn(32, 2, 64, gen=gen), _randn(32, 2, 64, gen=gen), _randn(32, 2, 64, gen=gen)
    cu = cu_seqlens_of([16, 16])
    per_chunk = 2 * rows_per_sequence
    keys, values = _randn(num_chunks * per_chunk, 2, 64, gen=gen), _randn(num_chunks * per_chunk, 2, 64, gen=gen)
    cu_k = cu_seqlens_of([rows_per_sequence, rows_per_sequence])
    chunks = [
        mla_ops.ContextChunk(
            keys[c * per_chunk : (c + 1) * per_chunk], values[c * per_chunk : (c + 1) * per_chunk], cu_k, 4
        )
        for c in range(num_chunks)
    ]
    with torch.no_grad():
        out, _ = mla_ops.prefill_with_context(q, k, v, cu, 16, chunks)
    ref, _ = attention_fp64(q, k, v, cu, 16, chunks, 1.0 / 8.0)
    return ((out.double() - ref).norm() / ref.norm()).item()


def test_error_does_not_grow_with_the_number_of_chunks() -> None:
    one = _many_chunks(1)
    for count in (SEQUENTIAL_MERGE_MAX_CHUNKS, SEQUENTIAL_MERGE_MAX_CHUNKS + 1, 64, 512):
        assert _many_chunks(count) <= 1.5 * one, count


class _OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("count", [1, SEQUENTIAL_MERGE_MAX_CHUNKS, SEQUENTIAL_MERGE_MAX_CHUNKS + 1])
def test_few_chunks_keep_the_merge_op(count: int) -> None:
    q, k, v, cu, max_seqlen, chunks = _batch(count, seed=5)
    with torch.no_grad(), _OpLog() as log:
        mla_ops.prefill_with_context(q, k, v, cu, max_seqlen, chunks)
    merges = sum(name.startswith("mla.merge_attn_states") for name in log.names)
    fused = sum(name.startswith("mla.prefill_with_chunk") for name in log.names)
    if count == 1:  # eagerly, one chunk runs the three ops' work, its merge included, as one op
        assert (fused, merges) == (1, 0)
    else:
        assert fused == 0 and merges == (count if count <= SEQUENTIAL_MERGE_MAX_CHUNKS else 0)


# --- inference only -------------------------------------------------------------------------------------


def _inputs(requires_grad: str):
    q, k, v, cu, max_seqlen, chunks = _batch(1, seed=2)
    tensors = {"q": q, "k": k, "v": v}
    tensors[requires_grad] = tensors[requires_grad].detach().requires_grad_(True)
    return tensors, cu, max_seqlen, chunks[0]


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_the_ops_refuse_autograd(name: str) -> None:
    tensors, cu, max_seqlen, _ = _inputs(name)
    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    with pytest.raises(RuntimeError, match=rf"mla.prefill is inference-only .* {name} requires grad.*torch.no_grad"):
        torch.ops.mla.prefill(q, k, v, cu, max_seqlen, 0.1)
    with pytest.raises(RuntimeError, match=r"mla\.prefill_context_chunk is inference-only"):
        mla_ops.prefill_context_chunk(q, k, v, cu, cu, max_seqlen, max_seqlen)
    with torch.no_grad():  # the same inputs are fine without grad mode
        mla_ops.prefill(q, k, v, cu, max_seqlen)
    with torch.inference_mode():
        mla_ops.prefill(q, k, v, cu, max_seqlen)


def test_the_merge_refuses_autograd() -> None:
    out = torch.randn(4, H, DV, dtype=BF16, requires_grad=True)
    lse = torch.randn(H, 4)
    with pytest.raises(RuntimeError, match=r"mla\.merge_attn_states is inference-only .* prefix_out requires grad"):
        mla_ops.merge_attn_states(out, lse, out.detach(), lse)


def test_compile_refuses_autograd_at_trace_time() -> None:
    tensors, cu, max_seqlen, _ = _inputs("q")
    torch._dynamo.reset()
    compiled = torch.compile(mla_ops.prefill, fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="inference-only"):
        compiled(tensors["q"], tensors["k"], tensors["v"], cu, max_seqlen)


# --- NaN through the merge -----------------------------------------------------------------------------


def _merge_inputs():
    gen = torch.Generator().manual_seed(4)
    prefix, suffix = _randn(6, 2, 32, gen=gen), _randn(6, 2, 32, gen=gen)
    prefix_lse, suffix_lse = torch.randn(2, 6, generator=gen), torch.randn(2, 6, generator=gen)
    prefix_lse[0, 1] = math.nan  # NaN on one side, a valid other side
    suffix_lse[1, 2] = math.nan
    prefix_lse[:, 3] = -math.inf  # a side without keys whose output is garbage
    prefix[3] = math.nan
    prefix_lse[:, 4], suffix_lse[:, 4] = -math.inf, math.inf  # no keys on either side
    return prefix, prefix_lse, suffix, suffix_lse


def _merge_triton(call):
    pytest.importorskip("triton", reason="the Triton merge kernel needs triton (runs in its interpreter on CPU)")
    from mla_ops.kernels.merge import merge_attn_states_triton

    return merge_attn_states_triton(call)


@pytest.mark.parametrize("merge", [merge_attn_states_reference, _merge_triton], ids=["reference", "triton"])
def test_merge_keeps_nan_and_drops_empty_sides(merge) -> None:
    prefix, prefix_lse, suffix, suffix_lse = _merge_inputs()
    out, lse = merge(MergeCall(prefix, prefix_lse, suffix, suffix_lse))
    assert torch.isnan(lse[0, 1]) and torch.isnan(out[1, 0]).all()  # NaN in, NaN out
    assert torch.isnan(lse[1, 2]) and torch.isnan(out[2, 1]).all()
    assert not torch.isnan(out[1, 1]).any() and not torch.isnan(lse[1, 1])  # the row's other head is fine
    assert torch.equal(out[3].float(), suffix[3].float()) and torch.equal(lse[:, 3], suffix_lse[:, 3])
    assert (out[4] == 0).all() and torch.isneginf(lse[:, 4]).all()
    valid = [0, 5]
    ref_out, ref_lse = merge_attn_states_reference(
        MergeCall(prefix[valid], prefix_lse[:, valid], suffix[valid], suffix_lse[:, valid])
    )
    torch.testing.assert_close(out[valid], ref_out)
    torch.testing.assert_close(lse[:, valid], ref_lse)


def test_fp32_accumulation_keeps_nan() -> None:
    prefix, prefix_lse, suffix, suffix_lse = _merge_inputs()
    out, lse = mla_ops.api._merge_in_fp32([(prefix, prefix_lse), (suffix, suffix_lse)])
    ref_out, ref_lse = merge_attn_states_reference(MergeCall(prefix, prefix_lse, suffix, suffix_lse))
    assert torch.equal(torch.isnan(lse), torch.isnan(ref_lse))
    assert torch.equal(torch.isnan(out), torch.isnan(ref_out))
    finite = ~torch.isnan(ref_out)
    torch.testing.assert_close(out[finite], ref_out[finite])


# --- the CUDA-graph-tree refusal, on CPU -------------------------------------------------------------------


class _PlanningReference(ReferenceBackend):
    """REFERENCE declared as planning on the host: the selector's CPU backend with FLASHINFER's trait."""

    plans_on_host = True


def _layer_fn(q, k, v, cu):
    # The op itself: calls through mla_ops.prefill are routed inside CUDA-graph trees, never refused
    # (tests/test_graph_tree_routing.py).
    out, _ = torch.ops.mla.prefill(q, k, v, cu, 8, 0.1)
    return out * 2


@pytest.fixture
def cpu_graph_tree_check(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(graph_trees, "CHECKED_DEVICE_TYPES", ("cpu", "cuda"))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_graph_trees_refusal_survives_warm_compile_caches(cpu_graph_tree_check) -> None:
    q, k, v, cu, _, _ = _batch(0, seed=9, lengths=(8,))
    with torch.no_grad():
        # The same function compiled for the same mode first, with a backend that does not plan:
        # AOTAutograd's and Inductor's caches now hold its graph, and a later compile hits them.
        torch.compile(_layer_fn, mode="reduce-overhead", fullgraph=True)(q, k, v, cu)
        torch._dynamo.reset()
        with backend_installed(_PlanningReference()):
            with pytest.raises(Exception, match=r"plans each batch on the host.*call those instead of torch\.ops"):
                torch.compile(_layer_fn, mode="reduce-overhead", fullgraph=True)(q, k, v, cu)
            torch._dynamo.reset()
            api = torch.compile(lambda q, k, v, cu: mla_ops.prefill(q, k, v, cu, 8, 0.1)[0] * 2, mode="reduce-overhead")
            assert torch.equal(api(q, k, v, cu), _layer_fn(q, k, v, cu))  # through the API: the in-graph op, no refusal
            torch._dynamo.reset()
            torch.compile(_layer_fn, fullgraph=True)(q, k, v, cu)  # no CUDA-graph trees: fine


# --- argument errors -------------------------------------------------------------------------------------


def test_zero_heads() -> None:
    q, k, v = torch.empty(4, 0, DQK, dtype=BF16), torch.empty(4, 0, DQK, dtype=BF16), torch.empty(4, 0, DV, dtype=BF16)
    cu = cu_seqlens_of([4])
    for call in (lambda: mla_ops.prefill(q, k, v, cu, 4), lambda: torch.ops.mla.prefill(q, k, v, cu, 4, 0.1)):
        with pytest.raises(ValueError, match="q has 0 heads"):
            call()


def test_max_seqlen_types_and_range() -> None:
    q, k, v, cu, _, _ = _batch(0, seed=1)
    with torch.no_grad():
        out, _ = mla_ops.prefill(q, k, v, cu, np.int64(9))  # NumPy integers are integers
        assert out.shape == (q.shape[0], H, DV)
        with pytest.raises(ValueError, match=r"max_seqlen must be at most 2\*\*31 - 1"):
            mla_ops.prefill(q, k, v, cu, 2**63)
        with pytest.raises(ValueError, match=r"max_seqlen must be at most 2\*\*31 - 1"):
            torch.ops.mla.prefill(q, k, v, cu, 2**31, 0.1)
        for bad in (True, 9.0, "9"):
            with pytest.raises(TypeError, match="max_seqlen must be an int"):
                mla_ops.prefill(q, k, v, cu, bad)
        with pytest.raises(TypeError, match="max_seqlen_k must be an int"):
            mla_ops.prefill_context_chunk(q, k, v, cu, cu, 9, False)


def test_softmax_scale_must_be_a_number() -> None:
    q, k, v, cu, _, _ = _batch(0, seed=1)
    for bad in ("0.1", True, None.__class__):
        with pytest.raises(TypeError, match="softmax_scale must be a float"):
            mla_ops.prefill(q, k, v, cu, 9, softmax_scale=bad)
    with torch.no_grad():
        mla_ops.prefill(q, k, v, cu, 9, softmax_scale=np.float32(0.1))


def test_a_chunk_with_other_head_dims_is_named() -> None:
    q, k, v, cu, max_seqlen, chunks = _batch(2, seed=6)
    bad = chunks[1]._replace(v=chunks[1].v[..., :64])
    with pytest.raises(ValueError, match=r"chunks\[1\]: v has shape .* must be \[Tk, 3, 128\]"):
        mla_ops.prefill_with_context(q, k, v, cu, max_seqlen, [chunks[0], bad])


def test_compile_without_fullgraph_surfaces_the_package_error() -> None:
    q, k, v, cu, _, _ = _batch(0, seed=1)
    torch._dynamo.reset()
    with pytest.raises(TypeError, match="cu_seqlens must have dtype int32"):
        torch.compile(mla_ops.prefill, backend="eager")(q, k, v, cu.long(), 9)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="cu_seqlens must have dtype int32"):  # fullgraph: inside Dynamo's error
        torch.compile(mla_ops.prefill, fullgraph=True, backend="eager")(q, k, v, cu.long(), 9)


def test_plain_eager_calls_go_straight_to_the_op(monkeypatch) -> None:
    """Eager calls with arguments of the plain types skip the API's own checks (the op's kernel makes them
    all); other types still meet those checks, which name the argument."""
    import mla_ops.api as api

    q, k, v, cu, max_seqlen, chunks = _batch(1, seed=2)
    chunk = chunks[0]
    expected = mla_ops.prefill(q, k, v, cu, max_seqlen, 0.1)

    def unexpected(*args, **kwargs):
        raise AssertionError("the eager fast path ran the API's checks")

    monkeypatch.setattr(api, "check_argument_types", unexpected)
    with torch.no_grad():
        out, _ = mla_ops.prefill(q, k, v, cu, max_seqlen, 0.1)
        assert torch.equal(out, expected[0])
        mla_ops.prefill(q, k, v, cu, max_seqlen)  # the default scale
        out_c, lse_c = mla_ops.prefill_context_chunk(q, chunk.k, chunk.v, cu, chunk.cu_seqlens_k, max_seqlen, 7)
        mla_ops.merge_attn_states(out, expected[1], out_c, lse_c)
        with pytest.raises(AssertionError, match="fast path ran"):
            mla_ops.prefill(q, k, v, cu, np.int64(max_seqlen))  # not a plain int: the full checks
