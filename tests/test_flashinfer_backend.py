"""FLASHINFER-specific behaviour on CPU, around the ``flashinfer`` stand-in of tests/standins.py.

What every backend must do (correct attention on both paths, empty rows, padding rows, strided ``v``,
the LSE conventions) is checked by tests/test_backend_contract.py. Here: the LSE conversion from
FlashInfer's base 2, the kernel choice, availability messages, planning once per batch and its cache,
the workspace, warm-up, and the CUDA-graph protocol (``mla_ops.plan_cuda_graph``, capture refusing to
plan). The backend is built around the stand-in with a simulated capability and installed with
``mla_ops.selector.backend_installed``; its kernels then run on CPU tensors.
"""

from __future__ import annotations

import importlib.abc
import math
import sys
from dataclasses import dataclass

import pytest
import standins
import torch
from utils import DEEPSEEK_DIMS, assert_attention_close, cu_seqlens_of, make_batch, make_qkv

import mla_ops
from mla_ops.backends import flashinfer as fib
from mla_ops.backends.base import MergeCall, VarlenCall
from mla_ops.backends.flashinfer import FlashInferBackend
from mla_ops.backends.reference import merge_attn_states_reference
from mla_ops.selector import backend_installed
from mla_ops.specs import DEEPSEEK_V3, DeviceCapability, MLADimensions, SelectorConfig

DQK, DV = DEEPSEEK_DIMS
H = 4
SCALE = 1.0 / math.sqrt(DQK)
BF16 = torch.bfloat16
SM90, SM100 = DeviceCapability(9, 0), DeviceCapability(10, 0)
NOT_INSTALLED = "flashinfer is not installed (pip install 'mla_ops[flashinfer]')"


@dataclass
class Installed:
    """A FLASHINFER backend around a fresh stand-in module, installed as the process's instance."""

    backend: FlashInferBackend
    module: object

    @property
    def created(self) -> list:
        """Every wrapper the backend created, oldest first."""
        return self.module.created

    @property
    def plans(self) -> int:
        """``plan()`` calls, counted by the backend; the wrappers' own logs must agree."""
        assert self.backend.plan_count == sum(len(w.plan_log) for w in self.created)
        return self.backend.plan_count

    def prefill(self, q, k, v, cu, max_seqlen, scale=SCALE):
        return self.backend.attention(VarlenCall(q, k, v, cu, cu, max_seqlen, max_seqlen, scale, True))

    def chunk(self, q, k, v, cu_q, cu_k, max_q, max_k, scale=SCALE):
        return self.backend.attention(VarlenCall(q, k, v, cu_q, cu_k, max_q, max_k, scale, False))

    def prefill_batch(self, batch, max_seqlen=None):
        return self.prefill(batch.q, batch.k, batch.v, batch.cu_seqlens, max_seqlen or batch.max_seqlen)


def install(capability: DeviceCapability = SM90, *, trtllm: bool = True, **kwargs) -> tuple[FlashInferBackend, object]:
    """A backend around a fresh stand-in; ``trtllm=False``: a FlashInfer without the trtllm-gen DeepSeek kernel,
    so that SM100 bf16 calls run the ragged wrapper's kernels (tests/test_flashinfer_trtllm.py covers that kernel)."""
    module = standins.flashinfer_module(trtllm=trtllm)
    kwargs.setdefault("workspace_bytes", 1 << 20)
    return FlashInferBackend(library=module, capability=capability, **kwargs), module


@pytest.fixture
def fi():
    backend, module = install()
    with backend_installed(backend):
        yield Installed(backend, module)
        mla_ops.release_cuda_graph_buffers()  # while installed: it releases the registry's instances


def _check_prefill(out, lse, batch) -> None:
    assert_attention_close(out, lse, batch.q, batch.k, batch.v, batch.cu_seqlens, batch.cu_seqlens, SCALE, True)


# --- LSE conversion ---------------------------------------------------------------------------------


def test_lse_conversion_gives_natural_log_head_major():
    natural = torch.randn(3, 11, dtype=torch.float64) * 5
    natural[1, 4] = -math.inf
    base2 = (natural / math.log(2.0)).t().contiguous().float()  # what FlashInfer returns: [T, H]
    out = fib.lse_base2_to_natural(base2)
    assert out.shape == (3, 11) and out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out.double(), natural, rtol=1e-6, atol=1e-6)
    assert out[1, 4] == -math.inf and not out.isnan().any()
    # Into a preallocated destination, including a strided view (the padded-batch case).
    full = torch.full((3, 15), 7.0)
    fib.lse_base2_to_natural(base2, out=full[:, :11])
    torch.testing.assert_close(full[:, :11].double(), natural, rtol=1e-6, atol=1e-6)
    assert bool((full[:, 11:] == 7.0).all())


def test_lse_conversion_maps_posinf_to_neginf_on_request():
    base2 = torch.tensor([[1.0, math.inf], [-math.inf, 2.0]])
    kept = fib.lse_base2_to_natural(base2)
    assert kept[1, 0] == math.inf
    cleaned = fib.lse_base2_to_natural(base2, posinf_means_empty=True)
    assert cleaned[1, 0] == -math.inf and cleaned[0, 1] == -math.inf
    torch.testing.assert_close(cleaned[0, 0], torch.tensor(math.log(2.0)))
    assert not cleaned.isnan().any()


def _attention_base2(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """One sequence of plain attention returning FlashInfer's LSE convention (base 2, [T, H])."""
    s = torch.einsum("thd,shd->hts", q, k) * scale
    out = torch.einsum("hts,shd->thd", torch.softmax(s, dim=-1), v)
    return out, (torch.logsumexp(s, dim=-1) / math.log(2.0)).t().contiguous()


def test_lse_conversion_makes_split_halves_merge_to_unsplit_attention():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(6, 2, 16, generator=gen)
    k = torch.randn(20, 2, 16, generator=gen)
    v = torch.randn(20, 2, 8, generator=gen)
    # Large logits make the two halves' weights very different, so a wrong base shows clearly.
    scale = 2.0
    full, _ = _attention_base2(q, k, v, scale)
    out_a, lse_a = _attention_base2(q, k[:7], v[:7], scale)
    out_b, lse_b = _attention_base2(q, k[7:], v[7:], scale)
    merged, _ = merge_attn_states_reference(
        MergeCall(out_a, fib.lse_base2_to_natural(lse_a), out_b, fib.lse_base2_to_natural(lse_b))
    )
    torch.testing.assert_close(merged, full, rtol=1e-5, atol=1e-5)
    # Without the conversion (the base-2 LSE merged as if natural) the same merge is wrong.
    wrong, _ = merge_attn_states_reference(MergeCall(out_a, lse_a.t().contiguous(), out_b, lse_b.t().contiguous()))
    assert (wrong - full).abs().max() > 1e-2


# --- kernel choice and validation -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("capability", "dims", "cuda_graph", "expected"),
    [
        ((9, 0), (192, 128), False, "fa3"),
        ((9, 0), (192, 128), True, "fa3"),
        ((9, 0), (128, 128), False, "fa3"),
        ((10, 0), (192, 128), False, "cutlass"),
        ((10, 0), (64, 64), False, "cutlass"),
        ((10, 0), (256, 256), False, "fa2"),  # outside the CUTLASS kernel's head dims
        ((10, 0), (192, 128), True, "fa2"),  # a CUTLASS graph wrapper cannot be re-planned
        ((8, 0), (192, 128), False, "fa2"),
        ((8, 9), (192, 128), False, "fa2"),
        ((12, 0), (192, 128), False, "fa2"),
        (None, (192, 128), False, "fa2"),
    ],
)
def test_kernel_choice_by_capability(capability, dims, cuda_graph, expected):
    cap = None if capability is None else DeviceCapability(*capability)
    assert fib.choose_kernel(cap, *dims, cuda_graph=cuda_graph) == expected


def test_cutlass_falls_back_to_fa2_past_its_work_capacity(monkeypatch):
    small = torch.tensor([0, 4096, 8192], dtype=torch.int32)
    huge = torch.tensor([0, 300_000], dtype=torch.int32)  # 1172 tiles x 128 heads > 131072 work items
    assert fib.cutlass_work_items(small, 128) == 32 * 128
    assert fib.cutlass_work_items(huge, 128) > fib.CUTLASS_MAX_WORK_ITEMS
    # A batch past the planner's capacity runs on fa2; the limit is lowered so that the batch stays small.
    batch = make_batch([300, 200], H, DQK, DV, BF16)  # 2 + 1 query tiles of 256 rows, times 4 heads: 12 items
    for limit, kernel in ((12, "cutlass"), (11, "fa2")):
        monkeypatch.setattr(fib, "CUTLASS_MAX_WORK_ITEMS", limit)
        backend, module = install(SM100, trtllm=False)
        call = VarlenCall(batch.q, batch.k, batch.v, batch.cu_seqlens, batch.cu_seqlens, 300, 300, SCALE, True)
        _check_prefill(*backend.attention(call), batch)
        assert [w.backend for w in module.created] == [kernel]


def test_validation_reasons(fi):
    reasons = fi.backend.reasons
    deepseek = SelectorConfig(BF16, DEEPSEEK_V3)
    for cap in [(8, 0), (9, 0), (10, 0)]:
        assert reasons(DeviceCapability(*cap), deepseek) == []
    assert reasons(SM90, SelectorConfig(torch.float16, MLADimensions(64, 0, 64))) == []
    assert reasons(SM90, SelectorConfig(torch.float32, DEEPSEEK_V3)) == [
        "dtype float32 is not supported (use bfloat16, float16)"
    ]
    assert reasons(SM90, SelectorConfig(BF16, MLADimensions(64, 64, 64))) == [
        "head dims (Dqk, Dv) = (128, 64) have no FlashInfer ragged prefill kernel: fa2/fa3 are built for "
        "Dqk == Dv in (64, 128, 256) and for DeepSeek's (192, 128)"
    ]
    assert reasons(DeviceCapability(7, 5), deepseek) == ["compute capability 7.5 is not supported (needs 8.0 or newer)"]
    assert reasons(None, deepseek) == ["runs on CUDA devices only, not on CPU"]


# --- availability -------------------------------------------------------------------------------------


def test_unavailable_when_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` fail
    backend = FlashInferBackend()
    assert backend.library_reasons(SM90, SelectorConfig(BF16)) == [NOT_INSTALLED]
    assert NOT_INSTALLED in backend.reasons(SM90, SelectorConfig(BF16))
    assert backend.describe(SM90, SelectorConfig(BF16)) == f"unavailable: {NOT_INSTALLED}"
    assert backend.version() is None
    with pytest.raises(ValueError, match=r"FLASHINFER cannot serve .*flashinfer is not installed"):
        backend.warmup(torch.device("cpu"), SelectorConfig(BF16), 2)


class _BrokenFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "flashinfer":
            raise OSError("libcudart.so.13: cannot open shared object file")
        return None


def test_unavailable_reports_the_import_error(monkeypatch):
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BrokenFinder(), *sys.meta_path])
    assert FlashInferBackend().library_reasons(SM90, SelectorConfig(BF16)) == [
        "flashinfer failed to import: OSError: libcudart.so.13: cannot open shared object file"
    ]


def test_unavailable_when_too_old():
    class OldWrapper:
        def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False):
            pass

        def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim, causal=False):
            pass

    backend = FlashInferBackend(library=standins.flashinfer_module("0.1.6", OldWrapper))
    assert backend.reasons(SM90, SelectorConfig(BF16)) == [
        "flashinfer 0.1.6 is too old: BatchPrefillWithRaggedKVCacheWrapper lacks backend, head_dim_vo, "
        "o_data_type; upgrade it (pip install 'mla_ops[flashinfer]')"
    ]


def test_describe_names_version_and_kernels(fi):
    config = SelectorConfig(BF16)
    assert fi.backend.describe(None, config) == (
        "flashinfer 0.7.2.post1 BatchPrefillWithRaggedKVCacheWrapper; backend fa3 on SM90, cutlass on SM100 "
        "(heads [(64, 64), (128, 128), (192, 128)]), else fa2; eager bf16 calls on SM100 run "
        "trtllm_ragged_attention_deepseek (not run on hardware by this project)"
    )
    assert fi.backend.describe(SM90, config).endswith("backend fa3 on SM90")
    half = SelectorConfig(torch.float16)  # outside the trtllm-gen kernel's dtypes
    assert fi.backend.describe(SM100, half).endswith("backend cutlass on SM100 (fa2 in CUDA graphs)")


# --- eager planning -----------------------------------------------------------------------------------


def test_sixty_layers_on_one_batch_plan_once(fi):
    batch = make_batch([5, 0, 13, 1], H, DQK, DV, BF16)
    results = [fi.prefill_batch(batch) for _ in range(60)]
    assert fi.plans == 1
    assert len(fi.created) == 1 and len(fi.created[0].run_log) == 60
    _check_prefill(*results[0], batch)
    _check_prefill(*results[-1], batch)


def test_new_batch_and_in_place_write_replan_but_views_do_not(fi):
    batch = make_batch([6, 3, 9], H, DQK, DV, BF16)
    fi.prefill_batch(batch)
    assert fi.plans == 1
    # A view shares the data pointer and the version counter: the same batch.
    fi.prefill(batch.q, batch.k, batch.v, batch.cu_seqlens.view(-1)[:], 9)
    assert fi.plans == 1
    # Equal values in a new tensor are a new batch as far as the cache can tell.
    fi.prefill(batch.q, batch.k, batch.v, batch.cu_seqlens.clone(), 9)
    assert fi.plans == 2
    # An in-place write keeps the address but bumps the version: re-planned, and right.
    batch.cu_seqlens.copy_(cu_seqlens_of([2, 12, 4]))
    batch.lengths = [2, 12, 4]
    out, lse = fi.prefill_batch(batch)
    assert fi.plans == 3
    _check_prefill(out, lse, batch)


def test_reused_addresses_never_reuse_a_stale_plan(fi):
    # Offsets tensors of equal size are created and dropped one after another, so the allocator
    # hands out recycled addresses with a fresh version counter; every result must still match.
    q, k, v = make_qkv(24, H, DQK, DV, BF16, generator=torch.Generator().manual_seed(1))
    for i in range(3 * fib.MAX_CACHED_BATCHES):
        lengths = [i % 5 + 1, 7 - i % 4, (3 * i) % 6]
        cu = cu_seqlens_of(lengths)
        out, lse = fi.prefill(q, k, v, cu, 8)
        assert_attention_close(out, lse, q, k, v, cu, cu, SCALE, True)
        del cu
    assert fi.plans == 3 * fib.MAX_CACHED_BATCHES


def test_eviction_keeps_recent_batches_and_reuses_wrappers(fi):
    q, k, v = make_qkv(16, H, DQK, DV, BF16)
    offsets = [cu_seqlens_of([i + 1, 15 - i]) for i in range(fib.MAX_CACHED_BATCHES + 3)]
    for cu in offsets:
        fi.prefill(q, k, v, cu, 16)
    assert fi.plans == len(offsets)
    # Evicted batches gave their wrappers back: no more than the cache holds plus one were built.
    assert len(fi.created) <= fib.MAX_CACHED_BATCHES + 1
    for cu in offsets[-fib.MAX_CACHED_BATCHES :]:  # still cached
        fi.prefill(q, k, v, cu, 16)
    assert fi.plans == len(offsets)
    out, lse = fi.prefill(q, k, v, offsets[0], 16)  # evicted: planned again
    assert fi.plans == len(offsets) + 1
    assert_attention_close(out, lse, q, k, v, offsets[0], offsets[0], SCALE, True)


def test_offsets_from_inference_mode_are_checked_on_the_host(fi, caplog):
    batch = make_batch([4, 9, 2], H, DQK, DV, BF16)
    with torch.inference_mode():
        cu = cu_seqlens_of([4, 9, 2])
        with caplog.at_level("WARNING", logger="mla_ops"):
            fi.prefill(batch.q, batch.k, batch.v, cu, 9)
            fi.prefill(batch.q, batch.k, batch.v, cu, 9)
        assert fi.plans == 1
        assert "no version counter" in caplog.text
        cu.copy_(cu_seqlens_of([10, 1, 4]))  # invisible to a version counter: there is none
        out, lse = fi.prefill(batch.q, batch.k, batch.v, cu, 10)
    assert fi.plans == 2
    assert_attention_close(out, lse, batch.q, batch.k, batch.v, cu, cu, SCALE, True)


def test_context_chunks_get_their_own_wrappers(fi):
    lengths, ctx = [4, 0, 7, 2], [[9, 3, 0, 5], [2, 0, 6, 0]]
    batch = make_batch(lengths, H, DQK, DV, BF16, seed=2)
    chunks = [make_batch(c, H, DQK, DV, BF16, seed=10 + i) for i, c in enumerate(ctx)]
    for _ in range(10):  # ten layers
        out, lse = fi.prefill_batch(batch)
        for c in chunks:
            out_c, lse_c = fi.chunk(batch.q, c.k, c.v, batch.cu_seqlens, c.cu_seqlens, max(lengths), c.max_seqlen)
            out, lse = merge_attn_states_reference(MergeCall(out_c, lse_c, out, lse))
    assert fi.plans == 3  # one plan per chunk and one for the new tokens, for all ten layers
    assert len({id(w) for w in fi.created if w.run_log}) == 3
    assert sorted(w.planned["causal"] for w in fi.created) == [False, False, True]


def test_padding_rows_are_cut_before_flashinfer(fi):
    batch = make_batch([3, 8, 0, 5], H, DQK, DV, BF16, padding=6)
    out, lse = fi.prefill_batch(batch)
    (wrapper,) = fi.created
    assert wrapper.run_log[-1]["rows"] == 16  # q[:cu_seqlens[-1]], as run() requires
    _check_prefill(out, lse, batch)
    # Padding rows are unspecified by contract; this backend zeroes them so no garbage flows on.
    assert bool((out[16:] == 0).all()) and bool(torch.isneginf(lse[:, 16:]).all())
    chunk = make_batch([5, 0, 2, 4], H, DQK, DV, BF16, padding=3, seed=4)
    out_c, lse_c = fi.chunk(batch.q, chunk.k, chunk.v, batch.cu_seqlens, chunk.cu_seqlens, 8, 5)
    assert fi.created[-1].run_log[-1]["rows"] == 16
    assert_attention_close(out_c, lse_c, batch.q, chunk.k, chunk.v, batch.cu_seqlens, chunk.cu_seqlens, SCALE, False)
    assert bool(torch.isneginf(lse_c[:, 16:]).all())


def test_attention_for_merge_hands_over_flashinfers_base2_lse_once_a_batch_is_planned(fi):
    """For a result that goes straight into the merge, a planned batch's call returns FlashInfer's own LSE
    (base 2, [T, H] viewed as [H, T]) instead of launching the conversion; anything else (a first call, a
    padded batch) is attention()'s result, natural log, and says so."""
    batch = make_batch([5, 0, 13, 1], H, DQK, DV, BF16)
    chunk = make_batch([4, 2, 0, 7], H, DQK, DV, BF16, seed=5)
    calls = [
        (batch.q, batch.k, batch.v, batch.cu_seqlens, batch.cu_seqlens, 13, 13, SCALE, True),
        (batch.q, chunk.k, chunk.v, batch.cu_seqlens, chunk.cu_seqlens, 13, 7, SCALE, False),
    ]  # fmt: skip
    for args in calls:
        first_out, first_lse, first_base2 = fi.backend.attention_for_merge(VarlenCall(*args))  # plans the batch
        out, lse = fi.backend.attention(VarlenCall(*args))
        assert first_base2 is False and torch.equal(first_out, out) and torch.equal(first_lse, lse)
        got_out, got_lse, base2 = fi.backend.attention_for_merge(VarlenCall(*args))
        assert base2 is True and got_lse.shape == lse.shape and got_lse.stride() == (1, H)
        assert torch.equal(got_out, out) and torch.equal(got_lse * math.log(2.0), lse)
    assert fi.plans == 2
    padded = make_batch([3, 8], H, DQK, DV, BF16, padding=4)
    args = (padded.q, padded.k, padded.v, padded.cu_seqlens, padded.cu_seqlens, 8, 8, SCALE, True)
    for _ in range(2):
        out, lse, base2 = fi.backend.attention_for_merge(VarlenCall(*args))
        assert base2 is False and bool(torch.isneginf(lse[:, 11:]).all())


def test_the_fused_op_on_flashinfer_merges_its_base2_lse_without_converting_it(fi, monkeypatch):
    """mla::prefill_with_chunk routed to FLASHINFER: once the batch is planned, neither part converts its LSE
    (no call of the converting run), and the result is bit for bit the three ops'."""
    # The route the ops cache for these CPU tensors, as a GPU would cache FLASHINFER's.
    monkeypatch.setitem(mla_ops.selector._routes, (torch.device("cpu"), BF16, DQK, DV, False), fi.backend)
    batch = make_batch([6, 1, 9], H, DQK, DV, BF16)
    chunk = make_batch([3, 0, 5], H, DQK, DV, BF16, seed=6)
    args = (batch.q, batch.k, batch.v, batch.cu_seqlens, 9, chunk.k, chunk.v, chunk.cu_seqlens, 5, SCALE)
    ops = torch.ops.mla
    want = ops.merge_attn_states(
        *ops.prefill_context_chunk(batch.q, chunk.k, chunk.v, batch.cu_seqlens, chunk.cu_seqlens, 9, 5, SCALE),
        *ops.prefill(batch.q, batch.k, batch.v, batch.cu_seqlens, 9, SCALE),
    )
    converting = []
    real_run = fib._run
    monkeypatch.setattr(fib, "_run", lambda *a, **kw: (converting.append(1), real_run(*a, **kw))[1])
    out, lse = ops.prefill_with_chunk(*args)
    assert converting == []
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    assert fi.plans == 2


def test_empty_chunk_and_empty_batch_skip_flashinfer(fi):
    batch = make_batch([3, 4], H, DQK, DV, BF16)
    kc, vc, _ = make_qkv(2, H, DQK, DV, BF16)
    out, lse = fi.chunk(batch.q, kc, vc, batch.cu_seqlens, cu_seqlens_of([0, 0]), 4, 0)
    assert bool((out == 0).all()) and bool(torch.isneginf(lse).all())
    empty = make_batch([0, 0], H, DQK, DV, BF16, padding=3)
    out, lse = fi.prefill_batch(empty, max_seqlen=0)
    assert bool((out == 0).all()) and bool(torch.isneginf(lse).all())
    none = make_batch([], H, DQK, DV, BF16)
    out, lse = fi.prefill_batch(none, max_seqlen=0)
    assert out.shape == (0, H, DV) and lse.shape == (H, 0)
    assert fi.plans == 0 and fi.created == []


# --- replaying the planned kernel call (flashinfer_replay) -------------------------------------------


def _installed_with_module(**module_kwargs) -> tuple[FlashInferBackend, standins.FakeKernelModule, object]:
    kernel = standins.FakeKernelModule(**module_kwargs.pop("kernel_kwargs", {}))
    module = standins.flashinfer_module(kernel_module=kernel, **module_kwargs)
    backend = FlashInferBackend(library=module, capability=SM90, workspace_bytes=1 << 20)
    return backend, kernel, module


def test_later_calls_of_a_plan_replay_its_kernel_call_without_run():
    backend, kernel, module = _installed_with_module()
    batch = make_batch([5, 0, 13, 1], H, DQK, DV, BF16, padding=3)
    chunk = make_batch([4, 2, 0, 6], H, DQK, DV, BF16, seed=3)
    with backend_installed(backend):
        for _ in range(10):
            out, lse = backend.attention(
                VarlenCall(batch.q, batch.k, batch.v, batch.cu_seqlens, batch.cu_seqlens, 13, 13, SCALE, True)
            )
            out_c, lse_c = backend.attention(
                VarlenCall(batch.q, chunk.k, chunk.v, batch.cu_seqlens, chunk.cu_seqlens, 13, 6, SCALE, False)
            )
    runs = [len(w.run_log) for w in module.created]
    assert runs == [1, 1]  # run() served the first call of each plan, which recorded its kernel call
    # 10 calls per plan, plus one replay that checked the recording against run() (once per module).
    assert kernel.calls == 2 * 10 + 1
    _check_prefill(out, lse, batch)
    assert bool(torch.isneginf(lse[:, 19:]).all())  # padding rows, cut before the kernel, as with run()
    assert_attention_close(out_c, lse_c, batch.q, chunk.k, chunk.v, batch.cu_seqlens, chunk.cu_seqlens, SCALE, False)


def test_a_replanned_wrapper_records_again():
    backend, kernel, module = _installed_with_module()
    with backend_installed(backend):
        for seed, lengths in enumerate(([3, 4], [6, 1], [2, 2])):
            batch = make_batch(lengths, H, DQK, DV, BF16, seed=seed)
            for _ in range(3):
                out, lse = backend.attention(
                    VarlenCall(batch.q, batch.k, batch.v, batch.cu_seqlens, batch.cu_seqlens, 6, 6, SCALE, True)
                )
            _check_prefill(out, lse, batch)
    assert sum(len(w.run_log) for w in module.created) == 3  # the first call of each batch's plan
    assert kernel.calls == 3 * 3 + 1


def test_a_recorded_call_holds_no_reference_to_the_call_tensors():
    import gc
    import weakref

    backend, _, _ = _installed_with_module()
    batch = make_batch([5, 3], H, DQK, DV, BF16)
    q = batch.q.clone()
    with backend_installed(backend):
        out, lse = backend.attention(
            VarlenCall(q, batch.k, batch.v, batch.cu_seqlens, batch.cu_seqlens, 5, 5, SCALE, True)
        )
        refs = [weakref.ref(t) for t in (q, out, lse)]
        del q, out, lse
        gc.collect()
        assert [r() for r in refs] == [None, None, None]
        out, lse = backend.attention(
            VarlenCall(batch.q, batch.k, batch.v, batch.cu_seqlens, batch.cu_seqlens, 5, 5, SCALE, True)
        )
    _check_prefill(out, lse, batch)


@pytest.mark.parametrize(
    "module_kwargs",
    [
        pytest.param({"kernel_kwargs": {"out_factor": 2.0}}, id="run-finishes-the-output-after-the-kernel"),
        pytest.param({"calls_per_run": 2}, id="run-calls-the-module-twice"),
    ],
)
def test_a_run_that_a_replay_would_not_reproduce_is_never_replayed(module_kwargs):
    backend, _, module = _installed_with_module(**module_kwargs)
    batch = make_batch([5, 0, 7], H, DQK, DV, BF16)
    with backend_installed(backend):
        for _ in range(4):
            out, lse = backend.attention(
                VarlenCall(batch.q, batch.k, batch.v, batch.cu_seqlens, batch.cu_seqlens, 7, 7, SCALE, True)
            )
            _check_prefill(out, lse, batch)
    (wrapper,) = module.created
    assert len(wrapper.run_log) == 4  # every call went through run()


def test_a_wrapper_without_a_kernel_module_runs_through_run(fi):
    batch = make_batch([5, 2], H, DQK, DV, BF16)
    for _ in range(3):
        fi.prefill_batch(batch)
    assert len(fi.created[0].run_log) == 3


def test_bad_offsets_are_rejected_when_planned(fi):
    batch = make_batch([3, 4], H, DQK, DV, BF16)
    with pytest.raises(ValueError, match="max_seqlen for cu_seqlens is 2 but a sequence has 4 tokens"):
        fi.prefill(batch.q, batch.k, batch.v, batch.cu_seqlens, 2)
    with pytest.raises(ValueError, match="must be non-decreasing"):
        fi.prefill(batch.q, batch.k, batch.v, torch.tensor([0, 5, 2], dtype=torch.int32), 7)


def test_strided_v_is_passed_without_a_copy_and_misaligned_inputs_are_copied(fi):
    batch = make_batch([7, 2, 11], H, DQK, DV, BF16, strided_v=True)
    assert fib._aligned(batch.v) is batch.v  # kv_nope[..., Dqk:] keeps 16-byte alignment: no copy
    fi.prefill_batch(batch)
    assert fi.created[-1].run_log[-1]["v"] is batch.v
    wide = torch.randn(20, H, DV + 1).to(BF16)
    odd = wide[..., 1:]  # starts 2 bytes into a row: vector loads would be misaligned
    copy = fib._aligned(odd)
    assert copy is not odd and copy.is_contiguous() and torch.equal(copy, odd)


@pytest.mark.parametrize(("capability", "kernel"), [(SM90, "fa3"), (SM100, "cutlass"), (DeviceCapability(8, 0), "fa2")])
def test_the_simulated_device_picks_the_kernel(capability, kernel):
    backend, module = install(capability, trtllm=False)
    batch = make_batch([5, 6], H, DQK, DV, BF16)
    call = VarlenCall(batch.q, batch.k, batch.v, batch.cu_seqlens, batch.cu_seqlens, 6, 6, SCALE, True)
    _check_prefill(*backend.attention(call), batch)
    assert [w.backend for w in module.created] == [kernel]


def test_one_workspace_per_device_shared_by_all_wrappers(monkeypatch):
    monkeypatch.setenv(fib.WORKSPACE_ENV, "2")
    backend, module = install(workspace_bytes=None)
    batch = make_batch([4, 4], H, DQK, DV, BF16)
    chunk = make_batch([3, 1], H, DQK, DV, BF16, seed=5)
    run = Installed(backend, module)
    run.prefill_batch(batch)
    run.chunk(batch.q, chunk.k, chunk.v, batch.cu_seqlens, chunk.cu_seqlens, 4, 3)
    assert len(module.created) == 2 and module.created[0].workspace is module.created[1].workspace
    assert module.created[0].workspace.numel() == 2 << 20
    monkeypatch.setenv(fib.WORKSPACE_ENV, "lots")
    with pytest.raises(ValueError, match="MLA_OPS_FLASHINFER_WORKSPACE_MB must be a positive number of MiB"):
        Installed(*install(workspace_bytes=None)).prefill_batch(batch)


def test_first_build_warns_once_per_module(fi, caplog):
    batch = make_batch([4, 5], H, DQK, DV, BF16)
    with caplog.at_level("WARNING", logger="mla_ops"):
        fi.prefill_batch(batch)
        fi.prefill(batch.q, batch.k, batch.v, batch.cu_seqlens.clone(), 5)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert "can take minutes" in warnings[0] and "python -m mla_ops warmup" in warnings[0]
    half = make_batch([4, 5], H, DQK, DV, torch.float16)
    caplog.clear()
    with caplog.at_level("WARNING", logger="mla_ops"):
        fi.prefill_batch(half)
    assert "float16" in caplog.text


def test_warmup_builds_causal_and_non_causal(caplog):
    backend, module = install(SM90)
    with caplog.at_level("INFO", logger="mla_ops"):
        backend.warmup(torch.device("cpu"), SelectorConfig(BF16, DEEPSEEK_V3), 16)
    (wrapper,) = module.created
    assert wrapper.backend == "fa3" and [p["causal"] for p in wrapper.plan_log] == [True, False]
    assert len(wrapper.run_log) == 2
    assert "warming up FlashInfer fa3" in caplog.text
    assert "python -m mla_ops warmup" not in caplog.text  # no advice to run what is running
    # On SM100 the eager kernel (cutlass) and the CUDA-graph kernel (fa2) differ: both are built.
    backend, module = install(SM100, trtllm=False)
    backend.warmup(torch.device("cpu"), SelectorConfig(BF16, DEEPSEEK_V3), 16)
    assert [(w.backend, len(w.plan_log), len(w.run_log)) for w in module.created] == [("cutlass", 2, 2), ("fa2", 2, 2)]
    with pytest.raises(ValueError, match="FLASHINFER cannot serve"):
        backend.warmup(torch.device("cpu"), SelectorConfig(torch.float32, DEEPSEEK_V3), 16)


# --- CUDA-graph mode ----------------------------------------------------------------------------------


def test_cuda_graph_flow(fi):
    budget, budget_k = 40, 48
    q, k, v = make_qkv(budget, H, DQK, DV, BF16, generator=torch.Generator().manual_seed(7))
    kc, vc, _ = make_qkv(budget_k, H, DQK, DV, BF16, generator=torch.Generator().manual_seed(8))
    cu = cu_seqlens_of([5, 0, 12, 3, 0])  # the trailing zero-length sequence is padding
    cu_k = cu_seqlens_of([10, 0, 7, 0, 0])

    def step():
        return fi.prefill(q, k, v, cu, budget), fi.chunk(q, kc, vc, cu, cu_k, budget, budget_k)

    def check(results):
        (out, lse), (out_c, lse_c) = results
        assert_attention_close(out, lse, q, k, v, cu, cu, SCALE, True)
        assert_attention_close(out_c, lse_c, q, kc, vc, cu, cu_k, SCALE, False)

    mla_ops.plan_cuda_graph(cu, cu_seqlens_k=[cu_k])
    check(step())  # the eager warm-up creates and plans the graph wrappers
    graph_wrappers = [w for w in fi.created if w.use_cuda_graph]
    assert len(graph_wrappers) == 2 and len(fi.created) == 2
    main, chunk = sorted(graph_wrappers, key=lambda w: not w.planned["causal"])
    # One padding sequence of length 0 over the keys covers the rows [20, 40) of the budget.
    assert main.plan_log[-1]["qo"] == [0, 5, 5, 17, 20, 20, 40]
    assert main.plan_log[-1]["kv"] == [0, 5, 5, 17, 20, 20, 20]
    assert chunk.plan_log[-1]["kv"] == [0, 10, 10, 17, 17, 17, 17]
    assert main.max_total_num_rows == budget and chunk.max_total_num_rows == budget
    plans = fi.plans

    with standins.capturing():
        captured = step()
    assert fi.plans == plans  # capture never plans
    for w in graph_wrappers:
        assert w.run_log[-1]["rows"] == budget and w.run_log[-1]["capturing"]
    check(captured)

    # A new batch in the same buffers, then re-planning through the public entry point.
    cu.copy_(cu_seqlens_of([1, 30, 0, 0, 9]))
    cu_k.copy_(cu_seqlens_of([0, 48, 0, 0, 0]))
    with pytest.raises(RuntimeError, match=r"written after mla_ops\.plan_cuda_graph"):
        step()
    mla_ops.plan_cuda_graph(cu, cu_seqlens_k=[cu_k])
    assert fi.plans == plans + 2
    assert main.qo_indptr_buf.tolist() == [0, 1, 31, 31, 31, 40, 40]
    with standins.capturing():
        replanned = step()
    assert fi.plans == plans + 2 and len(fi.created) == 2
    check(replanned)

    # A batch that uses the whole budget leaves the padding sequence empty.
    cu.copy_(cu_seqlens_of([20, 20, 0, 0, 0]))
    mla_ops.plan_cuda_graph(cu, cu_seqlens_k=[cu_k])
    with standins.capturing():
        check(step())

    # A batch past the budget is refused when planned, not run wrong.
    cu.copy_(cu_seqlens_of([30, 20, 0, 0, 0]))
    with pytest.raises(ValueError, match="token budget"):
        mla_ops.plan_cuda_graph(cu, cu_seqlens_k=[cu_k])
    with standins.capturing(), pytest.raises(RuntimeError, match="plan_cuda_graph reads the offsets on the host"):
        mla_ops.plan_cuda_graph(cu, cu_seqlens_k=[cu_k])

    # Released: the next capture finds nothing planned.
    mla_ops.release_cuda_graph_buffers()
    with standins.capturing(), pytest.raises(RuntimeError, match="cu_seqlens is not registered"):
        fi.prefill(q, k, v, cu, budget)


def test_capture_without_a_plan_raises(fi):
    q, k, v = make_qkv(24, H, DQK, DV, BF16)
    cu = cu_seqlens_of([8, 8, 0])
    hint = r"mla_ops\.plan_cuda_graph\(cu_seqlens, cu_seqlens_k=\[\.\.\.\]\).*eager warm-up call"
    with standins.capturing(), pytest.raises(RuntimeError, match=f"cu_seqlens is not registered.*{hint}"):
        fi.prefill(q, k, v, cu, 24)
    # Registered, but no warm-up call for this layer configuration.
    mla_ops.plan_cuda_graph(cu)
    no_wrapper = f"no FlashInfer graph wrapper is planned.*H=4.*{hint}"
    with standins.capturing(), pytest.raises(RuntimeError, match=no_wrapper):
        fi.prefill(q, k, v, cu, 24)
    fi.prefill(q, k, v, cu, 24)  # warm-up
    q8, k8, v8 = make_qkv(24, 8, DQK, DV, BF16)
    with standins.capturing(), pytest.raises(RuntimeError, match="H=8"):
        fi.prefill(q8, k8, v8, cu, 24)
    with standins.capturing(), pytest.raises(RuntimeError, match=r"causal=True.*token budget 24"):
        fi.prefill(q, k, v, cu, 24, 0.5 * SCALE)
    # A chunk whose offsets were never registered.
    kc, vc, _ = make_qkv(6, H, DQK, DV, BF16)
    with standins.capturing(), pytest.raises(RuntimeError, match=f"cu_seqlens_k is not registered.*{hint}"):
        fi.chunk(q, kc, vc, cu, cu_seqlens_of([3, 3, 0]), 8, 3)
    with standins.capturing():
        out, lse = fi.prefill(q, k, v, cu, 24)
    assert_attention_close(out, lse, q, k, v, cu, cu, SCALE, True)
    assert fi.plans == 1


def test_graph_wrappers_on_sm100_use_fa2():
    backend, module = install(SM100)
    q, k, v = make_qkv(16, H, DQK, DV, BF16)
    cu = cu_seqlens_of([6, 4])
    with backend_installed(backend):
        mla_ops.plan_cuda_graph(cu)
        backend.attention(VarlenCall(q, k, v, cu, cu, 16, 16, SCALE, True))
        cu.copy_(cu_seqlens_of([2, 12]))
        mla_ops.plan_cuda_graph(cu)  # a cutlass graph wrapper would refuse this re-plan
        out, lse = backend.attention(VarlenCall(q, k, v, cu, cu, 16, 16, SCALE, True))
        mla_ops.release_cuda_graph_buffers()
    assert [w.backend for w in module.created] == ["fa2"]
    assert_attention_close(out, lse, q, k, v, cu, cu, SCALE, True)


def test_info_selects_flashinfer_and_names_what_runs_inside_graph_trees(fi) -> None:
    from mla_ops.cli.info import machine_table

    table = machine_table(SM90, SelectorConfig(torch.bfloat16, DEEPSEEK_V3), True)
    row = "  FLASHINFER  yes    flashinfer 0.7.2.post1 BatchPrefillWithRaggedKVCacheWrapper, backend fa3 on SM90\n"
    assert row in table
    assert "  selected: FLASHINFER\n" in table
    # Which backend runs inside the graphs depends on the other libraries (tests/test_graph_tree_routing.py).
    assert table.endswith("(FLASHINFER plans on the host)")
