"""FLASH_ATTN-specific behaviour on a CUDA GPU, with the real libraries (``pytest -m gpu``).

The contract every backend keeps is checked for FLASH_ATTN (whichever implementation the chain picks
here) by tests/test_backend_contract.py. Here: which implementation this machine runs; each installed
implementation on its own, so that the ones later in the chain run too; ``v`` in every layout the
widening handles, with NaN where a window reaches past ``v``; and FlashAttention-4's just-in-time
compiles, which capture refuses until ``FlashAttnBackend.warmup`` has run.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from utils import DEEPSEEK_DIMS, GraphBuffers, assert_attention_close, cu_seqlens_of, make_batch

import mla_ops
import mla_ops.backends.flash_attn as fa
from mla_ops import DeviceCapability, MLADimensions, SelectorConfig
from mla_ops.backends.base import VarlenCall
from mla_ops.backends.flash_attn import FlashAttnBackend

pytestmark = pytest.mark.gpu

DQK, DV = DEEPSEEK_DIMS
DEVICE = "cuda"
BF16 = torch.bfloat16
FA4, FA3, FA2, BUNDLED = (
    "flash_attn.cute",
    "flash_attn_interface",
    "flash_attn",
    "torch.ops.aten._flash_attention_forward",
)


def _capability() -> DeviceCapability:
    return DeviceCapability.of(torch.device(DEVICE))


def _real_library(name: str):
    """The installed implementation ``name`` (a module, or the bundled op), or a skip saying why not."""
    if name == BUNDLED:
        if not torch.backends.cuda.is_flash_attention_available():
            pytest.skip(f"torch {torch.__version__} was built without FlashAttention")
        return torch.ops.aten._flash_attention_forward.default
    try:
        return importlib.import_module(name)
    except Exception as exc:  # absent, or a broken install
        pytest.skip(f"{name} cannot be imported here: {type(exc).__name__}: {exc}")


def test_chain_on_this_machine():
    backend = FlashAttnBackend()
    config = SelectorConfig(BF16)
    print(f"FLASH_ATTN on {torch.cuda.get_device_name()} ({_capability()}): {backend.describe(_capability(), config)}")
    assert backend.reasons(_capability(), config) == []
    adapter, _ = backend.choose(_capability(), DQK, DV)
    present = {a.kind.name for a in backend.chain().present}
    if FA4 in present and _capability().major in (9, 10, 11):
        assert adapter.kind.name == FA4, "FlashAttention-4 is installed and serves this GPU: it comes first"
    elif not present & {FA4, FA3, FA2}:
        assert adapter.kind.name == BUNDLED


@pytest.mark.parametrize("name", [FA4, FA3, FA2, BUNDLED])
@pytest.mark.parametrize("path", ["causal", "chunk"])
def test_each_installed_implementation(name, path):
    """Each implementation on its own, even where an earlier one of the chain would be picked."""
    backend = FlashAttnBackend(libraries={name: _real_library(name)})
    adapter, skipped = backend.choose(_capability(), DQK, DV)
    if adapter is None:
        pytest.skip(f"{name} does not serve this GPU: {'; '.join(skipped)}")
    lengths, slices = [0, 5, 300, 0, 1000, 1], [7, 0, 129, 3, 2000, 0]
    batch = make_batch(lengths, 16, DQK, DV, BF16, DEVICE, strided_v=True, padding=13, seed=1)
    chunk = make_batch(slices, 16, DQK, DV, BF16, DEVICE, strided_v=True, seed=2)
    cu = batch.cu_seqlens
    k, v, cu_k, max_k = (batch.k, batch.v, cu, 2048) if path == "causal" else (chunk.k, chunk.v, chunk.cu_seqlens, 4096)
    out, lse = backend.attention(VarlenCall(batch.q, k, v, cu, cu_k, 2048, max_k, 0.093, path == "causal"))
    assert_attention_close(out, lse, batch.q, k, v, cu, cu_k, 0.093, causal=path == "causal")


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=DEVICE, dtype=torch.float32).to(BF16)


def _v(gen: torch.Generator, tokens: int, heads: int, layout: str) -> torch.Tensor:
    """A ``[tokens, heads, 128]`` v laid out as MLA code produces it (see ``widen_v`` for the paths).

    ``window-before``/``window-after``: a view of ``kv_nope`` ``[T, H, 256]`` with 64 readable columns
    before/after every row, filled with NaN to prove they cannot leak; ``copy``: contiguous;
    ``copy-strided``: a view with too little room on either side.
    """
    if layout == "copy":
        return _randn(gen, tokens, heads, DV)
    if layout == "copy-strided":
        return _randn(gen, tokens, heads, DV + 16)[..., 16:]
    kv = _randn(gen, tokens, heads, 2 * DV)
    if layout == "window-before":
        kv[..., DV - (DQK - DV) : DV] = math.nan
        return kv[..., DV:]
    kv[..., DV : DV + (DQK - DV)] = math.nan
    return kv[..., :DV]


@pytest.mark.parametrize("layout", ["window-before", "window-after", "copy", "copy-strided"])
@pytest.mark.parametrize("path", ["prefill", "chunk"])
def test_v_layouts(layout, path):
    gen = torch.Generator(DEVICE).manual_seed(7)
    heads, lengths, chunk = 16, [3, 250, 0, 77], [40, 0, 513, 1]
    q = _randn(gen, sum(lengths), heads, DQK)
    cu = cu_seqlens_of(lengths, DEVICE)
    if path == "prefill":
        k, v, cu_k = _randn(gen, sum(lengths), heads, DQK), _v(gen, sum(lengths), heads, layout), cu
    else:
        k, v = _randn(gen, sum(chunk), heads, DQK), _v(gen, sum(chunk), heads, layout)
        cu_k = cu_seqlens_of(chunk, DEVICE)
    adapter, _ = FlashAttnBackend().choose(_capability(), DQK, DV)
    if adapter.kind.pads_v:
        assert fa.widen_v(v, DQK)[2] == ("copy" if layout.startswith("copy") else layout)
    scale = mla_ops.default_softmax_scale(DQK)
    with mla_ops.prefill_backend("FLASH_ATTN"):
        if path == "prefill":
            out, lse = mla_ops.prefill(q, k, v, cu, 250, scale)
        else:
            out, lse = mla_ops.prefill_context_chunk(q, k, v, cu, cu_k, 250, 513, scale)
    assert not torch.isnan(out).any(), "NaN next to v leaked into the output"
    assert_attention_close(out, lse, q, k, v, cu, cu_k, scale, causal=path == "prefill")


# --- FlashAttention-4: compiles refused under capture until warmed up ------------------------------------


def test_fa4_capture_refuses_to_compile_until_warm_up(monkeypatch):
    """A fresh FLASH_ATTN backend captured without warm-up meets a compile and says what to run; after
    ``warmup`` the same capture succeeds, and replays with other lengths are right.

    flash-attn-4 keeps its compiled kernels in one process-wide cache, which earlier tests fill; the
    forward's cache is swapped for an empty one here (and restored after), so that this test does not
    depend on which variants ran before it. fp16, (64, 64) heads and H = 3 are used by no other test.
    """
    interface = pytest.importorskip("flash_attn.cute.interface", reason="flash-attn-4 is not installed")
    cache_utils = pytest.importorskip("flash_attn.cute.cache_utils", reason="flash-attn-4 has no cache_utils")
    forward = getattr(interface, "_flash_attn_fwd", None)
    if forward is None or not hasattr(forward, "compile_cache") or not hasattr(cache_utils, "JITCache"):
        pytest.skip("this flash-attn-4 keeps its forward kernels elsewhere than _flash_attn_fwd.compile_cache")
    backend = FlashAttnBackend()
    adapter, skipped = backend.choose(_capability(), 64, 64)
    if adapter is None or adapter.kind.name != FA4:
        pytest.skip(f"FlashAttention-4 does not run (64, 64) heads here: {'; '.join(skipped)}")
    monkeypatch.setattr(forward, "compile_cache", cache_utils.JITCache())

    dtype, heads, dims = torch.float16, 3, (64, 64)
    bufs = GraphBuffers(heads, *dims, dtype, budget=512, budget_k=768, max_batch=4, seed=5)
    scale = 0.125

    def step():
        return (
            *backend.attention(
                VarlenCall(bufs.q, bufs.k, bufs.v, bufs.cu, bufs.cu, bufs.budget, bufs.budget, scale, True)
            ),
            *backend.attention(
                VarlenCall(bufs.q, bufs.kc, bufs.vc, bufs.cu, bufs.cu_k, bufs.budget, bufs.budget_k, scale, False)
            ),
        )

    bufs.load([100, 0, 300, 7], [500, 3, 0, 200])
    with (
        pytest.raises(RuntimeError, match=r"inside CUDA-graph capture.*python -m mla_ops warmup"),
        torch.cuda.graph(torch.cuda.CUDAGraph()),
    ):
        step()
    torch.cuda.synchronize()

    backend.warmup(torch.device(DEVICE), SelectorConfig(dtype, MLADimensions.from_head_dims(*dims)), heads)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse, out_c, lse_c = step()
    for lengths, context in (
        ([100, 0, 300, 7], [500, 3, 0, 200]),
        ([512, 0, 0, 0], [1, 767, 0, 0]),
        ([1, 1, 1], [0, 0, 9]),
    ):
        bufs.load(lengths, context)
        graph.replay()
        torch.cuda.synchronize()
        assert_attention_close(out, lse, bufs.q, bufs.k, bufs.v, bufs.cu, bufs.cu, scale, causal=True)
        assert_attention_close(out_c, lse_c, bufs.q, bufs.kc, bufs.vc, bufs.cu, bufs.cu_k, scale, causal=False)
