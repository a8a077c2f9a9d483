"""The native merge (``mla_ops.native``, ``mla_ops/native/csrc``) on a CUDA GPU (``pytest -m gpu``).

It is built here when it is not cached (about a minute): the tests need ``nvcc`` and ``ninja`` and skip,
saying so, without them. Checked: the op's CUDA key runs the C++ kernel; its results against the fp32
reference and the Triton merge for both dtypes, several head widths (vector and scalar loads), strided and
misaligned inputs, ``+-inf`` and NaN rows, base-2 LSEs; its errors (the Python check's, word for word);
zero-size inputs; inference mode; CUDA-graph replay; ``torch.compile``; the build cache across processes.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest
import torch
from utils import native_library_or_skip

import mla_ops
from mla_ops import native
from mla_ops.backends.base import MergeCall
from mla_ops.backends.reference import merge_attn_states_reference
from mla_ops.meta.checks import check_merge_inputs
from mla_ops.runtime.merge_dispatch import merge_kernel

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
DTYPES = [torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", autouse=True)
def _loaded():
    native_library_or_skip()


def _ulp_rtol(dtype: torch.dtype) -> float:
    return 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10


def _inputs(tokens, heads, dv, dtype, *, seed=0, lse_transposed=False, out_strided=False, misaligned=False):
    gen = torch.Generator().manual_seed(seed)

    def out_tensor():
        if out_strided:  # a view of a wider [T, H, Dv + 8] tensor, as v is a view of kv_nope
            return torch.randn(tokens, heads, dv + 8, generator=gen).to(DEVICE, dtype)[..., 4 : 4 + dv]
        if misaligned:  # one element off 16 bytes: scalar loads
            return torch.randn(tokens * heads * dv + 1, generator=gen).to(DEVICE, dtype)[1:].view(tokens, heads, dv)
        return torch.randn(tokens, heads, dv, generator=gen).to(DEVICE, dtype)

    def lse_tensor():
        values = torch.randn(heads, tokens, generator=gen) * 8
        return values.t().contiguous().to(DEVICE).t() if lse_transposed else values.to(DEVICE)

    return out_tensor(), lse_tensor(), out_tensor(), lse_tensor()


def _assert_merge_close(got, want, dtype):
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=_ulp_rtol(dtype), atol=1e-5, equal_nan=True)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-5, equal_nan=True)


def test_the_ops_cuda_key_runs_the_cpp_kernel():
    dump = torch._C._dispatch_dump("mla::merge_attn_states")
    cuda = [line for line in dump.splitlines() if line.startswith("CUDA:")]
    assert cuda and "merge_attn_states.cpp" in cuda[0], dump
    assert merge_kernel(torch.device(DEVICE)) is native.merge
    assert native.status() == "native CUDA kernel"


SHAPES = [(1, 1, 128), (16, 16, 128), (1000, 128, 128), (37, 3, 64), (5, 2, 7), (9, 4, 24), (300, 16, 512)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "strided", "misaligned"])
def test_matches_the_reference_and_the_triton_merge(shape, dtype, layout):
    from mla_ops.kernels.merge import merge_attn_states_triton

    inputs = _inputs(
        *shape, dtype, seed=sum(shape), lse_transposed=layout == "strided", out_strided=layout == "strided",
        misaligned=layout == "misaligned",
    )  # fmt: skip
    got = torch.ops.mla.merge_attn_states(*inputs)
    assert got[0].shape == shape and got[0].dtype == dtype and got[0].is_contiguous()
    assert got[1].shape == shape[1::-1] and got[1].dtype == torch.float32 and got[1].is_contiguous()
    _assert_merge_close(got, merge_attn_states_reference(MergeCall(*inputs)), dtype)
    _assert_merge_close(got, merge_attn_states_triton(MergeCall(*inputs)), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_empty_sides_infinities_and_nan(dtype):
    """-inf or +inf: a side without keys (weight 0, its output never read, NaN there included); both empty:
    out 0, lse -inf; a NaN LSE on either side: a NaN row."""
    tokens, heads, dv = 8, 2, 128
    prefix, suffix = (
        torch.randn(tokens, heads, dv, device=DEVICE).to(dtype),
        torch.randn(tokens, heads, dv, device=DEVICE).to(dtype),
    )
    a = torch.zeros(heads, tokens, device=DEVICE)
    b = torch.ones(heads, tokens, device=DEVICE)
    inf = math.inf
    cases = {
        0: (-inf, 1.0),
        1: (inf, 1.0),
        2: (1.0, -inf),
        3: (-inf, -inf),
        4: (inf, inf),
        5: (math.nan, 1.0),
        6: (1.0, math.nan),
    }
    for t, (lse_a, lse_b) in cases.items():
        a[:, t], b[:, t] = lse_a, lse_b
    prefix[[0, 1, 3, 4]] = math.nan  # outputs of empty sides: never read
    suffix[[2, 3, 4]] = math.nan
    out, lse = torch.ops.mla.merge_attn_states(prefix, a, suffix, b)
    assert torch.equal(out[0], suffix[0]) and torch.equal(out[1], suffix[1]) and torch.equal(out[2], prefix[2])
    assert torch.equal(lse[:, :3], torch.tensor([[1.0, 1.0, 1.0]] * heads, device=DEVICE))
    assert (out[3:5] == 0).all() and torch.isneginf(lse[:, 3:5]).all()
    assert out[5:7].isnan().all() and lse[:, 5:7].isnan().all()
    _assert_merge_close(
        (out[7:], lse[:, 7:]), merge_attn_states_reference(MergeCall(prefix[7:], a[:, 7:], suffix[7:], b[:, 7:])), dtype
    )


def test_base2_lse_is_converting_first_bit_for_bit():
    po, pl, so, sl = _inputs(33, 16, 128, torch.bfloat16, seed=3)
    pl[0, 0], sl[1, 1], sl[2, 2] = -math.inf, math.inf, math.nan
    for base2 in ((True, False), (False, True), (True, True)):
        got = native.merge(MergeCall(po, pl, so, sl, prefix_lse_base2=base2[0], suffix_lse_base2=base2[1]))
        converted = [lse * math.log(2.0) if flag else lse for lse, flag in zip((pl, sl), base2)]
        want = native.merge(MergeCall(po, converted[0], so, converted[1]))
        # Bits, not values: the NaN rows must match too.
        assert torch.equal(got[0].view(torch.int16), want[0].view(torch.int16))
        assert torch.equal(got[1].view(torch.int32), want[1].view(torch.int32))


def _bad_inputs():
    po, pl, so, sl = _inputs(6, 2, 16, torch.bfloat16)
    return {
        "float32 outputs": (po.float(), pl, so.float(), sl),
        "mixed dtypes": (po, pl, so.half(), sl),
        "shapes differ": (po, pl, so[:5], sl),
        "rank 2": (po[0], pl, so[0], sl),
        "lse shape": (po, pl[:, :5], so, sl),
        "lse token-major": (po, pl.t().contiguous(), so, sl),
        "lse float64": (po, pl.double(), so, sl),
        "lse on the CPU": (po, pl.cpu(), so, sl),
        "channel stride": (po[..., ::2], pl, so[..., ::2], sl),
    }


BAD_CASES = [
    "float32 outputs", "mixed dtypes", "shapes differ", "rank 2", "lse shape", "lse token-major", "lse float64",
    "lse on the CPU", "channel stride",
]  # fmt: skip


def test_every_bad_case_is_tested():
    assert sorted(_bad_inputs()) == sorted(BAD_CASES)


@pytest.mark.parametrize("case", BAD_CASES)
def test_errors_are_the_checks_word_for_word(case):
    bad = _bad_inputs()[case]
    with pytest.raises((TypeError, ValueError)) as expected:
        check_merge_inputs(*bad)
    with pytest.raises(type(expected.value), match=re.escape(str(expected.value))):
        torch.ops.mla.merge_attn_states(*bad)


def test_grad_is_refused_only_in_grad_mode():
    po, pl, so, sl = _inputs(6, 2, 16, torch.bfloat16)
    po.requires_grad_()
    with pytest.raises(RuntimeError, match=r"mla\.merge_attn_states is inference-only"):
        torch.ops.mla.merge_attn_states(po, pl, so, sl)
    with torch.no_grad():
        out, _ = torch.ops.mla.merge_attn_states(po, pl, so, sl)
    assert not out.requires_grad


@pytest.mark.parametrize("shape", [(0, 4, 128), (5, 0, 128), (5, 4, 0)], ids=str)
def test_zero_size_inputs(shape):
    tokens, heads, _ = shape
    out_in = torch.empty(shape, device=DEVICE, dtype=torch.bfloat16)
    lse_in = torch.zeros(heads, tokens, device=DEVICE)
    out, lse = torch.ops.mla.merge_attn_states(out_in, lse_in, out_in, lse_in)
    assert out.shape == shape and lse.shape == (heads, tokens)


def test_outputs_follow_inference_mode():
    inputs = _inputs(4, 2, 128, torch.bfloat16)
    assert not torch.ops.mla.merge_attn_states(*inputs)[0].is_inference()
    with torch.inference_mode():
        out, lse = torch.ops.mla.merge_attn_states(*inputs)
    assert out.is_inference() and lse.is_inference()


def test_cuda_graph_replay_reads_new_inputs():
    static = _inputs(24, 16, 128, torch.bfloat16, seed=1)
    torch.ops.mla.merge_attn_states(*static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = torch.ops.mla.merge_attn_states(*static)
    for seed in (2, 3):
        for buffer, fresh in zip(static, _inputs(24, 16, 128, torch.bfloat16, seed=seed)):
            buffer.copy_(fresh)
        graph.replay()
        want = torch.ops.mla.merge_attn_states(*static)
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


def test_under_torch_compile_equals_eager():
    inputs = _inputs(40, 16, 128, torch.bfloat16, seed=5)

    def layer(po, pl, so, sl):
        out, lse = torch.ops.mla.merge_attn_states(po, pl, so, sl)
        return out * 2, lse + 1

    compiled = torch.compile(layer, fullgraph=True)
    got, want = compiled(*inputs), layer(*inputs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_the_fused_layer_op_merges_as_the_three_ops_do():
    """mla_ops.prefill_with_context with one chunk (the fused op, whose merge reads base-2 LSEs through
    mla_native.merge_attn_states) gives bit for bit what prefill, the chunk and merge_attn_states give."""
    from utils import make_batch

    with mla_ops.prefill_backend("TRITON"):
        batch = make_batch([5, 0, 19, 2], 16, 192, 128, torch.bfloat16, DEVICE, strided_v=True)
        chunk = make_batch([7, 3, 0, 12], 16, 192, 128, torch.bfloat16, DEVICE, seed=100)
        scale = 192**-0.5
        fused = mla_ops.prefill_with_context(
            batch.q, batch.k, batch.v, batch.cu_seqlens, batch.max_seqlen,
            [(chunk.k, chunk.v, chunk.cu_seqlens, 12)], softmax_scale=scale,
        )  # fmt: skip
        new = mla_ops.prefill(batch.q, batch.k, batch.v, batch.cu_seqlens, batch.max_seqlen, scale)
        ctx = mla_ops.prefill_context_chunk(
            batch.q, chunk.k, chunk.v, batch.cu_seqlens, chunk.cu_seqlens, batch.max_seqlen, 12, scale
        )
        three = mla_ops.merge_attn_states(*ctx, *new)
    assert torch.equal(fused[0], three[0]) and torch.equal(fused[1], three[1])


def test_a_new_process_loads_the_cached_build_without_compiling():
    script = "import mla_ops; from mla_ops import native; assert native.load(), native.status()"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "compiling" not in done.stderr, done.stderr
