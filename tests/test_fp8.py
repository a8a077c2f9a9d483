"""The fp8 ops on CPU: the quantiser, REFERENCE and (in Triton's interpreter) TRITON under the accuracy contract,
the ops' fakes, opcheck, compile, the merge with bf16 results, routing and every bad input's error."""

from __future__ import annotations

import math
import os

import pytest
import torch
from fp8_contract import contract_errors, fp8_batch, fp8_call, run_fp8
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from utils import cu_seqlens_of, dense_attention, reset_compile

import mla_ops
from mla_ops.backends.base import Fp8Scales, VarlenCall
from mla_ops.specs import FP8_DTYPE, FP8_MAX

SCALE = 192**-0.5
FP8_SCHEMAS = {
    "prefill_fp8": "mla::prefill_fp8(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, SymInt max_seqlen, "
    "Tensor q_descale, Tensor k_descale, Tensor v_descale, float softmax_scale, ScalarType out_dtype) "
    "-> (Tensor out, Tensor lse)",
    "prefill_context_chunk_fp8": "mla::prefill_context_chunk_fp8(Tensor q, Tensor k, Tensor v, "
    "Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor q_descale, "
    "Tensor k_descale, Tensor v_descale, float softmax_scale, ScalarType out_dtype) -> (Tensor out, Tensor lse)",
}
# (lengths, key lengths or None for new tokens): ragged, with an empty sequence and an empty chunk slice.
CASES = [([5, 0, 37], None), ([5, 0, 37, 20], [40, 3, 0, 70])]


# --- the quantiser ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("per_head", [True, False])
def test_quantize_fp8_round_trips_within_e4m3_precision(per_head) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(50, 3, 64, generator=gen) * torch.tensor([1.0, 30.0, 0.01])[:, None]).bfloat16()
    x8, descale = mla_ops.quantize_fp8(x, per_head=per_head)
    assert x8.dtype == FP8_DTYPE and x8.shape == x.shape and x8.is_contiguous()
    assert descale.dtype == torch.float32 and descale.shape == ((3,) if per_head else ())
    back = x8.float() * (descale[:, None] if per_head else descale)
    amax = x.float().abs().amax(dim=(0, 2) if per_head else (0, 1, 2), keepdim=True).reshape(-1, 1)
    # Each head's largest magnitude maps to 448 (e4m3's largest): nothing saturates, and round-to-nearest keeps a
    # relative error of 2**-4 for normal numbers (the smallest of which is amax * 2**-6 / 448 * 448 / 2**... ).
    assert back.abs().amax().item() <= x.float().abs().amax().item() * (1 + 2**-4)
    err = (back - x.float()).abs()
    assert bool((err <= 2**-4 * x.float().abs() + amax.reshape(-1, 1) * 2**-9 / FP8_MAX * 64).all())
    if per_head:  # the tiny head keeps its precision: its own factor, not the large head's
        assert descale[2] < descale[0] < descale[1]


def test_quantize_fp8_of_zeros_empty_and_strided_inputs() -> None:
    zeros8, descale = mla_ops.quantize_fp8(torch.zeros(4, 2, 16))
    assert torch.equal(descale, torch.ones(2)) and not zeros8.float().any()
    empty8, descale = mla_ops.quantize_fp8(torch.zeros(0, 2, 16), per_head=False)
    assert empty8.shape == (0, 2, 16) and descale.shape == () and descale.item() == 1.0
    kv = torch.randn(6, 2, 48)
    v8, _ = mla_ops.quantize_fp8(kv[..., 16:])
    assert torch.equal(v8, mla_ops.quantize_fp8(kv[..., 16:].contiguous())[0])


def test_quantize_fp8_traces_without_a_graph_break() -> None:
    reset_compile()
    compiled = torch.compile(mla_ops.quantize_fp8, fullgraph=True, dynamic=True)
    x = torch.randn(9, 2, 32)
    got, want = compiled(x), mla_ops.quantize_fp8(x)
    assert torch.equal(got[0].float(), want[0].float()) and torch.equal(got[1], want[1])


def _key_major_storage(x8: torch.Tensor) -> torch.Tensor:
    """The ``[H, D, W]`` storage behind a key-major result, after checking its layout: strides ``(1, D * W, W)``,
    ``W >= T`` a multiple of 16."""
    num_tokens, num_heads, dim = x8.shape
    width = x8.stride(2)
    assert x8.stride() == (1, dim * width, width) and width % 16 == 0 and width >= max(num_tokens, 1)
    assert x8.untyped_storage().nbytes() >= num_heads * dim * width
    return x8.as_strided((num_heads, dim, width), (dim * width, width, 1))


@pytest.mark.parametrize("tokens", [1, 15, 16, 17, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("per_head", [True, False])
def test_quantize_fp8_key_major_holds_the_same_bytes(per_head, dtype, tokens) -> None:
    """``key_major=True`` gives the bytes and factors of the default layout, bit for bit, on a strided view, with
    each channel's tokens contiguous in a ``[H, D, W]`` storage whose columns past the tokens hold 0."""
    gen = torch.Generator().manual_seed(tokens)
    kv = (torch.randn(tokens, 3, 320, generator=gen) * torch.tensor([1.0, 30.0, 0.01])[:, None]).to(dtype)
    x = kv[..., 128:]
    want8, want = mla_ops.quantize_fp8(x, per_head=per_head)
    got8, got = mla_ops.quantize_fp8(x, per_head=per_head, key_major=True)
    assert got8.dtype == FP8_DTYPE and got8.shape == x.shape and not got8.is_contiguous()
    assert torch.equal(got, want)
    assert torch.equal(got8.view(torch.uint8), want8.view(torch.uint8))
    storage = _key_major_storage(got8)
    assert torch.equal(storage[:, :, :tokens].permute(2, 0, 1).view(torch.uint8), want8.view(torch.uint8))
    assert not storage.view(torch.uint8)[:, :, tokens:].any(), "the padding columns hold 0"
    width = storage.shape[-1]
    assert width % 128 == 0 and width >= tokens and width & (width - 1), "rows of no power of two bytes"


@pytest.mark.parametrize("shape", [(0, 2, 16), (0, 0, 16), (5, 0, 16)])
def test_quantize_fp8_key_major_of_an_empty_tensor(shape) -> None:
    x8, descale = mla_ops.quantize_fp8(torch.zeros(shape), key_major=True)
    assert x8.shape == shape and x8.dtype == FP8_DTYPE and torch.equal(descale, torch.ones(shape[1]))
    storage = _key_major_storage(x8)
    assert storage.shape[-1] == (16 if shape[0] == 0 else 384) and not storage.view(torch.uint8).any()


def test_quantize_fp8_key_major_traces_without_a_graph_break() -> None:
    reset_compile()
    compiled = torch.compile(
        lambda x: mla_ops.quantize_fp8(x, per_head=True, key_major=True), fullgraph=True, dynamic=True
    )
    for tokens in (9, 128, 130):  # W > T, W == T (where a slice and a permute came back contiguous)
        x = torch.randn(tokens, 2, 32)
        got, want = compiled(x), mla_ops.quantize_fp8(x)
        assert got[0].stride() == mla_ops.quantize_fp8(x, key_major=True)[0].stride()
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
        assert not _key_major_storage(got[0]).view(torch.uint8)[:, :, tokens:].any()


@pytest.mark.parametrize("key_major", [1, None, "yes"])
def test_quantize_fp8_refuses_a_key_major_that_is_not_a_bool(key_major) -> None:
    with pytest.raises(TypeError, match=f"key_major must be True or False, got {type(key_major).__name__}"):
        mla_ops.quantize_fp8(torch.zeros(3, 2, 4), key_major=key_major)
    with pytest.raises(TypeError):  # keyword-only
        mla_ops.quantize_fp8(torch.zeros(3, 2, 4), True, True)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (([1.0],), TypeError, "x must be a torch.Tensor"),
        ((torch.zeros(3, 4),), ValueError, r"3-D tensor \[T, H, D\], got shape \(3, 4\)"),
        ((torch.zeros(3, 2, 4, dtype=torch.int32),), TypeError, "floating tensor"),
        ((torch.zeros(3, 2, 4).to(FP8_DTYPE),), TypeError, "floating tensor"),
        ((torch.zeros(3, 2, 4), 1), TypeError, "per_head must be True or False"),
    ],
)
def test_quantize_fp8_bad_inputs(args, error, match) -> None:
    with pytest.raises(error, match=match):
        mla_ops.quantize_fp8(*args)


# --- the contract --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("lengths", "key_lengths"), CASES)
@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("outliers", [False, True])
def test_reference_meets_the_contract_and_keeps_the_lse(lengths, key_lengths, per_head, outliers) -> None:
    causal = key_lengths is None
    batch = fp8_batch(lengths, key_lengths, 3, padding=4, per_head=per_head, outliers=outliers)
    out, lse = run_fp8(batch, causal, SCALE)
    assert out.dtype == torch.bfloat16 and out.shape == (batch.q.shape[0], 3, 128) and lse.shape == (3, out.shape[0])
    error, bound = contract_errors(batch, out, causal, SCALE)
    assert error <= bound, (error, bound)
    _, want_lse = dense_attention(*batch.dequantised, batch.cu_seqlens_q, batch.cu_seqlens_k, SCALE, causal)
    rows = int(batch.cu_seqlens_q[-1])
    torch.testing.assert_close(lse[:, :rows].double(), want_lse[:, :rows], atol=1e-4, rtol=1e-5)


def test_fp16_output_and_error_against_the_bf16_op() -> None:
    """The output dtype is the caller's; and against the bf16 op on the unquantised data, fp8's error stays within a
    few times bf16's own (reported here as a bound, measured on the GPU by the benchmarks)."""
    batch = fp8_batch([30, 50], None, 2, outliers=True)
    out, _ = run_fp8(batch, True, SCALE, torch.float16)
    assert out.dtype == torch.float16
    q, k, v = batch.bf16
    bf16_out, _ = mla_ops.prefill(q, k, v, batch.cu_seqlens_q, batch.max_seqlen_q, SCALE)
    exact, _ = dense_attention(q.double(), k.double(), v.double(), batch.cu_seqlens_q, batch.cu_seqlens_q, SCALE, True)
    fp8_error = (out.double() - exact).abs().max().item()
    bf16_error = (bf16_out.double() - exact).abs().max().item()
    assert fp8_error < 0.25 and bf16_error < fp8_error, (fp8_error, bf16_error)


interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="kernel launches on CPU tensors need TRITON_INTERPRET=1 (set by conftest when CUDA is absent)",
)


@interpreted
@pytest.mark.parametrize(("lengths", "key_lengths"), CASES)
@pytest.mark.parametrize("per_head", [True, False])
def test_triton_kernel_meets_the_contract_in_the_interpreter(attention_launches, lengths, key_lengths, per_head):
    from mla_ops.backends.triton import TritonBackend

    causal = key_lengths is None
    batch = fp8_batch(lengths, key_lengths, 2, padding=3, per_head=per_head, outliers=True, seed=1)
    call, scales = fp8_call(batch, causal, SCALE)
    out, lse = TritonBackend().attention_fp8(call, scales)
    error, bound = contract_errors(batch, out, causal, SCALE)
    # Twice the contract's bound: the interpreter converts float32 to e4m3 by truncation, not to nearest as the GPU
    # does (measured on U(0, 2): mean signed error -0.033 against +0.001), which biases every rounded probability
    # down. tests/test_gpu_fp8.py holds the GPU to the contract itself.
    assert error <= 2 * bound, (error, bound)
    _, want_lse = mla_ops.backends.reference.ReferenceBackend().attention_fp8(call, scales)
    rows = int(batch.cu_seqlens_q[-1])
    torch.testing.assert_close(lse[:, :rows], want_lse[:, :rows], atol=1e-5, rtol=1e-5)
    assert torch.isneginf(lse[:, rows:]).all(), "padding rows get lse = -inf"


# --- the op contract -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FP8_SCHEMAS))
def test_fp8_schema_and_registration(name) -> None:
    assert str(getattr(torch.ops.mla, name).default._schema) == FP8_SCHEMAS[name]
    for key in ("CPU", "CUDA", "Meta"):
        assert torch._C._dispatch_has_computed_kernel_for_dispatch_key(f"mla::{name}", key), key


@pytest.mark.parametrize("per_head", [True, False])
def test_opcheck_fp8_ops(per_head) -> None:
    # All of opcheck's tests but test_schema, whose SchemaCheckMode compares the inputs before and after the call
    # with arithmetic that torch does not implement for float8_e4m3fn on CPU ("mul_cpu_reduced_float").
    tests = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    new = fp8_batch([3, 0, 6], None, 2, per_head=per_head)
    args = (new.q, new.k, new.v, new.cu_seqlens_q, new.max_seqlen_q, *new.descales, SCALE, torch.bfloat16)
    torch.library.opcheck(torch.ops.mla.prefill_fp8.default, args, test_utils=tests)
    chunk = fp8_batch([3, 0, 6], [4, 2, 0], 2, per_head=per_head)
    args = (
        chunk.q, chunk.k, chunk.v, chunk.cu_seqlens_q, chunk.cu_seqlens_k, chunk.max_seqlen_q, chunk.max_seqlen_k,
        *chunk.descales, SCALE, torch.float16,
    )  # fmt: skip
    torch.library.opcheck(torch.ops.mla.prefill_context_chunk_fp8.default, args, test_utils=tests)


def test_fp8_results_merge_with_bf16_ones() -> None:
    """New tokens in fp8 and a context chunk in bf16 merge through the LSE into attention over both key sets."""
    lengths, context = [4, 7], [5, 3]
    new = fp8_batch(lengths, None, 2, seed=2)
    chunk = fp8_batch(lengths, context, 2, seed=3)
    cu, cu_k = new.cu_seqlens_q, cu_seqlens_of(context)
    q = new.dequantised[0].bfloat16()
    kc, vc = (x.bfloat16() for x in chunk.dequantised[1:])
    out_new, lse_new = run_fp8(new, True, SCALE)
    out_ctx, lse_ctx = mla_ops.prefill_context_chunk(q, kc, vc, cu, cu_k, 7, 5, SCALE)
    out, lse = mla_ops.merge_attn_states(out_ctx, lse_ctx, out_new, lse_new)
    # The same attention over [context, new tokens] of each sequence, from the dequantised values.
    qd, kn, vn = new.dequantised
    for b, (n, c) in enumerate(zip(lengths, context)):
        q0, k0 = int(cu[b]), int(cu_k[b])
        keys = torch.cat([kc[k0 : k0 + c].double(), kn[q0 : q0 + n].double()])
        values = torch.cat([vc[k0 : k0 + c].double(), vn[q0 : q0 + n].double()])
        # The chunk's scores from the bf16 q its op was given, the new tokens' from the dequantised one.
        scores = (
            torch.cat(
                [
                    torch.einsum("qhd,khd->hqk", q[q0 : q0 + n].double(), keys[:c]),
                    torch.einsum("qhd,khd->hqk", qd[q0 : q0 + n].double(), keys[c:]),
                ],
                dim=-1,
            )
            * SCALE
        )
        visible = torch.ones(n, c + n, dtype=torch.bool).tril(diagonal=c)
        scores = scores.masked_fill(~visible, -math.inf)
        want = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), values)
        torch.testing.assert_close(out[q0 : q0 + n].double(), want, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse[:, q0 : q0 + n].double(), torch.logsumexp(scores, -1), atol=1e-4, rtol=1e-5)


def _graphs(fn) -> int:
    return len(_debug_get_cache_entry_list(fn.__code__))


def test_fp8_op_compiles_one_graph_across_batches() -> None:
    reset_compile()

    def attend(q, k, v, cu, max_seqlen, dq, dk, dv):
        return mla_ops.prefill_fp8(q, k, v, cu, max_seqlen, dq, dk, dv)

    compiled = torch.compile(attend, fullgraph=True, dynamic=True)
    for seed, lengths in enumerate([[5, 9], [40, 3, 7], [2, 2], [17]]):
        b = fp8_batch(lengths, None, 2, seed=seed)
        got = compiled(b.q, b.k, b.v, b.cu_seqlens_q, b.max_seqlen_q, *b.descales)
        want = mla_ops.prefill_fp8(b.q, b.k, b.v, b.cu_seqlens_q, b.max_seqlen_q, *b.descales)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert _graphs(attend) == 1


# --- routing -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("capability", "expected"), [("9.0", "TRITON"), ("8.9", "TRITON"), ("10.0", "FLASH_ATTN")])
def test_fp8_routes_to_the_backends_with_fp8_kernels(all_installed, capability, expected) -> None:
    config = mla_ops.SelectorConfig(FP8_DTYPE)
    assert mla_ops.select_backend(mla_ops.DeviceCapability.parse(capability), config).name == expected
    assert mla_ops.select_backend(None, config).name == "REFERENCE"


def test_fp8_on_ampere_and_a_forced_bf16_only_backend_say_why(all_installed) -> None:
    config = mla_ops.SelectorConfig(FP8_DTYPE)
    with pytest.raises(ValueError, match=r"TRITON: \[dtype float8_e4m3fn needs compute capability 8.9 or newer"):
        mla_ops.select_backend(mla_ops.DeviceCapability(8, 0), config)
    with mla_ops.prefill_backend("FLASHINFER"), pytest.raises(ValueError, match="dtype float8_e4m3fn is not supported"):
        mla_ops.select_backend(mla_ops.DeviceCapability(9, 0), config)


# --- bad inputs ----------------------------------------------------------------------------------------------


def _good():
    b = fp8_batch([3, 4], None, 2)
    return dict(q=b.q, k=b.k, v=b.v, cu_seqlens=b.cu_seqlens_q, max_seqlen=4, q_descale=b.descales[0],
                k_descale=b.descales[1], v_descale=b.descales[2])  # fmt: skip


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda a: a.update(q=a["q"].bfloat16()), TypeError, "q has dtype bfloat16; this op takes float8_e4m3fn"),
        (lambda a: a.update(v=a["v"].bfloat16()), TypeError, "v has dtype bfloat16 but q has float8_e4m3fn"),
        (lambda a: a.update(q_descale=a["q_descale"].half()), TypeError, "q_descale must have dtype float32"),
        (lambda a: a.update(k_descale=torch.ones(3)), ValueError, r"k_descale must have shape .* H = 2 .* got \(3,\)"),
        (lambda a: a.update(k_descale=torch.ones(1, 2)), ValueError, r"k_descale must have shape .* got \(1, 2\)"),
        (lambda a: a.update(v_descale=[1.0]), TypeError, "v_descale must be a torch.Tensor"),
        (lambda a: a.update(v_descale=torch.ones(2, device="meta")), ValueError, "v_descale is on meta but q is on"),
        (lambda a: a.update(q_descale=torch.tensor(math.nan)), ValueError, "q_descale must hold finite, positive.*nan"),
        (lambda a: a.update(k_descale=torch.tensor([1.0, math.inf])), ValueError, "k_descale must hold finite.*inf"),
        (lambda a: a.update(v_descale=torch.tensor([0.0])), ValueError, "v_descale must hold finite, positive.*0.0"),
        (lambda a: a.update(v_descale=torch.tensor([-1.0, 1.0])), ValueError, "v_descale .*positive.*-1.0"),
        (lambda a: a.update(out_dtype=torch.float32), TypeError, "out_dtype must be torch.bfloat16 or torch.float16"),
        (lambda a: a.update(max_seqlen=2.5), TypeError, "max_seqlen must be an int"),
        (lambda a: a.update(cu_seqlens=torch.tensor([0, 3, 9], dtype=torch.int32)), ValueError, "cu_seqlens ends at 9"),
    ],
)
def test_fp8_bad_inputs_raise_clear_errors(change, error, match) -> None:
    args = _good()
    change(args)
    with pytest.raises(error, match=match):
        mla_ops.prefill_fp8(**args)


def test_bf16_op_given_fp8_tensors_names_the_fp8_op() -> None:
    b = fp8_batch([3], None, 2)
    with pytest.raises(TypeError, match=r"for float8_e4m3fn inputs with descale factors call mla\.prefill_fp8"):
        mla_ops.prefill(b.q, b.k, b.v, b.cu_seqlens_q, 3)
    with pytest.raises(TypeError, match=r"call mla\.prefill_context_chunk_fp8"):
        mla_ops.prefill_context_chunk(b.q, b.k, b.v, b.cu_seqlens_q, b.cu_seqlens_q, 3, 3)


def test_fake_raises_the_same_errors_under_fake_tensors() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    b = fp8_batch([3, 4], None, 2)
    with FakeTensorMode(allow_non_fake_inputs=True):
        out, lse = torch.ops.mla.prefill_fp8(b.q, b.k, b.v, b.cu_seqlens_q, 4, *b.descales, SCALE, torch.float16)
        assert out.dtype == torch.float16 and out.shape == (7, 2, 128) and lse.shape == (2, 7)
        with pytest.raises(ValueError, match="q_descale must have shape"):
            torch.ops.mla.prefill_fp8(b.q, b.k, b.v, b.cu_seqlens_q, 4, torch.ones(5), b.descales[1], b.descales[2],
                                      SCALE, torch.bfloat16)  # fmt: skip


@interpreted
def test_triton_fp8_warmup_launches_both_paths_and_factor_layouts(attention_launches, monkeypatch) -> None:
    from mla_ops.backends.triton import TritonBackend
    from mla_ops.kernels import attention

    calls = []
    real = attention.attention_triton

    def record(call, **kwargs):
        calls.append((call.causal, kwargs["scales"].k_descale.stride(0), kwargs["scales"].out_dtype, call.v.stride(0)))
        return real(call, **kwargs)

    monkeypatch.setattr(attention, "attention_triton", record)
    TritonBackend()._warmup_fp8(torch.device("cpu"), 64, 32, 2, torch.Generator().manual_seed(0))
    # causal and chunk x per-head (stride 1) and per-tensor (stride 0) factors x two output dtypes x two v layouts
    assert len(set(calls)) == len(calls) == 16


def test_fp8_launches_replace_ten_leading_tensors_and_bf16_launches_keep_seven() -> None:
    """An fp8 launch's descale factors follow the seven tensors, so that a known layout's relaunch replaces their
    addresses too; a bf16 launch passes None for them and for their strides, which Triton compiles out (its variants
    keep the parameters and code they had without fp8)."""
    pytest.importorskip("triton", reason="the launch plan is the Triton kernel's")
    from mla_ops.kernels import attention
    from mla_ops.kernels.configs import AttentionConfig

    b = fp8_batch([5, 9], None, 2)
    out, lse = torch.empty(14, 2, 128, dtype=torch.bfloat16), torch.empty(2, 14)
    call = VarlenCall(b.q, b.k, b.v, b.cu_seqlens_q, b.cu_seqlens_q, 9, 9, SCALE, True)
    scales = Fp8Scales(*(d.reshape(-1).expand(2) for d in b.descales), torch.bfloat16)
    plan = attention.launch_plan(call, out, lse, AttentionConfig(64, 32, 4, 2), scales)
    assert plan.leading == 10 and plan.constexprs["FP8"]
    assert [a.data_ptr() for a in plan.args[7:10]] == [d.data_ptr() for d in scales[:3]]
    assert plan.args[-3:] == (1, 1, 1)  # the per-head factors' strides
    bf16 = call._replace(q=b.bf16[0], k=b.bf16[1], v=b.bf16[2])
    plan = attention.launch_plan(bf16, out, lse, AttentionConfig(64, 32, 4, 2))
    assert plan.leading == 7 and not plan.constexprs["FP8"]
    assert plan.args[7:10] == (None, None, None) and plan.args[-3:] == (None, None, None)


@interpreted
@pytest.mark.parametrize("per_head", [True, False])
def test_quantize_kernel_in_the_interpreter(per_head) -> None:
    """The CUDA conversion kernel, run in Triton's interpreter, on a strided view and a token count no block divides,
    with per-head or per-tensor scales. The inputs are e4m3 values times powers of two, so every product is exact
    and the rounding mode cannot matter: the interpreter truncates (and mis-converts some values near a power of two,
    126.4 to 64), where a GPU rounds to nearest as PyTorch does (tests/test_gpu_fp8.py holds the two equal there)."""
    from mla_ops.kernels.quantize import quantize_rows_fp8

    gen = torch.Generator().manual_seed(5)
    values = (torch.randn(37, 3, 192, generator=gen) * 40).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    descale = torch.tensor([0.25, 2.0, 8.0]) if per_head else torch.tensor([4.0])
    kv = torch.zeros(37, 3, 320, dtype=torch.bfloat16)
    kv[..., 128:] = (values.float() * descale.reshape(-1, 1)).bfloat16()  # exact: 4 significant bits
    scale = (1.0 / descale).expand(3)
    got = quantize_rows_fp8(kv[..., 128:], scale, torch.empty(37, 3, 192, dtype=FP8_DTYPE))
    assert torch.equal(got.float(), values.float())


@interpreted
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("per_head", [True, False])
def test_quantize_keys_kernel_in_the_interpreter(per_head, dim) -> None:
    """The CUDA key-major conversion kernel, run in Triton's interpreter: on exact inputs (as in
    test_quantize_kernel_in_the_interpreter) the e4m3 values, transposed; on any input (a NaN, infinities, values that
    round) the bytes of the row-major kernel, which converts alike; 0 in the columns past the tokens, a NaN factor's
    head too; on a strided view, with a token count that spans three programs and that none divides. It refuses the
    inputs it miscompiled for on an H100 (float32, a head dimension that is no power of two or above 128)."""
    from mla_ops import quantize
    from mla_ops.kernels.quantize import KEY_COLUMNS, key_major_kernel_fits, quantize_keys_fp8, quantize_rows_fp8

    assert KEY_COLUMNS == quantize._KEY_MAJOR_COLUMNS  # the storage's width is what the programs tile
    tokens, width = 300, 384
    gen = torch.Generator().manual_seed(7)
    values = (torch.randn(tokens, 3, dim, generator=gen) * 40).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    descale = torch.tensor([0.25, 2.0, 8.0]) if per_head else torch.tensor([4.0])
    kv = torch.zeros(tokens, 3, 128 + dim, dtype=torch.bfloat16)
    kv[..., 128:] = (values.float() * descale.reshape(-1, 1)).bfloat16()  # exact: 4 significant bits
    scale = (1.0 / descale).expand(3)
    # Storage filled with e4m3 NaN bytes: every byte, the padding's too, must be written.
    storage = torch.full((3, dim, width), 0x7F, dtype=torch.uint8).view(FP8_DTYPE)
    got = quantize_keys_fp8(kv[..., 128:], scale, storage)
    assert got is storage
    assert torch.equal(got[:, :, :tokens].permute(2, 0, 1).view(torch.uint8), values.view(torch.uint8))
    assert not got.view(torch.uint8)[:, :, tokens:].any()

    x = (torch.randn(tokens, 3, 128 + dim, generator=gen) * 300).bfloat16()[..., 128:]
    x[5, 0, 3], x[299, 1, 0], x[17, 2, 7] = float("nan"), float("inf"), -float("inf")
    scale = torch.tensor([1.0, 0.37, float("nan")]) if per_head else torch.tensor([0.37]).expand(3)
    storage.view(torch.uint8).fill_(0x7F)
    got = quantize_keys_fp8(x, scale, storage)
    want = quantize_rows_fp8(x, scale, torch.empty(tokens, 3, dim, dtype=FP8_DTYPE))
    assert torch.equal(got[:, :, :tokens].permute(2, 0, 1).view(torch.uint8), want.view(torch.uint8))
    assert not got.view(torch.uint8)[:, :, tokens:].any(), "0 past the tokens, whatever the factor"
    with pytest.raises(ValueError, match="W >= 300 a multiple of 128"):
        quantize_keys_fp8(x, scale, storage[:, :, :304])
    for bad in (x.float(), torch.zeros(4, 3, 192, dtype=torch.bfloat16), torch.zeros(4, 3, 256, dtype=torch.float16)):
        assert not key_major_kernel_fits(bad)
        with pytest.raises(ValueError, match="bfloat16 or float16 with a power-of-two head dimension up to 128"):
            quantize_keys_fp8(bad, scale, torch.empty(3, bad.shape[-1], 128, dtype=FP8_DTYPE))
    assert key_major_kernel_fits(x) and key_major_kernel_fits(x.half())


@interpreted
@pytest.mark.parametrize("per_head", [True, False])
def test_amax_kernel_in_the_interpreter(per_head) -> None:
    """The CUDA maxima's kernel, run in Triton's interpreter, against PyTorch's reduction: a strided view, a token
    count that spans two programs and no block divides, one head of zeros, one with a NaN (kept, as PyTorch keeps
    it) and -inf in another (an infinite magnitude)."""
    from mla_ops.kernels.quantize import amax_rows

    gen = torch.Generator().manual_seed(6)
    kv = torch.randn(1100, 4, 320, generator=gen).bfloat16()
    kv[:, 1] = 0.0
    kv[1037, 2, 200] = float("nan")
    kv[3, 3, 300] = -float("inf")
    x = kv[..., 128:]
    got = amax_rows(x, per_head)
    want = torch.linalg.vector_norm(x, ord=math.inf, dim=(0, 2) if per_head else (0, 1, 2)).float()
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
    if per_head:
        assert got[1] == 0 and got[2].isnan() and got[3] == float("inf") and got[0] == x[:, 0].abs().max()


def test_triton_describes_its_fp8_kernel() -> None:
    pytest.importorskip("triton.experimental.gluon", reason="the bf16 description names the Gluon kernel where it runs")
    from mla_ops.backends.triton import TritonBackend

    backend = TritonBackend(triton_version=lambda: "3.6.0")
    fp8 = backend.describe(mla_ops.DeviceCapability(9, 0), mla_ops.SelectorConfig(FP8_DTYPE))
    assert "fp8 (e4m3) inputs: this kernel at every size" in fp8 and "large batches" not in fp8
    bf16 = backend.describe(mla_ops.DeviceCapability(9, 0), mla_ops.SelectorConfig(torch.bfloat16))
    assert "large batches: the Hopper kernel written in Gluon" in bf16
