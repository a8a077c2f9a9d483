"""Every bad input gets a clear error naming what is wrong, through the API and the raw ops."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from utils import cu_seqlens_of, make_batch, make_qkv

import mla_ops
from mla_ops.meta.checks import check_attention_inputs, checked_attention_sizes

BF16 = torch.bfloat16


def _good():
    b = make_batch([3, 4], 2, 192, 128, BF16)
    return {"q": b.q, "k": b.k, "v": b.v, "cu_seqlens": b.cu_seqlens, "max_seqlen": 4}


def _call_prefill(**overrides):
    args = _good() | overrides
    return mla_ops.prefill(args["q"], args["k"], args["v"], args["cu_seqlens"], args["max_seqlen"])


PREFILL_CASES = [
    ("q as float32", {"q": torch.randn(7, 2, 192)}, TypeError, "mla.prefill: q has dtype float32; only bfloat16"),
    (
        "k dtype",
        {"k": torch.randn(7, 2, 192, dtype=torch.float16)},
        TypeError,
        "k has dtype float16 but q has bfloat16",
    ),
    (
        "v dtype",
        {"v": torch.randn(7, 2, 128, dtype=torch.float16)},
        TypeError,
        "v has dtype float16 but q has bfloat16",
    ),
    (
        "q rank",
        {"q": torch.randn(7, 384, dtype=BF16)},
        ValueError,
        "q must be a 3-D tensor [T, H, Dqk], got shape (7, 384)",
    ),
    ("v rank", {"v": torch.randn(7, 2, 2, 64, dtype=BF16)}, ValueError, "v must be a 3-D tensor [T, H, Dv]"),
    ("q not a tensor", {"q": [1, 2]}, TypeError, "q must be a torch.Tensor, got list"),
    (
        "head mismatch",
        {"k": torch.randn(7, 3, 192, dtype=BF16)},
        ValueError,
        "head counts differ: q has 2, k has 3, v has 2",
    ),
    ("dim mismatch", {"k": torch.randn(7, 2, 128, dtype=BF16)}, ValueError, "q has head dim 192 but k has 128"),
    ("token mismatch k/v", {"v": torch.randn(6, 2, 128, dtype=BF16)}, ValueError, "k has 7 tokens but v has 6"),
    (
        "token mismatch q/k",
        {"k": torch.randn(8, 2, 192, dtype=BF16), "v": torch.randn(8, 2, 128, dtype=BF16)},
        ValueError,
        "q has 7 tokens but k has 8",
    ),
    (
        "cu_seqlens int64",
        {"cu_seqlens": torch.tensor([0, 3, 7])},
        TypeError,
        "cu_seqlens must have dtype int32, got int64; use cu_seqlens.to(torch.int32)",
    ),
    (
        "cu_seqlens rank",
        {"cu_seqlens": torch.zeros(2, 2, dtype=torch.int32)},
        ValueError,
        "cu_seqlens must be a 1-D tensor [B+1] starting at 0",
    ),
    ("cu_seqlens not a tensor", {"cu_seqlens": [0, 3, 7]}, TypeError, "cu_seqlens must be a torch.Tensor, got list"),
    (
        "cu_seqlens past T",
        {"cu_seqlens": cu_seqlens_of([3, 5])},
        ValueError,
        "cu_seqlens ends at 8 but the tensor holds only 7 tokens",
    ),
    (
        "cu_seqlens start",
        {"cu_seqlens": torch.tensor([1, 3, 7], dtype=torch.int32)},
        ValueError,
        "cu_seqlens must start at 0",
    ),
    (
        "cu_seqlens decreasing",
        {"cu_seqlens": torch.tensor([0, 5, 3], dtype=torch.int32)},
        ValueError,
        "cu_seqlens must be non-decreasing",
    ),
    (
        "max_seqlen too small",
        {"max_seqlen": 3},
        ValueError,
        "max_seqlen for cu_seqlens is 3 but a sequence has 4 tokens",
    ),
    ("max_seqlen negative", {"max_seqlen": -1}, ValueError, "max_seqlen must be >= 0, got -1"),
    ("max_seqlen float", {"max_seqlen": 4.0}, TypeError, "max_seqlen must be an int, got float"),
    (
        "strided last dim",
        {"q": torch.randn(7, 2, 384, dtype=BF16)[..., ::2]},
        ValueError,
        "q must have stride 1 in its last dimension",
    ),
]


@pytest.mark.parametrize(("name", "overrides", "error", "message"), PREFILL_CASES, ids=[c[0] for c in PREFILL_CASES])
def test_prefill_errors(name, overrides, error, message) -> None:
    with pytest.raises(error, match=re.escape(message)):
        _call_prefill(**overrides)


def test_raw_op_validates_too() -> None:
    g = _good()
    with pytest.raises(TypeError, match=re.escape("mla.prefill: q has dtype float32")):
        torch.ops.mla.prefill(g["q"].float(), g["k"], g["v"], g["cu_seqlens"], 4, 0.1)


def test_softmax_scale_errors() -> None:
    g = _good()
    with pytest.raises(ValueError, match="softmax_scale must be finite, got nan"):
        mla_ops.prefill(g["q"], g["k"], g["v"], g["cu_seqlens"], 4, softmax_scale=float("nan"))


def test_device_mismatch_is_named() -> None:
    g = _good()
    meta_v = torch.empty(7, 2, 128, dtype=BF16, device="meta")
    with pytest.raises(ValueError, match=re.escape("v is on meta but q is on cpu")):
        mla_ops.prefill(g["q"], g["k"], meta_v, g["cu_seqlens"], 4)
    with pytest.raises(ValueError, match=re.escape("cu_seqlens is on meta but q is on cpu; move it to cpu")):
        mla_ops.prefill(g["q"], g["k"], g["v"], g["cu_seqlens"].to("meta"), 4)


def test_the_ops_check_returns_the_sizes_they_route_by() -> None:
    # The ops' one-expression check hands its sizes to the route (mla_ops.selector.route_checked): exactly the
    # sizes of the inputs where it accepts them, and None wherever the full check may have to explain a problem.
    g = _good()
    q, k, v, cu = g["q"], g["k"], g["v"], g["cu_seqlens"]
    new = (q, k, v, cu, cu, 4, 4, 0.1, True)
    assert checked_attention_sizes(*new) == (q.device, BF16, q.shape, 7, 128, 3)
    cq, k_c, v_c, cu_q, cu_k, max_q, max_k = _chunk_args()
    assert checked_attention_sizes(cq, k_c, v_c, cu_q, cu_k, max_q, max_k, 0.1, False) == (
        q.device,
        BF16,
        q.shape,
        5,
        128,
        3,
    )
    bad = {
        "float32 q": {0: q.float()},
        "no k": {1: None},
        "int64 offsets": {3: cu.long()},
        "k of other heads": {1: torch.randn(7, 4, 192, dtype=BF16)},
        "v of other rows": {2: v[:6]},
        "negative bound": {5: -1},
        "non-finite scale": {7: float("inf")},
        "self-attention over other rows": {1: k[:6], 2: v[:6]},
    }
    for name, overrides in bad.items():
        args = list(new)
        for i, value in overrides.items():
            args[i] = value
        assert checked_attention_sizes(*args) is None, name
        with pytest.raises((TypeError, ValueError)):
            check_attention_inputs("mla.prefill", tuple(args[:8]), True)


def _assert_refused(op, op_name: str, args: list, overrides: dict, error: type[Exception], message: str) -> None:
    """``op(*args)``, with ``args[i]`` replaced by ``overrides[i]``, raises ``error`` saying ``op_name: message``."""
    for i, value in overrides.items():
        args[i] = value
    with pytest.raises(error, match=re.escape(f"{op_name}: {message}")):
        op(*args)


def _chunk_args():
    b = make_batch([3, 4], 2, 192, 128, BF16)
    _, k_c, v_c = make_qkv(5, 2, 192, 128, BF16)
    return [b.q, k_c, v_c, b.cu_seqlens, cu_seqlens_of([2, 3]), 4, 3]


CHUNK_CASES = [
    (
        "batch mismatch",
        {4: cu_seqlens_of([2, 3, 0])},
        ValueError,
        "cu_seqlens_q describes 2 sequences but cu_seqlens_k describes 3",
    ),
    ("cu_k int64", {4: torch.tensor([0, 2, 5])}, TypeError, "cu_seqlens_k must have dtype int32, got int64"),
    (
        "cu_k past Tk",
        {4: cu_seqlens_of([2, 4])},
        ValueError,
        "cu_seqlens_k ends at 6 but the tensor holds only 5 tokens",
    ),
    ("max_k too small", {6: 2}, ValueError, "max_seqlen for cu_seqlens_k is 2 but a sequence has 3 tokens"),
    ("k heads", {1: torch.randn(5, 4, 192, dtype=BF16)}, ValueError, "head counts differ: q has 2, k has 4"),
]


@pytest.mark.parametrize(("name", "overrides", "error", "message"), CHUNK_CASES, ids=[c[0] for c in CHUNK_CASES])
def test_context_chunk_errors(name, overrides, error, message) -> None:
    _assert_refused(
        mla_ops.prefill_context_chunk, "mla.prefill_context_chunk", _chunk_args(), overrides, error, message
    )


def _merge_args():
    out = torch.randn(5, 2, 128, dtype=BF16)
    lse = torch.randn(2, 5)
    return [out, lse, out.clone(), lse.clone()]


MERGE_CASES = [
    (
        "lse layout [T, H]",
        {1: torch.randn(5, 2)},
        ValueError,
        "prefix_lse must have shape [H, T] = (2, 5) (head-major), got (5, 2)",
    ),
    (
        "lse dtype",
        {3: torch.randn(2, 5, dtype=torch.float16)},
        TypeError,
        "suffix_lse must have dtype float32, got float16",
    ),
    (
        "out dtype",
        {2: torch.randn(5, 2, 128, dtype=torch.float16)},
        TypeError,
        "suffix_out has dtype float16 but prefix_out has bfloat16",
    ),
    (
        "out shape",
        {2: torch.randn(5, 2, 64, dtype=BF16)},
        ValueError,
        "prefix_out has shape (5, 2, 128) but suffix_out has",
    ),
    ("float32 out", {0: torch.randn(5, 2, 128), 2: torch.randn(5, 2, 128)}, TypeError, "prefix_out has dtype float32"),
]


@pytest.mark.parametrize(("name", "overrides", "error", "message"), MERGE_CASES, ids=[c[0] for c in MERGE_CASES])
def test_merge_errors(name, overrides, error, message) -> None:
    _assert_refused(mla_ops.merge_attn_states, "mla.merge_attn_states", _merge_args(), overrides, error, message)


def test_prefill_with_context_rejects_malformed_chunks() -> None:
    g = _good()
    with pytest.raises(TypeError, match=re.escape("chunks[0] must be (k, v, cu_seqlens_k, max_seqlen_k), got 2 items")):
        mla_ops.prefill_with_context(g["q"], g["k"], g["v"], g["cu_seqlens"], 4, [(g["k"], g["v"])])


@pytest.mark.parametrize(
    ("part", "bad", "message"),
    [
        ("k", lambda t: t[..., :128], "chunks[0]: k has shape (7, 2, 128), but the new tokens' k has"),
        ("v", lambda t: t[:, :1], "chunks[0]: v has shape (7, 1, 128), but the new tokens' v has"),
        ("v", lambda t: t[0], "chunks[0]: v has shape (2, 128), but the new tokens' v has"),
    ],
)
def test_prefill_with_context_rejects_a_chunk_of_other_dims(part, bad, message) -> None:
    g = _good()
    chunk = {"k": g["k"], "v": g["v"]}
    chunk[part] = bad(chunk[part])
    for form in (mla_ops.ContextChunk, lambda *c: c):  # the fast path's two forms, and the general checks
        with pytest.raises(ValueError, match=re.escape(message)):
            mla_ops.prefill_with_context(
                g["q"], g["k"], g["v"], g["cu_seqlens"], 4, [form(chunk["k"], chunk["v"], g["cu_seqlens"], 4)]
            )


def test_prefill_with_context_takes_every_form_of_a_chunk_alike() -> None:
    g = _good()
    args = (g["q"], g["k"], g["v"], g["cu_seqlens"], 4)
    forms = [
        mla_ops.ContextChunk(g["k"], g["v"], g["cu_seqlens"], 4),
        (g["k"], g["v"], g["cu_seqlens"], 4),
        [g["k"], g["v"], g["cu_seqlens"], 4],
        (g["k"], g["v"], g["cu_seqlens"], np.int64(4)),
    ]
    want_out, want_lse = mla_ops.prefill_with_context(*args, [forms[0]], g["q"].shape[-1] ** -0.5)
    for chunk in forms:
        out, lse = mla_ops.prefill_with_context(*args, [chunk])
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse), type(chunk)


def test_errors_surface_at_trace_time_under_compile() -> None:
    g = _good()

    @torch.compile(fullgraph=True, backend="eager")
    def f(q, k, v, cu):
        return mla_ops.prefill(q, k, v, cu, 4)

    with pytest.raises(Exception, match=re.escape("q has head dim 192 but k has 128")):
        f(g["q"], g["k"][..., :128], g["v"], g["cu_seqlens"])


def test_fp8_ops_take_key_major_values_and_the_bf16_ops_refuse_them() -> None:
    """The fp8 ops take ``v`` key-major (unit stride over the tokens, quantize_fp8's ``key_major`` layout) with the
    results of token-major ``v``; the bf16 ops refuse it, and a ``v`` unit-strided in neither dimension gets a message
    that names the key-major layout."""
    q, k, v = make_qkv(20, 2, 32, 16, torch.float32)
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    (q8, dq), (k8, dk), (v8, dv) = (mla_ops.quantize_fp8(x) for x in (q, k, v))
    storage = torch.zeros(2, 16, 32, dtype=torch.float8_e4m3fn)
    storage[..., :20] = v8.permute(1, 2, 0)
    v8_keys = storage[..., :20].permute(2, 0, 1)
    assert v8_keys.stride() == (1, 16 * 32, 32)
    want = mla_ops.prefill_fp8(q8, k8, v8, cu, 13, dq, dk, dv)
    got = mla_ops.prefill_fp8(q8, k8, v8_keys, cu, 13, dq, dk, dv)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    got = mla_ops.prefill_context_chunk_fp8(q8, k8, v8_keys, cu, cu, 13, 13, dq, dk, dv)
    want = mla_ops.prefill_context_chunk_fp8(q8, k8, v8, cu, cu, 13, 13, dq, dk, dv)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    v_keys = v.bfloat16().permute(1, 2, 0).contiguous().permute(2, 0, 1)
    with pytest.raises(ValueError, match=r"v must have stride 1 in its last dimension \(got"):
        mla_ops.prefill(q.bfloat16(), k.bfloat16(), v_keys, cu, 13)
    neither = torch.zeros(20, 2, 32, dtype=torch.float8_e4m3fn)[..., ::2]
    with pytest.raises(ValueError, match=r"or, for v of the fp8 ops, in its first: quantize_fp8\(v, key_major=True\)"):
        mla_ops.prefill_fp8(q8, k8, neither, cu, 13, dq, dk, dv)
