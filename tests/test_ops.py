"""The op contract: schemas, registration per dispatch key, fake kernels and opcheck."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from utils import cu_seqlens_of, make_batch, make_qkv

import mla_ops

SCHEMAS = {
    "prefill": "mla::prefill(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, SymInt max_seqlen, float softmax_scale)"
    " -> (Tensor out, Tensor lse)",
    "prefill_context_chunk": "mla::prefill_context_chunk(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, "
    "Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, float softmax_scale) -> (Tensor out, Tensor lse)",
    "merge_attn_states": "mla::merge_attn_states(Tensor prefix_out, Tensor prefix_lse, Tensor suffix_out, "
    "Tensor suffix_lse) -> (Tensor out, Tensor lse)",
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema_is_the_documented_one(name: str) -> None:
    assert str(getattr(torch.ops.mla, name).default._schema) == SCHEMAS[name]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_kernels_registered_for_cpu_cuda_and_meta(name: str) -> None:
    qualname = f"mla::{name}"
    for key in ("CPU", "CUDA"):
        # The merge's Python kernel serves CUDA through CompositeExplicitAutograd (the native merge
        # registers its C++ kernel for CUDA itself when loaded): ask for the kernel the key computes to.
        assert torch._C._dispatch_has_computed_kernel_for_dispatch_key(qualname, key), (qualname, key)
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "Meta")


def test_merge_registers_python_for_cpu_and_every_backend_but_not_for_cuda_itself() -> None:
    """The CUDA key stays free for the native merge's C++ kernel (mla_ops.native): were the Python kernel
    registered for CUDA, loading the library would override it (a dispatcher warning)."""
    import mla_ops.native

    qualname = "mla::merge_attn_states"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CPU")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CompositeExplicitAutograd")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CUDA") == mla_ops.native.is_loaded()


@pytest.mark.parametrize("name", ["prefill", "prefill_context_chunk", "prefill_with_chunk"])
def test_attention_ops_leave_cuda_to_the_native_library_and_keep_a_python_twin(name: str) -> None:
    """As for the merge, the CUDA key stays free for the native library's C++ kernel, which calls the Python
    kernel through the op's twin (mla_ops.ops.PYTHON_TWINS) for the calls it does not launch itself. The
    library registers it only while a TRITON layout is remembered (none without a GPU)."""
    import mla_ops.native
    from mla_ops.ops import FUSED_SCHEMA, PYTHON_TWINS

    qualname = f"mla::{name}"
    schema = {**SCHEMAS, "prefill_with_chunk": "mla::" + FUSED_SCHEMA}[name]
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CompositeExplicitAutograd")
    registered = mla_ops.native.attention_kernels_registered()
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CUDA") == registered
    twin = getattr(torch.ops.mla, PYTHON_TWINS[name]).default
    assert str(twin._schema).removeprefix(f"mla::{PYTHON_TWINS[name]}") == schema.removeprefix(qualname)
    for key in ("CPU", "CUDA", "Meta"):
        assert torch._C._dispatch_has_computed_kernel_for_dispatch_key(twin.name(), key), key


def test_check_merge_inputs_op_raises_the_merge_ops_errors() -> None:
    """mla::_check_merge_inputs, with which the native merge raises: check_merge_inputs's errors, word for word."""
    from mla_ops.meta.checks import check_merge_inputs

    po = torch.zeros(3, 2, 8, dtype=torch.bfloat16)
    lse = torch.zeros(2, 3)
    torch.ops.mla._check_merge_inputs(po, lse, po, lse)  # accepted: returns nothing
    for bad in (
        (po, lse.double(), po, lse),
        (po, lse, po.half(), lse),
        (po, lse, po, lse[:1]),
        (po[..., ::2], lse, po, lse),
    ):
        with pytest.raises((TypeError, ValueError)) as expected:
            check_merge_inputs(*bad)
        with pytest.raises(type(expected.value), match=re.escape(str(expected.value))):
            torch.ops.mla._check_merge_inputs(*bad)


# (lengths, heads, Dqk, Dv, dtype, strided v, padding rows); includes zero-length sequences.
SHAPES = [
    ([5], 1, 192, 128, torch.bfloat16, False, 0),
    ([3, 0, 7, 1], 2, 192, 128, torch.bfloat16, True, 2),
    ([0, 0], 2, 64, 64, torch.float16, False, 3),
    ([4, 9], 3, 128, 128, torch.float16, True, 0),
    ([], 2, 192, 128, torch.bfloat16, False, 4),
]


def _chunk_for(batch, context_lengths):
    _, k, v = make_qkv(sum(context_lengths), batch.q.shape[1], batch.q.shape[2], batch.v.shape[2], batch.q.dtype)
    return k, v, cu_seqlens_of(context_lengths), max(context_lengths, default=0)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_opcheck_all_ops(shape) -> None:
    lengths, heads, dqk, dv, dtype, strided, padding = shape
    b = make_batch(lengths, heads, dqk, dv, dtype, strided_v=strided, padding=padding)
    scale = dqk**-0.5
    torch.library.opcheck(torch.ops.mla.prefill.default, (b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen, scale))
    k_c, v_c, cu_k, max_k = _chunk_for(b, [(i * 3) % 5 for i in range(len(lengths))])
    chunk_args = (b.q, k_c, v_c, b.cu_seqlens, cu_k, b.max_seqlen, max_k, scale)
    torch.library.opcheck(torch.ops.mla.prefill_context_chunk.default, chunk_args)
    out_a, lse_a = torch.ops.mla.prefill(b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen, scale)
    out_b, lse_b = torch.ops.mla.prefill_context_chunk(*chunk_args)
    torch.library.opcheck(torch.ops.mla.merge_attn_states.default, (out_a, lse_a, out_b, lse_b))


def test_the_internal_fused_op_is_registered_like_the_ops() -> None:
    """mla::prefill_with_chunk, which prefill_with_context runs eagerly for one chunk: its documented schema,
    a kernel for CPU and CUDA, and a fake."""
    from mla_ops.ops import FUSED_SCHEMA

    assert str(torch.ops.mla.prefill_with_chunk.default._schema) == "mla::" + FUSED_SCHEMA
    for key in ("CPU", "CUDA", "Meta"):
        assert torch._C._dispatch_has_computed_kernel_for_dispatch_key("mla::prefill_with_chunk", key), key


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fused_op_passes_opcheck_and_equals_the_three_ops(shape) -> None:
    lengths, heads, dqk, dv, dtype, strided, padding = shape
    b = make_batch(lengths, heads, dqk, dv, dtype, strided_v=strided, padding=padding)
    scale = dqk**-0.5
    k_c, v_c, cu_k, max_k = _chunk_for(b, [(i * 3) % 5 for i in range(len(lengths))])
    args = (b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen, k_c, v_c, cu_k, max_k, scale)
    torch.library.opcheck(torch.ops.mla.prefill_with_chunk.default, args)
    out, lse = torch.ops.mla.prefill_with_chunk(*args)
    want = torch.ops.mla.merge_attn_states(
        *torch.ops.mla.prefill_context_chunk(b.q, k_c, v_c, b.cu_seqlens, cu_k, b.max_seqlen, max_k, scale),
        *torch.ops.mla.prefill(b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen, scale),
    )
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


@pytest.mark.parametrize("fake", [False, True], ids=["kernel", "fake"])
def test_fused_op_checks_each_part_as_its_op_does(fake: bool) -> None:
    b = make_batch([3, 4], 2, 192, 128, torch.bfloat16)
    k_c, v_c, cu_k, max_k = _chunk_for(b, [2, 5])
    good = [b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen, k_c, v_c, cu_k, max_k, 0.1]
    cases = [
        ({2: b.v.half()}, TypeError, "mla.prefill: v has dtype float16 but q has bfloat16"),
        ({5: k_c[..., :128]}, ValueError, "mla.prefill_context_chunk: q has head dim 192 but k has 128"),
        ({7: cu_k.long()}, TypeError, "mla.prefill_context_chunk: cu_seqlens_k must have dtype int32"),
        ({6: torch.randn(7, 2, 64, dtype=torch.bfloat16)}, ValueError, "v_chunk has head dim 64 but v has 128"),
    ]
    for overrides, error, message in cases:
        args = [overrides.get(i, a) for i, a in enumerate(good)]
        if fake:
            mode = FakeTensorMode()
            args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            with mode, pytest.raises(error, match=re.escape(message)):
                torch.ops.mla.prefill_with_chunk(*args)
        else:
            with pytest.raises(error, match=re.escape(message)):
                torch.ops.mla.prefill_with_chunk(*args)


def test_fake_kernels_give_shapes_without_data() -> None:
    with FakeTensorMode():
        q = torch.empty(11, 4, 192, dtype=torch.bfloat16)
        v = torch.empty(11, 4, 256, dtype=torch.bfloat16)[..., 128:]
        cu = torch.empty(3, dtype=torch.int32)
        out, lse = torch.ops.mla.prefill(q, q, v, cu, 8, 0.1)
        assert out.shape == (11, 4, 128) and out.dtype == torch.bfloat16 and out.is_contiguous()
        assert lse.shape == (4, 11) and lse.dtype == torch.float32 and lse.is_contiguous()
        k_c = torch.empty(30, 4, 192, dtype=torch.bfloat16)
        out, lse = torch.ops.mla.prefill_context_chunk(q, k_c, k_c[..., :128], cu, cu, 8, 20, 0.1)
        assert out.shape == (11, 4, 128) and lse.shape == (4, 11)
        out2, lse2 = torch.ops.mla.merge_attn_states(out, lse, out, lse)
        assert out2.shape == out.shape and lse2.shape == lse.shape


def test_outputs_follow_conventions_on_cpu() -> None:
    b = make_batch([6, 2], 3, 192, 128, torch.float16, strided_v=True)
    out, lse = mla_ops.prefill(b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen)
    assert out.shape == (8, 3, 128) and out.dtype == torch.float16 and out.is_contiguous()
    assert lse.shape == (3, 8) and lse.dtype == torch.float32 and lse.is_contiguous()


def test_default_softmax_scale_is_inverse_sqrt_dqk() -> None:
    b = make_batch([5, 4], 2, 192, 128, torch.bfloat16)
    default = mla_ops.prefill(b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen)
    explicit = torch.ops.mla.prefill(b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen, 1 / 192**0.5)
    other = torch.ops.mla.prefill(b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen, 0.5)
    assert torch.equal(default[1], explicit[1])
    assert not torch.equal(default[1], other[1])


def test_meta_is_installed_inside_the_package(tmp_path) -> None:
    import mla_ops.meta

    assert mla_ops.meta.__name__ == "mla_ops.meta"
    # PyPI has an unrelated top-level package called "meta"; the fake kernels must never shadow it.
    code = "import importlib.util, mla_ops; print(importlib.util.find_spec('meta') is None)"
    # Run outside the checkout, whose meta/ folder would otherwise be importable from the cwd.
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert result.stdout.strip() == "True"


def test_meta_imports_no_gpu_library() -> None:
    code = (
        "import sys, mla_ops.meta\n"
        "bad = [m for m in ('triton', 'flashinfer', 'flash_attn', 'flash_attn_interface') if m in sys.modules]\n"
        "print(bad)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
