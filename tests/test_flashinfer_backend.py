"""CPU tests of the FLASHINFER backend, with a stand-in for the ``flashinfer`` module.

The stand-in's ``BatchPrefillWithRaggedKVCacheWrapper`` takes the real constructor, ``plan`` and
``run`` arguments, enforces the real constraints that shape the backend (``q.shape[0] ==
qo_indptr[-1]``; in CUDA-graph mode a fixed batch size and a row count fixed by the first plan; no
re-plan of a CUTLASS graph wrapper) and computes attention with dense math, returning the LSE the
way FlashInfer does: base 2, ``[T, H]``. The backend targets CUDA, so these tests call its class
methods directly on CPU tensors; the workspace follows ``q``'s device.
"""

from __future__ import annotations

import importlib.abc
import math
import sys
import types
from typing import ClassVar

import pytest
import torch
from utils import DEEPSEEK_DIMS, assert_attention_close, cu_seqlens_of, dense_attention, make_batch, make_qkv

import mla_ops
from mla_ops.backends import flashinfer as fib
from mla_ops.backends.flashinfer import FlashInferBackend
from mla_ops.backends.reference import merge_attn_states_reference
from mla_ops.config import DEEPSEEK_V3, DeviceCapability, MLADimensions, SelectorConfig

DQK, DV = DEEPSEEK_DIMS
H = 4
SCALE = 1.0 / math.sqrt(DQK)
BF16 = torch.bfloat16


# --- the stand-in -----------------------------------------------------------------------------------


def _capturing() -> bool:
    try:
        return torch.cuda.is_current_stream_capturing()
    except RuntimeError:
        return False


class FakeRaggedWrapper:
    """Signature-compatible stand-in for ``flashinfer.BatchPrefillWithRaggedKVCacheWrapper``."""

    created: ClassVar[list[FakeRaggedWrapper]] = []
    plans: ClassVar[int] = 0

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: torch.Tensor | None = None,
        kv_indptr_buf: torch.Tensor | None = None,
        custom_mask_buf: torch.Tensor | None = None,
        mask_indptr_buf: torch.Tensor | None = None,
        backend: str = "auto",
        jit_args: list | None = None,
        jit_kwargs: dict | None = None,
    ) -> None:
        assert kv_layout in ("NHD", "HND")
        self.workspace = float_workspace_buffer
        self.device = float_workspace_buffer.device
        self.backend = backend
        self.use_cuda_graph = use_cuda_graph
        if use_cuda_graph:
            if not torch.is_tensor(qo_indptr_buf) or not torch.is_tensor(kv_indptr_buf):
                raise ValueError("qo_indptr_buf and kv_indptr_buf should be tensors in cuda graph mode")
            self.fixed_batch_size = len(qo_indptr_buf) - 1
            if len(kv_indptr_buf) != self.fixed_batch_size + 1:
                raise ValueError("The length of kv_indptr_buf should be the same as qo_indptr_buf")
        self.qo_indptr_buf = qo_indptr_buf
        self.kv_indptr_buf = kv_indptr_buf
        self.max_total_num_rows: int | None = None
        self.planned: dict | None = None
        self.plan_log: list[dict] = []
        self.run_log: list[dict] = []
        FakeRaggedWrapper.created.append(self)

    def plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        head_dim_vo: int | None = None,
        custom_mask: torch.Tensor | None = None,
        packed_custom_mask: torch.Tensor | None = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        q_data_type: str | torch.dtype = "float16",
        kv_data_type: str | torch.dtype | None = None,
        o_data_type: str | torch.dtype | None = None,
        non_blocking: bool = True,
        **kwargs,
    ) -> None:
        assert not _capturing(), "plan() called inside CUDA graph capture"
        assert qo_indptr.dtype == torch.int32 and kv_indptr.dtype == torch.int32
        batch_size = len(qo_indptr) - 1
        if len(kv_indptr) != batch_size + 1:
            raise ValueError("The kv_indptr length should be equal to mask_indptr length.")
        qo_host, kv_host = qo_indptr.to("cpu"), kv_indptr.to("cpu")
        assert int(qo_host[0]) == 0 and bool((qo_host[1:] >= qo_host[:-1]).all())
        assert int(kv_host[0]) == 0 and bool((kv_host[1:] >= kv_host[:-1]).all())
        total = int(qo_host[-1])
        if self.use_cuda_graph:
            if self.backend == "cutlass" and self.planned is not None:
                raise ValueError("the cutlass backend cannot be re-planned in CUDA-graph mode")
            if self.max_total_num_rows is None:
                self.max_total_num_rows = total
            elif total > self.max_total_num_rows:
                raise ValueError(f"total rows {total} exceed the {self.max_total_num_rows} of the first plan")
            if batch_size != self.fixed_batch_size:
                raise ValueError(f"batch size {batch_size} != fixed batch size {self.fixed_batch_size}")
            self.qo_indptr_buf.copy_(qo_indptr)
            self.kv_indptr_buf.copy_(kv_indptr)
        else:
            self.qo_indptr_buf = qo_indptr.to(self.device)
            self.kv_indptr_buf = kv_indptr.to(self.device)
        self.planned = dict(
            rows=total,
            heads=(num_qo_heads, num_kv_heads),
            dims=(head_dim_qk, head_dim_vo or head_dim_qk),
            causal=causal,
            sm_scale=sm_scale,
            dtypes=(q_data_type, kv_data_type, o_data_type),
        )
        self.plan_log.append(dict(self.planned, qo=qo_host.tolist(), kv=kv_host.tolist()))
        FakeRaggedWrapper.plans += 1

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *args,
        q_scale: float | None = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
        o_scale: float | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        lse_base: str = "log2",
        lse_layout: str = "NH",
        enable_pdl: bool | None = None,
        kv_cache_sf: torch.Tensor | None = None,
    ):
        plan = self.planned
        assert plan is not None, "run() before plan()"
        assert (lse_base, lse_layout) == ("log2", "NH"), "the backend converts the LSE itself"
        if q.size(0) != plan["rows"]:
            raise ValueError(f"q.shape[0] ({q.size(0)}) does not match qo_indptr[-1] ({plan['rows']}).")
        assert (q.shape[1], k.shape[1]) == plan["heads"] and (q.shape[2], v.shape[2]) == plan["dims"]
        assert q.dtype == k.dtype == v.dtype == plan["dtypes"][0]
        o, lse_ln = dense_attention(
            q, k, v, self.qo_indptr_buf, self.kv_indptr_buf, plan["sm_scale"], plan["causal"], torch.float32
        )
        out_shape = (q.shape[0], q.shape[1], v.shape[2])
        if out is None:
            out = torch.empty(out_shape, dtype=q.dtype)
        assert out.shape == out_shape and out.dtype == q.dtype and out.is_contiguous()
        out.copy_(o)
        if return_lse:
            if lse is None:
                lse = torch.empty((q.shape[0], q.shape[1]), dtype=torch.float32)
            # The kernels index the LSE as a dense [T, H] array.
            assert lse.shape == (q.shape[0], q.shape[1]) and lse.dtype == torch.float32 and lse.is_contiguous()
            lse.copy_((lse_ln / math.log(2.0)).t())
        self.run_log.append(dict(rows=q.shape[0], capturing=_capturing(), v_contiguous=v.is_contiguous()))
        return (out, lse) if return_lse else out


def _fake_module(version: str = "0.7.2.post1", wrapper: type = FakeRaggedWrapper) -> types.ModuleType:
    module = types.ModuleType("flashinfer")
    module.__version__ = version
    module.BatchPrefillWithRaggedKVCacheWrapper = wrapper
    return module


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch):
    """Install the stand-in as ``flashinfer`` and start from empty backend state."""
    monkeypatch.setitem(sys.modules, "flashinfer", _fake_module())
    monkeypatch.setattr(fib, "WORKSPACE_BYTES", 1 << 20)
    monkeypatch.setattr(FakeRaggedWrapper, "created", [])
    monkeypatch.setattr(FakeRaggedWrapper, "plans", 0)
    fib.reset_state()
    yield FakeRaggedWrapper
    mla_ops.release_cuda_graph_buffers()
    fib.reset_state()


@pytest.fixture
def no_flashinfer(monkeypatch: pytest.MonkeyPatch):
    fib.reset_state()
    yield monkeypatch
    fib.reset_state()


def _prefill(batch, max_seqlen: int | None = None):
    return FlashInferBackend.prefill(
        batch.q, batch.k, batch.v, batch.cu_seqlens, max_seqlen or max(batch.lengths, default=0), SCALE
    )


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
        out_a, fib.lse_base2_to_natural(lse_a), out_b, fib.lse_base2_to_natural(lse_b)
    )
    torch.testing.assert_close(merged, full, rtol=1e-5, atol=1e-5)
    # Without the conversion (the base-2 LSE merged as if natural) the same merge is wrong.
    wrong, _ = merge_attn_states_reference(out_a, lse_a.t().contiguous(), out_b, lse_b.t().contiguous())
    assert (wrong - full).abs().max() > 1e-2


# --- selection and validation -----------------------------------------------------------------------


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


def test_cutlass_falls_back_to_fa2_past_its_work_capacity():
    cfg = fib._LayerConfig(128, 192, 128, BF16, SCALE, True)
    small = torch.tensor([0, 4096, 8192], dtype=torch.int32)
    huge = torch.tensor([0, 300_000], dtype=torch.int32)  # 1172 tiles x 128 heads > 131072 work items
    assert fib.cutlass_work_items(small, 128) == 32 * 128
    assert fib._eager_kernel(DeviceCapability(10, 0), small, cfg) == "cutlass"
    assert fib._eager_kernel(DeviceCapability(10, 0), huge, cfg) == "fa2"


def test_validation_reasons(fake):
    validate = FlashInferBackend.validate_configuration
    deepseek = SelectorConfig(BF16, DEEPSEEK_V3)
    for cap in [(8, 0), (9, 0), (10, 0)]:
        assert validate(DeviceCapability(*cap), deepseek) == []
    assert validate(DeviceCapability(9, 0), SelectorConfig(torch.float16, MLADimensions(64, 0, 64))) == []
    assert validate(DeviceCapability(9, 0), SelectorConfig(torch.float32, DEEPSEEK_V3)) == [
        "dtype float32 is not supported (use bfloat16, float16)"
    ]
    assert validate(DeviceCapability(9, 0), SelectorConfig(BF16, MLADimensions(64, 64, 64))) == [
        "head dims (Dqk, Dv) = (128, 64) have no FlashInfer ragged prefill kernel: fa2/fa3 are built for "
        "Dqk == Dv in (64, 128, 256) and for DeepSeek's (192, 128)"
    ]
    assert validate(DeviceCapability(7, 5), deepseek) == ["compute capability 7.5 is not supported"]
    assert validate(None, deepseek) == ["runs on CUDA devices only, not on CPU"]


def test_unavailable_when_not_installed(no_flashinfer):
    no_flashinfer.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` fail
    reason = "flashinfer is not installed (pip install 'mla_ops[flashinfer]')"
    assert FlashInferBackend.unavailable_reason() == reason
    assert not FlashInferBackend.is_available()
    assert reason in FlashInferBackend.validate_configuration(DeviceCapability(9, 0), SelectorConfig(BF16))
    assert FlashInferBackend.implementation() == f"unavailable: {reason}"


class _BrokenFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "flashinfer":
            raise OSError("libcudart.so.13: cannot open shared object file")
        return None


def test_unavailable_reports_the_import_error(no_flashinfer):
    no_flashinfer.delitem(sys.modules, "flashinfer", raising=False)
    no_flashinfer.setattr(sys, "meta_path", [_BrokenFinder(), *sys.meta_path])
    assert FlashInferBackend.unavailable_reason() == (
        "flashinfer failed to import: OSError: libcudart.so.13: cannot open shared object file"
    )


def test_unavailable_when_too_old(no_flashinfer):
    class OldWrapper:
        def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False):
            pass

        def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim, causal=False):
            pass

    no_flashinfer.setitem(sys.modules, "flashinfer", _fake_module("0.1.6", OldWrapper))
    assert FlashInferBackend.unavailable_reason() == (
        "flashinfer 0.1.6 is too old: BatchPrefillWithRaggedKVCacheWrapper lacks backend, head_dim_vo, "
        "o_data_type; upgrade it (pip install 'mla_ops[flashinfer]')"
    )


def test_implementation_names_version_and_kernels(fake):
    text = FlashInferBackend.implementation()
    assert text.startswith("flashinfer 0.7.2.post1 BatchPrefillWithRaggedKVCacheWrapper")
    assert "fa3" in text and "fa2" in text


# --- eager planning -----------------------------------------------------------------------------------


def test_sixty_layers_on_one_batch_plan_once(fake):
    batch = make_batch([5, 0, 13, 1], H, DQK, DV, BF16)
    before = fib.plan_count()
    results = [_prefill(batch) for _ in range(60)]
    assert fib.plan_count() - before == 1 and fake.plans == 1
    assert len(fake.created) == 1 and len(fake.created[0].run_log) == 60
    _check_prefill(*results[0], batch)
    _check_prefill(*results[-1], batch)


def test_new_batch_and_in_place_write_replan_but_views_do_not(fake):
    batch = make_batch([6, 3, 9], H, DQK, DV, BF16)
    _prefill(batch)
    assert fake.plans == 1
    # A view shares the data pointer and the version counter: the same batch.
    view = batch.cu_seqlens.view(-1)[:]
    FlashInferBackend.prefill(batch.q, batch.k, batch.v, view, 9, SCALE)
    assert fake.plans == 1
    # Equal values in a new tensor are a new batch as far as the cache can tell.
    FlashInferBackend.prefill(batch.q, batch.k, batch.v, batch.cu_seqlens.clone(), 9, SCALE)
    assert fake.plans == 2
    # An in-place write keeps the address but bumps the version: re-planned, and right.
    batch.cu_seqlens.copy_(cu_seqlens_of([2, 12, 4]))
    batch.lengths = [2, 12, 4]
    out, lse = _prefill(batch)
    assert fake.plans == 3
    _check_prefill(out, lse, batch)


def test_reused_addresses_never_reuse_a_stale_plan(fake):
    # Offsets tensors of equal size are created and dropped one after another, so the allocator
    # hands out recycled addresses with a fresh version counter; every result must still match.
    q, k, v = make_qkv(24, H, DQK, DV, BF16, generator=torch.Generator().manual_seed(1))
    for i in range(3 * fib.MAX_CACHED_BATCHES):
        lengths = [i % 5 + 1, 7 - i % 4, (3 * i) % 6]
        cu = cu_seqlens_of(lengths)
        out, lse = FlashInferBackend.prefill(q, k, v, cu, 8, SCALE)
        assert_attention_close(out, lse, q, k, v, cu, cu, SCALE, True)
        del cu
    assert fake.plans == 3 * fib.MAX_CACHED_BATCHES


def test_eviction_keeps_recent_batches_and_reuses_wrappers(fake):
    q, k, v = make_qkv(16, H, DQK, DV, BF16)
    offsets = [cu_seqlens_of([i + 1, 15 - i]) for i in range(fib.MAX_CACHED_BATCHES + 3)]
    for cu in offsets:
        FlashInferBackend.prefill(q, k, v, cu, 16, SCALE)
    assert fake.plans == len(offsets)
    # Evicted batches gave their wrappers back: no more than the cache holds plus one were built.
    assert len(fake.created) <= fib.MAX_CACHED_BATCHES + 1
    for cu in offsets[-fib.MAX_CACHED_BATCHES :]:  # still cached
        FlashInferBackend.prefill(q, k, v, cu, 16, SCALE)
    assert fake.plans == len(offsets)
    out, lse = FlashInferBackend.prefill(q, k, v, offsets[0], 16, SCALE)  # evicted: planned again
    assert fake.plans == len(offsets) + 1
    assert_attention_close(out, lse, q, k, v, offsets[0], offsets[0], SCALE, True)


def test_offsets_from_inference_mode_are_checked_on_the_host(fake, caplog):
    batch = make_batch([4, 9, 2], H, DQK, DV, BF16)
    with torch.inference_mode():
        cu = cu_seqlens_of([4, 9, 2])
        with caplog.at_level("WARNING", logger="mla_ops"):
            FlashInferBackend.prefill(batch.q, batch.k, batch.v, cu, 9, SCALE)
            FlashInferBackend.prefill(batch.q, batch.k, batch.v, cu, 9, SCALE)
        assert fake.plans == 1
        assert "no version counter" in caplog.text
        cu.copy_(cu_seqlens_of([10, 1, 4]))  # invisible to a version counter: there is none
        out, lse = FlashInferBackend.prefill(batch.q, batch.k, batch.v, cu, 10, SCALE)
    assert fake.plans == 2
    assert_attention_close(out, lse, batch.q, batch.k, batch.v, cu, cu, SCALE, True)


def test_context_chunks_get_their_own_wrappers(fake):
    lengths, ctx = [4, 0, 7, 2], [[9, 3, 0, 5], [2, 0, 6, 0]]
    batch = make_batch(lengths, H, DQK, DV, BF16, seed=2)
    chunks = []
    for i, chunk_lengths in enumerate(ctx):
        chunk = make_batch(chunk_lengths, H, DQK, DV, BF16, seed=10 + i)
        chunks.append((chunk.k, chunk.v, chunk.cu_seqlens, max(chunk_lengths)))
    for _ in range(10):  # ten layers
        out, lse = _prefill(batch)
        for kc, vc, cu_k, max_k in chunks:
            out_c, lse_c = FlashInferBackend.prefill_context_chunk(
                batch.q, kc, vc, batch.cu_seqlens, cu_k, max(lengths), max_k, SCALE
            )
            out, lse = merge_attn_states_reference(out_c, lse_c, out, lse)
    assert fake.plans == 3
    used = {id(w) for w in fake.created if w.run_log}
    assert len(used) == 3
    assert sorted(w.planned["causal"] for w in fake.created) == [False, False, True]
    # The merged result is one causal attention over [context ; new tokens] per sequence; a wrong
    # LSE base in the backend would break this equality.
    keys, values, full_lengths = [], [], []
    for b in range(len(lengths)):
        parts_k, parts_v = [], []
        for kc, vc, cu_k, _ in chunks:
            s, e = int(cu_k[b]), int(cu_k[b + 1])
            parts_k.append(kc[s:e])
            parts_v.append(vc[s:e])
        s, e = int(batch.cu_seqlens[b]), int(batch.cu_seqlens[b + 1])
        parts_k.append(batch.k[s:e])
        parts_v.append(batch.v[s:e])
        keys.append(torch.cat(parts_k))
        values.append(torch.cat(parts_v))
        full_lengths.append(keys[-1].shape[0])
    k_full, v_full = torch.cat(keys), torch.cat(values)
    cu_full = cu_seqlens_of(full_lengths)
    assert_attention_close(out, lse, batch.q, k_full, v_full, batch.cu_seqlens, cu_full, SCALE, True)


def test_padding_rows_are_cut_before_flashinfer(fake):
    batch = make_batch([3, 8, 0, 5], H, DQK, DV, BF16, padding=6)
    out, lse = _prefill(batch)
    (wrapper,) = fake.created
    assert wrapper.run_log[-1]["rows"] == 16  # q[:cu_seqlens[-1]], as run() requires
    assert out.shape == (22, H, DV) and lse.shape == (H, 22)
    _check_prefill(out, lse, batch)
    assert bool((out[16:] == 0).all()) and bool(torch.isneginf(lse[:, 16:]).all())
    chunk = make_batch([5, 0, 2, 4], H, DQK, DV, BF16, padding=3, seed=4)
    out_c, lse_c = FlashInferBackend.prefill_context_chunk(
        batch.q, chunk.k, chunk.v, batch.cu_seqlens, chunk.cu_seqlens, 8, 5, SCALE
    )
    assert fake.created[-1].run_log[-1]["rows"] == 16
    assert_attention_close(out_c, lse_c, batch.q, chunk.k, chunk.v, batch.cu_seqlens, chunk.cu_seqlens, SCALE, False)
    assert bool(torch.isneginf(lse_c[:, 16:]).all())


def test_empty_chunk_and_empty_batch_skip_flashinfer(fake):
    batch = make_batch([3, 4], H, DQK, DV, BF16)
    kc, vc, _ = make_qkv(2, H, DQK, DV, BF16)
    out, lse = FlashInferBackend.prefill_context_chunk(
        batch.q, kc, vc, batch.cu_seqlens, cu_seqlens_of([0, 0]), 4, 0, SCALE
    )
    assert bool((out == 0).all()) and bool(torch.isneginf(lse).all())
    empty = make_batch([0, 0], H, DQK, DV, BF16, padding=3)
    out, lse = _prefill(empty)
    assert bool((out == 0).all()) and bool(torch.isneginf(lse).all())
    none = make_batch([], H, DQK, DV, BF16)
    out, lse = _prefill(none)
    assert out.shape == (0, H, DV) and lse.shape == (H, 0)
    assert fake.plans == 0


def test_bad_offsets_are_rejected_when_planned(fake):
    batch = make_batch([3, 4], H, DQK, DV, BF16)
    with pytest.raises(ValueError, match="max_seqlen for cu_seqlens is 2 but a sequence has 4 tokens"):
        FlashInferBackend.prefill(batch.q, batch.k, batch.v, batch.cu_seqlens, 2, SCALE)
    with pytest.raises(ValueError, match="must be non-decreasing"):
        FlashInferBackend.prefill(batch.q, batch.k, batch.v, torch.tensor([0, 5, 2], dtype=torch.int32), 7, SCALE)


def test_strided_v_and_unaligned_inputs(fake):
    batch = make_batch([7, 2, 11], H, DQK, DV, BF16, strided_v=True)
    assert fib._aligned(batch.v) is batch.v  # kv_nope[..., Dqk:] keeps 16-byte alignment: no copy
    out, lse = _prefill(batch)
    _check_prefill(out, lse, batch)
    assert fake.created[-1].run_log[-1]["v_contiguous"] is False
    wide = torch.randn(20, H, DV + 1).to(BF16)
    odd = wide[..., 1:]  # starts 2 bytes into a row: vector loads would be misaligned
    copy = fib._aligned(odd)
    assert copy is not odd and copy.is_contiguous() and torch.equal(copy, odd)


def test_simulated_devices_pick_the_kernel(fake, monkeypatch):
    batch = make_batch([5, 6], H, DQK, DV, BF16)
    monkeypatch.setattr(fib, "_device_capability", lambda device: DeviceCapability(9, 0))
    _prefill(batch)
    assert [w.backend for w in fake.created] == ["fa3"]
    fib.reset_state()
    monkeypatch.setattr(fib, "_device_capability", lambda device: DeviceCapability(10, 0))
    out, lse = _prefill(batch)
    assert [w.backend for w in fake.created[1:]] == ["cutlass"]
    _check_prefill(out, lse, batch)


def test_one_workspace_per_device_shared_by_all_wrappers(fake, monkeypatch):
    monkeypatch.setenv(fib.WORKSPACE_ENV, "2")
    batch = make_batch([4, 4], H, DQK, DV, BF16)
    chunk = make_batch([3, 1], H, DQK, DV, BF16, seed=5)
    _prefill(batch)
    FlashInferBackend.prefill_context_chunk(batch.q, chunk.k, chunk.v, batch.cu_seqlens, chunk.cu_seqlens, 4, 3, SCALE)
    assert len(fake.created) == 2 and fake.created[0].workspace is fake.created[1].workspace
    assert fake.created[0].workspace.numel() == 2 << 20
    fib.reset_state()
    monkeypatch.setenv(fib.WORKSPACE_ENV, "lots")
    with pytest.raises(ValueError, match="MLA_OPS_FLASHINFER_WORKSPACE_MB must be a positive number of MiB"):
        _prefill(batch)


def test_first_build_warns_once_per_module(fake, caplog):
    batch = make_batch([4, 5], H, DQK, DV, BF16)
    with caplog.at_level("WARNING", logger="mla_ops"):
        _prefill(batch)
        FlashInferBackend.prefill(batch.q, batch.k, batch.v, batch.cu_seqlens.clone(), 5, SCALE)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert "can take minutes" in warnings[0] and "python -m mla_ops warmup" in warnings[0]
    half = make_batch([4, 5], H, DQK, DV, torch.float16)
    caplog.clear()
    with caplog.at_level("WARNING", logger="mla_ops"):
        _prefill(half)
    assert "float16" in caplog.text


def test_warmup_builds_causal_and_non_causal(fake, monkeypatch, caplog):
    monkeypatch.setattr(fib, "_device_capability", lambda device: DeviceCapability(9, 0))
    with caplog.at_level("INFO", logger="mla_ops"):
        FlashInferBackend.warmup(torch.device("cpu"), SelectorConfig(BF16, DEEPSEEK_V3), 16)
    (wrapper,) = fake.created
    assert wrapper.backend == "fa3" and [p["causal"] for p in wrapper.plan_log] == [True, False]
    assert len(wrapper.run_log) == 2
    assert "warming up FlashInfer fa3" in caplog.text
    assert "python -m mla_ops warmup" not in caplog.text  # no advice to run what is running
    # On SM100 the eager kernel (cutlass) and the CUDA-graph kernel (fa2) differ: both are built.
    fib.reset_state()
    monkeypatch.setattr(fake, "created", [])
    monkeypatch.setattr(fib, "_device_capability", lambda device: DeviceCapability(10, 0))
    FlashInferBackend.warmup(torch.device("cpu"), SelectorConfig(BF16, DEEPSEEK_V3), 16)
    assert [(w.backend, len(w.plan_log), len(w.run_log)) for w in fake.created] == [("cutlass", 2, 2), ("fa2", 2, 2)]
    with pytest.raises(ValueError, match="FLASHINFER cannot serve"):
        FlashInferBackend.warmup(torch.device("cpu"), SelectorConfig(torch.float32, DEEPSEEK_V3), 16)


# --- CUDA-graph mode ----------------------------------------------------------------------------------


@pytest.fixture
def capture(monkeypatch: pytest.MonkeyPatch):
    """A context manager that makes the current stream look like it is being captured."""

    def enter():
        ctx = monkeypatch.context()
        patch = ctx.__enter__()
        patch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        return ctx

    class Capture:
        def __enter__(self):
            self.ctx = enter()

        def __exit__(self, *exc):
            self.ctx.__exit__(*exc)

    return Capture


def test_cuda_graph_flow(fake, capture):
    budget, budget_k = 40, 48
    q, k, v = make_qkv(budget, H, DQK, DV, BF16, generator=torch.Generator().manual_seed(7))
    kc, vc, _ = make_qkv(budget_k, H, DQK, DV, BF16, generator=torch.Generator().manual_seed(8))
    cu = cu_seqlens_of([5, 0, 12, 3, 0])  # the trailing zero-length sequence is padding
    cu_k = cu_seqlens_of([10, 0, 7, 0, 0])

    def step():
        return (
            FlashInferBackend.prefill(q, k, v, cu, budget, SCALE),
            FlashInferBackend.prefill_context_chunk(q, kc, vc, cu, cu_k, budget, budget_k, SCALE),
        )

    def check(results):
        (out, lse), (out_c, lse_c) = results
        assert_attention_close(out, lse, q, k, v, cu, cu, SCALE, True)
        assert_attention_close(out_c, lse_c, q, kc, vc, cu, cu_k, SCALE, False)

    mla_ops.plan_cuda_graph(cu, cu_seqlens_k=[cu_k])
    check(step())  # the eager warm-up creates and plans the graph wrappers
    graph_wrappers = [w for w in fake.created if w.use_cuda_graph]
    assert len(graph_wrappers) == 2 and len(fake.created) == 2
    main, chunk = sorted(graph_wrappers, key=lambda w: not w.planned["causal"])
    # One padding sequence of length 0 over the keys covers the rows [20, 40) of the budget.
    assert main.plan_log[-1]["qo"] == [0, 5, 5, 17, 20, 20, 40]
    assert main.plan_log[-1]["kv"] == [0, 5, 5, 17, 20, 20, 20]
    assert chunk.plan_log[-1]["kv"] == [0, 10, 10, 17, 17, 17, 17]
    assert main.max_total_num_rows == budget and chunk.max_total_num_rows == budget
    plans = fake.plans

    with capture():
        captured = step()
    assert fake.plans == plans  # capture never plans
    assert all(w.run_log[-1] == dict(rows=budget, capturing=True, v_contiguous=True) for w in graph_wrappers)
    check(captured)

    # A new batch in the same buffers, then re-planning through the public entry point.
    cu.copy_(cu_seqlens_of([1, 30, 0, 0, 9]))
    cu_k.copy_(cu_seqlens_of([0, 48, 0, 0, 0]))
    with pytest.raises(RuntimeError, match=r"written after mla_ops\.plan_cuda_graph"):
        step()
    mla_ops.plan_cuda_graph(cu, cu_seqlens_k=[cu_k])
    assert fake.plans == plans + 2
    assert main.qo_indptr_buf.tolist() == [0, 1, 31, 31, 31, 40, 40]
    with capture():
        replanned = step()
    assert fake.plans == plans + 2 and len(fake.created) == 2
    check(replanned)

    # A batch that uses the whole budget leaves the padding sequence empty.
    cu.copy_(cu_seqlens_of([20, 20, 0, 0, 0]))
    mla_ops.plan_cuda_graph(cu, cu_seqlens_k=[cu_k])
    with capture():
        check(step())

    # A batch past the budget is refused when planned, not run wrong.
    cu.copy_(cu_seqlens_of([30, 20, 0, 0, 0]))
    with pytest.raises(ValueError, match="token budget"):
        mla_ops.plan_cuda_graph(cu, cu_seqlens_k=[cu_k])

    mla_ops.release_cuda_graph_buffers()
    assert not fib._graph_wrappers


def test_capture_without_a_plan_raises(fake, capture):
    q, k, v = make_qkv(24, H, DQK, DV, BF16)
    cu = cu_seqlens_of([8, 8, 0])
    hint = r"mla_ops\.plan_cuda_graph\(cu_seqlens, cu_seqlens_k=\[\.\.\.\]\).*eager warm-up call"
    with capture(), pytest.raises(RuntimeError, match=f"cu_seqlens is not registered.*{hint}"):
        FlashInferBackend.prefill(q, k, v, cu, 24, SCALE)
    # Registered, but no warm-up call for this layer configuration.
    mla_ops.plan_cuda_graph(cu)
    with capture(), pytest.raises(RuntimeError, match=f"no FlashInfer graph wrapper is planned.*H=4.*{hint}"):
        FlashInferBackend.prefill(q, k, v, cu, 24, SCALE)
    FlashInferBackend.prefill(q, k, v, cu, 24, SCALE)  # warm-up
    q8, k8, v8 = make_qkv(24, 8, DQK, DV, BF16)
    with capture(), pytest.raises(RuntimeError, match="H=8"):
        FlashInferBackend.prefill(q8, k8, v8, cu, 24, SCALE)
    with capture(), pytest.raises(RuntimeError, match=r"causal=True.*token budget 24"):
        FlashInferBackend.prefill(q, k, v, cu, 24, 0.5 * SCALE)
    # A chunk whose offsets were never registered.
    kc, vc, _ = make_qkv(6, H, DQK, DV, BF16)
    with capture(), pytest.raises(RuntimeError, match=f"cu_seqlens_k is not registered.*{hint}"):
        FlashInferBackend.prefill_context_chunk(q, kc, vc, cu, cu_seqlens_of([3, 3, 0]), 8, 3, SCALE)
    with capture():
        out, lse = FlashInferBackend.prefill(q, k, v, cu, 24, SCALE)
    assert_attention_close(out, lse, q, k, v, cu, cu, SCALE, True)
    assert fake.plans == 1


def test_graph_wrappers_on_sm100_use_fa2(fake, monkeypatch):
    monkeypatch.setattr(fib, "_device_capability", lambda device: DeviceCapability(10, 0))
    q, k, v = make_qkv(16, H, DQK, DV, BF16)
    cu = cu_seqlens_of([6, 4])
    mla_ops.plan_cuda_graph(cu)
    FlashInferBackend.prefill(q, k, v, cu, 16, SCALE)
    cu.copy_(cu_seqlens_of([2, 12]))
    mla_ops.plan_cuda_graph(cu)  # a cutlass graph wrapper would refuse this re-plan
    out, lse = FlashInferBackend.prefill(q, k, v, cu, 16, SCALE)
    assert [w.backend for w in fake.created] == ["fa2"]
    assert_attention_close(out, lse, q, k, v, cu, cu, SCALE, True)


def test_info_points_flashinfer_users_to_compile_options(fake) -> None:
    from mla_ops.info import machine_table

    mla_ops.clear_cache()
    try:
        table = machine_table(DeviceCapability(9, 0), SelectorConfig(torch.bfloat16, DEEPSEEK_V3), True)
    finally:
        mla_ops.clear_cache()
    assert "  selected: FLASHINFER\n" in table
    assert table.endswith(
        "CUDA-graph trees: torch.compile(..., options=mla_ops.compile_options('reduce-overhead')): it plans on the host"
    )
