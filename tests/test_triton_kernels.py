"""The Triton kernels and the TRITON backend, on CPU under ``TRITON_INTERPRET=1``: what is specific to them.

The contract every backend keeps (both paths at awkward lengths, empty sequences and chunks, strided
``v``, the LSE conventions) is checked for TRITON by tests/test_backend_contract.py; here are the tile
logic at several block shapes, the sequence lookup, the launch grid, TMA, launch configurations, the
merge kernel and the backend's reasons.

``tests/conftest.py`` turns the interpreter on when there is no CUDA device. The interpreter runs
every program in numpy, so these tests use two heads, short sequences and small blocks (passed to
the launcher explicitly); the tile logic they exercise is the same as with the GPU's large blocks.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton", reason="the Triton kernels need triton installed (pip install 'mla_ops[triton]')")

from sequence_isolation import assert_sequences_close, poison_sequences
from utils import assert_attention_close, cu_seqlens_of, make_batch, make_qkv

from mla_ops.backends.base import MergeCall, VarlenCall
from mla_ops.backends.reference import merge_attn_states_reference
from mla_ops.backends.triton import TritonBackend
from mla_ops.kernels import configs
from mla_ops.kernels.attention import attention_triton, head_dim_split
from mla_ops.kernels.configs import AttentionConfig
from mla_ops.kernels.merge import merge_attn_states_triton
from mla_ops.specs import DEEPSEEK_V3, DeviceCapability, MLADimensions, SelectorConfig

# Kernel launches on CPU tensors need the interpreter; conftest enables it on machines without CUDA.
interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="kernel launches on CPU tensors need TRITON_INTERPRET=1 (set by conftest when CUDA is absent); "
    "on a GPU machine tests/test_gpu_triton.py covers the kernels",
)

HEADS = 2
SMALL = AttentionConfig(16, 16, 4, 1)
DTYPES = [torch.bfloat16, torch.float16]


def _dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_padding(lse: torch.Tensor, valid: int) -> None:
    """Rows past cu_seqlens_q[-1] are padding: the kernel gives them lse = -inf (their out is unspecified)."""
    assert torch.isneginf(lse[:, valid:]).all(), "padding rows must have lse -inf"


def _check_empty_rows(out: torch.Tensor, lse: torch.Tensor, rows: slice) -> None:
    """Rows that attend to no key: out = 0 and lse = -inf, never NaN."""
    assert torch.equal(out[rows], torch.zeros_like(out[rows])), "rows without keys must be zero"
    assert torch.isneginf(lse[:, rows]).all(), "rows without keys must have lse -inf"


def _chunk_inputs(lengths_q, lengths_k, dqk, dv, dtype, seed=0, padding=0, strided_v=False):
    gen = torch.Generator().manual_seed(seed)
    q, _, _ = make_qkv(sum(lengths_q) + padding, HEADS, dqk, dv, dtype, generator=gen)
    _, k, v = make_qkv(sum(lengths_k), HEADS, dqk, dv, dtype, strided_v=strided_v, generator=gen)
    return q, k, v, cu_seqlens_of(lengths_q), cu_seqlens_of(lengths_k)


# --- attention: new tokens (causal) -----------------------------------------------------------------


@interpreted
@pytest.mark.parametrize(
    "config",
    [AttentionConfig(32, 16, 4, 1), AttentionConfig(16, 32, 4, 1), AttentionConfig(64, 64, 4, 2)],
    ids=str,
)
def test_causal_block_shapes(config):
    """BLOCK_M != BLOCK_N changes which key tiles are mask-free and which are diagonal."""
    lengths = [70, 1, 31, 48]
    batch = make_batch(lengths, HEADS, 192, 128, torch.float16, seed=2)
    out, lse = attention_triton(
        VarlenCall(batch.q, batch.k, batch.v, batch.cu_seqlens, batch.cu_seqlens, 70, 70, 0.1, True), config=config
    )
    assert_attention_close(out, lse, batch.q, batch.k, batch.v, batch.cu_seqlens, batch.cu_seqlens, 0.1, True)


@interpreted
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "chunk"])
def test_many_sequences_span_several_lookup_passes(monkeypatch, causal):
    """Each program finds its sequence in passes of SEQ_CHUNK offsets; make that 4 to cross passes."""
    from mla_ops.kernels import attention

    monkeypatch.setattr(attention, "SEQ_CHUNK", 4)  # what the launcher passes the kernel
    lengths_q = [3, 0, 17, 1, 0, 0, 16, 5, 33, 2, 0]
    lengths_k = lengths_q if causal else [9, 4, 0, 1, 0, 7, 16, 40, 3, 2, 0]
    q, k, v, cu_q, cu_k = _chunk_inputs(lengths_q, lengths_k, 64, 64, torch.float16, seed=17, padding=6)
    if causal:
        q, k, v = make_qkv(q.shape[0], HEADS, 64, 64, torch.float16, generator=torch.Generator().manual_seed(18))
        cu_k = cu_q
    out, lse = attention_triton(VarlenCall(q, k, v, cu_q, cu_k, 33, max(lengths_k), 0.125, causal), config=SMALL)
    assert_attention_close(out, lse, q, k, v, cu_q, cu_k, 0.125, causal)
    _check_padding(lse, sum(lengths_q))


@interpreted
def test_grid_does_not_grow_with_max_seqlen(monkeypatch):
    """A CUDA graph passes its token budget as max_seqlen: the launch must not scale with it."""
    from mla_ops.kernels import attention

    grids = []
    real_kernel = attention.LAUNCHES.launcher.kernel

    class Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return real_kernel[grid]

    # Every launch of the interpreter goes through the JIT function.
    monkeypatch.setattr(attention.LAUNCHES.launcher, "kernel", Recorder())
    batch = make_batch([30, 0, 7], HEADS, 64, 64, torch.float16, padding=4, seed=19)
    for max_seqlen in (30, 1_000_000):
        call = VarlenCall(
            batch.q, batch.k, batch.v, batch.cu_seqlens, batch.cu_seqlens, max_seqlen, max_seqlen, 0.125, True
        )
        out, lse = attention_triton(call, config=SMALL)
        assert_attention_close(out, lse, batch.q, batch.k, batch.v, batch.cu_seqlens, batch.cu_seqlens, 0.125, True)
    assert grids[0] == grids[1]
    # Tq // BLOCK_M + B slots per head, plus the programs that mark padding rows.
    assert grids[0][0] == HEADS * (41 // 16 + 3) + 1


@interpreted
def test_causal_odd_head_dims():
    """Dims that are not 2^a + 2^b pad the second QK part and the V tile, with masks."""
    batch = make_batch([21, 9], HEADS, 80, 48, torch.float16, seed=4)
    out, lse = attention_triton(
        VarlenCall(batch.q, batch.k, batch.v, batch.cu_seqlens, batch.cu_seqlens, 21, 21, 0.2, True), config=SMALL
    )
    assert_attention_close(out, lse, batch.q, batch.k, batch.v, batch.cu_seqlens, batch.cu_seqlens, 0.2, True)


@interpreted
def test_negative_scale():
    """A negative scale flips which score is the row maximum; the mask-free loop must not assume scale >= 0."""
    batch = make_batch([40], HEADS, 64, 64, torch.float16, seed=5)
    for causal in (True, False):
        out, lse = attention_triton(
            VarlenCall(batch.q, batch.k, batch.v, batch.cu_seqlens, batch.cu_seqlens, 40, 40, -0.125, causal),
            config=SMALL,
        )
        assert_attention_close(out, lse, batch.q, batch.k, batch.v, batch.cu_seqlens, batch.cu_seqlens, -0.125, causal)


@interpreted
def test_all_sequences_empty_and_no_sequences():
    q, k, v = make_qkv(6, HEADS, 64, 64, torch.float16)
    for cu in (cu_seqlens_of([0, 0]), cu_seqlens_of([])):
        _, lse = attention_triton(VarlenCall(q, k, v, cu, cu, 0, 0, 0.125, True), config=SMALL)
        _check_padding(lse, 0)


# --- attention: context chunks (non-causal) ---------------------------------------------------------


@interpreted
def test_chunk_nan_beyond_slices_does_not_leak():
    """Keys outside a sequence's slice (another sequence's, or a budget's padding) may hold NaN."""
    lengths_q, lengths_k = [7, 12], [13, 5]
    q, k, v, cu_q, cu_k = _chunk_inputs(lengths_q, lengths_k, 64, 64, torch.float16, seed=7)
    k = torch.cat([k, torch.full_like(k[:20], math.nan)])
    v = torch.cat([v, torch.full_like(v[:20], math.nan)])
    out, lse = attention_triton(VarlenCall(q, k, v, cu_q, cu_k, 12, 13, 0.125, False), config=SMALL)
    assert_attention_close(out, lse, q, k, v, cu_q, cu_k, 0.125, False)


#: The key loops of the tl.dot kernel the tables use: the plain pipelined one and the overlapped one ('ovl').
KEY_LOOPS = {"plain": {}, "ovl": dict(overlap_softmax=True)}


@interpreted
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "chunk"])
@pytest.mark.parametrize("loop", list(KEY_LOOPS), ids=str)
def test_key_loops_match_reference(loop, causal):
    flags = KEY_LOOPS[loop]
    # Full and partial 16-row blocks, an empty sequence, 5 padding rows holding NaN, keys far larger
    # than the first tile's (a later tile must rescale what the first accumulated) and strided v.
    lengths_q = [32, 0, 16, 21]
    lengths_k = lengths_q if causal else [40, 7, 0, 33]
    q, k, v, cu_q, cu_k = _chunk_inputs(lengths_q, lengths_k, 192, 128, torch.float16, seed=9, strided_v=True)
    if causal:
        cu_k = cu_q
    k[cu_k[0] + 20 : cu_k[0] + 24] *= 8.0  # row maxima grow by far more than 2^8 after the first tile
    q = torch.cat([q, torch.full_like(q[:5], math.nan)])
    config = AttentionConfig(16, 16, 4, 1, **flags)
    out, lse = attention_triton(VarlenCall(q, k, v, cu_q, cu_k, 32, 40, 0.1, causal), config=config)
    n = sum(lengths_q)
    assert_attention_close(out, lse, q, k, v, cu_q, cu_k, 0.1, causal)
    assert torch.isneginf(lse[:, n:]).all(), "padding rows must have lse -inf"


@interpreted
@pytest.mark.parametrize("blocks", [(16, 16), (32, 16)], ids=["16x16", "32x16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "chunk"])
def test_overlapped_loop_over_many_tiles(causal, blocks):
    """The ``ovl`` loops carry one tile's probabilities into the next step: sequences of 0 to 6
    whole key tiles plus a partial one, causal ones with more keys than queries (bottom-right: rows
    whose masked tiles follow several mask-free ones, and a query block that sees only masked
    tiles), and a large key late in the sequence so a later tile must rescale what the earlier
    ones accumulated."""
    lengths_q = [100, 3, 48, 17, 9] if causal else [20, 16, 5, 33, 9]
    lengths_k = [100, 40, 48, 17, 9] if causal else [100, 16, 0, 71, 9]
    q, k, v, cu_q, cu_k = _chunk_inputs(lengths_q, lengths_k, 192, 128, torch.float16, seed=5, strided_v=True)
    q = torch.cat([q, torch.full_like(q[:3], math.nan)])  # padding rows
    k[cu_k[0] + 70 : cu_k[0] + 72] *= 6.0
    config = AttentionConfig(*blocks, 4, 1, overlap_softmax=True)  # 32x16: 2 diagonal tiles
    out, lse = attention_triton(
        VarlenCall(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), 0.1, causal), config=config
    )
    assert_attention_close(out, lse, q, k, v, cu_q, cu_k, 0.1, causal)


@interpreted
@pytest.mark.parametrize("loop", list(KEY_LOOPS), ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "chunk"])
def test_key_loops_isolate_sequences(loop, causal):
    """The key loops read no key or value outside a sequence's own rows (masked loads read them as 0), so
    NaN and inf in the keys and values of a sequence's neighbours never reach its output.

    Clean sequences shorter than a tile sit at row 0, between two poisoned sequences and at the end,
    before padding rows (past ``cu_seqlens_k[-1]``) that hold NaN; a tile-aligned one and longer ones
    are there too. A tile that started before a short sequence or ran past its end would weigh those
    rows 0 in the PV product, and ``0 * NaN`` and ``0 * inf`` are NaN. Each clean sequence must match
    the reference computed from its own rows; causal runs with more keys than queries (bottom-right).
    """
    poisoned = {1, 3, 6}
    lengths_q = [5, 7, 3, 20, 16, 0, 9, 11]
    lengths_k = [9, 7, 3, 24, 16, 0, 9, 13] if causal else [9, 7, 3, 24, 32, 0, 9, 13]
    # One more key sequence, cut off below: its rows are the padding past cu_seqlens_k[-1].
    q, k, v, cu_q, cu_k = _chunk_inputs(lengths_q, [*lengths_k, 6], 192, 128, torch.float16, seed=11, strided_v=True)
    cu_k = cu_k[:-1].contiguous()
    poison_sequences(k, v, cu_k, [*poisoned, len(lengths_k)])
    q = torch.cat([q, torch.full_like(q[:3], math.nan)])
    config = AttentionConfig(16, 16, 4, 1, **KEY_LOOPS[loop])
    out, lse = attention_triton(VarlenCall(q, k, v, cu_q, cu_k, 20, 32, 0.1, causal), config=config)
    clean = sorted(set(range(len(lengths_q))) - poisoned)
    assert_sequences_close(out, lse, q, k, v, cu_q, cu_k, 0.1, causal, clean)
    assert torch.isneginf(lse[:, sum(lengths_q) :]).all(), "padding rows must have lse -inf"


@interpreted
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    causal=st.booleans(),
    dims=st.sampled_from([(192, 128), (64, 64)]),
    dtype=st.sampled_from(DTYPES),
    block=st.sampled_from([(16, 16), (32, 16), (16, 32)]),
)
def test_fuzz_ragged_batches(data, causal, dims, dtype, block):
    dqk, dv = dims
    lengths_q = data.draw(st.lists(st.integers(0, 24), min_size=1, max_size=4), label="lengths_q")
    if causal:
        lengths_k = lengths_q
    else:
        lengths_k = data.draw(
            st.lists(st.integers(0, 24), min_size=len(lengths_q), max_size=len(lengths_q)), label="lengths_k"
        )
    padding = data.draw(st.integers(0, 3), label="padding")
    slack = data.draw(st.integers(0, 20), label="max_seqlen slack")
    if causal:
        q, k, v = make_qkv(sum(lengths_q) + padding, HEADS, dqk, dv, dtype, generator=torch.Generator().manual_seed(9))
        cu_q = cu_k = cu_seqlens_of(lengths_q)
    else:
        q, k, v, cu_q, cu_k = _chunk_inputs(lengths_q, lengths_k, dqk, dv, dtype, seed=9, padding=padding)
    config = AttentionConfig(*block, 4, 1)
    out, lse = attention_triton(
        VarlenCall(q, k, v, cu_q, cu_k, max(lengths_q) + slack, max(lengths_k) + slack, dqk**-0.5, causal),
        config=config,
    )
    assert_attention_close(out, lse, q, k, v, cu_q, cu_k, dqk**-0.5, causal)
    _check_padding(lse, sum(lengths_q))


def test_head_dim_split():
    assert head_dim_split(192) == (128, 64)
    assert head_dim_split(128) == (128, 0)
    assert head_dim_split(64) == (64, 0)
    assert head_dim_split(80) == (64, 16)
    assert head_dim_split(240) == (128, 128)


def test_launcher_rejects_bad_inputs():
    q, k, v = make_qkv(4, HEADS, 72, 64, torch.float16)
    cu = cu_seqlens_of([4])
    with pytest.raises(ValueError, match="Dqk must be a multiple of 16"):
        attention_triton(VarlenCall(q, k, v, cu, cu, 4, 4, 0.1, True))
    q, k, v = make_qkv(4, HEADS, 64, 64, torch.float32)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        attention_triton(VarlenCall(q, k, v, cu, cu, 4, 4, 0.1, True))


# --- merge ------------------------------------------------------------------------------------------


def _assert_merge_close(got, want):
    out, lse = got
    ref_out, ref_lse = want
    assert out.is_contiguous() and lse.is_contiguous() and out.dtype == ref_out.dtype and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=1e-6, atol=1e-6)
    # Both compute in fp32 and round once; they may differ by one ulp of the output dtype.
    ulp = torch.finfo(out.dtype).eps * max(ref_out.float().abs().max().item(), 1.0)
    assert (out.float() - ref_out.float()).abs().max().item() <= ulp


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_merge_matches_reference_with_empty_sides(dtype):
    num_tokens, heads, dv = 37, 3, 128
    gen = torch.Generator().manual_seed(11)
    prefix_out = torch.randn(num_tokens, heads, dv, generator=gen).to(dtype)
    suffix_out = torch.randn(num_tokens, heads, dv, generator=gen).to(dtype)
    prefix_lse = torch.randn(heads, num_tokens, generator=gen) * 4
    suffix_lse = torch.randn(heads, num_tokens, generator=gen) * 4
    # Empty prefix (-inf, and +inf as some kernels write), with NaN in its ignored output.
    prefix_lse[0, :6], prefix_lse[1, :6] = -math.inf, math.inf
    prefix_out[:6, :2] = math.nan
    # Empty suffix on other rows; both empty (mixing -inf and +inf) on rows 4..5.
    suffix_lse[0, 4:10], suffix_lse[1, 4:10] = math.inf, -math.inf
    suffix_out[4:10, :2] = math.nan
    # Very different magnitudes: one side's weight underflows to 0.
    prefix_lse[2, 20], suffix_lse[2, 20] = 200.0, -200.0
    got = merge_attn_states_triton(MergeCall(prefix_out, prefix_lse, suffix_out, suffix_lse), block_t=8)
    want = merge_attn_states_reference(MergeCall(prefix_out, prefix_lse, suffix_out, suffix_lse))
    _assert_merge_close(got, want)
    out, lse = got
    assert torch.isneginf(lse[:2, 4:6]).all() and torch.equal(out[4:6, :2], torch.zeros_like(out[4:6, :2]))
    # +inf means empty, exactly like -inf.
    assert torch.equal(out[:4, 1], suffix_out[:4, 1]) and torch.equal(lse[1, :4], suffix_lse[1, :4])


@interpreted
def test_merge_strided_inputs():
    """Outputs that are views (unit last stride) and lse stored [T, H] and viewed as [H, T]."""
    num_tokens, heads, dv = 21, 2, 64
    gen = torch.Generator().manual_seed(12)
    wide = torch.randn(num_tokens, heads, 2 * dv, generator=gen).to(torch.bfloat16)
    prefix_out, suffix_out = wide[..., :dv], wide[..., dv:]
    prefix_lse = torch.randn(num_tokens, heads, generator=gen).t()
    suffix_lse = torch.randn(num_tokens, heads, generator=gen).t()
    assert not prefix_lse.is_contiguous()
    got = merge_attn_states_triton(MergeCall(prefix_out, prefix_lse, suffix_out, suffix_lse))
    _assert_merge_close(got, merge_attn_states_reference(MergeCall(prefix_out, prefix_lse, suffix_out, suffix_lse)))
    # Contiguous copies take the kernel without stride arguments: the same bits.
    dense = merge_attn_states_triton(
        MergeCall(*(t.contiguous() for t in (prefix_out, prefix_lse, suffix_out, suffix_lse)))
    )
    assert torch.equal(dense[0].view(torch.int16), got[0].view(torch.int16))
    assert torch.equal(dense[1].view(torch.int32), got[1].view(torch.int32))


@interpreted
@pytest.mark.parametrize("merge", ["triton", "reference"])
def test_merge_reads_a_base2_lse_as_if_converted_first(merge):
    """``*_lse_base2``: a side's base-2 LSE (a library's own, [T, H] viewed as [H, T]) merges bit for bit as
    the same LSE converted first (``lse * ln 2``, as the FLASHINFER backend's attention() converts it),
    the empty-side markers (-inf, +inf) and NaN included."""
    num_tokens, heads, dv = 19, 3, 64
    gen = torch.Generator().manual_seed(14)
    prefix_out = torch.randn(num_tokens, heads, dv, generator=gen).to(torch.bfloat16)
    suffix_out = torch.randn(num_tokens, heads, dv, generator=gen).to(torch.bfloat16)
    prefix_lse2 = (torch.randn(num_tokens, heads, generator=gen) * 6).t()
    suffix_lse2 = (torch.randn(num_tokens, heads, generator=gen) * 6).t()
    prefix_lse2[0, :3], suffix_lse2[1, 2:5], prefix_lse2[2, 7] = -math.inf, math.inf, math.nan
    fn = merge_attn_states_triton if merge == "triton" else merge_attn_states_reference
    ln2 = math.log(2.0)
    for base2 in ((True, False), (False, True), (True, True)):
        pl = prefix_lse2 if base2[0] else prefix_lse2 * ln2
        sl = suffix_lse2 if base2[1] else suffix_lse2 * ln2
        got = fn(MergeCall(prefix_out, pl, suffix_out, sl, prefix_lse_base2=base2[0], suffix_lse_base2=base2[1]))
        want = fn(MergeCall(prefix_out, prefix_lse2 * ln2, suffix_out, suffix_lse2 * ln2))
        assert torch.equal(got[0].view(torch.int16), want[0].view(torch.int16)), base2  # bf16 bits
        assert torch.equal(got[1].view(torch.int32), want[1].view(torch.int32)), base2  # fp32 bits, NaN too
    # Without the keyword the same numbers are read as natural log: a different result, so the flag matters.
    plain = fn(MergeCall(prefix_out, prefix_lse2, suffix_out, suffix_lse2))
    assert not torch.equal(plain[1].nan_to_num(), want[1].nan_to_num())


def test_merge_checks_each_layout_once_on_host_stand_ins(monkeypatch, merge_launches):
    """``check=``: called before a layout's first launch and not again for it; called again for any change of
    shape, stride, dtype, device or grad recording (all that mla.merge_attn_states' check reads), and for a
    layout known only from calls without a check. The launches are stand-ins, so this runs on CPU tensors."""
    from mla_ops.kernels import merge
    from mla_ops.meta.checks import check_merge_inputs

    launches, checks = [], []

    class Launch:  # what a FixedLaunch is called with
        native = None

        def __call__(self, leading):
            launches.append(leading)

    def fake_launch(prefix_out, prefix_lse, suffix_out, suffix_lse, out, lse, *rest):
        launches.append("first")
        return Launch()

    def check(*tensors):
        checks.append(len(tensors))
        check_merge_inputs(*tensors)

    merge_launches.launch = fake_launch
    monkeypatch.setattr(merge, "current_cuda_device", lambda: -1)  # a CPU tensor's get_device()
    gen = torch.Generator().manual_seed(3)
    po, so = (torch.randn(8, 2, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    pl, sl = torch.randn(2, 8, generator=gen), torch.randn(2, 8, generator=gen)
    out, lse = merge.merge_attn_states_triton(MergeCall(po, pl, so, sl), check=check)
    assert (checks, launches) == ([4], ["first"]) and out.shape == (8, 2, 64) and lse.shape == (2, 8)
    out2, _ = merge.merge_attn_states_triton(MergeCall(po.clone(), pl, so, sl), check=check)
    assert checks == [4] and len(launches) == 2 and launches[-1][4] == out2.data_ptr()  # no check, relaunched
    bad = [
        (po, torch.randn(2, 9), so, sl, ValueError),  # an LSE of another shape
        (po, pl.double(), so, sl, TypeError),  # another dtype
        (po, pl, so.half(), sl, TypeError),
        (po, pl, so, sl.t().contiguous().t(), None),  # other strides, same values: checked, accepted
    ]
    for prefix_out, prefix_lse, suffix_out, suffix_lse, error in bad:
        before = len(checks)
        if error is None:
            merge.merge_attn_states_triton(MergeCall(prefix_out, prefix_lse, suffix_out, suffix_lse), check=check)
        else:
            with pytest.raises(error):
                merge.merge_attn_states_triton(MergeCall(prefix_out, prefix_lse, suffix_out, suffix_lse), check=check)
        assert len(checks) == before + 1
    with torch.enable_grad(), pytest.raises(RuntimeError, match="inference-only"):
        merge.merge_attn_states_triton(MergeCall(po.requires_grad_(), pl, so, sl), check=check)
    po.requires_grad_(False)
    # Known from a call without a check: the first call with one checks it.
    other = torch.randn(4, 2, 64).to(torch.bfloat16), torch.randn(2, 4)
    merge.merge_attn_states_triton(MergeCall(*other, *other))
    before = len(checks)
    merge.merge_attn_states_triton(MergeCall(*other, *other), check=check)
    merge.merge_attn_states_triton(MergeCall(*other, *other), check=check)
    assert len(checks) == before + 1


def test_merge_zero_tokens():
    empty_out, empty_lse = torch.empty(0, 2, 64, dtype=torch.float16), torch.empty(2, 0)
    out, lse = merge_attn_states_triton(MergeCall(empty_out, empty_lse, empty_out, empty_lse))
    assert out.shape == (0, 2, 64) and lse.shape == (2, 0)


@interpreted
@pytest.mark.parametrize("heads", [16, 3, 80])
def test_lse_conversion_kernel_is_torch_mul_bit_for_bit(heads):
    """The FLASHINFER backend's LSE conversion kernel writes ``torch.mul(lse.t(), ln 2, out=out)`` exactly:
    into a contiguous [H, n] and into the [H, n] view of a padded batch's wider buffer, -inf, +inf and NaN
    kept; a token count over one block of tokens, heads over one block of heads where there are more."""
    from mla_ops.kernels.lse import lse_base2_to_natural_triton

    num_rows = 70
    lse = torch.randn(num_rows, heads, generator=torch.Generator().manual_seed(heads)) * 30
    lse[0, 0], lse[3, -1], lse[-1, 1] = -math.inf, math.inf, math.nan
    want = torch.mul(lse.t(), math.log(2.0))
    out = lse_base2_to_natural_triton(lse, torch.empty(heads, num_rows))
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))
    wide = torch.full((heads, num_rows + 5), 7.0)
    lse_base2_to_natural_triton(lse, wide[:, :num_rows])
    assert torch.equal(wide[:, :num_rows].contiguous().view(torch.int32), want.view(torch.int32))
    assert (wide[:, num_rows:] == 7.0).all()
    with pytest.raises(ValueError, match=r"out \[H, n\]"):
        lse_base2_to_natural_triton(lse, torch.empty(num_rows, heads + 1))


@interpreted
def test_merge_reconstructs_unsplit_attention():
    """Attention over keys [A; B] == merge(attention over A, attention over B): checks the LSE base."""
    lengths_q, lengths_a, lengths_b = [11, 6], [9, 0], [14, 5]
    gen = torch.Generator().manual_seed(13)
    q, _, _ = make_qkv(sum(lengths_q) + 4, HEADS, 64, 64, torch.float16, generator=gen)  # 4 padding rows
    _, k_a, v_a = make_qkv(sum(lengths_a), HEADS, 64, 64, torch.float16, generator=gen)
    _, k_b, v_b = make_qkv(sum(lengths_b), HEADS, 64, 64, torch.float16, generator=gen)
    cu_q, cu_a, cu_b = cu_seqlens_of(lengths_q), cu_seqlens_of(lengths_a), cu_seqlens_of(lengths_b)
    part_a = attention_triton(VarlenCall(q, k_a, v_a, cu_q, cu_a, 11, 9, 0.125, False), config=SMALL)
    part_b = attention_triton(VarlenCall(q, k_b, v_b, cu_q, cu_b, 11, 14, 0.125, False), config=SMALL)
    out, lse = merge_attn_states_triton(MergeCall(*part_a, *part_b))
    # Padding rows have lse -inf on both sides, so the merge writes clean zeros there.
    _check_empty_rows(out, lse, slice(17, None))
    k = torch.cat([k_a[:9], k_b[:14], k_a[9:], k_b[14:]])
    v = torch.cat([v_a[:9], v_b[:14], v_a[9:], v_b[14:]])
    cu_k = cu_seqlens_of([a + b for a, b in zip(lengths_a, lengths_b)])
    # Two roundings to fp16 (each part, then the merge) against one: allow a factor of 3.
    assert_attention_close(out, lse, q, k, v, cu_q, cu_k, 0.125, False, factor=3.0)


# --- configuration ----------------------------------------------------------------------------------


def test_config_env_var(monkeypatch):
    monkeypatch.setenv(configs.CONFIG_ENV_VAR, "64, 32, 4, 2")
    assert configs.attention_config(torch.device("cpu"), 192, 128, True, torch.bfloat16) == AttentionConfig(
        64, 32, 4, 2
    )
    monkeypatch.setenv(configs.CONFIG_ENV_VAR, "128,64,8,3, OVL")
    overlap = AttentionConfig(128, 64, 8, 3, overlap_softmax=True)
    assert configs.env_attention_config() == overlap
    # str() writes the same format back, so the tuning script's output can be pasted into the variable.
    gluon = AttentionConfig(128, 128, 4, 2, overlap_softmax=True, gluon=True, persistent=True)
    for config in (AttentionConfig(64, 32, 4, 2), overlap, gluon):
        assert AttentionConfig.parse(str(config)) == config
    assert str(gluon) == "128,128,4,2,ovl,gluon,pers"
    assert AttentionConfig.parse("128,128,4,2,pers,gluon,ovl") == gluon
    pingpong = AttentionConfig(128, 128, 4, 4, overlap_softmax=True, gluon=True, persistent=True, pingpong=True)
    assert str(pingpong) == "128,128,4,4,ovl,gluon,pers,pp"
    assert AttentionConfig.parse("128,128,4,4,gluon,ovl,pers,PP") == pingpong


@pytest.mark.parametrize("flag", sorted(configs.REMOVED_FLAGS))
def test_removed_flags_are_refused_with_their_reason(monkeypatch, flag):
    """The flags of variants no table chose name what they were and that they were removed."""
    monkeypatch.setenv(configs.CONFIG_ENV_VAR, f"128,64,8,3,{flag}")
    with pytest.raises(ValueError) as info:
        configs.env_attention_config()
    message = str(info.value)
    assert message.startswith(f"MLA_OPS_TRITON_CONFIG='128,64,8,3,{flag}': the flag '{flag}' was removed (")
    assert configs.REMOVED_FLAGS[flag] in message and "drop it" in message
    assert len(message.splitlines()) == 1


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("128,64,8", "must be 'BLOCK_M,BLOCK_N,num_warps,num_stages"),
        ("128,64,eight,3", "integer fields"),
        ("100,64,8,3", "block_m must be a power of two from 16 to 256, got 100"),
        ("128,512,8,3", "block_n must be a power of two"),
        ("128,64,6,3", "num_warps must be 1, 2, 4, 8 or 16, got 6"),
        ("128,64,8,0", "num_stages must be an integer from 1 to 8"),
        ("128,64,8,3,yes", "unknown flag 'yes'"),
        ("128,128,8,2,gluon,ovl,pers", "gluon (the Hopper Gluon kernel) needs block_m=128, num_warps=4"),
        ("64,64,4,2,gluon,ovl,pers", "needs block_m=128"),
        ("128,32,4,2,gluon,ovl,pers", "block_n 64 or 128, got 128,32,4"),
        ("128,128,4,2,gluon", "gluon needs 'ovl' and 'pers' too ('gluon,ovl,pers')"),
        ("128,128,4,2,gluon,ovl", "gluon needs 'ovl' and 'pers' too"),
        ("128,64,8,3,ovl,pers", "persistent (the 'pers' flag) needs gluon"),
        ("128,64,8,3,ovl,pp", "pingpong (the 'pp' flag) needs gluon"),
    ],
)
def test_config_env_var_errors(monkeypatch, text, message):
    monkeypatch.setenv(configs.CONFIG_ENV_VAR, text)
    with pytest.raises(ValueError, match="MLA_OPS_TRITON_CONFIG") as info:
        q, k, v = make_qkv(4, HEADS, 64, 64, torch.float16)
        cu = cu_seqlens_of([4])
        attention_triton(VarlenCall(q, k, v, cu, cu, 4, 4, 0.1, True))
    assert message in str(info.value)


def test_config_env_value_follows_the_variable(monkeypatch):
    """What the attention kernel's layout names of MLA_OPS_TRITON_CONFIG: None while unset, and a value that
    changes with the text (set, changed, removed through os.environ, as monkeypatch and users do)."""
    monkeypatch.delenv(configs.CONFIG_ENV_VAR, raising=False)
    assert configs.config_env_value() is None
    seen = []
    for text in ("64,32,4,2", "64,32,4,2", "128,64,8,3"):
        monkeypatch.setenv(configs.CONFIG_ENV_VAR, text)
        seen.append(configs.config_env_value())
    assert seen[0] == seen[1] and seen[1] != seen[2] and None not in seen
    monkeypatch.delenv(configs.CONFIG_ENV_VAR)
    assert configs.config_env_value() is None


def test_config_tables():
    sm90 = configs.table_attention_config((9, 0), 192, 128, True, torch.bfloat16)
    assert sm90 == configs.SM90_ATTENTION[(192, 128, True)]
    # A dtype-specific entry wins over the dtype-free one.
    special = AttentionConfig(64, 64, 4, 2)
    table = {(192, 128, True): sm90, (192, 128, True, torch.float16): special}
    assert configs._lookup(table, 192, 128, True, torch.float16) == special
    assert configs._lookup(table, 192, 128, True, torch.bfloat16) == sm90
    # Untuned dims and GPUs get a default that fits the device's shared memory.
    ada = configs.table_attention_config((8, 9), 256, 256, False, torch.float16, shared_memory=99 * 1024)
    assert configs.shared_memory_estimate(ada, 256, 256) <= 99 * 1024
    for config in (sm90, *configs.SM90_ATTENTION.values()):
        assert configs.shared_memory_estimate(config, 192, 128) <= 227 * 1024


def test_gluon_kernel_is_refused_where_it_cannot_run(monkeypatch):
    """The Gluon kernel runs on SM90 GPUs only: an explicit request elsewhere (here the interpreter's CPU
    tensors, through the argument and the variable) is refused with the reason and what to do, and the
    large-batch table has no entry off CUDA."""
    q, k, v = make_qkv(4, HEADS, 192, 128, torch.bfloat16)
    cu = cu_seqlens_of([4])
    gluon = AttentionConfig(128, 128, 4, 2, overlap_softmax=True, gluon=True, persistent=True)
    with pytest.raises(ValueError, match="asks for the Gluon kernel, but it runs on CUDA devices only") as info:
        attention_triton(VarlenCall(q, k, v, cu, cu, 4, 4, 0.1, True), config=gluon)
    assert "drop the 'gluon' flag" in str(info.value)
    monkeypatch.setenv(configs.CONFIG_ENV_VAR, str(gluon))
    with pytest.raises(ValueError, match="asks for the Gluon kernel"):
        attention_triton(VarlenCall(q, k, v, cu, cu, 4, 4, 0.1, False))
    monkeypatch.delenv(configs.CONFIG_ENV_VAR)
    assert configs.large_batch_attention_config(torch.device("cpu"), 192, 128, True, torch.bfloat16) is None
    for entry in configs.SM90_LARGE_BATCH_ATTENTION.values():
        assert entry.gluon


def test_gluon_kernel_runs_on_the_triton_releases_it_is_adapted_to():
    """The Hopper kernel runs with the supported releases (pyproject.toml's range); with any other it is
    neither chosen nor accepted, with a reason that names the installed release."""
    from mla_ops.kernels.triton_compat import SUPPORTED_RELEASES, gluon_triton_reason

    assert SUPPORTED_RELEASES == ("3.6", "3.7", "3.8", "3.9")
    for version in ("3.6.0", "3.7.1", "3.8.0", "3.9.0", "3.8.1+git123"):
        assert gluon_triton_reason(version) is None
    for version in ("3.5.1", "3.10.0"):
        reason = gluon_triton_reason(version)
        assert reason is not None and f"(installed: {version})" in reason and "3.6, 3.7, 3.8, 3.9" in reason


def test_gluon_kernel_is_register_lean_from_triton_3_8():
    """3.6 and 3.7 compile the Gluon kernel as timed on the H200; 3.8 on take the spellings that fit its
    register budgets (compared as numbers: 3.10 is after 3.9)."""
    from mla_ops.kernels.triton_compat import lean_registers

    assert not lean_registers("3.6.0") and not lean_registers("3.7.1")
    assert lean_registers("3.8.0") and lean_registers("3.9.0+git1a2b") and lean_registers("3.10.0")


def test_supported_triton_releases_match_pyproject():
    """pyproject.toml's triton requirements admit exactly the releases the kernels are adapted to."""
    import re
    from pathlib import Path

    from mla_ops.kernels.triton_compat import SUPPORTED_RELEASES

    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    first, last = SUPPORTED_RELEASES[0], SUPPORTED_RELEASES[-1]
    upper = f"{last.split('.')[0]}.{int(last.split('.')[1]) + 1}"
    requirements = re.findall(r'"(triton[^"]*)"', text)
    assert requirements and set(requirements) == {f"triton>={first},<{upper}"}


def test_gluon_names_resolve_under_the_installed_triton():
    """The adapter gives the Gluon builtin under this release's name (Triton 3.6: the old name; 3.7 on: the new)."""
    pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon, which the kernel is written in")
    from mla_ops.kernels import triton_compat

    function = triton_compat.tma_load()
    assert function.__name__ in ("async_load", "async_copy_global_to_shared")
    assert getattr(function, "__triton_builtin__", False)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_compile_sm90_compiles_the_tabled_variants_under_the_installed_triton(dtype):
    """benchmarks/compile_sm90.py (no GPU needed) compiles every variant the SM90 tables launch for sm_90a with
    this Triton: no compile error, no spill, no serialised wgmma, the Gluon kernel warp-specialised; for fp8 inputs,
    the main table's entries, which fp8 calls launch at every size, and the Gluon kernel's fp8 variant (large fp8
    calls' on SM90), also on key-major values. benchmarks/compile_matrix.sh runs it under each supported release."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = root / "benchmarks" / "compile_sm90.py"
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))  # this checkout's kernels
    command = [sys.executable, str(script), "--dtype", dtype]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode == 2 and "needs Triton with its NVIDIA backend and ptxas" in proc.stderr:
        pytest.skip(f"this Triton cannot compile for sm_90a here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    fp8 = dtype == "float8_e4m3fn"
    large = configs.SM90_GLUON_FP8_ATTENTION if fp8 else configs.SM90_LARGE_BATCH_ATTENTION
    tables = (configs.SM90_ATTENTION, large)
    tabled = {(str(c), k[2]) for t in tables for k, c in t.items() if k[:2] == (192, 128)}
    # fp8: the Gluon variants once more on key-major values of one sequence, read without the copy (vK).
    variants = len(tabled) + (len({(str(c), k[2]) for k, c in large.items() if k[:2] == (192, 128)}) if fp8 else 0)
    summary = proc.stdout.strip().splitlines()[-1]
    inputs = ", fp8 (e4m3)" if dtype == "float8_e4m3fn" else ""
    assert f"sm_90a{inputs}: {variants} of {variants} variants compiled" in summary, summary
    assert proc.stdout.count("vK(device)") == (variants - len(tabled)), proc.stdout
    assert "0 spill, 0 serialise wgmma; 0 failed" in summary, summary
    if fp8:  # the values' transposed copy stores 16-byte vectors, not single bytes (which made it 11x a plain copy)
        copy = next(line for line in proc.stdout.splitlines() if line.startswith("transposed values copy"))
        assert "st.global.v4" in copy and "FAIL" not in copy, copy


def test_program_layout():
    """Slots cover any batch of the query rows (one extra per sequence), heads are grouped so that a group's
    K/V fits the L2 budget, and the padding fill gets one program per 256 rows, at most 64."""
    from mla_ops.kernels.programs import L2_BUDGET_BYTES, program_layout

    layout = program_layout(1000, 16, 3, 900, 8192, 640, 128)
    assert layout == (1000 // 128 + 3, L2_BUDGET_BYTES // (8192 * 640), 4)
    assert layout.grid(16) == (16 * layout.num_slots + 4,)
    assert program_layout(1000, 16, 3, 0, 8192, 640, 128).num_slots == 0  # no query: no attention programs
    assert program_layout(1 << 20, 2, 1, 1, 1, 640, 64) == ((1 << 20) // 64 + 1, 2, 64)


def test_gluon_kernel_scope():
    """What the Gluon kernel covers, checked on the host before any launch."""
    pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon, which the kernel is written in")
    from mla_ops.kernels.attention_sm90 import sm90_shared_memory, sm90_unsupported_reason

    def reason(dqk=192, dv=128, dtype=torch.bfloat16, scale=0.1, block_n=128, stages=2, strided=False):
        q, k, v = make_qkv(8, 2, dqk, dv, dtype, strided_v=strided)
        return sm90_unsupported_reason(q, k, v, scale, block_n, stages)

    assert reason() == "tensors that are not all on one CUDA device"  # CPU tensors, otherwise in scope
    assert "head sizes (Dqk, Dv) = (128, 128)" in reason(128, 128)
    assert "head sizes (Dqk, Dv) = (192, 96)" in reason(192, 96)
    assert "dtype torch.float32" in reason(dtype=torch.float32)
    assert reason(scale=-0.1) == "a negative softmax scale"
    assert "overflow shared memory" in reason(block_n=128, stages=3)
    assert sm90_shared_memory(192, 128, 128, 2) <= 227 * 1024 < sm90_shared_memory(192, 128, 128, 3)
    # fp8: half the bytes per tile plus the probabilities' buffers; the values are copied transposed before the
    # launch, so their strides need no alignment; each head part is a wgmma K of 32 e4m3 values at least.
    fp8 = torch.float8_e4m3fn
    assert reason(dtype=fp8, stages=4, strided=True) == "tensors that are not all on one CUDA device"
    assert "overflow shared memory" in reason(dtype=fp8, stages=5)
    assert "6 stages in fp8" in reason(dtype=fp8, block_n=64, stages=6)  # they fit, but have 4 named barriers
    assert sm90_shared_memory(192, 128, 128, 4, 1) <= 227 * 1024 < sm90_shared_memory(192, 128, 128, 5, 1)
    assert "b >= 5" in reason(144, 128, dtype=fp8) and reason(144, 128) == "tensors that are not all on one CUDA device"


def test_gluon_launch_arguments_on_host_stand_ins():
    """``sm90_launch`` on CPU stand-ins: one program per multiprocessor, at most one per work item, with a
    zeroed item counter, followed by the padding programs. Its leading arguments are the seven tensors and the
    counter, and only integers follow, so that a layout's later calls relaunch with new addresses (the kernel
    builds its TMA descriptors itself, over Q's and K's rows); the blocks' shared-memory layouts are built once,
    not per launch, and a variant's key does not depend on the number of programs."""
    pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon, which the kernel is written in")
    from triton.experimental.gluon import language as gl

    from mla_ops.kernels import attention_sm90
    from mla_ops.kernels.programs import program_layout

    q, k, v = make_qkv(300, 4, 192, 128, torch.bfloat16, strided_v=True)
    k = torch.empty(290, 8, 256, dtype=torch.bfloat16)[:, 2:6, 32:224]  # rows and heads of a wider tensor
    out, lse = torch.empty(300, 4, 128, dtype=torch.bfloat16), torch.empty(4, 300)
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)

    def launch(num_sms):
        call = VarlenCall(q, k, v, cu, cu, 200, 200, 0.1, True)
        return attention_sm90.sm90_launch(call, out, lse, 128, 2, num_sms=num_sms)

    slots, _, pad = program_layout(300, 4, 2, 200, 200, 320 * 2, attention_sm90.BLOCK_M)
    plan, plan_p = launch(num_sms=1000), launch(num_sms=3)
    leading = attention_sm90.SM90_LEADING
    assert plan.leading == leading == 8
    assert list(plan.args[:7]) == [q, k, v, out, lse, cu, cu]
    assert not any(isinstance(a, torch.Tensor) for a in plan.args[leading:]), "only scalars follow"
    names = [p.name for p in attention_sm90._attn_fwd_sm90.params if not p.is_constexpr]
    assert len(names) == len(plan.args) and names[leading - 1] == "Counter"
    args, args_p = dict(zip(names, plan.args)), dict(zip(names, plan_p.args))
    assert (plan.grid, args["num_workers"]) == ((4 * slots + pad,), 4 * slots)  # fewer items than multiprocessors
    assert (plan_p.grid, args_p["num_workers"]) == ((3 + pad,), 3)
    for launched in (args, args_p):
        assert launched["Counter"].dtype == torch.int32 and launched["Counter"].tolist() == [0]
    # Q's rows span its 4 heads; K's run to the end of its last head's 192 channels in the wider rows.
    assert (args["num_tokens_q"], args["q_cols"], args["stride_qt"]) == (300, 4 * 192, 4 * 192)
    assert (args["k_rows"], args["k_cols"], args["stride_kt"]) == (290, 3 * 256 + 192, 8 * 256)
    assert plan.key == plan_p.key
    constexprs = plan.constexprs
    assert plan_p.constexprs["Q_LAYOUT_A"] is constexprs["Q_LAYOUT_A"]
    assert constexprs["Q_LAYOUT_A"] is not constexprs["K_LAYOUT_A"]
    assert constexprs["Q_LAYOUT_A"] == gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16)  # 128 channels
    assert (constexprs["D_A"], constexprs["D_B"], constexprs["D_V"], constexprs["BN"]) == (128, 64, 128, 128)
    assert constexprs["FP8"] is False and constexprs["P_LAYOUT"] is None
    assert constexprs["PINGPONG"] is False  # the 'pp' flag: its own variant, the arguments unchanged
    call = VarlenCall(q, k, v, cu, cu, 200, 200, 0.1, True)
    turns = attention_sm90.sm90_launch(call, out, lse, 128, 2, num_sms=1000, pingpong=True)
    assert turns.constexprs["PINGPONG"] is True and turns.key != plan.key
    assert [type(a) for a in turns.args] == [type(a) for a in plan.args] and turns.grid == plan.grid
    descale_names = ["QDescale", "KDescale", "VDescale", "stride_qd", "stride_kd", "stride_vd"]
    assert [args[n] for n in descale_names] == [None] * 6  # bf16: no descale factors nor strides, compiled out


def test_gluon_fp8_launch_arguments_on_host_stand_ins():
    """``sm90_launch`` with fp8 scales: the values go in transposed (``[H, Dv, width]``, keys contiguous, each
    sequence's from an aligned column after a block of lead columns) with their channel and head strides; the
    descale factors follow the counter among the leading arguments (their strides, 0 for one factor, after the
    softmax scale); the ``FP8`` constexpr, the ``[Dv, keys]`` value tiles' layout and the probabilities' buffer
    layout; Q's and K's descriptors are still the kernel's own, over extents passed as for bf16."""
    pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon, which the kernel is written in")
    from triton.experimental.gluon import language as gl

    from mla_ops.backends.base import Fp8Scales
    from mla_ops.kernels import attention_sm90

    q, k, v = (x.to(torch.float8_e4m3fn) for x in make_qkv(300, 4, 192, 128, torch.float32, strided_v=True))
    out, lse = torch.empty(300, 4, 128, dtype=torch.bfloat16), torch.empty(4, 300)
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    q_descale, v_descale = torch.rand(4) + 0.5, torch.tensor([0.25]).expand(4)
    scales = Fp8Scales(q_descale, q_descale, v_descale, torch.bfloat16)
    call = VarlenCall(q, k, v, cu, cu, 200, 200, 0.1, True)
    plan = attention_sm90.sm90_launch(call, out, lse, 128, 4, num_sms=132, scales=scales)
    leading = attention_sm90.SM90_LEADING_FP8
    assert plan.leading == leading == 11
    names = [p.name for p in attention_sm90._attn_fwd_sm90.params if not p.is_constexpr]
    assert len(names) == len(plan.args) and names[:leading][-4:] == ["Counter", "QDescale", "KDescale", "VDescale"]
    assert not any(isinstance(a, torch.Tensor) for a in plan.args[leading:]), "only scalars follow"
    args = dict(zip(names, plan.args))
    assert all(args[n] is t for n, t in zip(["Q", "K", "Out", "Lse", "cu_seqlens_q"], [q, k, out, lse, cu]))
    values = args["V"]
    # 128 lead columns, then 304 for the keys rounded up to 16 and 16 per sequence, rounded up to the copy's 128
    # columns per program (384); sequence 1 (keys 100-299) from column 128 + 112 + 16.
    assert values.shape == (4, 128, 512) and values.dtype == torch.float8_e4m3fn and values.is_contiguous()
    transposed = v.permute(1, 2, 0).view(torch.uint8)
    assert torch.equal(values[..., 128:228].view(torch.uint8), transposed[..., :100])
    assert torch.equal(values[..., 256:456].view(torch.uint8), transposed[..., 100:])
    assert (args["stride_vt"], args["stride_vh"]) == (512, 128 * 512)  # channel and head strides
    assert all(args[n] is d for n, d in zip(["QDescale", "KDescale", "VDescale"], scales[:3]))
    assert (args["stride_qd"], args["stride_kd"], args["stride_vd"]) == (1, 1, 0)
    assert (args["num_tokens_q"], args["q_cols"], args["k_rows"], args["k_cols"]) == (300, 4 * 192, 300, 4 * 192)
    constexprs = plan.constexprs
    assert constexprs["FP8"] is True
    assert constexprs["P_LAYOUT"] == gl.NVMMASharedLayout.get_default_for([64, 128], gl.float8e4nv)
    assert constexprs["V_LAYOUT"] == gl.NVMMASharedLayout.get_default_for([128, 128], gl.float8e4nv)  # [Dv, keys]
    assert constexprs["Q_LAYOUT_A"] == gl.NVMMASharedLayout.get_default_for([64, 128], gl.float8e4nv)
    assert (constexprs["D_A"], constexprs["D_B"], constexprs["D_V"], constexprs["BN"]) == (128, 64, 128, 128)
    bf16 = attention_sm90.sm90_launch(
        VarlenCall(*(x.to(torch.bfloat16) for x in (q, k, v)), cu, cu, 200, 200, 0.1, True), out, lse, 128, 4,
        num_sms=132,
    )  # fmt: skip
    assert bf16.key != plan.key


def test_gluon_relaunch_adds_a_fresh_zeroed_work_counter():
    """A remembered Gluon layout is called with the seven addresses, as the tl.dot kernel's is; CountedRelaunch hands
    its FixedLaunch an eighth, a zeroed int32 counter alive for the launch, new each call; its native launch codes
    that counter as NATIVE_COUNTER_CODE, a fresh zeroed int32 the C++ launcher allocates per launch."""
    import ctypes

    pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon, which the kernel is written in")
    from mla_ops.kernels.attention_sm90 import CountedRelaunch
    from mla_ops.kernels.launch import NATIVE_COUNTER_CODE

    seen, codes = [], []

    class Fixed:
        def __call__(self, leading):
            seen.append((leading, ctypes.c_int32.from_address(leading[-1]).value))

        def native_launch(self, leading_codes):
            codes.append(leading_codes)
            return "native"

    relaunch = CountedRelaunch(Fixed(), torch.device("cpu"))
    for _ in range(2):
        relaunch((1, 2, 3, 4, 5, 6, 7))
    assert [(leading[:7], len(leading), value) for leading, value in seen] == [((1, 2, 3, 4, 5, 6, 7), 8, 0)] * 2
    assert relaunch.native_launch((0, 1, 2, 3, 4, 5, 6)) == "native"
    assert codes == [(0, 1, 2, 3, 4, 5, 6, NATIVE_COUNTER_CODE)] and NATIVE_COUNTER_CODE == 7


def test_gluon_fp8_relaunch_copies_the_values_transposed_first():
    """A remembered fp8 Gluon layout is called with the ten addresses of an fp8 call (the descale factors' after
    the seven); TransposedRelaunch copies v into a fresh buffer of the layout's shape at the lead column, with the
    copy's FixedLaunch, then launches the kernel on that buffer with a fresh zeroed counter, the descale factors
    after it, in the plan's order; no native launch (the C++ launcher makes no copy)."""
    import ctypes

    pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon, which the kernel is written in")
    from mla_ops.kernels.attention_sm90 import SM90_LEADING_FP8, TransposedRelaunch
    from mla_ops.runtime.alloc import template

    events, buffers = [], []

    class Copy:
        def __call__(self, leading):
            events.append(("copy", leading))

    class Fixed:
        def __call__(self, leading):
            events.append(("kernel", leading, ctypes.c_int32.from_address(leading[7]).value))

    shape = (4, 128, 1024)
    values_template = template(shape, torch.float8_e4m3fn, torch.device("cpu"))
    relaunch = TransposedRelaunch(Fixed(), Copy(), values_template, 128, torch.device("cpu"))
    real_empty_like = torch.empty_like

    def empty_like(t, *args, **kwargs):
        made = real_empty_like(t, *args, **kwargs)
        buffers.append(made)
        return made

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "empty_like", empty_like)
        for _ in range(2):
            relaunch((1, 2, 3, 4, 5, 6, 7, 8, 9, 10))
    assert len(buffers) == 2 and all(b.shape == shape and b.dtype == torch.float8_e4m3fn for b in buffers)
    assert all(b.is_contiguous() for b in buffers)
    for i, values in enumerate(buffers):
        copy, kernel = events[2 * i], events[2 * i + 1]
        assert copy == ("copy", (3, values.data_ptr() + 128, 7))  # v, the buffer's lead column, cu_seqlens_k
        leading = kernel[1]
        assert len(leading) == SM90_LEADING_FP8 and kernel[2] == 0
        assert leading[:7] == (1, 2, values.data_ptr(), 4, 5, 6, 7) and leading[8:] == (8, 9, 10)
    assert relaunch.native_launch(tuple(range(10))) is None


def _key_major(v: torch.Tensor, width: int) -> torch.Tensor:
    """``v`` ``[T, H, D]`` as a key-major view of a contiguous ``[H, D, width]`` tensor, as quantize_fp8 makes it."""
    storage = torch.zeros(v.shape[1], v.shape[2], width, dtype=v.dtype)
    storage[..., : v.shape[0]] = v.permute(1, 2, 0)
    return storage[..., : v.shape[0]].permute(2, 0, 1)


@pytest.mark.parametrize("causal", [True, False])
def test_gluon_fp8_launch_reads_key_major_values_of_one_sequence_directly(causal):
    """A one-sequence fp8 call with key-major values (unit key stride, aligned channel and head strides) launches
    the kernel on ``v`` itself: ``V_DIRECT``, v's channel and head strides as the kernel's (stride_vt, stride_vh),
    no transposed copy. With two sequences, unaligned strides or token-major values, the copy as before."""
    pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon, which the kernel is written in")
    from mla_ops.backends.base import Fp8Scales
    from mla_ops.kernels import attention_sm90

    q, k, v = (x.to(torch.float8_e4m3fn) for x in make_qkv(300, 4, 192, 128, torch.float32, strided_v=True))
    out, lse = torch.empty(300, 4, 128, dtype=torch.bfloat16), torch.empty(4, 300)
    descale = torch.ones(4)
    scales = Fp8Scales(descale, descale, descale, torch.bfloat16)
    one = torch.tensor([0, 300], dtype=torch.int32)
    names = [p.name for p in attention_sm90._attn_fwd_sm90.params if not p.is_constexpr]

    def plan_of(values, cu):
        call = VarlenCall(q, k, values, cu, cu, 300, 300, 0.1, causal)
        plan = attention_sm90.sm90_launch(call, out, lse, 128, 4, num_sms=132, scales=scales)
        return plan, dict(zip(names, plan.args))

    key_major = _key_major(v, 304)
    assert key_major.stride() == (1, 128 * 304, 304)
    plan, args = plan_of(key_major, one)
    assert plan.constexprs["V_DIRECT"] is True and args["V"] is key_major
    assert (args["stride_vt"], args["stride_vh"]) == (304, 128 * 304)
    assert attention_sm90.values_read_directly(key_major, 1)
    for values, cu in [
        (key_major, torch.tensor([0, 100, 300], dtype=torch.int32)),  # two sequences: the second starts unaligned
        (_key_major(v, 300), one),  # a channel stride that is no multiple of 16 bytes
        (v, one),  # token-major
    ]:
        plan, args = plan_of(values.contiguous() if values.stride(0) != 1 else values, cu)
        assert plan.constexprs["V_DIRECT"] is False and args["V"].shape[:2] == (4, 128), "the transposed copy"
    assert not attention_sm90.values_read_directly(_key_major(v, 300), 1)
    assert not attention_sm90.values_read_directly(key_major, 2)
    assert not attention_sm90.values_read_directly(v, 1)


def test_gluon_fp8_direct_relaunch_adds_the_counter_after_the_seventh_address():
    """A remembered fp8 layout whose values the kernel read directly relaunches with the ten addresses of an fp8
    call, a fresh zeroed counter after the seventh and no copy; from a plan, TransposedRelaunch.of gives it; no
    native launch."""
    import ctypes

    pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon, which the kernel is written in")
    from mla_ops.kernels.attention_sm90 import DirectRelaunch, TransposedRelaunch
    from mla_ops.kernels.launch import LaunchPlan

    seen = []

    class Fixed:
        def __call__(self, leading):
            seen.append((leading, ctypes.c_int32.from_address(leading[7]).value))

    plan = LaunchPlan(None, (1,), (), {"V_DIRECT": True}, {}, 11)
    relaunch = TransposedRelaunch.of(Fixed(), None, plan, 128, torch.device("cpu"))
    assert isinstance(relaunch, DirectRelaunch)
    for _ in range(2):
        relaunch((1, 2, 3, 4, 5, 6, 7, 8, 9, 10))
    assert [(leading[:7], leading[8:], len(leading), value) for leading, value in seen] == [
        ((1, 2, 3, 4, 5, 6, 7), (8, 9, 10), 11, 0)
    ] * 2
    assert relaunch.native_launch(tuple(range(10))) is None


@interpreted
def test_key_major_fp8_values_off_the_gluon_kernel_become_token_major(attention_launches):
    """attention_triton keeps key-major fp8 values only where the Gluon kernel reads them as they are; elsewhere (here
    the tl.dot kernel in the interpreter) it runs on ``v.contiguous()``, with the same result as token-major values."""
    from mla_ops.backends.base import Fp8Scales
    from mla_ops.kernels import attention

    q, k, v = (x.to(torch.float8_e4m3fn) for x in make_qkv(40, 2, 64, 32, torch.float32))
    cu = torch.tensor([0, 40], dtype=torch.int32)
    descale = torch.ones(2)
    scales = Fp8Scales(descale, descale, descale, torch.bfloat16)
    config = AttentionConfig(32, 32, 4, 1)
    call = VarlenCall(q, k, v, cu, cu, 40, 40, 0.125, True)
    expected = attention.attention_triton(call, config=config, scales=scales)
    call = VarlenCall(q, k, _key_major(v, 48), cu, cu, 40, 40, 0.125, True)
    assert not attention._reads_key_major(call, config)
    got = attention.attention_triton(call, config=config, scales=scales)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize("kernel", [True, False], ids=["triton", "torch"])
@pytest.mark.parametrize(
    "lengths",
    [[1], [37], [1, 17, 0, 130, 3], [16, 16, 0], [0, 0], [3, 0, 21, 1, 64, 15, 16, 17, 2, 100, 1, 1, 33, 0, 5]],
    ids=["one", "37", "ragged", "aligned", "empty", "many"],
)
@pytest.mark.parametrize("lead", [0, 128])
def test_transposed_values(monkeypatch, kernel, lengths, lead):
    """The fp8 Gluon kernel's transposed values, from the Triton kernel (here in the interpreter) and from PyTorch's
    copies (CPU stand-ins outside it): every byte of each sequence of a strided ``v`` (NaN's among them) at
    ``lead + sequence_column(start, b)`` on, a multiple of 16; rows past the last sequence are not copied."""
    from mla_ops.kernels import transpose

    if kernel and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("kernel launches on CPU tensors need TRITON_INTERPRET=1 (set by conftest when CUDA is absent)")
    if not kernel:
        monkeypatch.setattr(transpose, "_interpreting", lambda: False)
    gen = torch.Generator().manual_seed(0)
    num_tokens = sum(lengths) + 5  # padding rows
    kv = torch.randint(0, 256, (num_tokens, 3, 192 + 128), dtype=torch.uint8, generator=gen)
    kv[0, 1, 200] = 0x7F  # e4m3's NaN is copied as it is
    v = kv.view(torch.float8_e4m3fn)[..., 192:]
    starts = [0, *itertools.accumulate(lengths)]
    got = transpose.transposed_values(v, torch.tensor(starts, dtype=torch.int32), lead=lead)
    width = transpose.transposed_width(num_tokens, len(lengths), lead)
    assert width % 16 == 0 and got.shape == (3, 128, width) and got.dtype == torch.float8_e4m3fn
    columns = []
    for b, (start, length) in enumerate(zip(starts, lengths)):
        column = lead + transpose.sequence_column(start, b)
        assert column % 16 == 0 and (not columns or column >= columns[-1]) and column + length <= width
        columns.append(column + length)
        want = kv[start : start + length, :, 192:].permute(1, 2, 0)
        assert torch.equal(got.view(torch.uint8)[..., column : column + length], want), b


def test_transposed_values_refuses_an_unaligned_lead():
    from mla_ops.kernels import transpose

    v = torch.zeros(4, 2, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="lead must be a non-negative multiple of 16, got 8"):
        transpose.transposed_values(v, torch.tensor([0, 4], dtype=torch.int32), lead=8)


def test_shrink_steps_down_to_smallest():
    config, seen = AttentionConfig(128, 128, 8, 3), []
    while config is not None:
        seen.append(config)
        config = configs.shrink(config)
    assert seen[-1] == AttentionConfig(16, 16, 4, 1)
    assert len(seen) == len(set(seen))


# --- the backend class ------------------------------------------------------------------------------


def test_backend_dimension_reasons():
    reasons = TritonBackend().reasons
    hopper = DeviceCapability(9, 0)
    assert reasons(hopper, SelectorConfig(torch.bfloat16, DEEPSEEK_V3)) == []
    assert reasons(hopper, SelectorConfig(torch.float16, MLADimensions(64, 0, 64))) == []
    assert reasons(hopper, SelectorConfig(torch.bfloat16, MLADimensions(128, 64, 100))) == [
        "v head dim 100 is not a positive multiple of 16"
    ]
    assert reasons(hopper, SelectorConfig(torch.bfloat16, MLADimensions(256, 64, 512))) == [
        "qk head dim (qk_nope + qk_rope) 320 exceeds 256",
        "v head dim 512 exceeds 256",
    ]


def test_backend_describes_the_hopper_kernel_where_it_applies():
    """``info`` names the kernel that runs large batches: the Gluon one on Hopper, for the dims its table lists,
    with the Triton releases it is adapted to; with another release the ``tl.dot`` kernel, and why."""
    pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon, which the kernel is written in")
    deepseek = SelectorConfig(torch.bfloat16, DEEPSEEK_V3)
    text = TritonBackend(triton_version=lambda: "3.10.0").describe(DeviceCapability(9, 0), deepseek)
    assert "large batches: this kernel too, not the Hopper kernel written in Gluon:" in text
    assert "(installed: 3.10.0)" in text
    for version in ("3.6.0", "3.8.0", "3.9.0"):
        describe = TritonBackend(triton_version=lambda version=version: version).describe
        assert "large batches: the Hopper kernel written in Gluon" in describe(DeviceCapability(9, 0), deepseek)
    assert "Gluon" not in describe(DeviceCapability(10, 0), deepseek)
    assert "Gluon" not in describe(DeviceCapability(9, 0), SelectorConfig(torch.float16, MLADimensions(64, 0, 64)))
    assert "Gluon" not in describe(None, deepseek)


def test_backend_capability_and_device():
    backend, config = TritonBackend(), SelectorConfig(torch.bfloat16, DEEPSEEK_V3)
    assert backend.capability_reasons(DeviceCapability(8, 0)) == []
    assert backend.capability_reasons(DeviceCapability(10, 0)) == []
    assert backend.reasons(DeviceCapability(7, 5), config) == [
        "compute capability 7.5 is not supported (needs 8.0 or newer)"
    ]
    assert backend.reasons(None, config) == ["runs on CUDA devices only, not on CPU"]
    assert backend.reasons(DeviceCapability(9, 0), SelectorConfig(torch.float32, DEEPSEEK_V3)) == [
        "dtype float32 is not supported (use bfloat16, float16, float8_e4m3fn)"
    ]
    assert not backend.plans_on_host, "the kernels read cu_seqlens on the device"


def test_backend_available_and_described():
    import triton

    backend = TritonBackend()
    assert backend.library_reasons(DeviceCapability(9, 0), SelectorConfig(torch.bfloat16)) == []
    assert backend.describe(DeviceCapability(9, 0), SelectorConfig(torch.bfloat16)).startswith(
        f"Triton {triton.__version__}: mla_ops varlen flash-attention forward"
    )


def test_backend_unavailable_without_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    backend, config = TritonBackend(), SelectorConfig(torch.bfloat16)
    assert backend.reasons(DeviceCapability(9, 0), config) == [
        "triton is not installed (pip install 'mla_ops[triton]')"
    ]
    assert backend.describe(DeviceCapability(9, 0), config).startswith("Triton (not installed)")


def test_backend_module_imports_without_triton():
    """The registry imports the backend module to ask it why it is unavailable: that must not need triton."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from mla_ops.backends.triton import TritonBackend\n"
        "print(TritonBackend().library_reasons(None, None))\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[\"triton is not installed (pip install 'mla_ops[triton]')\"]"


def test_backend_warmup_rejects_cpu():
    with pytest.raises(ValueError, match="runs on CUDA devices only"):
        TritonBackend().warmup(torch.device("cpu"), SelectorConfig(torch.bfloat16), num_heads=2)


@interpreted
def test_out_of_resources_steps_down_unless_explicit(monkeypatch, attention_launches):
    """A table config too big for the GPU is shrunk (and remembered); an explicit one is reported."""
    from triton.runtime.errors import OutOfResources

    from mla_ops.kernels import attention

    real_launch, tried, layouts = attention_launches.launch, [], []

    def launch(plan_args):
        config = plan_args[-2]  # (..., causal, config, scales)
        tried.append(config)
        if config.block_n > 16:
            raise OutOfResources(config.block_n * 1024, 16 * 1024, "shared memory")
        return real_launch(plan_args)

    class Known(dict):  # the table of known layouts, recording what each call looks up
        def get(self, layout, default=None):
            layouts.append(layout)
            return super().get(layout, default)

    attention_launches.launch = launch
    attention_launches.known = Known()
    monkeypatch.setattr(attention, "attention_config", lambda *a: AttentionConfig(16, 64, 4, 2))
    batch = make_batch([20], HEADS, 64, 64, torch.float16, seed=16)
    call = VarlenCall(batch.q, batch.k, batch.v, batch.cu_seqlens, batch.cu_seqlens, 20, 20, 0.125, True)
    out, lse = attention_triton(call)
    assert_attention_close(out, lse, batch.q, batch.k, batch.v, batch.cu_seqlens, batch.cu_seqlens, 0.125, True)
    assert tried == [AttentionConfig(16, 64, 4, 2), AttentionConfig(16, 64, 4, 1), AttentionConfig(16, 32, 4, 1),
                     AttentionConfig(16, 16, 4, 1)]  # fmt: skip
    tried.clear()
    attention_triton(call)
    assert tried == [AttentionConfig(16, 16, 4, 1)], "the working config is remembered"
    with pytest.raises(RuntimeError, match="does not fit this GPU"):
        attention_triton(call, config=AttentionConfig(16, 64, 4, 1))
    # The layout names what chose the configuration: an explicit one (or MLA_OPS_TRITON_CONFIG's text), else
    # None for the table, whose entry a step-down changes before any layout of it is remembered.
    assert [layout[-2] for layout in layouts] == [None, None, AttentionConfig(16, 64, 4, 1)]


def _runtime(stream=lambda index: f"stream{index}", enter=None, leave=None):
    """A launch runtime of stand-ins: ``stream(device_index)`` for the current stream, and Triton's knobs with
    these launch hooks (``None``: none installed)."""
    from types import SimpleNamespace

    from mla_ops.kernels import launch

    hooks = SimpleNamespace(launch_enter_hook=enter, launch_exit_hook=leave)
    return launch.Runtime(knobs=SimpleNamespace(runtime=hooks), current_stream=stream)


def test_cached_launch_skips_the_jit_after_the_first_launch(monkeypatch):
    """CachedLaunch's bookkeeping, with a stand-in for a @triton.jit kernel and its compiled variant."""
    from types import SimpleNamespace

    from mla_ops.kernels import launch

    calls = []

    class Compiled:
        function, packed_metadata = "function", "metadata"

        def __init__(self, key):
            self.key = key

        def launch_metadata(self, *args):
            raise AssertionError("no launch hook is set: no metadata is built")

        def run(self, *args):
            calls.append(("direct", self.key, args))

    def kernel_fn(x_ptr, n, stride, BLOCK, MODE):  # the stand-in marks BLOCK and MODE constexpr
        pass

    class Jit:
        fn = staticmethod(kernel_fn)

        def __init__(self):
            names = ("x_ptr", "n", "stride", "BLOCK", "MODE")
            self.params = [SimpleNamespace(name=n, is_constexpr=n.isupper()) for n in names]

        def __getitem__(self, grid):
            def launch_(*args, **kwargs):
                calls.append(("jit", grid, args, kwargs))
                return Compiled(len(calls))

            return launch_

    monkeypatch.setattr(launch, "current_cuda_device", lambda: 0)
    launcher = launch.CachedLaunch(Jit(), _runtime())
    assert launcher.enabled and launcher.constexpr_names == ["BLOCK", "MODE"]
    cuda0 = torch.device("cuda", 0)
    constexprs = {"MODE": 1, "BLOCK": 64}  # given out of order: the launcher orders them by the signature
    launcher(("variant-a",), cuda0, (4, 2), ("x", 7, 16), constexprs, num_warps=4)
    launcher(("variant-a",), cuda0, (5,), ("y", 8, 16), constexprs, num_warps=4)
    launcher(("variant-b",), cuda0, (5,), ("z", 8, 32), constexprs, num_warps=4)
    launcher(("variant-a",), torch.device("cuda", 1), (5,), ("w", 8, 16), constexprs, num_warps=4)  # not current
    assert [c[0] for c in calls] == ["jit", "direct", "jit", "jit"]
    # The JIT launch compiles with the package's options too (FMA contraction asked for explicitly).
    assert calls[0] == ("jit", (4, 2), ("x", 7, 16), {"MODE": 1, "BLOCK": 64, "num_warps": 4, "enable_fp_fusion": True})
    _, compiled_key, args = calls[1]
    assert compiled_key == 1  # the variant compiled by the first launch
    assert args == (5, 1, 1, "stream0", "function", "metadata", None, None, None, "y", 8, 16, 64, 1)
    # The FixedLaunch a direct launch returns repeats it with new leading arguments only.
    assert launcher(("variant-a",), torch.device("cuda", 1), (6,), ("t", 9, 16), constexprs, num_warps=4) is None
    fixed = launcher(("variant-a",), cuda0, (6, 3), ("v", 9, 16), constexprs, num_warps=4, leading=1)
    fixed(("u",))
    assert [c[0] for c in calls[4:]] == ["jit", "direct", "direct"]
    assert calls[-1][2] == (6, 3, 1, "stream0", "function", "metadata", None, None, None, "u", 9, 16, 64, 1)
    # fixed_launch gives that FixedLaunch without launching, for a variant launched directly before only.
    plan = launch.LaunchPlan(("variant-a",), (6, 3), ("v", 9, 16), constexprs, {"num_warps": 4}, 1)
    count = len(calls)
    assert launcher.fixed_launch(plan, torch.device("cuda", 1)) is None  # not the current device
    assert launcher.fixed_launch(plan._replace(key=("variant-c",)), cuda0) is None  # never launched
    unlaunched = launcher.fixed_launch(plan, cuda0)
    assert len(calls) == count
    unlaunched(("s",))
    assert calls[-1][2] == (6, 3, 1, "stream0", "function", "metadata", None, None, None, "s", 9, 16, 64, 1)
    # Triton's hooks are passed, with launch metadata, only when one is installed.
    runtime = _runtime(enter=SimpleNamespace(calls=[]), leave=SimpleNamespace(calls=[]))
    hooks = runtime.knobs.runtime
    assert runtime.hooks() == (None, None)
    hooks.launch_enter_hook.calls.append(print)
    assert runtime.hooks() == (hooks.launch_enter_hook, hooks.launch_exit_hook)


def test_a_known_launcher_is_called_through_its_c_launch_and_any_other_through_call(monkeypatch):
    """CachedLaunch calls a compiled kernel's C ``launch`` itself only for a launcher whose ``__call__``
    source it knows, with what that ``__call__`` would pass: the kernel's arguments one by one (Triton 3.6's
    forwarding) or as one tuple after the launcher's annotations and signature (3.7 to 3.9's); else ``__call__``."""
    import hashlib
    import inspect
    import textwrap
    from types import SimpleNamespace

    from mla_ops.kernels import launch

    calls = []

    class CudaLauncher:  # forwards as Triton 3.6's does
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid, launch_pdl = False, True
        arg_annotations, kernel_signature = "annotations", "signature"

        def __init__(self):
            self.launch = lambda *args: calls.append(("c", args))

        def __call__(self, gridX, gridY, gridZ, stream, function, *args):
            calls.append(("call", (gridX, gridY, gridZ, stream, function, *args)))

    compiled = SimpleNamespace(run=CudaLauncher(), function="fn", packed_metadata="meta", metadata=None)
    runtime = _runtime(stream=lambda index: "stream")
    launch._forwarding.cache_clear()
    fixed = launch.FixedLaunch(compiled, 0, (3,), ("tail",), runtime)
    assert fixed.native is None  # an unknown __call__
    fixed(("lead",))
    assert calls.pop() == ("call", (3, 1, 1, "stream", "fn", "meta", None, None, None, "lead", "tail"))
    digest = hashlib.sha256(textwrap.dedent(inspect.getsource(CudaLauncher.__call__)).encode()).hexdigest()
    monkeypatch.setattr(launch, "KNOWN_LAUNCHER_CALLS", {digest: launch.SPREAD})
    launch._forwarding.cache_clear()
    launch.FixedLaunch(compiled, 0, (3,), ("tail",), runtime)(("lead",))
    assert calls.pop() == (
        "c",
        (3, 1, 1, "stream", "fn", False, True, None, None, "meta", None, None, None, "lead", "tail"),
    )
    monkeypatch.setattr(launch, "KNOWN_LAUNCHER_CALLS", {digest: launch.PACKED})
    launch._forwarding.cache_clear()
    launch.FixedLaunch(compiled, 0, (3,), ("tail",), runtime)(("lead",))
    assert calls.pop() == (
        "c",
        (3, 1, 1, "stream", "fn", False, True, "meta", None, None, None, None, None, "annotations", "signature",
         ("lead", "tail")),
    )  # fmt: skip
    compiled.run.gsan_enabled = True  # Triton's GPU sanitizer adds arguments in __call__: go through it
    assert launch.FixedLaunch(compiled, 0, (3,), ("tail",)).native is None
    compiled.run.gsan_enabled = False
    compiled.run.global_scratch_size = 128  # a kernel that needs scratch goes through __call__, which allocates it
    assert launch.FixedLaunch(compiled, 0, (3,), ("tail",)).native is None
    launch._forwarding.cache_clear()


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton: its launcher is what is checked")
def test_the_installed_tritons_launcher_is_known_and_launched_as_its_call_would(monkeypatch):
    """A supported Triton release's ``CudaLauncher.__call__`` is in KNOWN_LAUNCHER_CALLS (a patch release that changed
    it would quietly lose the direct launch), and FixedLaunch passes its C ``launch`` exactly what the real
    ``__call__`` passes it: both run here on a launcher built without a GPU, whose ``launch`` records its arguments."""
    from types import SimpleNamespace

    import triton

    from mla_ops.kernels import launch
    from mla_ops.kernels.triton_compat import SUPPORTED_RELEASES, release

    if release(triton.__version__) not in SUPPORTED_RELEASES:
        pytest.skip(f"Triton {triton.__version__} is not a supported release")
    try:
        from triton.backends.nvidia.driver import CudaLauncher
    except ImportError as exc:
        pytest.skip(f"this Triton has no NVIDIA launcher: {exc}")
    try:
        _ = triton.runtime.driver.active  # 3.8 and 3.9's __call__ reads it (for a profile buffer, of size 0 here)
    except RuntimeError:  # no GPU driver on this machine
        monkeypatch.setattr(triton.runtime.driver, "_active", SimpleNamespace())
    recorded = []
    run = object.__new__(CudaLauncher)
    run.launch = lambda *args: recorded.append(args)
    run.global_scratch_size = run.profile_scratch_size = 0
    run.global_scratch_align = run.profile_scratch_align = run.num_ctas = 1
    run.launch_cooperative_grid, run.launch_pdl, run.gsan_enabled = False, True, False
    run.arg_annotations, run.kernel_signature = "annotations", "signature"
    run(3, 2, 1, "stream", "fn", "meta", None, None, None, "lead", 7, 0.5)
    launch._forwarding.cache_clear()
    compiled = SimpleNamespace(run=run, function="fn", packed_metadata="meta", metadata=None)
    fixed = launch.FixedLaunch(compiled, 0, (3, 2), (7, 0.5), _runtime(stream=lambda index: "stream"))
    assert fixed.native is not None, f"Triton {triton.__version__}'s CudaLauncher.__call__ is not known"
    fixed(("lead",))
    assert recorded[1] == recorded[0]
    launch._forwarding.cache_clear()


def _ptx_entry(*params: str) -> str:
    """A PTX module whose kernel entry declares ``params`` (each as PTX writes a parameter's type)."""
    body = ",\n".join(f"\t.param {p} kernel_param_{i}" for i, p in enumerate(params))
    head = ".version 8.7\n.target sm_90a\n.address_size 64\n\n.visible .entry kernel(\n"
    return f"{head}{body}\n)\n.maxntid 128\n{{\n}}\n"


_PTR = ".u64 .ptr .global .align 16"


def test_native_abi_reads_the_kernels_parameters_from_its_ptx():
    """native_abi: one PTX parameter per non-constexpr argument, of the width the native launch passes, then the two
    scratch pointers; any other list (a host TMA descriptor's 128-byte array, a missing scratch pointer, a width
    that differs, an unknown type) is refused. benchmarks/compile_sm90.py checks the real kernels under each
    Triton release."""
    from types import SimpleNamespace

    from mla_ops.kernels.launch import native_abi

    signature = {"Q": "*bf16", "n": "i32", "BLOCK": "constexpr", "scale": "fp32", "big": "i64", "flag": "i1"}

    def abi(*params, sig=signature):
        return native_abi(SimpleNamespace(asm={"ptx": _ptx_entry(*params)}, src=SimpleNamespace(signature=sig)))

    good = (_PTR, ".u32", ".f32", ".u64", ".u8", _PTR, _PTR)
    assert abi(*good)
    assert abi(".u64 .ptr .global .align 1", *good[1:])  # a pointer's alignment does not matter
    assert not abi(*good[:-1]), "the profile scratch pointer is missing"
    assert not abi(*good, _PTR), "a parameter more"
    assert not abi(_PTR, ".u64", *good[2:]), "an i32 passed as 8 bytes"
    assert not abi(".align 64 .b8", *good[1:]) and not abi(".align 64 .b8 [128]", *good[1:])
    assert not abi(".u64", *good[1:]), "a pointer must be one"
    assert not abi(*good, sig={**signature, "n": "fp64"}), "a type the native launch does not store"
    assert not native_abi(SimpleNamespace(asm={}, src=SimpleNamespace(signature=signature)))
    assert not native_abi(SimpleNamespace())


def test_native_launch_describes_the_parameters_triton_passes():
    """FixedLaunch.native_launch: the kernel's parameters as cuLaunchKernel takes them, the constexprs left out
    as Triton's launcher leaves them out, a float as its 32 bits; nothing where C++ could launch differently."""
    import struct
    from types import SimpleNamespace

    from mla_ops.kernels import launch

    signature = {"Q": "*bf16", "Out": "*fp32", "n": "i32", "stride": "constexpr", "scale": "fp32", "big": "i64"}
    signature |= {"BLOCK": "constexpr"}
    compiled = SimpleNamespace(
        run=None,  # no launcher whose forwarding is known: the native launch does not need one
        function=0xABC,
        packed_metadata=None,
        metadata=SimpleNamespace(num_warps=4, num_ctas=1, shared=1024),
        src=SimpleNamespace(signature=signature),
        asm={"ptx": _ptx_entry(_PTR, _PTR, ".u32", ".f32", ".u64", _PTR, _PTR)},
    )
    runtime = _runtime()
    fixed = launch.FixedLaunch(compiled, 0, (3, 2), (7, 1, 0.5, -(2**40), 64), runtime)
    assert fixed.native is None
    got = fixed.native_launch((5, 2))
    half_bits = struct.unpack("<I", struct.pack("<f", 0.5))[0]
    assert got == launch.NativeLaunch(0xABC, (3, 2, 1), 128, 1024, (0, 0, 1, 3, 2), (5, 2, 7, half_bits, -(2**40)))
    assert fixed.native_launch((5,)) is None  # the leading codes do not cover the leading arguments
    for refusal in (
        {"launch_cooperative_grid": True},
        {"launch_pdl": True},
        {"num_ctas": 2},
        {"profile_scratch_size": 64},  # profiler instrumentation writes a buffer a native launch passes null
    ):
        metadata = SimpleNamespace(**{"num_warps": 4, "num_ctas": 1, "shared": 1024, **refusal})
        other = launch.FixedLaunch(SimpleNamespace(**{**vars(compiled), "metadata": metadata}), 0, (3, 2),
                                   (7, 1, 0.5, -(2**40), 64), runtime)  # fmt: skip
        assert other.native_launch((5, 2)) is None, refusal
    # Global scratch (device-built TMA descriptors): the whole grid's, which the C++ launcher allocates per launch,
    # where the caching allocator's 512-byte alignment covers the kernel's.
    for align, want in ((128, 3 * 2 * 1 * 640), (1024, None)):
        metadata = SimpleNamespace(num_warps=4, num_ctas=1, shared=1024, global_scratch_size=640,
                                   global_scratch_align=align)  # fmt: skip
        other = launch.FixedLaunch(SimpleNamespace(**{**vars(compiled), "metadata": metadata}), 0, (3, 2),
                                   (7, 1, 0.5, -(2**40), 64), runtime)  # fmt: skip
        assert other.needs_scratch
        got_scratch = other.native_launch((5, 2))
        assert (got_scratch and got_scratch.scratch_bytes) == want, align
    assert got.scratch_bytes == 0
    other = launch.FixedLaunch(SimpleNamespace(**{**vars(compiled), "asm": {"ptx": _ptx_entry(_PTR, _PTR)}}), 0,
                               (3, 2), (7, 1, 0.5, -(2**40), 64), runtime)  # fmt: skip
    assert other.native_launch((5, 2)) is None, "parameters other than a native launch's"
    hooks = runtime.knobs.runtime
    hooks.launch_enter_hook, hooks.launch_exit_hook = "enter", "leave"  # hooks installed: handed back anyway
    assert fixed.native_launch((5, 2)) is None
    hooks.launch_enter_hook = hooks.launch_exit_hook = None
    compiled.src.signature = {**signature, "n": "fp64"}  # a type the C++ launcher does not store
    assert fixed.native_launch((5, 2)) is None
    compiled.src.signature = {**signature, "n": "*i32"}  # a pointer among the fixed arguments
    assert fixed.native_launch((5, 2)) is None


def test_relaunched_leading_arguments_are_the_plans():
    """A remembered layout is relaunched with the addresses of (q, k, v, out, lse, cu_q, cu_k) in place of the
    plan's leading arguments, which must be those tensors in that order; the native launch codes them so
    (0..6, ``TensorCode`` in the C++ launcher)."""
    from mla_ops.kernels import attention

    batch = make_batch([5, 0, 17], HEADS, 192, 128, torch.bfloat16, strided_v=True, padding=2, seed=3)
    out = torch.empty(batch.q.shape[0], HEADS, 128, dtype=torch.bfloat16)
    lse = torch.empty(HEADS, batch.q.shape[0])
    cu = batch.cu_seqlens
    call = VarlenCall(batch.q, batch.k, batch.v, cu, cu, 17, 17, 0.1, True)
    plan = attention.launch_plan(call, out, lse, AttentionConfig(64, 32, 4, 2))
    tensors = (batch.q, batch.k, batch.v, out, lse, cu, cu)
    expected = tuple(t.data_ptr() for t in tensors)
    assert len(expected) == attention._LEADING == len(attention.NATIVE_TENSOR_CODES)
    assert attention.NATIVE_TENSOR_CODES == (0, 1, 2, 3, 4, 5, 6)
    assert len({t.data_ptr() for t in tensors}) == 6, "distinct addresses, so that a mix-up shows"
    assert [a.data_ptr() for a in plan.args[: attention._LEADING]] == list(expected)
    assert not any(isinstance(a, torch.Tensor) for a in plan.args[attention._LEADING :]), "only scalars follow"


def test_cached_launch_supplies_the_scratch_allocator(monkeypatch):
    """Kernels that build TMA descriptors on the device get their global scratch from the launch's own
    allocator (torch's caching allocator, or a graph's pool during capture), on the JIT launch and on
    direct ones; the caller's allocator is back in place afterwards, and kernels without scratch run
    with it untouched."""
    import contextvars
    from types import SimpleNamespace

    from triton.runtime import _allocation

    from mla_ops.kernels import launch

    seen = []

    class Compiled:
        function, packed_metadata = "function", "metadata"

        def __init__(self, scratch_bytes):
            self.metadata = SimpleNamespace(global_scratch_size=scratch_bytes)

        def run(self, *args):
            seen.append(("direct", _allocation._allocator.get()))

    def kernel_fn(x_ptr, BLOCK):
        pass

    class Jit:
        fn = staticmethod(kernel_fn)
        params = (SimpleNamespace(name="x_ptr", is_constexpr=False), SimpleNamespace(name="BLOCK", is_constexpr=True))

        def __getitem__(self, grid):
            def launch_(x, BLOCK, scratch_bytes, **options):  # options: Triton's compile options
                seen.append(("jit", _allocation._allocator.get()))
                return Compiled(scratch_bytes)

            return launch_

    monkeypatch.setattr(launch, "current_cuda_device", lambda: 0)
    cuda0 = torch.device("cuda", 0)

    def callers_allocator(size, alignment, stream):
        raise AssertionError("the package's launches use their own allocator")

    def scenario():
        _allocation._allocator.set(callers_allocator)
        launcher = launch.CachedLaunch(Jit(), _runtime())
        for variant, scratch_bytes in (("device-descriptors", 384), ("plain", 0)):
            for _ in range(2):  # the JIT launch compiles the variant, the second one is direct
                launcher((variant,), cuda0, (3,), ("x",), {"BLOCK": 16}, scratch_bytes=scratch_bytes)
        assert _allocation._allocator.get() is callers_allocator

    contextvars.copy_context().run(scenario)  # the caller's allocator stays inside this test
    assert seen == [
        ("jit", launch._torch_scratch),
        ("direct", launch._torch_scratch),
        ("jit", launch._torch_scratch),  # not known yet to need none
        ("direct", callers_allocator),
    ]
