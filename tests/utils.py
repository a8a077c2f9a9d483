"""Helpers shared by the tests: ragged batches, independent attention math, tolerances, and a call recorder.

Tolerances follow flash-attention's tests: a kernel's error against an fp32 computation may be at
most a small multiple of the error that the same computation done in the input dtype with PyTorch
makes against fp32. There are no blanket ``atol``s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

DEEPSEEK_DIMS = (192, 128)  # (Dqk, Dv) of DeepSeek-V3: 128 + 64 and 128


def cu_seqlens_of(lengths: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """int32 offsets ``[B+1]`` of packed sequences of the given lengths."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return torch.tensor(out, dtype=torch.int32, device=device)


@dataclass
class RaggedBatch:
    """A packed batch: ``q``/``k`` ``[T, H, Dqk]``, ``v`` ``[T, H, Dv]`` and its offsets."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens: torch.Tensor
    lengths: list[int]

    @property
    def max_seqlen(self) -> int:
        return max(self.lengths, default=0)


def make_qkv(
    num_tokens: int,
    num_heads: int,
    dqk: int,
    dv: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    strided_v: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ``q``, ``k``, ``v``. With ``strided_v``, ``v`` is a view into a wider ``kv`` tensor,
    as MLA's ``kv_b_proj`` output ``[T, H, nope + Dv]`` is split, so its token and head strides are
    not those of a contiguous tensor."""

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)

    q = randn(num_tokens, num_heads, dqk)
    k = randn(num_tokens, num_heads, dqk)
    if strided_v:
        kv = randn(num_tokens, num_heads, dqk + dv)
        v = kv[..., dqk:]
        # is_contiguous() is True for any tensor with fewer than two elements whatever its strides,
        # so check the strides themselves: they must be those of the wider kv tensor.
        assert v.stride() == (num_heads * (dqk + dv), dqk + dv, 1)
    else:
        v = randn(num_tokens, num_heads, dv)
    return q, k, v


def make_batch(
    lengths: Sequence[int],
    num_heads: int,
    dqk: int,
    dv: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    strided_v: bool = False,
    padding: int = 0,
    seed: int = 0,
) -> RaggedBatch:
    """A ragged batch with the given sequence lengths and ``padding`` extra rows past the last one."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths) + padding
    q, k, v = make_qkv(total, num_heads, dqk, dv, dtype, device, strided_v, gen)
    return RaggedBatch(q, k, v, cu_seqlens_of(lengths, device), list(lengths))


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged attention written independently of the package, computed in ``compute_dtype``.

    Per sequence it builds the full score matrix, masks it, and applies ``softmax``. Returns
    ``out`` ``[Tq, H, Dv]`` in ``compute_dtype`` (0 on rows with no keys) and ``lse`` ``[H, Tq]`` in
    float64 (``-inf`` on rows with no keys). With a low-precision ``compute_dtype`` this is "the same
    computation in the input dtype" that tolerances are measured against.
    """
    num_q, num_heads, _ = q.shape
    out = torch.zeros(num_q, num_heads, v.shape[-1], dtype=compute_dtype, device=q.device)
    lse = torch.full((num_heads, num_q), -math.inf, dtype=torch.float64, device=q.device)
    bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(bq) - 1):
        q0, q1, k0, k1 = bq[b], bq[b + 1], bk[b], bk[b + 1]
        if q1 == q0 or k1 == k0:
            continue
        qq = q[q0:q1].to(compute_dtype).transpose(0, 1)
        kk = k[k0:k1].to(compute_dtype).transpose(0, 1)
        vv = v[k0:k1].to(compute_dtype).transpose(0, 1)
        s = (
            (qq @ kk.transpose(1, 2)).float() * softmax_scale
            if compute_dtype != torch.float64
            else (qq @ kk.transpose(1, 2)) * softmax_scale
        )
        if causal:
            lq, lk = q1 - q0, k1 - k0
            mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)
            s = s.masked_fill(~mask, -math.inf)
        lse[:, q0:q1] = torch.logsumexp(s.double(), dim=-1)
        p = torch.softmax(s, dim=-1).to(compute_dtype)
        p = torch.nan_to_num(p, nan=0.0)
        out[q0:q1] = (p @ vv).transpose(0, 1)
    return out, lse


def record_results(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list[Any]:
    """Wrap ``owner.name`` for the rest of the test so that it still runs and each call's result is also
    appended to the returned list (the last call's result is its last item)."""
    results: list[Any] = []
    real = getattr(owner, name)

    def recording(*args: Any, **kwargs: Any) -> Any:
        results.append(real(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(owner, name, recording)
    return results


def reset_compile() -> None:
    """Forget every compiled graph and zero Dynamo's counters, so that what a test counts (graph breaks,
    recompiles, CUDA-graph skips) is its own."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def _valid_rows(cu_seqlens_q: torch.Tensor) -> int:
    return int(cu_seqlens_q[-1])


def assert_attention_close(
    out: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    factor: float = 2.0,
) -> None:
    """Check a kernel's ``(out, lse)`` against fp32 math, with flash-attention-style tolerances.

    ``out`` may err by at most ``factor`` times the error of the same attention computed in the
    input dtype, plus one ulp of the output dtype at the output's scale; ``lse`` by at most
    ``factor`` times that computation's LSE error plus 1e-5 (the kernels accumulate the scores in
    fp32, so their LSE is much closer than the low-precision computation's). Rows past
    ``cu_seqlens_q[-1]`` are padding and are not checked. Empty rows must give ``lse = -inf``.
    """
    n = _valid_rows(cu_seqlens_q)
    ref_out, ref_lse = dense_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, torch.float32)
    low_out, low_lse = dense_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, q.dtype)
    assert out.shape == (q.shape[0], q.shape[1], v.shape[-1]) and out.dtype == q.dtype
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    assert out.is_contiguous() and lse.is_contiguous()
    out, lse = out[:n].float(), lse[:, :n].double()
    ref_out, low_out = ref_out[:n].float(), low_out[:n].float()
    ref_lse, low_lse = ref_lse[:, :n], low_lse[:, :n]
    assert not torch.isnan(out).any(), "output has NaN"
    ulp = torch.finfo(q.dtype).eps * max(ref_out.abs().max().item(), 1e-6) if n else 0.0
    out_err = (out - ref_out).abs().max().item() if n else 0.0
    out_bound = factor * ((low_out - ref_out).abs().max().item() if n else 0.0) + ulp
    assert out_err <= out_bound, f"out error {out_err:.3e} exceeds {out_bound:.3e}"
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), "rows with no keys must have lse -inf, and only those"
    finite = ~empty
    if finite.any():
        lse_err = (lse[finite] - ref_lse[finite]).abs().max().item()
        lse_bound = factor * (low_lse[finite] - ref_lse[finite]).abs().max().item() + 1e-5
        assert lse_err <= lse_bound, f"lse error {lse_err:.3e} exceeds {lse_bound:.3e}"


class GraphBuffers:
    """The static buffers a captured CUDA graph reads, for a token budget and a maximum batch.

    ``q``/``k`` ``[budget, H, Dqk]`` and ``v`` ``[budget, H, Dv]``, a strided view of ``kv``
    ``[budget, H, Dqk + Dv]`` as MLA makes it; one context chunk ``kc``/``vc`` ``[budget_k, H, ...]``; and
    the offsets ``cu``/``cu_k`` int32 ``[max_batch + 1]``. :meth:`load` writes a new batch into them.
    """

    def __init__(
        self,
        heads: int,
        dqk: int,
        dv: int,
        dtype: torch.dtype,
        budget: int,
        budget_k: int,
        max_batch: int,
        device: torch.device | str = "cuda",
        seed: int = 0,
    ) -> None:
        self.budget, self.budget_k, self.max_batch = budget, budget_k, max_batch
        self.q = torch.empty(budget, heads, dqk, dtype=dtype, device=device)
        self.k = torch.empty_like(self.q)
        self.kv = torch.empty(budget, heads, dqk + dv, dtype=dtype, device=device)
        self.v = self.kv[..., dqk:]
        self.kc = torch.empty(budget_k, heads, dqk, dtype=dtype, device=device)
        self.vc = torch.empty(budget_k, heads, dv, dtype=dtype, device=device)
        self.cu = torch.zeros(max_batch + 1, dtype=torch.int32, device=device)
        self.cu_k = torch.zeros_like(self.cu)
        self.generator = torch.Generator(device).manual_seed(seed)

    def load(self, lengths: Sequence[int], context: Sequence[int]) -> None:
        """Write a batch: new data, and the offsets of ``lengths`` new tokens and ``context`` chunk slices
        per sequence, padded to ``max_batch`` with sequences of length 0."""
        for buf in (self.q, self.k, self.kv, self.kc, self.vc):
            buf.copy_(torch.randn(buf.shape, generator=self.generator, device=buf.device))
        pad = [0] * (self.max_batch - len(lengths))
        self.cu.copy_(cu_seqlens_of([*lengths, *pad], self.cu.device))
        self.cu_k.copy_(cu_seqlens_of([*context, *pad], self.cu.device))


def native_library_or_skip() -> None:
    """Load the native library (:mod:`mla_ops.native`) for a GPU test module, or skip it saying why it cannot
    be built here. Where the toolchain is present, a failed build fails the test instead of skipping it."""
    import os
    import shutil

    from torch.utils.cpp_extension import CUDA_HOME

    from mla_ops import native

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible")
    reason = native.unavailable_reason()
    if reason is None and (CUDA_HOME is None or not os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc"))):
        reason = "no CUDA toolkit (nvcc) found: the native library cannot be built here"
    if reason is None and shutil.which("ninja") is None:
        reason = "ninja is not on PATH (pip install ninja): the native library cannot be built here"
    if reason is not None and not native.is_loaded():
        pytest.skip(reason)
    assert native.load(), native.status()


def gluon_or_skip(device: str = "cuda") -> None:
    """Skip where ``device`` does not run the Hopper kernel written in Gluon: off SM90, without Gluon, or under a
    Triton release the kernel is not adapted to (each says which)."""
    if torch.cuda.get_device_capability(device) != (9, 0):
        pytest.skip(f"the Gluon kernel runs on SM90 (Hopper) GPUs only, not on {torch.cuda.get_device_name(device)}")
    pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon, which the kernel is written in")
    import triton

    from mla_ops.kernels.triton_compat import gluon_triton_reason

    reason = gluon_triton_reason(triton.__version__)
    if reason is not None:
        pytest.skip(f"the Gluon kernel: {reason}")
