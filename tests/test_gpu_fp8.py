"""The fp8 ops on a CUDA GPU (``pytest -m gpu``), per backend with fp8 kernels here: the accuracy contract
(tests/fp8_contract.py) on both paths at awkward lengths, per-head and per-tensor factors, DeepSeek-like outlier
channels; the quantiser on the device; CUDA-graph replay with new lengths; torch.compile with one graph."""

from __future__ import annotations

import pytest
import torch
from fp8_contract import contract_batch, contract_errors, fp8_batch, run_fp8
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from utils import cu_seqlens_of, reset_compile

import mla_ops
from mla_ops.specs import FP8_DTYPE, SelectorConfig

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
SCALE = 192**-0.5


def _fp8_backends() -> list[str]:
    """The backends valid for fp8 on this GPU (none without one)."""
    if not torch.cuda.is_available():
        return ["TRITON"]  # the tests are skipped anyway; a parameter keeps them collected
    capability = mla_ops.DeviceCapability.of(torch.device(DEVICE))
    names = []
    for member in mla_ops.PrefillBackendEnum:
        backend, reasons = mla_ops.selector.validate_backend(member, capability, SelectorConfig(FP8_DTYPE))
        if backend is not None and not reasons and member.name != "REFERENCE":
            names.append(member.name)
    return names or ["TRITON"]


@pytest.fixture(params=_fp8_backends())
def backend(request):
    with mla_ops.prefill_backend(request.param):
        yield request.param


@pytest.mark.parametrize(
    ("lengths", "key_lengths"),
    [([1, 3000, 17, 1100], None), ([4097, 0, 129], None), ([1, 3000, 17, 1100], [900, 0, 4500, 33])],
)
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize(("per_head", "outliers"), [(True, True), (False, False)])
def test_fp8_meets_the_contract(backend, lengths, key_lengths, heads, per_head, outliers) -> None:
    batch, causal = contract_batch(lengths, key_lengths, heads, per_head, outliers, DEVICE)
    out, lse = run_fp8(batch, causal, SCALE)
    assert out.dtype == torch.bfloat16 and out.is_cuda
    error, bound = contract_errors(batch, out, causal, SCALE)
    assert error <= bound, f"{backend}: error {error:.4f} exceeds the contract's {bound:.4f}"
    rows = int(batch.cu_seqlens_q[-1].item())
    assert torch.isneginf(lse[:, rows:]).all(), "padding rows get lse = -inf"
    assert torch.isfinite(out[:rows]).all()


@pytest.mark.parametrize(("tokens", "heads"), [(333, 16), (1366, 128)], ids=["reduced-maxima", "kernel-maxima"])
def test_quantize_fp8_on_the_device_matches_the_cpu(backend, tokens: int, heads: int) -> None:
    """The CUDA conversion kernel (mla_ops.kernels.quantize) and PyTorch's operators on the CPU compute the same
    products and round them to nearest alike: equal results, on a strided view and a ragged token count. The
    maxima come from PyTorch's reduction below ``2**25`` elements and from the maxima's kernel (``amax_rows``)
    from there on: the second case is above it."""
    kv = torch.randn(tokens, heads, 320, generator=torch.Generator().manual_seed(0)).bfloat16()
    for x in (kv[..., 128:], kv[..., :192].contiguous()):
        assert (x.numel() >= 1 << 25) == (heads == 128)
        for per_head in (True, False):
            got8, got = mla_ops.quantize_fp8(x.to(DEVICE), per_head=per_head)
            want8, want = mla_ops.quantize_fp8(x, per_head=per_head)
            assert torch.equal(got.cpu(), want)
            assert torch.equal(got8.cpu().float(), want8.float())


@pytest.mark.parametrize(("tokens", "heads"), [(5000, 16), (1, 128)])
def test_quantize_fp8_key_major_on_the_device(tokens: int, heads: int) -> None:
    """The key-major conversion kernel (``quantize_keys_fp8``) writes the bytes of the row-major one, transposed into
    a ``[H, D, W]`` storage (W a multiple of 16, at least T) whose columns past the tokens hold 0: on a strided view
    and a token count no program divides, and on one token; float32 and D=192, which go to PyTorch's operators (the
    kernel miscompiled for them), alike. Its storage most likely starts as NaN bytes: the caching allocator hands back
    the block of a NaN-filled tensor of its size just freed, so that unwritten bytes show."""
    kv = torch.randn(tokens, heads, 320, generator=torch.Generator().manual_seed(1)).bfloat16().to(DEVICE)
    for x in (kv[..., 192:], kv[..., :128].contiguous(), kv[..., 192:].half(), kv[..., 192:].float(), kv[..., 128:]):
        dim = x.shape[-1]
        for per_head in (True, False):
            want8, want = mla_ops.quantize_fp8(x, per_head=per_head)
            width = -(-tokens // 128) * 128
            torch.full((heads * dim * width,), 0x7F, dtype=torch.uint8, device=DEVICE)  # freed at once
            got8, got = mla_ops.quantize_fp8(x, per_head=per_head, key_major=True)
            assert got8.shape == x.shape and got8.dtype == FP8_DTYPE and torch.equal(got, want)
            w = got8.stride(2)
            assert got8.stride() == (1, dim * w, w) and w % 16 == 0 and w >= tokens
            assert torch.equal(got8.view(torch.uint8), want8.view(torch.uint8)), (x.dtype, dim, per_head)
            storage = got8.as_strided((heads, dim, w), (dim * w, w, 1)).view(torch.uint8)
            assert not storage[:, :, tokens:].any(), "the padding columns hold 0"


def test_fp8_replays_in_a_cuda_graph_with_new_lengths(backend) -> None:
    """Quantisation and attention captured once, replayed with new data and offsets in the same buffers."""
    heads, budget, max_batch = 16, 2048, 4
    x = torch.zeros(3, budget, heads, 320, dtype=torch.bfloat16, device=DEVICE)  # q, k and kv
    cu = torch.zeros(max_batch + 1, dtype=torch.int32, device=DEVICE)

    def step():
        q8, dq = mla_ops.quantize_fp8(x[0][..., :192])
        k8, dk = mla_ops.quantize_fp8(x[1][..., :192])
        v8, dv = mla_ops.quantize_fp8(x[2][..., 192:])
        return mla_ops.prefill_fp8(q8, k8, v8, cu, budget, dq, dk, dv, SCALE)

    def load(lengths, seed):
        x.copy_(torch.randn(x.shape, generator=torch.Generator(DEVICE).manual_seed(seed), device=DEVICE))
        cu.copy_(cu_seqlens_of([*lengths, *[0] * (max_batch - len(lengths))], DEVICE))

    load([100, 7], 0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    for seed, lengths in enumerate([[1, 2000, 3], [512, 0, 512, 1], [33]], start=1):
        load(lengths, seed)
        graph.replay()
        want_out, want_lse = step()
        rows = sum(lengths)
        torch.testing.assert_close(out[:rows], want_out[:rows], atol=0, rtol=0)
        torch.testing.assert_close(lse[:, :rows], want_lse[:, :rows], atol=0, rtol=0)


def test_fp8_compiles_one_graph_on_the_device(backend) -> None:
    reset_compile()

    def attend(q, k, v, cu, max_seqlen, dq, dk, dv):
        return mla_ops.prefill_fp8(q, k, v, cu, max_seqlen, dq, dk, dv)

    compiled = torch.compile(attend, fullgraph=True, dynamic=True)
    for seed, lengths in enumerate([[5, 900], [40, 3, 7], [2, 2], [1700]]):
        b = fp8_batch(lengths, None, 16, device=DEVICE, seed=seed)
        got = compiled(b.q, b.k, b.v, b.cu_seqlens_q, b.max_seqlen_q, *b.descales)
        want = mla_ops.prefill_fp8(b.q, b.k, b.v, b.cu_seqlens_q, b.max_seqlen_q, *b.descales)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert len(_debug_get_cache_entry_list(attend.__code__)) == 1
