"""The attention ops' C++ kernels (``mla_ops/native/csrc/attention_launch.cpp``) on a CUDA GPU (``pytest -m gpu``).

With the native library loaded and TRITON selected, a call whose inputs have the layout of an earlier
TRITON call is launched by the C++ kernel, every other call by the Python kernel. Checked: that layouts are
remembered and the C++ launch returns what the Python launch returns, bit for bit, over both paths,
dtypes, head counts, strided and padded inputs; that each fact outside the inputs the C++ kernel reads
(recorded gradients, ``MLA_OPS_TRITON_CONFIG``, Triton's launch hooks, the selection) sends the call to
the Python kernel; that inputs the check refuses are still refused, with its messages; CUDA-graph replay
and ``torch.compile`` of remembered layouts. It needs ``nvcc`` and ``ninja`` to build the library and
skips, saying so, without them.
"""

from __future__ import annotations

import os

import pytest
import torch
from utils import gluon_or_skip, make_batch, native_library_or_skip

import mla_ops
from mla_ops import native
from mla_ops.backends.base import VarlenCall
from mla_ops.kernels import attention

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
DQK, DV = 192, 128


@pytest.fixture(scope="module", autouse=True)
def _loaded():
    native_library_or_skip()
    if os.environ.get(native.LAUNCH_VARIABLE, "1").strip() == "0":
        pytest.skip(f"{native.LAUNCH_VARIABLE}=0: TRITON launches are not handed to the native library")


@pytest.fixture(autouse=True)
def _triton():
    with mla_ops.prefill_backend("TRITON"):
        yield
    native.forget_attention()


def _new_tokens(lengths, heads=16, dtype=torch.bfloat16, *, strided_v=True, padding=0, seed=0):
    """``(q, k, v, cu_seqlens, max_seqlen, scale)`` of a ragged batch (``v`` a view of ``kv`` by default)."""
    batch = make_batch(lengths, heads, DQK, DV, dtype, DEVICE, strided_v=strided_v, padding=padding, seed=seed)
    return batch.q, batch.k, batch.v, batch.cu_seqlens, batch.max_seqlen, DQK**-0.5


def _chunk(lengths, chunk_lengths, heads=16, dtype=torch.bfloat16, seed=1):
    q, _, _, cu_q, max_q, scale = _new_tokens(lengths, heads, dtype, seed=seed)
    _, k, v, cu_k, max_k, _ = _new_tokens(chunk_lengths, heads, dtype, seed=seed + 1)
    return q, k, v, cu_q, cu_k, max_q, max_k, scale


def _same(a, b):
    """Bit for bit over the rows a caller reads (padding rows' out is unspecified)."""
    assert a[0].shape == b[0].shape and a[1].shape == b[1].shape
    assert torch.equal(a[1], b[1])
    valid = torch.isfinite(a[1]).all(dim=0)  # padding rows have lse = -inf in every head
    assert torch.equal(a[0][valid], b[0][valid])


def _triton_direct(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
    return attention.attention_triton(VarlenCall(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal))


CASES = [
    pytest.param(([16], 16, torch.bfloat16, True, 0), id="T16-H16-bf16"),
    pytest.param(([5, 0, 27, 1], 16, torch.bfloat16, True, 0), id="ragged"),
    pytest.param(([64, 200], 8, torch.float16, False, 0), id="fp16-contiguous-v"),
    pytest.param(([7, 9], 128, torch.bfloat16, True, 48), id="H128-padding"),
]


@pytest.mark.parametrize("case", CASES)
def test_prefill_second_call_is_launched_natively_and_equal(case):
    lengths, heads, dtype, strided_v, padding = case
    q, k, v, cu, max_q, scale = _new_tokens(lengths, heads, dtype, strided_v=strided_v, padding=padding)
    before = native.remembered_attention_layouts()
    first = torch.ops.mla.prefill(q, k, v, cu, max_q, scale)  # Python kernel: compiles, remembers
    second = torch.ops.mla.prefill(q, k, v, cu, max_q, scale)  # at least the first was Python; this one is C++
    assert native.remembered_attention_layouts() == before + 1
    third = torch.ops.mla.prefill(q, k, v, cu, max_q, scale)
    assert native.remembered_attention_layouts() == before + 1  # a remembered layout is not handed again
    _same(second, first)
    _same(third, first)
    _same(second, _triton_direct(q, k, v, cu, cu, max_q, max_q, scale, True))
    # New data under the same layout: the C++ launch reads the new addresses.
    q2, k2, v2, _, _, _ = _new_tokens(lengths, heads, dtype, strided_v=strided_v, padding=padding, seed=5)
    _same(
        torch.ops.mla.prefill(q2, k2, v2, cu, max_q, scale),
        _triton_direct(q2, k2, v2, cu, cu, max_q, max_q, scale, True),
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_context_chunk_second_call_is_launched_natively_and_equal(dtype):
    args = _chunk([16, 3], [40, 0], dtype=dtype)
    before = native.remembered_attention_layouts()
    first = torch.ops.mla.prefill_context_chunk(*args)
    second = torch.ops.mla.prefill_context_chunk(*args)
    assert native.remembered_attention_layouts() == before + 1
    _same(second, first)
    _same(second, _triton_direct(*args, False))
    assert torch.isneginf(second[1][:, 16:]).all() and (second[0][16:] == 0).all()  # the empty chunk slice


@pytest.mark.parametrize("path", ["prefill", "chunk"])
def test_gluon_layout_is_launched_natively_and_equal(path):
    """A large batch (at least TMA_MIN_KEY_ROWS key rows times heads: the Gluon kernel) is remembered as the tl.dot
    kernel's layouts are, and its C++ launch, with a zeroed work counter and global scratch of its own per launch,
    returns what the Python launch returns, bit for bit, on the same and on new data; and in a replayed graph."""
    gluon_or_skip(DEVICE)

    def inputs(seed):
        if path == "chunk":
            return _chunk([300, 17], [4097, 0], seed=seed)
        q, k, v, cu, max_q, scale = _new_tokens([3000, 1200, 17], padding=5, seed=seed)
        return q, k, v, cu, cu, max_q, max_q, scale

    def op(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        if path == "chunk":
            return torch.ops.mla.prefill_context_chunk(q, k, v, cu_q, cu_k, max_q, max_k, scale)
        return torch.ops.mla.prefill(q, k, v, cu_q, max_q, scale)

    args, fresh, causal = inputs(1), inputs(7), path == "prefill"
    assert args[1].shape[0] * args[1].shape[1] >= attention.TMA_MIN_KEY_ROWS
    before = native.remembered_attention_layouts()
    first = op(*args)
    second = op(*args)
    assert native.remembered_attention_layouts() == before + 1, "the Gluon layout is remembered"
    _same(second, first)
    _same(second, _triton_direct(*args, causal))
    _same(op(*fresh), _triton_direct(*fresh, causal))  # new addresses, the same layout
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = op(*args)
    for static, new in zip(args[:3], fresh[:3]):
        static.copy_(new)  # v's copy writes through the view into its kv
    graph.replay()
    torch.cuda.synchronize()
    _same((out, lse), _triton_direct(*args, causal))


def test_layouts_are_told_apart():
    """One layout remembered does not launch another: each differs in one fact the C++ key holds."""
    q, k, v, cu, max_q, scale = _new_tokens([16])
    torch.ops.mla.prefill(q, k, v, cu, max_q, scale)
    base = native.remembered_attention_layouts()
    variants = {
        "bound": (q, k, v, cu, max_q + 1, scale),
        "scale": (q, k, v, cu, max_q, scale * 0.5),
        "v contiguous": (q, k, v.contiguous(), cu, max_q, scale),
        "q misaligned": (*_misaligned(q), k, v, cu, max_q, scale),
    }
    for name, args in variants.items():
        got = torch.ops.mla.prefill(*args)
        qq, kk, vv, cc, mm, ss = args
        _same(got, _triton_direct(qq, kk, vv, cc, cc, mm, mm, ss, True))
        assert torch.ops.mla.prefill(*args)[0].shape == got[0].shape, name
    assert native.remembered_attention_layouts() > base
    # The prefill layout does not serve the chunk op, whose key says which op it is.
    chunk = torch.ops.mla.prefill_context_chunk(q, k, v, cu, cu, max_q, max_q, scale)
    _same(chunk, _triton_direct(q, k, v, cu, cu, max_q, max_q, scale, False))


def _misaligned(q):
    """``q`` with the same values at an address 2 bytes off 16 (Triton specialises on alignment)."""
    flat = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)
    shifted = flat[1:].view(q.shape)
    shifted.copy_(q)
    return (shifted,)


def test_refused_inputs_are_still_refused_with_the_checks_message():
    q, k, v, cu, max_q, scale = _new_tokens([16])
    torch.ops.mla.prefill(q, k, v, cu, max_q, scale)
    torch.ops.mla.prefill(q, k, v, cu, max_q, scale)
    grad_q = q.clone().requires_grad_()
    with pytest.raises(RuntimeError, match=r"mla\.prefill is inference-only .* q requires grad and grad mode is on"):
        torch.ops.mla.prefill(grad_q, k, v, cu, max_q, scale)
    with torch.no_grad():  # the same layout without gradients recorded is accepted, and launched natively
        _same(
            torch.ops.mla.prefill(grad_q, k, v, cu, max_q, scale),
            _triton_direct(q, k, v, cu, cu, max_q, max_q, scale, True),
        )
    with pytest.raises(TypeError, match="cu_seqlens must have dtype int32, got int64"):
        torch.ops.mla.prefill(q, k, v, cu.long(), max_q, scale)
    with pytest.raises(ValueError, match="softmax_scale must be finite, got nan"):
        torch.ops.mla.prefill(q, k, v, cu, max_q, float("nan"))


def test_selection_change_forgets_the_layouts():
    q, k, v, cu, max_q, scale = _new_tokens([16])
    torch.ops.mla.prefill(q, k, v, cu, max_q, scale)
    assert native.remembered_attention_layouts() >= 1
    with mla_ops.prefill_backend("REFERENCE"):
        assert native.remembered_attention_layouts() == 0
        out, _ = torch.ops.mla.prefill(q, k, v, cu, max_q, scale)  # REFERENCE: nothing to remember
        assert native.remembered_attention_layouts() == 0
    want, _ = _triton_direct(q, k, v, cu, cu, max_q, max_q, scale, True)
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)


def _cuda_key_runs_cpp(name: str = "prefill") -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"mla::{name}", "CUDA")


def test_cpp_kernels_hold_the_cuda_key_only_while_a_triton_layout_is_remembered():
    """Calls of other backends never pass through the C++ kernels: they are registered by the first remembered
    TRITON layout and unregistered when the layouts are forgotten (a selection change)."""
    q, k, v, cu, max_q, scale = _new_tokens([16])
    native.forget_attention()
    names = ("prefill", "prefill_context_chunk", "prefill_with_chunk")
    assert not any(_cuda_key_runs_cpp(name) for name in names)
    torch.ops.mla.prefill(q, k, v, cu, max_q, scale)
    assert native.attention_kernels_registered() and all(_cuda_key_runs_cpp(name) for name in names)
    mla_ops.clear_cache()
    assert not native.attention_kernels_registered() and not any(_cuda_key_runs_cpp(name) for name in names)
    torch.ops.mla.prefill(q, k, v, cu, max_q, scale)  # registered again: TRITON is still forced
    assert _cuda_key_runs_cpp()


@pytest.mark.parametrize("backend", ["FLASHINFER", "FLASH_ATTN", "REFERENCE"])
def test_other_backends_never_call_through_the_cpp_kernels(backend):
    """A FLASHINFER, FLASH_ATTN or REFERENCE call runs the op's Python kernel straight from the dispatcher:
    the profiler sees no ``mla::_*_python`` twin (the C++ kernel's hand-off) on any path."""
    native.forget_attention()
    q, k, v, cu, max_q, scale = _new_tokens([5, 27])
    qc, kc, vc, cu_q, cu_k, mq, mk, _ = _chunk([5, 27], [40, 3])
    try:
        with mla_ops.prefill_backend(backend):
            mla_ops.prefill(q, k, v, cu, max_q)  # warm: plans, compiles, loads the library
    except ValueError as exc:  # the selector refuses a forced backend that cannot run here, saying why
        pytest.skip(f"{backend} does not run here: {exc}")
    with mla_ops.prefill_backend(backend), torch.profiler.profile() as prof:
        torch.ops.mla.prefill(q, k, v, cu, max_q, scale)
        torch.ops.mla.prefill_context_chunk(qc, kc, vc, cu_q, cu_k, mq, mk, scale)
        mla_ops.prefill_with_context(q, k, v, cu, max_q, [mla_ops.ContextChunk(kc, vc, cu_k, mk)])
    names = {event.name for event in prof.events()}
    assert not any(name.startswith("mla::_") and name.endswith("_python") for name in names), names
    assert not _cuda_key_runs_cpp()


def test_config_variable_sends_calls_to_python(monkeypatch):
    q, k, v, cu, max_q, scale = _new_tokens([16])
    want = torch.ops.mla.prefill(q, k, v, cu, max_q, scale)
    torch.ops.mla.prefill(q, k, v, cu, max_q, scale)
    known = len(attention.LAUNCHES.known)
    monkeypatch.setenv("MLA_OPS_TRITON_CONFIG", "64,64,4,2")
    torch.ops.mla.prefill(q, k, v, cu, max_q, scale)  # the Python kernel compiles the forced configuration
    got = torch.ops.mla.prefill(q, k, v, cu, max_q, scale)  # and remembers its launch (only Python remembers)
    assert len(attention.LAUNCHES.known) == known + 1
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)


def test_triton_hooks_send_calls_to_python():
    from triton import knobs

    q, k, v, cu, max_q, scale = _new_tokens([16])
    torch.ops.mla.prefill(q, k, v, cu, max_q, scale)
    torch.ops.mla.prefill(q, k, v, cu, max_q, scale)
    seen = []
    knobs.runtime.launch_enter_hook.add(lambda metadata: seen.append(metadata))
    try:
        torch.ops.mla.prefill(q, k, v, cu, max_q, scale)
    finally:
        knobs.runtime.launch_enter_hook.calls.clear()
    assert len(seen) == 1  # the launch went through the Python kernel, which calls the hook


def test_graph_replay_of_a_remembered_layout():
    q, k, v, cu, max_q, scale = _new_tokens([9, 7], padding=16)
    torch.ops.mla.prefill(q, k, v, cu, max_q, scale)
    torch.ops.mla.prefill(q, k, v, cu, max_q, scale)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = torch.ops.mla.prefill(q, k, v, cu, max_q, scale)
    q2, k2, v2, _, _, _ = _new_tokens([9, 7], padding=16, seed=3)
    q.copy_(q2), k.copy_(k2), v.copy_(v2)
    graph.replay()
    torch.cuda.synchronize()
    _same((out, lse), _triton_direct(q, k, v, cu, cu, max_q, max_q, scale, True))


def test_compiled_calls_of_a_remembered_layout():
    args = _chunk([16], [32])
    want = torch.ops.mla.prefill_context_chunk(*args)
    torch.ops.mla.prefill_context_chunk(*args)

    @torch.compile(fullgraph=True)
    def chunk(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        return torch.ops.mla.prefill_context_chunk(q, k, v, cu_q, cu_k, max_q, max_k, scale)

    _same(chunk(*args), want)
    _same(chunk(*args), want)


def test_zero_tokens_and_python_only_paths():
    """No launch to remember for an empty batch; the C++ kernel passes it to the Python kernel."""
    q, k, v, _, _, scale = _new_tokens([16])
    empty = q[:0], k[:0], v[:0], torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for _ in range(2):
        out, lse = torch.ops.mla.prefill(*empty, 0, scale)
        assert out.shape == (0, 16, DV) and lse.shape == (16, 0)


# --- the fused layer op, mla::prefill_with_chunk ---------------------------------------------------------------


def _python_kernels_run(call):
    """``call()``'s result and the names of the ops' Python twins (``mla::_*_python``) it ran, from the
    profiler's record of dispatcher calls."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        result = call()
    names = {event.name for event in profile.events() if event.name.startswith("mla::_")}
    return result, sorted(name for name in names if name.endswith("_python"))


def _layer(lengths, chunk_lengths, heads=16, dtype=torch.bfloat16, padding=0, seed=0):
    """The fused op's arguments: new tokens (``v`` a view of ``kv``) and one context chunk."""
    q, k, v, cu, max_q, scale = _new_tokens(lengths, heads, dtype, padding=padding, seed=seed)
    _, k_c, v_c, cu_k, max_k, _ = _new_tokens(chunk_lengths, heads, dtype, seed=seed + 7)
    return q, k, v, cu, max_q, k_c, v_c, cu_k, max_k, scale


def _three_ops(q, k, v, cu, max_q, k_c, v_c, cu_k, max_k, scale):
    return torch.ops.mla.merge_attn_states(
        *torch.ops.mla.prefill_context_chunk(q, k_c, v_c, cu, cu_k, max_q, max_k, scale),
        *torch.ops.mla.prefill(q, k, v, cu, max_q, scale),
    )


LAYER_CASES = [
    pytest.param(([16], [16], 16, torch.bfloat16, 0), id="T16-H16-bf16"),
    pytest.param(([5, 0, 27, 1], [3, 8, 0, 40], 16, torch.bfloat16, 0), id="ragged-empty-slices"),
    pytest.param(([64, 200], [100, 7], 8, torch.float16, 32), id="fp16-H8-padding"),
]


@pytest.mark.parametrize("case", LAYER_CASES)
def test_fused_op_is_launched_natively_once_both_parts_are_remembered(case):
    args = _layer(*case)
    before = native.remembered_attention_layouts()
    # The Python kernel: through the C++ kernel's hand-off (the twin) where the C++ kernels hold the CUDA key
    # already, else straight from the dispatcher.
    python = ["mla::_prefill_with_chunk_python"] if native.attention_kernels_registered() else []
    first, ran = _python_kernels_run(lambda: torch.ops.mla.prefill_with_chunk(*args))
    assert ran == python
    torch.ops.mla.prefill_with_chunk(*args)  # a layout's first Triton launch may go through the JIT
    assert native.remembered_attention_layouts() == before + 2  # the two parts, as prefill's and the chunk's
    again, ran = _python_kernels_run(lambda: torch.ops.mla.prefill_with_chunk(*args))
    assert ran == []  # both parts and the merge launched from C++
    _same(again, first)
    _same(again, _three_ops(*args))
    # New data under the same layouts: the C++ kernel reads the new addresses.
    new = _layer(*case, seed=3)
    got, ran = _python_kernels_run(lambda: torch.ops.mla.prefill_with_chunk(*new))
    assert ran == []
    _same(got, _three_ops(*new))


def test_fused_op_with_one_part_remembered_runs_python_and_refuses_as_before():
    q, k, v, cu, max_q, k_c, v_c, cu_k, max_k, scale = _layer([16], [24])
    torch.ops.mla.prefill(q, k, v, cu, max_q, scale)
    torch.ops.mla.prefill(q, k, v, cu, max_q, scale)  # the new tokens' layout is remembered, the chunk's is not
    got, ran = _python_kernels_run(
        lambda: torch.ops.mla.prefill_with_chunk(q, k, v, cu, max_q, k_c, v_c, cu_k, max_k, scale)
    )
    assert ran == ["mla::_prefill_with_chunk_python"]
    _same(got, _three_ops(q, k, v, cu, max_q, k_c, v_c, cu_k, max_k, scale))
    # Both remembered now; chunk values narrower than the new tokens' are refused with the op's message.
    torch.ops.mla.prefill_with_chunk(q, k, v, cu, max_q, k_c, v_c, cu_k, max_k, scale)
    narrow = v_c[..., :64]
    with pytest.raises(ValueError, match="v_chunk has head dim 64 but v has 128"):
        torch.ops.mla.prefill_with_chunk(q, k, v, cu, max_q, k_c, narrow, cu_k, max_k, scale)
    grad_q = q.clone().requires_grad_()
    with pytest.raises(RuntimeError, match=r"mla\.prefill is inference-only"):
        torch.ops.mla.prefill_with_chunk(grad_q, k, v, cu, max_q, k_c, v_c, cu_k, max_k, scale)


def test_fused_op_under_triton_hooks_and_in_a_cuda_graph():
    from triton import knobs

    args = _layer([9, 7], [12, 30], padding=16)
    for _ in range(2):
        torch.ops.mla.prefill_with_chunk(*args)
    seen = []
    knobs.runtime.launch_enter_hook.add(lambda metadata: seen.append(metadata))
    try:
        torch.ops.mla.prefill_with_chunk(*args)
    finally:
        knobs.runtime.launch_enter_hook.calls.clear()
    assert len(seen) == 2  # both parts went through the Python kernel, which calls the hook
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = torch.ops.mla.prefill_with_chunk(*args)
    q, k, v = args[:3]
    q.copy_(torch.randn_like(q)), k.copy_(torch.randn_like(k)), v.copy_(torch.randn_like(v))
    graph.replay()
    torch.cuda.synchronize()
    _same((out, lse), _three_ops(*args))
