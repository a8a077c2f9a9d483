"""FLASHINFER's SM100 path through FlashInfer's trtllm-gen DeepSeek kernel, around its stand-in (tests/standins.py).

The kernel has not run on hardware in this project; these tests hold the adapter
(:mod:`mla_ops.backends.flashinfer_trtllm`) to what flashinfer-python 0.7.2.post1 documents and checks:
when it is chosen (SM100, bf16, its three head-dim pairs, eager calls, the function present) and when
not (SM90 keeps fa3, fp16 and other dims keep the ragged wrapper, CUDA graphs keep fa2); planning once
per batch; sequences without queries or keys compacted away on the device, with no host read per
call; packed ``q``; the
zeroed workspace sized for the softmax statistics. Correct attention on both paths, empty rows, padding
rows, strided ``v`` and the LSE conventions are the contract's (tests/test_backend_contract.py runs this
path as ``FLASHINFER-trtllm-standin``).
"""

from __future__ import annotations

import math

import pytest
import standins
import torch
from utils import DEEPSEEK_DIMS, assert_attention_close, cu_seqlens_of, make_batch, make_qkv

import mla_ops
from mla_ops.backends import flashinfer_trtllm as trt
from mla_ops.backends.base import VarlenCall
from mla_ops.backends.flashinfer import FlashInferBackend
from mla_ops.selector import backend_installed
from mla_ops.specs import DeviceCapability, MLADimensions, SelectorConfig

DQK, DV = DEEPSEEK_DIMS
H = 4
SCALE = DQK**-0.5
BF16, FP16 = torch.bfloat16, torch.float16
SM90, SM100, SM103 = DeviceCapability(9, 0), DeviceCapability(10, 0), DeviceCapability(10, 3)


def install(capability: DeviceCapability = SM100, **module_kwargs) -> tuple[FlashInferBackend, object]:
    module = standins.flashinfer_module(**module_kwargs)
    return FlashInferBackend(library=module, workspace_bytes=1 << 20, capability=capability), module


def prefill(backend: FlashInferBackend, batch, scale: float = SCALE):
    cu = batch.cu_seqlens
    out, lse = backend.attention(
        VarlenCall(batch.q, batch.k, batch.v, cu, cu, batch.max_seqlen, batch.max_seqlen, scale, True)
    )
    assert_attention_close(out, lse, batch.q, batch.k, batch.v, cu, cu, scale, True)
    return out, lse


def chunk(backend: FlashInferBackend, batch, keys, scale: float = SCALE):
    cu_q, cu_k = batch.cu_seqlens, keys.cu_seqlens
    out, lse = backend.attention(
        VarlenCall(batch.q, keys.k, keys.v, cu_q, cu_k, batch.max_seqlen, keys.max_seqlen, scale, False)
    )
    assert_attention_close(out, lse, batch.q, keys.k, keys.v, cu_q, cu_k, scale, False)
    return out, lse


# --- when the kernel runs ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("capability", "dtype", "dims", "expected"),
    [
        (SM100, BF16, (192, 128), "trtllm-gen"),
        (SM103, BF16, (192, 128), "trtllm-gen"),
        (SM100, BF16, (256, 256), "trtllm-gen"),
        (SM100, BF16, (128, 128), "trtllm-gen"),
        (SM100, FP16, (192, 128), "cutlass"),  # FlashInfer tests the kernel in bf16 only
        (SM100, BF16, (64, 64), "cutlass"),  # not among the function's head dims
        (SM100, FP16, (256, 256), "fa2"),
        (SM90, BF16, (192, 128), "fa3"),  # Hopper keeps the kernel measured fastest there
        (SM90, BF16, (256, 256), "fa3"),
        (DeviceCapability(8, 0), BF16, (192, 128), "fa2"),
        (DeviceCapability(12, 0), BF16, (192, 128), "fa2"),  # trtllm-gen has no SM120 cubins
    ],
)
def test_the_eager_kernel_by_capability_dtype_and_dims(capability, dtype, dims, expected):
    backend, module = install(capability)
    assert backend.eager_kernel(capability, *dims, dtype) == expected
    batch = make_batch([5, 7], H, *dims, dtype, seed=1)
    prefill(backend, batch, scale=dims[0] ** -0.5)
    assert len(module.trtllm_calls) == (expected == "trtllm-gen")
    assert [w.backend for w in module.created] == ([] if expected == "trtllm-gen" else [expected])


def test_on_sm90_the_backend_still_chooses_fa3_with_the_trtllm_kernel_installed():
    backend, module = install(SM90)
    assert backend.trtllm() is not None
    batch = make_batch([9, 4], H, DQK, DV, BF16)
    keys = make_batch([3, 8], H, DQK, DV, BF16, seed=7)
    prefill(backend, batch)
    chunk(backend, batch, keys)
    assert module.trtllm_calls == [] and [w.backend for w in module.created] == ["fa3", "fa3"]
    assert backend.describe(SM90, SelectorConfig(BF16)).endswith(
        "BatchPrefillWithRaggedKVCacheWrapper, backend fa3 on SM90"
    )


def test_a_flashinfer_without_the_function_keeps_cutlass_and_says_why():
    backend, module = install(trtllm=False)
    assert backend.trtllm() is None
    prefill(backend, make_batch([5, 7], H, DQK, DV, BF16))
    assert [w.backend for w in module.created] == ["cutlass"]
    assert backend.describe(SM100, SelectorConfig(BF16)) == (
        "flashinfer 0.7.2.post1 BatchPrefillWithRaggedKVCacheWrapper, backend cutlass on SM100 (fa2 in CUDA graphs); "
        "trtllm-gen unavailable: flashinfer 0.7.2.post1 has no prefill.trtllm_ragged_attention_deepseek"
    )
    assert backend.describe(None, SelectorConfig(BF16)).endswith(
        "else fa2; trtllm-gen unavailable: flashinfer 0.7.2.post1 has no prefill.trtllm_ragged_attention_deepseek"
    )


def test_a_function_without_out_and_lse_is_too_old_to_use():
    module = standins.flashinfer_module()

    def trtllm_ragged_attention_deepseek(
        query, key, value, workspace_buffer, seq_lens, max_q_len, max_kv_len, bmm1_scale, bmm2_scale, o_sf_scale,
        batch_size, window_left, cum_seq_lens_q, cum_seq_lens_kv, enable_pdl, is_causal, return_lse,
    ):  # fmt: skip
        raise AssertionError("an old function must not be called")

    module.prefill.trtllm_ragged_attention_deepseek = trtllm_ragged_attention_deepseek
    function, problem = trt.trtllm_function(module)
    assert function is None
    assert problem == "flashinfer 0.7.2.post1's trtllm_ragged_attention_deepseek lacks out, lse"
    backend = FlashInferBackend(library=module, workspace_bytes=1 << 20, capability=SM100)
    assert backend.eager_kernel(SM100, DQK, DV, BF16) == "cutlass"


def test_describe_labels_the_kernel_as_not_run_on_hardware():
    backend, _ = install()
    assert backend.describe(SM100, SelectorConfig(BF16)) == (
        "flashinfer 0.7.2.post1 prefill.trtllm_ragged_attention_deepseek (trtllm-gen) on SM100, not run on hardware "
        "by this project; BatchPrefillWithRaggedKVCacheWrapper backend fa2 in CUDA graphs"
    )


# --- planning and the call ------------------------------------------------------------------------------------


def test_sixty_layers_on_one_batch_plan_once_and_pass_the_exact_bounds():
    backend, module = install()
    batch = make_batch([17, 3, 40], H, DQK, DV, BF16)
    for _ in range(60):
        cu = batch.cu_seqlens
        out, lse = backend.attention(
            VarlenCall(batch.q, batch.k, batch.v, cu, cu, 4096, 4096, SCALE, True)
        )  # loose bounds
    assert_attention_close(out, lse, batch.q, batch.k, batch.v, cu, cu, SCALE, True)
    assert backend.plan_count == 1 and len(module.trtllm_calls) == 60
    call = module.trtllm_calls[-1]
    # The plan read the lengths on the host: the kernel gets the exact longest ones, not the loose bounds.
    assert (call["max_q_len"], call["max_kv_len"], call["batch_size"], call["causal"]) == (40, 40, 3, True)
    assert call["scale"] == SCALE and call["enable_pdl"] is False and call["mirrors"] is False


def test_empty_sequences_are_compacted_away_on_the_device():
    """The kernel only ever sees sequences with queries and keys: a batch with an empty one is gathered into
    such a batch (by indices built when planning) and scattered back, rows without keys get 0 and -inf."""
    backend, module = install()
    full = make_batch([6, 9], H, DQK, DV, BF16, seed=2)
    prefill(backend, full)
    chunk(backend, full, make_batch([4, 1], H, DQK, DV, BF16, seed=3))
    with_empty = make_batch([6, 0, 9], H, DQK, DV, BF16, padding=3, seed=4)
    prefill(backend, with_empty)
    out, lse = chunk(backend, full, make_batch([0, 5], H, DQK, DV, BF16, seed=5))  # the first has no context
    seen = [(c["batch_size"], c["q"].shape[0], c["k"].shape[0], c["mirrors"]) for c in module.trtllm_calls]
    assert seen == [(2, 15, 15, False), (2, 15, 5, False), (2, 15, 15, False), (1, 9, 5, False)]
    assert torch.equal(out[:6], torch.zeros_like(out[:6])) and torch.isneginf(lse[:, :6]).all()
    # No sequence with both: nothing to launch, every row is empty.
    out, lse = chunk(backend, make_batch([3, 0], H, DQK, DV, BF16), make_batch([0, 4], H, DQK, DV, BF16, seed=6))
    assert len(module.trtllm_calls) == 4 and torch.isneginf(lse[:, :3]).all()


def test_planned_calls_read_nothing_on_the_host():
    backend, module = install()
    batch = make_batch([6, 0, 9], H, DQK, DV, BF16, padding=2, seed=8)
    keys = make_batch([0, 3, 5], H, DQK, DV, BF16, seed=9)
    cu_q, cu_k = batch.cu_seqlens, keys.cu_seqlens
    calls = (
        lambda: backend.attention(VarlenCall(batch.q, batch.k, batch.v, cu_q, cu_q, 9, 9, SCALE, True)),
        lambda: backend.attention(VarlenCall(batch.q, keys.k, keys.v, cu_q, cu_k, 9, 5, SCALE, False)),
    )
    first = [call() for call in calls]  # plans: reads the offsets on the host once per batch
    with standins.no_host_sync():
        later = [call() for call in calls for _ in range(3)]
    assert backend.plan_count == 2 and len(module.trtllm_calls) == 8
    for (out, lse), (want_out, want_lse) in zip(later, [first[0]] * 3 + [first[1]] * 3):
        assert torch.equal(out[:15], want_out[:15]) and torch.equal(lse[:, :15], want_lse[:, :15])


def test_without_the_mirrors_the_stand_in_gives_garbage_for_rows_without_keys():
    """The stand-in models the kernel's undefined path for a sequence without keys, so that a backend that
    left the mirrors out would fail the contract."""
    batch = make_batch([3, 4], H, DQK, DV, BF16)
    keys = make_batch([0, 5], H, DQK, DV, BF16, seed=9)
    fn = standins.trtllm_ragged_function([])
    cu_q, cu_k = batch.cu_seqlens, keys.cu_seqlens
    workspace = torch.zeros(2 << 20, dtype=torch.uint8)
    seq_lens = (cu_k[1:] - cu_k[:-1]).to(torch.int32)
    args = (batch.q, keys.k, keys.v, workspace, seq_lens, 4, 5, SCALE, 1.0, 1.0, 2, -1, cu_q, cu_k, False, False, True)
    out, lse = fn(*args)
    assert torch.isnan(out[:3]).all() and not torch.isnan(out[3:]).any()
    out, lse = fn(*args, q_seq_lens_cpu=torch.tensor([3, 4]), kv_seq_lens_cpu=torch.tensor([0, 5]))
    assert torch.equal(out[:3], torch.zeros_like(out[:3])) and torch.isneginf(lse[:3]).all()


def test_padding_rows_and_the_chunk_tail_are_cut_and_strided_q_is_packed():
    backend, module = install()
    batch = make_batch([5, 8], H, DQK, DV, BF16, padding=6, strided_v=True)
    keys = make_batch([7, 2], H, DQK, DV, BF16, padding=3, seed=4)
    wide_q = torch.randn(batch.q.shape[0], H, DQK + 64).to(BF16)
    wide_q[..., :DQK] = batch.q
    q = wide_q[..., :DQK]  # a strided view: the kernel reads q packed, so the adapter copies it
    cu = batch.cu_seqlens
    out, lse = backend.attention(VarlenCall(q, batch.k, batch.v, cu, cu, 8, 8, SCALE, True))
    assert_attention_close(out, lse, batch.q, batch.k, batch.v, cu, cu, SCALE, True)
    out, lse = backend.attention(VarlenCall(q, keys.k, keys.v, cu, keys.cu_seqlens, 8, 7, SCALE, False))
    assert_attention_close(out, lse, batch.q, keys.k, keys.v, cu, keys.cu_seqlens, SCALE, False)
    causal, ctx = module.trtllm_calls
    assert causal["q"].shape[0] == 13 and causal["q"].is_contiguous() and causal["v"].stride(0) == H * (DQK + DV)
    assert ctx["k"].shape[0] == 9 and out.shape == (19, H, DV) and lse.shape == (H, 19)


def test_the_workspace_is_zeroed_its_own_and_grows_to_the_softmax_statistics():
    backend, module = install()
    small = make_batch([5, 7], H, DQK, DV, BF16)
    prefill(backend, small)
    first = module.trtllm_calls[0]["workspace"]
    assert first.numel() == trt.workspace_bytes_needed(H, 2, 7)  # the guard alone exceeds the 1 MiB minimum
    assert first.data_ptr() != backend._workspace(torch.device("cpu")).data_ptr()  # not the wrappers' workspace
    # 2 sequences x 4 heads x 512 rows x 8 bytes on top of the 1 MiB guard: more than the 1 MiB minimum.
    large = make_batch([300, 20], H, DQK, DV, BF16, seed=3)
    prefill(backend, large)
    grown = module.trtllm_calls[1]["workspace"]
    assert grown.numel() == trt.workspace_bytes_needed(H, 2, 300) > first.numel()
    assert trt.workspace_bytes_needed(H, 2, 300) == 8 * H * 2 * 512 + (1 << 20) + 256
    assert not grown.any()  # still zero: the stand-in checks it at every call, as the real kernel needs


def test_a_workspace_smaller_than_the_statistics_fails_in_the_stand_in():
    batch = make_batch([300], H, DQK, DV, BF16)
    cu = batch.cu_seqlens
    fn = standins.trtllm_ragged_function([])
    seq_lens = torch.tensor([300], dtype=torch.int32)
    workspace = torch.zeros(1 << 20, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="Buffer overflow when allocating memory for trtllm_gen_softmax_workspace"):
        fn(batch.q, batch.k, batch.v, workspace, seq_lens, 300, 300, SCALE, 1.0, 1.0, 1, -1, cu, cu, False, True, True)


def test_cuda_graphs_on_sm100_keep_the_wrappers_fa2():
    backend, module = install()
    q, k, v = make_qkv(16, H, DQK, DV, BF16)
    cu = cu_seqlens_of([6, 4])
    with backend_installed(backend):
        mla_ops.plan_cuda_graph(cu)
        out, lse = backend.attention(VarlenCall(q, k, v, cu, cu, 16, 16, SCALE, True))
        mla_ops.release_cuda_graph_buffers()
    assert module.trtllm_calls == [] and [w.backend for w in module.created] == ["fa2"]
    assert_attention_close(out, lse, q, k, v, cu, cu, SCALE, True)


def test_warmup_on_sm100_builds_the_trtllm_kernel_and_the_graph_kernel():
    backend, module = install()
    backend.warmup(torch.device("cpu"), SelectorConfig(BF16, MLADimensions(128, 64, 128)), 16)
    assert [c["causal"] for c in module.trtllm_calls] == [True, False]
    assert [(w.backend, len(w.run_log)) for w in module.created] == [("fa2", 2)]


def test_attention_for_merge_hands_over_the_base2_lse_of_a_planned_batch():
    backend, _ = install()
    batch = make_batch([5, 9], H, DQK, DV, BF16)
    cu = batch.cu_seqlens
    out, lse = prefill(backend, batch)
    out2, lse2, base2 = backend.attention_for_merge(VarlenCall(batch.q, batch.k, batch.v, cu, cu, 9, 9, SCALE, True))
    assert base2 and torch.equal(out2, out)
    torch.testing.assert_close(lse2 * math.log(2.0), lse)


def test_the_adapter_refuses_what_the_kernel_does_not_serve():
    wrapper = trt.TrtllmRaggedWrapper(standins.trtllm_ragged_function([]), trt.TrtllmWorkspaces(1 << 20), "cpu")
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"does not serve torch.float16 with \(Dqk, Dv\) = \(192, 128\)"):
        wrapper.plan(cu, cu, H, H, DQK, head_dim_vo=DV, causal=True, q_data_type=FP16)
    with pytest.raises(RuntimeError, match="before plan"):
        wrapper.run(*make_qkv(4, H, DQK, DV, BF16), out=torch.empty(0), lse=torch.empty(0))
