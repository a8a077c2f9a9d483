"""FLASH_ATTN on a CUDA device, through the public API with ``mla_ops.prefill_backend("FLASH_ATTN")``.

Whichever implementation of the chain is installed runs (``test_chain_on_this_machine`` prints it);
on a machine without flash-attn that is PyTorch's bundled FlashAttention-2, which pads ``v``. Every
result is checked against ``tests/utils.assert_attention_close``.
"""

from __future__ import annotations

import math

import pytest
import torch
from utils import DEEPSEEK_DIMS, assert_attention_close, cu_seqlens_of

import mla_ops
import mla_ops.backends.flash_attn as fa
from mla_ops import ContextChunk, DeviceCapability, SelectorConfig
from mla_ops.backends.flash_attn import FlashAttnBackend

pytestmark = pytest.mark.gpu

DQK, DV = DEEPSEEK_DIMS
DEVICE = "cuda"
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _flash_attn():
    fa.reset_implementation_cache()
    with mla_ops.prefill_backend("FLASH_ATTN"):
        yield


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=DEVICE, dtype=torch.float32).to(dtype)


def _v(gen: torch.Generator, tokens: int, heads: int, layout: str, dtype: torch.dtype = BF16) -> torch.Tensor:
    """A ``[tokens, heads, 128]`` v laid out as MLA code produces it (see ``widen_v`` for the paths).

    ``window-before``/``window-after``: a view of ``kv_nope`` ``[T, H, 256]`` with 64 readable columns
    before/after every row, filled with NaN to prove they cannot leak; ``copy``: contiguous;
    ``copy-strided``: a view with too little room on either side.
    """
    if layout == "copy":
        return _randn(gen, tokens, heads, DV, dtype=dtype)
    if layout == "copy-strided":
        return _randn(gen, tokens, heads, DV + 16, dtype=dtype)[..., 16:]
    kv = _randn(gen, tokens, heads, 2 * DV, dtype=dtype)
    if layout == "window-before":
        kv[..., DV - (DQK - DV) : DV] = math.nan
        return kv[..., DV:]
    kv[..., DV : DV + (DQK - DV)] = math.nan
    return kv[..., :DV]


def _scale() -> float:
    return mla_ops.default_softmax_scale(DQK)


def test_chain_on_this_machine():
    capability = DeviceCapability(*torch.cuda.get_device_capability())
    print(f"FLASH_ATTN on {torch.cuda.get_device_name()} ({capability}): {FlashAttnBackend.implementation()}")
    assert FlashAttnBackend.validate_configuration(capability, SelectorConfig(BF16)) == []
    adapter, _ = fa._choose(capability, DQK, DV)
    present = {a.kind for a in fa._chain().present}
    if fa._FA3 not in present and fa._FA2 not in present:
        assert adapter.kind is fa._BUNDLED


@pytest.mark.parametrize("length", [1, 17, 127, 1000, 4097])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("path", ["prefill", "chunk"])
def test_matches_reference(path, heads, length):
    gen = torch.Generator(DEVICE).manual_seed(length * 1000 + heads)
    padding = 5  # rows past cu_seqlens[-1]: their contents are unspecified, but nothing may fault on them
    q = _randn(gen, length + padding, heads, DQK)
    cu_q = cu_seqlens_of([length], DEVICE)
    scale = _scale()
    if path == "prefill":
        k = _randn(gen, length + padding, heads, DQK)
        v = _v(gen, length + padding, heads, "window-before")
        out, lse = mla_ops.prefill(q, k, v, cu_q, length, scale)  # exact max_seqlen (1 switches off causal)
        cu_k = cu_q
    else:
        k_len = length + 31
        k = _randn(gen, k_len, heads, DQK)
        v = _v(gen, k_len, heads, "copy")
        cu_k = cu_seqlens_of([k_len], DEVICE)
        out, lse = mla_ops.prefill_context_chunk(q, k, v, cu_q, cu_k, length + 100, k_len + 100, scale)
    assert_attention_close(out, lse, q, k, v, cu_q, cu_k, scale, causal=path == "prefill")


@pytest.mark.parametrize(("heads", "dtype"), [(16, BF16), (128, BF16), (16, torch.float16)])
def test_ragged_batch_with_empty_sequences_and_chunk_slices(heads, dtype):
    gen = torch.Generator(DEVICE).manual_seed(heads)
    lengths = [0, 5, 300, 0, 1000, 1, 0]
    chunk = [7, 0, 129, 0, 0, 2000, 3]  # sequences 1 and 4 have new tokens but no context in this chunk
    padding = 13
    total = sum(lengths) + padding
    q, k = _randn(gen, total, heads, DQK, dtype=dtype), _randn(gen, total, heads, DQK, dtype=dtype)
    v = _v(gen, total, heads, "window-before", dtype)
    kc = _randn(gen, sum(chunk), heads, DQK, dtype=dtype)
    vc = _v(gen, sum(chunk), heads, "window-after", dtype)
    cu, cu_k = cu_seqlens_of(lengths, DEVICE), cu_seqlens_of(chunk, DEVICE)
    scale = 0.093

    out, lse = mla_ops.prefill(q, k, v, cu, 2048, scale)
    assert_attention_close(out, lse, q, k, v, cu, cu, scale, causal=True)

    out, lse = mla_ops.prefill_context_chunk(q, kc, vc, cu, cu_k, 2048, 4096, scale)
    assert_attention_close(out, lse, q, kc, vc, cu, cu_k, scale, causal=False)
    empty = [i for i, (n, c) in enumerate(zip(lengths, chunk)) if n and not c]
    for i in empty:
        rows = slice(sum(lengths[:i]), sum(lengths[: i + 1]))
        assert torch.isneginf(lse[:, rows]).all() and not out[rows].any(), "an empty chunk slice gives 0 and -inf"


@pytest.mark.parametrize("layout", ["window-before", "window-after", "copy", "copy-strided"])
@pytest.mark.parametrize("path", ["prefill", "chunk"])
def test_strided_v(layout, path):
    gen = torch.Generator(DEVICE).manual_seed(7)
    heads, lengths, chunk = 16, [3, 250, 0, 77], [40, 0, 513, 1]
    q = _randn(gen, sum(lengths), heads, DQK)
    cu = cu_seqlens_of(lengths, DEVICE)
    if path == "prefill":
        k, v, cu_k = _randn(gen, sum(lengths), heads, DQK), _v(gen, sum(lengths), heads, layout), cu
    else:
        k, v, cu_k = (
            _randn(gen, sum(chunk), heads, DQK),
            _v(gen, sum(chunk), heads, layout),
            cu_seqlens_of(chunk, DEVICE),
        )
    adapter, _ = fa._choose(DeviceCapability(*torch.cuda.get_device_capability()), DQK, DV)
    if adapter.kind.pads_v:
        assert fa.widen_v(v, DQK)[2] == ("copy" if layout.startswith("copy") else layout)
    scale = _scale()
    if path == "prefill":
        out, lse = mla_ops.prefill(q, k, v, cu, 250, scale)
    else:
        out, lse = mla_ops.prefill_context_chunk(q, k, v, cu, cu_k, 250, 513, scale)
    assert not torch.isnan(out).any(), "NaN in the padding window leaked into the output"
    assert_attention_close(out, lse, q, k, v, cu, cu_k, scale, causal=path == "prefill")


@pytest.mark.parametrize(("heads", "num_chunks"), [(16, 1), (16, 2), (16, 3), (128, 3)])
def test_split_context_equals_unsplit_attention(heads, num_chunks):
    gen = torch.Generator(DEVICE).manual_seed(num_chunks)
    new = [100, 1, 257, 0, 33]
    context = [700, 0, 1500, 50, 2]
    full = [c + n for c, n in zip(context, new)]
    kv_full = _randn(gen, sum(full), heads, 2 * DV)
    k_full, v_full = _randn(gen, sum(full), heads, DQK), kv_full[..., DV:]
    starts = [sum(full[:b]) for b in range(len(full))]

    def rows(ranges):
        index = [torch.arange(lo, hi) for lo, hi in ranges]
        return torch.cat(index).to(DEVICE) if index else torch.zeros(0, dtype=torch.long, device=DEVICE)

    idx_new = rows([(s + c, s + f) for s, c, f in zip(starts, context, full)])
    q = _randn(gen, sum(new), heads, DQK)
    chunks = []
    for i in range(num_chunks):
        bounds = [(c * i // num_chunks, c * (i + 1) // num_chunks) for c in context]
        idx = rows([(s + lo, s + hi) for s, (lo, hi) in zip(starts, bounds)])
        slice_lengths = [hi - lo for lo, hi in bounds]
        kv_c = kv_full[idx]  # a fresh [Tk, H, 256] kv_nope, viewed as MLA does
        chunks.append(
            ContextChunk(k_full[idx], kv_c[..., DV:], cu_seqlens_of(slice_lengths, DEVICE), max(slice_lengths))
        )
    cu_new, cu_full = cu_seqlens_of(new, DEVICE), cu_seqlens_of(full, DEVICE)
    scale = _scale()
    out, lse = mla_ops.prefill_with_context(
        q, k_full[idx_new], kv_full[idx_new][..., DV:], cu_new, max(new), chunks, scale
    )
    # One causal attention of the new tokens over [context; new], aligned bottom-right.
    assert_attention_close(out, lse, q, k_full, v_full, cu_new, cu_full, scale, causal=True)


def test_cuda_graph_replay_with_new_lengths():
    gen = torch.Generator(DEVICE).manual_seed(3)
    heads, budget, budget_k, max_batch = 16, 2048, 3072, 6
    q = torch.empty(budget, heads, DQK, dtype=BF16, device=DEVICE)
    k = torch.empty_like(q)
    kv = torch.empty(budget, heads, 2 * DV, dtype=BF16, device=DEVICE)
    v = kv[..., DV:]  # widened through a window
    kc = torch.empty(budget_k, heads, DQK, dtype=BF16, device=DEVICE)
    vc = torch.empty(budget_k, heads, DV, dtype=BF16, device=DEVICE)  # widened through a copy
    cu = torch.zeros(max_batch + 1, dtype=torch.int32, device=DEVICE)
    cu_k = torch.zeros_like(cu)
    scale = _scale()

    def load(new: list[int], ctx: list[int]) -> None:
        """Write a batch into the static buffers; padding sequences have length 0."""
        for buf in (q, k, kv, kc, vc):
            buf.copy_(_randn(gen, *buf.shape))
        pad = [0] * (max_batch - len(new))
        cu.copy_(cu_seqlens_of(new + pad, DEVICE))
        cu_k.copy_(cu_seqlens_of(ctx + pad, DEVICE))

    def step():
        return (*mla_ops.prefill(q, k, v, cu, budget, scale),
                *mla_ops.prefill_context_chunk(q, kc, vc, cu, cu_k, budget, budget_k, scale))  # fmt: skip

    load([500, 0, 1000, 3], [64, 9, 0, 2000])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()

    batches = [
        ([500, 0, 1000, 3], [64, 9, 0, 2000]),
        ([2048], [3072]),
        ([1, 1, 1, 1, 1, 1], [0, 1, 0, 1, 0, 1]),
        ([17, 1200, 0, 0, 0, 311], [300, 0, 0, 0, 5, 1000]),
        ([], []),  # every sequence is padding: nothing to check but that nothing faults
    ]
    for new, ctx in batches:
        load(new, ctx)
        graph.replay()
        torch.cuda.synchronize()
        n = sum(new)
        eager = step()
        for name, got, want in zip(("out", "lse", "chunk out", "chunk lse"), static, eager):
            got, want = (got[:n], want[:n]) if "out" in name else (got[:, :n], want[:, :n])
            assert torch.equal(got, want), f"{name}: graph replay differs from eager for lengths {new}"
        if n:
            assert_attention_close(static[0], static[1], q, k, v, cu, cu, scale, causal=True)
            assert_attention_close(static[2], static[3], q, kc, vc, cu, cu_k, scale, causal=False)
