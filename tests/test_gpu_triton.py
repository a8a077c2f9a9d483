"""TRITON-specific behaviour on a CUDA GPU (``pytest -m gpu``).

The contract every backend keeps (both paths at awkward lengths, H = 16 and 128, bf16 and fp16, three head
shapes, strided ``v``, empty chunks, split context, CUDA-graph replay) is checked for TRITON by
tests/test_backend_contract.py. Here: the selection, many sequences (several lookup passes), the tabled
variants of the ``tl.dot`` kernel and the Gluon kernel, ``MLA_OPS_TRITON_CONFIG``, the LSE against REFERENCE
on the device, ``torch.compile``, a captured ``prefill_with_context`` with the merge kernel inside the graph,
the merge kernel, and warm-up.
"""

from __future__ import annotations

import math

import pytest
import torch
from sequence_isolation import assert_sequences_close, poison_sequences
from utils import (
    GraphBuffers,
    assert_attention_close,
    cu_seqlens_of,
    gluon_or_skip,
    make_batch,
    make_qkv,
    record_results,
)

import mla_ops
from mla_ops.backends.base import MergeCall, VarlenCall
from mla_ops.backends.reference import merge_attn_states_reference
from mla_ops.backends.triton import TritonBackend
from mla_ops.runtime.merge_dispatch import merge_kernel
from mla_ops.specs import MLADimensions, SelectorConfig

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
DTYPES = [torch.bfloat16, torch.float16]
SMALL_DIMS = [(64, 64), (128, 128)]


def _dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@pytest.fixture(autouse=True)
def _triton_backend():
    with mla_ops.prefill_backend("TRITON"):
        yield


def _scale(dqk: int) -> float:
    return dqk**-0.5


def _check_padding(lse: torch.Tensor, valid: int) -> None:
    """Rows past cu_seqlens_q[-1] are padding: lse -inf there (their out is unspecified)."""
    assert torch.isneginf(lse[:, valid:]).all(), "padding rows must have lse -inf"


def _check_empty_rows(out: torch.Tensor, lse: torch.Tensor, rows: slice) -> None:
    """Rows that attend to no key: out = 0 and lse = -inf, never NaN."""
    assert torch.equal(out[rows], torch.zeros_like(out[rows])), "rows without keys must be zero"
    assert torch.isneginf(lse[:, rows]).all(), "rows without keys must have lse -inf"


def _prefill_and_check(lengths, heads, dqk, dv, dtype, strided_v=False, padding=0, slack=0, seed=0):
    batch = make_batch(lengths, heads, dqk, dv, dtype, DEVICE, strided_v=strided_v, padding=padding, seed=seed)
    out, lse = mla_ops.prefill(batch.q, batch.k, batch.v, batch.cu_seqlens, batch.max_seqlen + slack)
    assert_attention_close(
        out, lse, batch.q, batch.k, batch.v, batch.cu_seqlens, batch.cu_seqlens, _scale(dqk), causal=True
    )
    _check_padding(lse, sum(lengths))
    return batch, out, lse


def _chunk_inputs(lengths_q, lengths_k, heads, dqk, dv, dtype, strided_v=False, padding=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, _, _ = make_qkv(sum(lengths_q) + padding, heads, dqk, dv, dtype, DEVICE, generator=gen)
    _, k, v = make_qkv(sum(lengths_k), heads, dqk, dv, dtype, DEVICE, strided_v=strided_v, generator=gen)
    return q, k, v, cu_seqlens_of(lengths_q, DEVICE), cu_seqlens_of(lengths_k, DEVICE)


def test_triton_is_selected():
    batch = make_batch([4], 2, 192, 128, torch.bfloat16, DEVICE)
    assert isinstance(mla_ops.selector.backend_for(batch.q, batch.v), TritonBackend)


# --- new tokens (causal) ----------------------------------------------------------------------------


def test_many_short_sequences():
    """More sequences than one lookup pass covers (256), many empty, on both paths."""
    gen = torch.Generator().manual_seed(11)
    lengths_q = torch.randint(0, 40, (300,), generator=gen).tolist()
    lengths_q[::7] = [0] * len(lengths_q[::7])
    _prefill_and_check(lengths_q, 16, 192, 128, torch.bfloat16, padding=9, slack=1000, seed=12)
    lengths_k = torch.randint(0, 60, (300,), generator=gen).tolist()
    lengths_k[::5] = [0] * len(lengths_k[::5])
    q, k, v, cu_q, cu_k = _chunk_inputs(lengths_q, lengths_k, 16, 192, 128, torch.bfloat16, padding=9, seed=13)
    out, lse = mla_ops.prefill_context_chunk(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k))
    assert_attention_close(out, lse, q, k, v, cu_q, cu_k, _scale(192), causal=False)
    _check_padding(lse, sum(lengths_q))


#: The SM90 table's variants of the tl.dot kernel: the plain key loop, the overlapped one ('ovl'), and
#: 128-key tiles.
TL_DOT_VARIANTS = ["128,64,8,3", "128,64,8,3,ovl", "128,128,8,2"]


@pytest.mark.parametrize("text", TL_DOT_VARIANTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "chunk"])
def test_tl_dot_variants(text, causal):
    """Each tabled variant of the tl.dot kernel against the reference, whatever the table picks: ragged and
    empty sequences, a last block that ends mid-block next to full blocks, padding rows holding NaN,
    strided v, H = 16 and 128."""
    from mla_ops.kernels.attention import attention_triton
    from mla_ops.kernels.configs import AttentionConfig

    config = AttentionConfig.parse(text, "variant")
    lengths_q = [1000, 0, 17, 256, 127]
    lengths_k = lengths_q if causal else [4097, 5, 0, 300, 1]
    for heads in (16, 128):
        q, k, v, cu_q, cu_k = _chunk_inputs(lengths_q, lengths_k, heads, 192, 128, torch.bfloat16, strided_v=True)
        q = torch.cat([q, torch.full_like(q[:7], math.nan)])  # padding rows of a token budget
        if causal:
            cu_k = cu_q
        out, lse = attention_triton(
            VarlenCall(q, k, v, cu_q, cu_k, 1000, max(lengths_k), _scale(192), causal), config=config
        )
        assert_attention_close(out, lse, q, k, v, cu_q, cu_k, _scale(192), causal)
        _check_padding(lse, sum(lengths_q))


def _capture_after_warmup(step, load, batch):
    """``load(*batch)``, one eager ``step()`` (the warm-up outside capture that the package documents),
    then ``step`` captured: ``(graph, what step returned during capture)``."""
    load(*batch)
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


@pytest.mark.parametrize("text", TL_DOT_VARIANTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "chunk"])
def test_tl_dot_variants_isolate_sequences(text, causal):
    """NaN and inf in the keys and values of a sequence's neighbours, and in the rows past
    ``cu_seqlens_k[-1]``, never reach its output: sequences shorter than a tile at row 0, between two
    poisoned ones and at the end, a tile-aligned one, longer ones. A tile that started before a short
    sequence or ran past its end would weigh those rows 0 in the PV product: ``0 * NaN`` is NaN."""
    from mla_ops.kernels.configs import AttentionConfig

    _check_sequence_isolation(AttentionConfig.parse(text, "variant"), causal)


def _check_sequence_isolation(config, causal: bool) -> None:
    """``config`` on a batch whose poisoned sequences (NaN and inf in their keys and values) sit among clean
    ones of every kind, with poisoned rows past ``cu_seqlens_k[-1]`` and NaN padding rows past
    ``cu_seqlens_q[-1]``: the clean sequences match the reference and the padding rows get ``lse = -inf``."""
    from mla_ops.kernels.attention import attention_triton

    poisoned = {1, 3, 6}
    lengths_q = [5, 300, 3, 1000, 64, 0, 129, 11]
    lengths_k = lengths_q if causal else [9, 300, 3, 1200, 128, 0, 129, 70]
    q, k, v, cu_q, cu_k = _chunk_inputs(lengths_q, [*lengths_k, 40], 16, 192, 128, torch.bfloat16, strided_v=True)
    cu_k = cu_q if causal else cu_k[:-1].contiguous()
    poison_sequences(k, v, cu_k, [*poisoned, len(lengths_k)])
    q = torch.cat([q, torch.full_like(q[:7], math.nan)])  # padding rows of a token budget
    out, lse = attention_triton(
        VarlenCall(q, k, v, cu_q, cu_k, 1000, max(lengths_k), _scale(192), causal), config=config
    )
    clean = sorted(set(range(len(lengths_q))) - poisoned)
    assert_sequences_close(out, lse, q, k, v, cu_q, cu_k, _scale(192), causal, clean)
    _check_padding(lse, sum(lengths_q))


def _check_graph_replays(config, causal: bool) -> None:
    """``config`` captured in a CUDA graph (device-side descriptors' scratch then comes from the graph's
    pool) and replayed with other batches in the same buffers, a poisoned sequence among them: the
    replays equal eager calls and the clean sequences match the reference."""
    from mla_ops.kernels.attention import attention_triton

    heads, scale = 16, _scale(192)
    bufs = GraphBuffers(heads, 192, 128, torch.bfloat16, budget=1024, budget_k=1536, max_batch=4, seed=5)
    k, v, cu_k = (bufs.k, bufs.v, bufs.cu) if causal else (bufs.kc, bufs.vc, bufs.cu_k)

    def step():
        return attention_triton(
            VarlenCall(bufs.q, k, v, bufs.cu, cu_k, bufs.budget, k.shape[0], scale, causal), config=config
        )

    batches = [([1000, 3, 0, 21], [1400, 3, 0, 61]), ([5, 300, 7, 600], [9, 1000, 2, 500]), ([0] * 4, [0] * 4)]

    def load(lengths, ctx_lengths):
        bufs.load(lengths, ctx_lengths)
        poison_sequences(k, v, cu_k, [1, bufs.max_batch])  # sequence 1 and the rows past the batch

    graph, (graph_out, graph_lse) = _capture_after_warmup(step, load, batches[0])
    for lengths, ctx_lengths in batches:
        load(lengths, ctx_lengths)
        graph.replay()
        eager_out, eager_lse = step()
        for b in (0, 2, 3):
            rows = slice(int(bufs.cu[b]), int(bufs.cu[b + 1]))
            assert torch.equal(graph_out[rows], eager_out[rows]) and torch.equal(graph_lse[:, rows], eager_lse[:, rows])
        assert_sequences_close(graph_out, graph_lse, bufs.q, k, v, bufs.cu, cu_k, scale, causal, (0, 2, 3))
        _check_padding(graph_lse, sum(lengths))


#: The Hopper kernel written in Gluon (mla_ops.kernels.attention_sm90): tabled for large batches on SM90
#: (128-key tiles in 2 buffers), selectable for any batch there; 64-key tiles in 3 buffers too.
GLUON_VARIANTS = ["128,128,4,2,gluon,ovl,pers", "128,64,4,3,gluon,ovl,pers"]


def _gluon_config(text: str):
    """The Gluon configuration ``text``; skips off SM90 or without Gluon (:func:`utils.gluon_or_skip`)."""
    from mla_ops.kernels.configs import AttentionConfig

    gluon_or_skip(DEVICE)
    return AttentionConfig.parse(text, "variant")


@pytest.mark.parametrize("text", GLUON_VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "chunk"])
def test_gluon_kernel(text, dtype, causal):
    """The Gluon kernel against the reference: ragged and empty sequences, blocks that end mid-block next
    to whole ones, padding rows holding NaN, strided v, H = 16 and 128; causal with its own keys and,
    bottom-right aligned, with more keys than queries and with fewer (the first rows then see no key, and
    so do whole warpgroups of them); chunks longer and shorter than the queries."""
    from mla_ops.kernels.attention import attention_triton

    config = _gluon_config(text)
    lengths_q = [1000, 0, 17, 256, 127, 1]
    for heads in (16, 128):
        for lengths_k in (
            ([1000, 0, 17, 256, 127, 1], [1037, 5, 17, 300, 127, 200], [700, 0, 3, 100, 127, 1])
            if causal
            else ([4097, 5, 0, 300, 1, 129],)
        ):
            q, k, v, cu_q, cu_k = _chunk_inputs(lengths_q, lengths_k, heads, 192, 128, dtype, strided_v=True)
            q = torch.cat([q, torch.full_like(q[:7], math.nan)])  # padding rows of a token budget
            if causal and lengths_k == lengths_q:
                cu_k = cu_q
            out, lse = attention_triton(
                VarlenCall(q, k, v, cu_q, cu_k, 1000, max(lengths_k), _scale(192), causal), config=config
            )
            assert_attention_close(out, lse, q, k, v, cu_q, cu_k, _scale(192), causal)
            _check_padding(lse, sum(lengths_q))


@pytest.mark.parametrize("text", GLUON_VARIANTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "chunk"])
def test_gluon_kernel_isolates_sequences(text, causal):
    """NaN and inf in a sequence's neighbours' keys and values, and past ``cu_seqlens_k[-1]``, never reach
    its output (values come through a descriptor over the sequence's own rows; keys past it are masked)."""
    _check_sequence_isolation(_gluon_config(text), causal)


@pytest.mark.parametrize("text", GLUON_VARIANTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "chunk"])
def test_gluon_kernel_in_a_cuda_graph(text, causal):
    """The Gluon kernel in a CUDA graph (:func:`_check_graph_replays`): its value descriptors are built on
    the device, in scratch from the graph's pool."""
    _check_graph_replays(_gluon_config(text), causal)


@pytest.mark.parametrize("text", GLUON_VARIANTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "chunk"])
def test_gluon_kernel_relaunches_its_layout_on_new_tensors(attention_launches, text, causal):
    """A layout's first launch goes through Triton's dispatch, its second through the compiled variant and every
    later one through the remembered launch, with only the addresses and a fresh work counter replaced: each
    call, on new tensors with new lengths and a poisoned sequence, matches the reference (a counter left over
    from the previous call would leave work items undone)."""
    from mla_ops.kernels import attention_sm90
    from mla_ops.kernels.attention import attention_triton

    config = _gluon_config(text)
    lengths_q = [[700, 3, 0, 321], [5, 1000, 7, 12], [1, 1, 1021, 1]]
    # Equal totals and bounds: one layout.
    lengths_k = [[900, 3, 0, 400], [9, 1000, 2, 292], [1024, 0, 1, 278]] if causal else [[1500, 40, 9, 1]] * 3
    for i, (lq, lk) in enumerate(zip(lengths_q, lengths_k)):
        q, k, v, cu_q, cu_k = _chunk_inputs(lq, lk, 16, 192, 128, torch.bfloat16, strided_v=True, seed=i)
        poison_sequences(k, v, cu_k, [1])
        if i == 2:
            known = list(attention_launches.known.values())
            assert len(known) == 1 and isinstance(known[0].launch, attention_sm90.CountedRelaunch), (
                "the second call's launch is remembered, with a counter"
            )
        out, lse = attention_triton(VarlenCall(q, k, v, cu_q, cu_k, 1024, sum(lk), _scale(192), causal), config=config)
        assert_sequences_close(out, lse, q, k, v, cu_q, cu_k, _scale(192), causal, (0, 2, 3))


@pytest.mark.parametrize("text", GLUON_VARIANTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "chunk"])
@pytest.mark.parametrize("programs", [1, 3, 7])
def test_gluon_persistent_programs_carry_their_rings(monkeypatch, text, causal, programs):
    """Persistent programs on a few multiprocessors, so that each takes dozens of work items of every kind
    in turn: whole and partial blocks, slots no block fills, blocks with no visible key (causal, fewer keys
    than queries), empty key sets, poisoned neighbours. The rings' phases, the Q handover and the value
    descriptor each item rewrites must carry from item to item."""
    from mla_ops.kernels import attention_sm90

    config = _gluon_config(text)
    monkeypatch.setattr(attention_sm90, "_multiprocessors", lambda index: programs)
    lengths_q = [300, 1, 0, 129, 1000, 64, 7]
    lengths_k = [200, 1, 0, 129, 1300, 0, 400] if causal else [513, 40, 9, 0, 1000, 128, 3]
    poisoned = {1, 4}
    q, k, v, cu_q, cu_k = _chunk_inputs(lengths_q, [*lengths_k, 40], 8, 192, 128, torch.bfloat16, strided_v=True)
    cu_k = cu_k[:-1].contiguous()
    poison_sequences(k, v, cu_k, [*poisoned, len(lengths_k)])
    q = torch.cat([q, torch.full_like(q[:9], math.nan)])
    call = VarlenCall(q, k, v, cu_q, cu_k, 1000, max(lengths_k), _scale(192), causal)
    out, lse = attention_sm90.attention_sm90(call, block_n=config.block_n, stages=config.num_stages)
    clean = sorted(set(range(len(lengths_q))) - poisoned)
    assert_sequences_close(out, lse, q, k, v, cu_q, cu_k, _scale(192), causal, clean)
    _check_padding(lse, sum(lengths_q))


def test_large_batches_take_the_gluon_kernel(monkeypatch, attention_launches):
    """Through the table (no explicit configuration), a batch of at least TMA_MIN_KEY_ROWS key rows times
    heads runs the Gluon kernel on SM90 and a smaller one the tl.dot kernel; both match the reference.
    Inputs the Gluon kernel does not cover (here (128, 128) heads) fall back to the tl.dot kernel, and an
    explicit request for them is refused with the reason."""
    from mla_ops.kernels import attention, attention_sm90

    config = _gluon_config(GLUON_VARIANTS[0])
    calls = record_results(monkeypatch, attention_sm90, "sm90_launch")
    heads, scale = 16, _scale(192)
    for rows, expected in ((1024, 0), (attention.TMA_MIN_KEY_ROWS // heads, 1)):
        lengths = [rows // 2, rows - rows // 2]
        batch = make_batch(lengths, heads, 192, 128, torch.bfloat16, DEVICE, strided_v=True, seed=rows)
        before = len(calls)
        out, lse = attention.attention_triton(
            VarlenCall(
                batch.q, batch.k, batch.v, batch.cu_seqlens, batch.cu_seqlens, max(lengths), max(lengths), scale, True
            )
        )
        assert len(calls) - before == expected, rows
        assert_attention_close(out, lse, batch.q, batch.k, batch.v, batch.cu_seqlens, batch.cu_seqlens, scale, True)
    rows = attention.TMA_MIN_KEY_ROWS // heads
    batch = make_batch([rows], heads, 128, 128, torch.bfloat16, DEVICE, seed=3)
    before = len(calls)
    call = VarlenCall(batch.q, batch.k, batch.v, batch.cu_seqlens, batch.cu_seqlens, rows, rows, scale, True)
    out, lse = attention.attention_triton(call)
    assert len(calls) == before
    assert_attention_close(out, lse, batch.q, batch.k, batch.v, batch.cu_seqlens, batch.cu_seqlens, scale, True)
    with pytest.raises(ValueError, match=r"asks for the Gluon kernel, but it does not cover head sizes"):
        attention.attention_triton(call, config=config)


def test_config_env_var_override(monkeypatch):
    """MLA_OPS_TRITON_CONFIG replaces the table for every call, and gives the same numbers."""
    from mla_ops.kernels.configs import CONFIG_ENV_VAR

    batch = make_batch([300, 0, 77], 16, 192, 128, torch.bfloat16, DEVICE, seed=10)
    for text in ("64,64,4,2", "128,32,8,4"):
        monkeypatch.setenv(CONFIG_ENV_VAR, text)
        out, lse = mla_ops.prefill(batch.q, batch.k, batch.v, batch.cu_seqlens, 300)
        assert_attention_close(
            out, lse, batch.q, batch.k, batch.v, batch.cu_seqlens, batch.cu_seqlens, _scale(192), True
        )
    monkeypatch.setenv(CONFIG_ENV_VAR, "128,64")
    with pytest.raises(ValueError, match="MLA_OPS_TRITON_CONFIG must be"):
        mla_ops.prefill(batch.q, batch.k, batch.v, batch.cu_seqlens, 300)


# --- context chunks (non-causal) --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_lse_agrees_with_reference_backend(dtype):
    """Natural log, [H, T]: the TRITON LSE must match the REFERENCE backend's closely."""
    batch = make_batch([300, 0, 77], 16, 192, 128, dtype, DEVICE, seed=4)
    _, lse = mla_ops.prefill(batch.q, batch.k, batch.v, batch.cu_seqlens, 300)
    with mla_ops.prefill_backend("REFERENCE"):
        _, ref_lse = mla_ops.prefill(batch.q, batch.k, batch.v, batch.cu_seqlens, 300)
    n = sum(batch.lengths)
    # Both accumulate fp32 scores of the same bf16/fp16 inputs; a base-2 LSE would be off by 44%.
    torch.testing.assert_close(lse[:, :n], ref_lse[:, :n], rtol=1e-5, atol=1e-4)


def _unsplit(k_new, v_new, cu_new, k_ctx, v_ctx, cu_ctx):
    """Each sequence's keys as one slice ``[context ; new tokens]``: ``(k, v, cu_seqlens_k)``."""
    bn, bc = cu_new.tolist(), cu_ctx.tolist()
    ks, vs, lengths = [], [], []
    for b in range(len(bn) - 1):
        ks += [k_ctx[bc[b] : bc[b + 1]], k_new[bn[b] : bn[b + 1]]]
        vs += [v_ctx[bc[b] : bc[b + 1]], v_new[bn[b] : bn[b + 1]]]
        lengths.append(bc[b + 1] - bc[b] + bn[b + 1] - bn[b])
    return torch.cat(ks), torch.cat(vs), cu_seqlens_of(lengths, k_new.device)


# --- torch.compile and CUDA graphs ------------------------------------------------------------------


def test_compile_fullgraph_equals_eager():
    heads, dqk, dv = 16, 192, 128
    batch = make_batch([17, 0, 300, 5], heads, dqk, dv, torch.bfloat16, DEVICE, padding=3, seed=6)
    _, k_c, v_c, _, cu_k = _chunk_inputs([17, 0, 300, 5], [64, 9, 0, 200], heads, dqk, dv, torch.bfloat16, seed=7)
    chunks = [mla_ops.ContextChunk(k_c, v_c, cu_k, 200)]

    def layer(q, k, v, cu, chunk_k, chunk_v, chunk_cu):
        return mla_ops.prefill_with_context(q, k, v, cu, 300, [(chunk_k, chunk_v, chunk_cu, 200)])

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    args = (batch.q, batch.k, batch.v, batch.cu_seqlens, k_c, v_c, cu_k)
    eager_out, eager_lse = mla_ops.prefill_with_context(batch.q, batch.k, batch.v, batch.cu_seqlens, 300, chunks)
    out, lse = compiled(*args)
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)


def test_cuda_graph_replay_of_prefill_with_context():
    """``prefill_with_context`` captured whole (attention on both paths and the merge kernel) with
    max_seqlen = the token budget, then replayed with batches of other lengths in the same buffers."""
    heads, dqk, dv, dtype = 16, 192, 128, torch.bfloat16
    TritonBackend().warmup(torch.device(DEVICE), SelectorConfig(dtype), heads)
    bufs = GraphBuffers(heads, dqk, dv, dtype, budget=2048, budget_k=1536, max_batch=4, seed=8)
    q, k, v, cu = bufs.q, bufs.k, bufs.v, bufs.cu

    def step():
        return mla_ops.prefill_with_context(q, k, v, cu, bufs.budget, [(bufs.kc, bufs.vc, bufs.cu_k, bufs.budget_k)])

    batches = [
        ([1000, 24, 0, 1], [1536, 0, 0, 0]),
        ([2048, 0, 0, 0], [100, 0, 0, 0]),
        ([17, 127, 1, 900], [0, 300, 1, 1000]),
        ([0, 0, 0, 0], [0, 0, 0, 0]),
        ([300, 300, 300, 300], [5, 0, 700, 64]),
    ]
    graph, (graph_out, graph_lse) = _capture_after_warmup(step, bufs.load, batches[0])
    for lengths, ctx_lengths in batches:
        bufs.load(lengths, ctx_lengths)
        graph.replay()
        eager_out, eager_lse = step()
        n = sum(lengths)
        assert torch.equal(graph_out[:n], eager_out[:n]) and torch.equal(graph_lse[:, :n], eager_lse[:, :n])
        # Padding rows: lse -inf from both kernels, so the merge leaves clean zeros there.
        _check_empty_rows(graph_out, graph_lse, slice(n, None))
        # And the replayed numbers are right, not only repeatable: one attention over [context ; new].
        k_all, v_all, cu_all = _unsplit(k, v, cu, bufs.kc, bufs.vc, bufs.cu_k)
        assert_attention_close(graph_out, graph_lse, q, k_all, v_all, cu, cu_all, _scale(dqk), True, factor=3.0)


# --- merge -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("shape", [(16384, 16, 128), (1000, 128, 128), (37, 3, 64)])
def test_merge_matches_reference(shape, dtype):
    tokens, heads, dv = shape
    gen = torch.Generator().manual_seed(9)
    prefix_out = torch.randn(tokens, heads, dv, generator=gen).to(DEVICE, dtype)
    suffix_out = torch.randn(tokens, heads, dv, generator=gen).to(DEVICE, dtype)
    prefix_lse = (torch.randn(heads, tokens, generator=gen) * 5).to(DEVICE)
    suffix_lse = (torch.randn(heads, tokens, generator=gen) * 5).to(DEVICE)
    prefix_lse[0, ::5], prefix_lse[-1, 1::5] = -math.inf, math.inf
    suffix_lse[0, ::3], suffix_lse[-1, ::4] = math.inf, -math.inf
    prefix_out[::5, 0] = math.nan  # ignored: that side is empty there
    suffix_out[::3, 0] = math.nan
    out, lse = mla_ops.merge_attn_states(prefix_out, prefix_lse, suffix_out, suffix_lse)
    ref_out, ref_lse = merge_attn_states_reference(MergeCall(prefix_out, prefix_lse, suffix_out, suffix_lse))
    assert out.is_contiguous() and lse.is_contiguous() and out.dtype == dtype
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=1e-6, atol=1e-5)
    ulp = torch.finfo(dtype).eps * ref_out.float().abs().max().item()
    assert (out.float() - ref_out.float()).abs().max().item() <= ulp


def test_merge_relaunches_its_layout_on_new_tensors():
    """From a layout's second launch on, the kernel is relaunched with only the tensors replaced: every
    call must read its own inputs and write its own outputs, whatever the layout remembered."""
    from mla_ops.kernels.merge import LAUNCHES, merge_attn_states_triton

    gen = torch.Generator().manual_seed(4)
    kv = torch.randn(64, 8, 192, generator=gen).to(DEVICE, torch.bfloat16)
    results = []
    for call in range(4):
        prefix_out = torch.randn(64, 8, 128, generator=gen).to(DEVICE, torch.bfloat16)
        suffix_out = kv[..., 64:] if call % 2 else torch.randn(64, 8, 128, generator=gen).to(DEVICE, torch.bfloat16)
        prefix_lse, suffix_lse = (torch.randn(8, 64, generator=gen).to(DEVICE) for _ in range(2))
        if call == 3:  # the same layout with the suffix's NaN rows masked by an empty side
            suffix_lse[:, ::2] = -math.inf
            suffix_out = suffix_out.clone()
            suffix_out[::2] = math.nan
        out, lse = merge_attn_states_triton(MergeCall(prefix_out, prefix_lse, suffix_out, suffix_lse))
        ref_out, ref_lse = merge_attn_states_reference(MergeCall(prefix_out, prefix_lse, suffix_out, suffix_lse))
        torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(out.float(), ref_out.float(), rtol=1e-2, atol=1e-2)
        results.append(out)
    assert len({t.data_ptr() for t in results}) == len(results)  # fresh outputs each call
    assert LAUNCHES.known, "the merge remembers its layouts"


def test_relaunches_call_the_c_launcher_where_its_forwarding_is_known():
    """With the Tritons this package knows (3.6 to 3.9), relaunches skip CudaLauncher.__call__; anywhere else they
    go through it, and so do those of kernels that take global scratch (the Gluon kernel's, which other tests
    may have left known). Either way the results are checked by the tests above."""
    import triton

    from mla_ops.kernels import attention, merge
    from mla_ops.kernels.launch import FixedLaunch
    from mla_ops.kernels.triton_compat import SUPPORTED_RELEASES, release

    batch = make_batch([40, 24], 16, 192, 128, torch.bfloat16, device=DEVICE, seed=9)
    for _ in range(2):
        out, lse = mla_ops.prefill(batch.q, batch.k, batch.v, batch.cu_seqlens, 40)
        mla_ops.merge_attn_states(out, lse, out, lse)
    fixed = [known.launch for cache in (attention.LAUNCHES, merge.LAUNCHES) for known in cache.known.values()]
    natives = [f.native is not None for f in fixed if isinstance(f, FixedLaunch) and not f.needs_scratch]
    if release(triton.__version__) not in SUPPORTED_RELEASES:
        pytest.skip(f"Triton {triton.__version__}: its launcher's forwarding is not one this package knows")
    assert natives and all(natives)


def test_merge_op_checks_a_known_layout_changed_in_any_way():
    """The merge op checks each layout of its inputs once: after good calls, inputs that differ in one
    property its check reads (an LSE shape, a dtype, a device, grad recording) are still refused with the
    check's error, and the good layout still merges what the reference merges."""
    gen = torch.Generator().manual_seed(5)
    prefix_out, suffix_out = (torch.randn(33, 8, 128, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(2))
    prefix_lse, suffix_lse = (torch.randn(8, 33, generator=gen).to(DEVICE) for _ in range(2))
    good = (prefix_out, prefix_lse, suffix_out, suffix_lse)
    for _ in range(3):
        out, lse = torch.ops.mla.merge_attn_states(*good)
    ref_out, ref_lse = merge_attn_states_reference(MergeCall(*good))
    torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="prefix_lse"):
        torch.ops.mla.merge_attn_states(prefix_out, prefix_lse[:, :32], suffix_out, suffix_lse)
    with pytest.raises(TypeError):
        torch.ops.mla.merge_attn_states(prefix_out, prefix_lse, suffix_out.half(), suffix_lse)
    with pytest.raises(ValueError, match="cpu"):
        torch.ops.mla.merge_attn_states(prefix_out, prefix_lse, suffix_out, suffix_lse.cpu())
    with torch.enable_grad(), pytest.raises(RuntimeError, match="inference-only"):
        torch.ops.mla.merge_attn_states(prefix_out.clone().requires_grad_(), prefix_lse, suffix_out, suffix_lse)
    again, _ = torch.ops.mla.merge_attn_states(*good)
    assert torch.equal(again, out)


@pytest.mark.parametrize("heads", [16, 128, 7])
def test_lse_conversion_kernel_is_torch_mul_bit_for_bit(heads):
    """The FLASHINFER backend's LSE conversion on the device: torch.mul(lse.t(), ln 2) exactly, into a
    contiguous [H, n] and a padded batch's [H, n] view, on repeated (relaunched) calls of one layout."""
    from mla_ops.kernels.lse import lse_base2_to_natural_triton

    gen = torch.Generator().manual_seed(heads)
    for num_rows in (16, 16, 1000, 1000):
        lse = (torch.randn(num_rows, heads, generator=gen) * 30).to(DEVICE)
        lse[0, 0], lse[-1, -1], lse[1, 0] = -math.inf, math.inf, math.nan
        want = torch.mul(lse.t(), math.log(2.0))
        out = lse_base2_to_natural_triton(lse, torch.empty(heads, num_rows, device=DEVICE))
        assert torch.equal(out.view(torch.int32), want.view(torch.int32))
        wide = torch.full((heads, num_rows + 3), 7.0, device=DEVICE)
        lse_base2_to_natural_triton(lse, wide[:, :num_rows])
        assert torch.equal(wide[:, :num_rows].contiguous().view(torch.int32), want.view(torch.int32))
        assert (wide[:, num_rows:] == 7.0).all()


def test_merge_is_native_or_triton_and_handles_zero_tokens():
    """The CUDA merge is the native one where it builds (tests/test_gpu_native.py), else the Triton kernel."""
    from mla_ops import native
    from mla_ops.kernels.merge import merge_attn_states_triton

    assert merge_kernel(torch.device(DEVICE)) is (native.merge if native.is_loaded() else merge_attn_states_triton)
    empty = torch.empty(0, 4, 128, device=DEVICE, dtype=torch.bfloat16)
    lse = torch.empty(4, 0, device=DEVICE)
    out, out_lse = mla_ops.merge_attn_states(empty, lse, empty, lse)
    assert out.shape == (0, 4, 128) and out_lse.shape == (4, 0)


# --- warm-up ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dims", [(192, 128), *SMALL_DIMS], ids=lambda d: f"{d[0]}x{d[1]}")
def test_warmup_compiles_without_error(dims):
    config = SelectorConfig(torch.bfloat16, MLADimensions.from_head_dims(*dims))
    TritonBackend().warmup(torch.device(DEVICE), config, num_heads=16)


def test_a_captured_call_launches_what_the_eager_warmup_compiled(attention_launches):
    """Which kernel and variant a call launches depends on its shapes only (TMA_MIN_KEY_ROWS, the tables), so
    a captured call of shapes launched eagerly before meets nothing to compile inside the capture."""
    from mla_ops.kernels import attention

    heads, scale = 16, _scale(192)
    batch = make_batch([40, 24], heads, 192, 128, torch.bfloat16, device=DEVICE, strided_v=True, seed=8)
    keys = 1024
    _, k, v = make_qkv(keys, heads, 192, 128, torch.bfloat16, DEVICE, True, torch.Generator().manual_seed(keys))
    cu_k = cu_seqlens_of([keys // 2, keys - keys // 2], DEVICE)
    out, lse = attention.attention_triton(VarlenCall(batch.q, k, v, batch.cu_seqlens, cu_k, 40, keys, scale, False))
    assert_attention_close(out, lse, batch.q, k, v, batch.cu_seqlens, cu_k, scale, False)
    compiled = dict(attention_launches.launcher.compiled)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = attention.attention_triton(VarlenCall(batch.q, k, v, batch.cu_seqlens, cu_k, 40, keys, scale, False))
    assert attention_launches.launcher.compiled == compiled, "the capture met no variant the eager call did not"
    graph.replay()
    assert_attention_close(out, lse, batch.q, k, v, batch.cu_seqlens, cu_k, scale, False)
