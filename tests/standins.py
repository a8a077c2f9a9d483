"""Stand-ins for the kernel libraries the backends call, so that the backends run on a CPU.

Each stand-in has the real function's signature (tests/test_standins.py checks it against the real
library wherever that is installed), so an unknown keyword fails as it would on the real library. It
checks what the real kernels check (dtypes, 16-byte aligned rows, int32 offsets, bounds that cover
every sequence), computes attention with ``tests/utils.dense_attention``, and answers in the library's
own conventions: FlashInfer's base-2 ``[T, H]`` LSE, FlashAttention-2's ``+inf`` LSE for rows without
keys, garbage in rows past ``cu_seqlens[-1]`` that the kernels never write.

A test builds a backend around them and installs it, which is how "the library is present" is
simulated everywhere:

.. code-block:: python

    backend = FlashInferBackend(library=standins.flashinfer_module(), workspace_bytes=1 << 20, capability=SM90)
    with mla_ops.selector.backend_installed(backend): ...
    FlashAttnBackend(libraries=standins.flash_attn_libraries("flash_attn.cute"))

Host reads of device tensors are allowed inside a stand-in "kernel" only (:func:`inside_kernel`), so
that :func:`no_host_sync` can prove a backend itself never synchronises.
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
from utils import dense_attention

# --- host reads -----------------------------------------------------------------------------------

_kernel_depth = 0


@contextlib.contextmanager
def inside_kernel() -> Iterator[None]:
    """Host reads are allowed here: this code stands in for a CUDA kernel, which reads on the device."""
    global _kernel_depth
    _kernel_depth += 1
    try:
        yield
    finally:
        _kernel_depth -= 1


_HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Within the block, every host read of a tensor fails, except inside a stand-in kernel."""
    with pytest.MonkeyPatch.context() as mp:
        for name in _HOST_READS:
            original = getattr(torch.Tensor, name)

            def guarded(self, *args, _name=name, _original=original, **kwargs):
                if _kernel_depth == 0:
                    raise AssertionError(f"host sync: Tensor.{_name} called outside a kernel")
                return _original(self, *args, **kwargs)

            mp.setattr(torch.Tensor, name, guarded)
        yield


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """Make the current stream look like it is capturing a CUDA graph: to torch's query, and to the C binding
    beneath it that ``mla_ops.runtime.capture.is_capturing`` calls."""
    from mla_ops.runtime import capture

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        mp.setattr(capture, "_stream_capturing", lambda: True)
        yield


def _is_capturing() -> bool:
    try:
        return torch.cuda.is_current_stream_capturing()
    except RuntimeError:
        return False


# --- what every FlashAttention kernel checks and computes ------------------------------------------------


def check_kernel_inputs(q, k, v, cu_q, cu_k, max_q, max_k) -> None:
    """What FlashAttention's kernels require of their inputs (they fail or read garbage otherwise)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert t.dtype in (torch.float16, torch.bfloat16), f"{name}: FlashAttention only supports fp16 and bf16"
        assert t.stride(-1) == 1, f"{name} must have contiguous last dimension"
        assert t.data_ptr() % 16 == 0, f"{name}: misaligned base pointer"
        for n, s in zip(t.shape[:-1], t.stride()[:-1]):
            assert n == 1 or (s * t.element_size()) % 16 == 0, f"{name}: misaligned stride {t.stride()}"
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        assert cu.dtype == torch.int32 and cu.is_contiguous(), f"{name} must be contiguous int32"
    assert isinstance(max_q, int) and isinstance(max_k, int)
    with inside_kernel():
        # The kernels size their grid from max_seqlen; a value below a real length would skip rows.
        assert max_q >= int((cu_q[1:] - cu_q[:-1]).max()), "max_seqlen_q is below a sequence length"
        assert max_k >= int((cu_k[1:] - cu_k[:-1]).max()), "max_seqlen_k is below a sequence length"


def kernel_attention(q, k, v, cu_q, cu_k, scale, causal, empty_lse: float):
    """Attention in the kernels' layout: out ``[Tq, H, v.shape[-1]]``, lse float32 ``[H, Tq]`` (natural log).

    Rows without keys get ``out = 0`` and ``lse = empty_lse`` (what the library writes there); rows past
    ``cu_q[-1]`` are never written by the kernels, so they hold NaN and a huge LSE here.
    """
    with inside_kernel():
        out, lse = dense_attention(q, k, v, cu_q, cu_k, scale, causal, torch.float32)
        valid = int(cu_q[-1])
    out, lse = out.to(q.dtype), lse.float()
    lse[torch.isneginf(lse)] = empty_lse
    out[valid:] = math.nan
    lse[:, valid:] = 1e30
    return out, lse


# --- FlashInfer -------------------------------------------------------------------------------------


class FakeRaggedWrapper:
    """Stand-in for ``flashinfer.BatchPrefillWithRaggedKVCacheWrapper`` (flashinfer 0.7.2).

    It enforces the real constraints that shape the backend: ``run()`` needs ``q.shape[0] ==
    qo_indptr[-1]``; in CUDA-graph mode the batch size is fixed by the indptr buffers, the row count by
    the first plan, and a CUTLASS wrapper cannot be re-planned; ``plan()`` never runs under capture. It
    returns FlashInfer's LSE: base 2, ``[T, H]``. Every wrapper a module's class creates is appended to
    that module's ``created`` list.
    """

    registry: ClassVar[list[FakeRaggedWrapper]]

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
        self.registry.append(self)

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
    ) -> None:
        assert not _is_capturing(), "plan() called inside CUDA graph capture"
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
        if (lse_base, lse_layout) != ("log2", "NH"):
            raise NotImplementedError("the stand-in returns FlashInfer's default LSE only: lse_base='log2', 'NH'")
        plan = self.planned
        assert plan is not None, "run() before plan()"
        if q.size(0) != plan["rows"]:
            raise ValueError(f"q.shape[0] ({q.size(0)}) does not match qo_indptr[-1] ({plan['rows']}).")
        assert (q.shape[1], k.shape[1]) == plan["heads"] and (q.shape[2], v.shape[2]) == plan["dims"]
        assert q.dtype == k.dtype == v.dtype == plan["dtypes"][0]
        out_shape = (q.shape[0], q.shape[1], v.shape[2])
        if out is None:
            out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
        assert out.shape == out_shape and out.dtype == q.dtype and out.is_contiguous()
        if lse is None:
            lse = torch.empty((q.shape[0], q.shape[1]), dtype=torch.float32, device=q.device)
        # The kernels index the LSE as a dense [T, H] array.
        assert lse.shape == (q.shape[0], q.shape[1]) and lse.dtype == torch.float32 and lse.is_contiguous()
        self._compute(q, k, v, out, lse)
        self.run_log.append(dict(rows=q.shape[0], capturing=_is_capturing(), v=v))
        return (out, lse) if return_lse else out

    def _compute(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
        """The kernel: attention into ``out`` and FlashInfer's base-2 ``[T, H]`` LSE into ``lse``."""
        plan = self.planned
        ragged_kernel(self.qo_indptr_buf, self.kv_indptr_buf, plan["sm_scale"], plan["causal"], q, k, v, out, lse)


def ragged_kernel(qo_indptr, kv_indptr, sm_scale, causal, q, k, v, out, lse) -> None:
    """What FlashInfer's ragged prefill kernel writes: ``out`` and the base-2 LSE ``[T, H]``."""
    with inside_kernel():
        o, lse_ln = dense_attention(q, k, v, qo_indptr, kv_indptr, sm_scale, causal, torch.float32)
    out.copy_(o)
    lse.copy_((lse_ln / math.log(2.0)).t())


class FakeKernelModule:
    """Stand-in for the compiled module a real wrapper keeps as ``_cached_module`` after ``plan()``.

    ``ragged_run`` is the kernel call, counted in ``calls``. ``out_factor`` scales what it writes to
    ``out``, for a wrapper whose ``run()`` finishes the output after the call (see
    :class:`ModuleRaggedWrapper`).
    """

    def __init__(self, out_factor: float = 1.0) -> None:
        self.calls = 0
        self.out_factor = out_factor

    def ragged_run(self, workspace, qo_indptr, kv_indptr, q, k, v, out, lse, sm_scale, causal, mask_mode=0) -> None:
        self.calls += 1
        ragged_kernel(qo_indptr, kv_indptr, sm_scale, causal, q, k, v, out, lse)
        if self.out_factor != 1.0:
            out.mul_(self.out_factor)


class ModuleRaggedWrapper(FakeRaggedWrapper):
    """A :class:`FakeRaggedWrapper` whose ``run()`` is built like FlashInfer 0.7.2's: after its checks it
    makes ``calls_per_run`` calls of its module's ``ragged_run`` (one in the library), with the plan's
    buffers and scalars around the call's tensors, then divides ``out`` by the module's ``out_factor``
    (a finishing step after the call, where the library has one). The module is the class's
    ``_cached_module``, shared by its wrappers as the library shares one module per kernel variant."""

    _cached_module: ClassVar[FakeKernelModule]
    calls_per_run: ClassVar[int] = 1

    def _compute(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
        plan = self.planned
        for _ in range(self.calls_per_run):
            self._cached_module.ragged_run(
                self.workspace,
                self.qo_indptr_buf,
                self.kv_indptr_buf,
                q,
                k,
                v,
                out,
                lse,
                plan["sm_scale"],
                plan["causal"],
            )
        if self._cached_module.out_factor != 1.0:
            out.div_(self._cached_module.out_factor)


#: What ``trtllm_ragged_attention_deepseek`` asserts of ``(q, k, v)`` head dims (flashinfer 0.7.2.post1).
TRTLLM_DIMS = ((192, 192, 128), (128, 128, 128), (256, 256, 256))


def trtllm_ragged_function(calls: list[dict]) -> Callable[..., Any]:
    """Stand-in for ``flashinfer.prefill.trtllm_ragged_attention_deepseek`` (flashinfer 0.7.2.post1).

    It enforces what the real function and its launcher require: the three head-dim triples; bf16 (the
    dtype FlashInfer tests it in); ``q`` and ``out`` packed (the launcher passes strides for ``k`` and
    ``v`` only) and 16-byte aligned ``k``/``v`` rows; int32 offsets, ``seq_lens`` equal to the key
    offsets' differences, bounds that cover every sequence; a zero-initialised workspace large enough for
    the softmax statistics (``8 * H * B * roundup(max_q_len, 256)`` bytes plus a 1 MiB guard); the length
    mirrors' checks. Rows of a sequence without queries or keys are written correctly (``out = 0``,
    ``lse = -inf``) only where the mirrors are passed: without them the real kernel takes an undefined
    path, modelled as NaN. Returns FlashInfer's base-2 LSE, ``[T, H]``; rows past ``cum_seq_lens_q[-1]``
    are never written. Each call is appended to ``calls``.
    """

    def trtllm_ragged_attention_deepseek(
        query, key, value, workspace_buffer, seq_lens, max_q_len, max_kv_len, bmm1_scale, bmm2_scale, o_sf_scale,
        batch_size, window_left, cum_seq_lens_q, cum_seq_lens_kv, enable_pdl, is_causal, return_lse,
        attention_sinks=None, skip_softmax_threshold_scale_factor=None, out=None, lse=None, backend="trtllm-gen",
        q_seq_lens_cpu=None, kv_seq_lens_cpu=None, skip_all_rows_active_check=True,
    ):  # fmt: skip
        dims = (query.shape[2], key.shape[2], value.shape[2])
        assert dims in TRTLLM_DIMS, f"Unsupported head dimensions: {dims}"
        if attention_sinks is not None or skip_softmax_threshold_scale_factor is not None or backend != "trtllm-gen":
            raise NotImplementedError("the trtllm-gen stand-in computes plain attention on the trtllm-gen backend")
        assert window_left == -1 and bmm2_scale == 1.0, "the stand-in computes attention without window or v scale"
        assert query.dtype == key.dtype == value.dtype == torch.bfloat16, "FlashInfer tests this kernel in bf16"
        assert query.is_contiguous(), "the launcher passes no strides for q: the kernel reads it packed"
        for name, t in (("key", key), ("value", value)):
            assert t.stride(-1) == 1 and t.data_ptr() % 16 == 0, f"{name}: TMA needs unit last stride, 16-byte base"
            assert all((s * t.element_size()) % 16 == 0 for s in t.stride()[:-1]), f"{name}: misaligned strides"
        num_tokens, num_heads, _ = query.shape
        out_shape = (num_tokens, num_heads, value.shape[2])
        if out is None:
            out = torch.empty(out_shape, dtype=query.dtype, device=query.device)
        elif tuple(out.shape) != out_shape:
            raise ValueError(f"out must have shape {out_shape}, got {tuple(out.shape)}")
        assert out.is_contiguous() and out.dtype == query.dtype, "the kernel writes out packed, in q's dtype"
        if return_lse and lse is None:
            lse = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=query.device)
        if lse is not None:
            assert lse.dtype == torch.float32 and lse.shape == (num_tokens, num_heads), "lse is float32 [T, H]"
        offsets = {"seq_lens": seq_lens, "cum_seq_lens_q": cum_seq_lens_q, "cum_seq_lens_kv": cum_seq_lens_kv}
        for name, t in offsets.items():
            assert t.dtype == torch.int32 and t.is_contiguous() and t.device == query.device, f"{name}: int32 [B]"
        assert seq_lens.shape == (batch_size,) and cum_seq_lens_q.shape == cum_seq_lens_kv.shape == (batch_size + 1,)
        assert isinstance(max_q_len, int) and isinstance(max_kv_len, int) and isinstance(bmm1_scale, float)
        if (q_seq_lens_cpu is None) != (kv_seq_lens_cpu is None):
            raise ValueError("q_seq_lens_cpu and kv_seq_lens_cpu must be provided together")
        mirrors = q_seq_lens_cpu is not None
        checks = [("q_seq_lens_cpu", q_seq_lens_cpu, num_tokens, max_q_len)]
        checks.append(("kv_seq_lens_cpu", kv_seq_lens_cpu, key.shape[0], max_kv_len))
        for name, t, total, bound in checks if mirrors else ():
            if t.device.type != "cpu" or t.dtype not in (torch.int32, torch.int64) or t.shape != (batch_size,):
                raise ValueError(f"{name} must be a CPU int32/int64 tensor of shape ({batch_size},)")
            if int(t.sum()) != total:
                raise ValueError(f"{name} sums to {int(t.sum())}, but expected {total} tokens from the ragged tensor")
            if batch_size and int(t.max()) > bound:
                raise ValueError(f"{name} contains a length larger than max_len")
        if mirrors and value.shape[0] != key.shape[0]:
            raise ValueError("kv_seq_lens_cpu must sum to both key and value token counts")
        if not mirrors and not skip_all_rows_active_check and _is_capturing():
            raise ValueError("q_seq_lens_cpu and kv_seq_lens_cpu must be provided during CUDA graph capture")
        calls.append(dict(
            q=query, k=key, v=value, workspace=workspace_buffer, max_q_len=max_q_len, max_kv_len=max_kv_len,
            scale=bmm1_scale, batch_size=batch_size, causal=is_causal, enable_pdl=enable_pdl, mirrors=mirrors,
            cum_seq_lens_q=cum_seq_lens_q, cum_seq_lens_kv=cum_seq_lens_kv, capturing=_is_capturing(),
        ))  # fmt: skip
        with inside_kernel():
            q_lens = cum_seq_lens_q[1:] - cum_seq_lens_q[:-1]
            kv_lens = cum_seq_lens_kv[1:] - cum_seq_lens_kv[:-1]
            assert int(cum_seq_lens_q[0]) == 0 and int(cum_seq_lens_kv[0]) == 0 and bool((q_lens >= 0).all())
            assert bool((kv_lens >= 0).all()) and torch.equal(seq_lens, kv_lens), "seq_lens are the key counts"
            assert int(cum_seq_lens_q[-1]) <= num_tokens and int(cum_seq_lens_kv[-1]) <= key.shape[0]
            assert batch_size == 0 or max_q_len >= int(q_lens.max()), "max_q_len is below a sequence length"
            assert batch_size == 0 or max_kv_len >= int(kv_lens.max()), "max_kv_len is below a sequence length"
            if return_lse:
                needed = 8 * num_heads * batch_size * (-(-max_q_len // 256) * 256) + (1 << 20)
                have = workspace_buffer.numel() * workspace_buffer.element_size()
                if have < needed:
                    raise RuntimeError(
                        f"Buffer overflow when allocating memory for trtllm_gen_softmax_workspace with size {needed}"
                    )
            assert not bool(workspace_buffer.any()), "the trtllm-gen workspace must be zero-initialised"
            o, lse_ln = dense_attention(
                query, key, value, cum_seq_lens_q, cum_seq_lens_kv, bmm1_scale, is_causal, torch.float32
            )
            undefined = (q_lens > 0) & (kv_lens == 0)  # sequences the kernel meets without keys
            rows = torch.repeat_interleave(undefined, q_lens, output_size=int(cum_seq_lens_q[-1]))
            valid = int(cum_seq_lens_q[-1])
        o, lse_2 = o.to(query.dtype), (lse_ln / math.log(2.0)).float().t()
        if not mirrors and skip_all_rows_active_check:
            o[:valid][rows] = math.nan
            lse_2[:valid][rows] = math.nan
        out[:valid] = o[:valid]
        if lse is not None:
            lse[:valid] = lse_2[:valid]
        return (out, lse) if return_lse else out

    return trtllm_ragged_attention_deepseek


def flashinfer_module(
    version: str = "0.7.2.post1",
    wrapper: type | None = None,
    *,
    kernel_module: FakeKernelModule | None = None,
    calls_per_run: int = 1,
    trtllm: bool = True,
) -> types.ModuleType:
    """A ``flashinfer`` stand-in whose wrapper class records the wrappers it creates in ``module.created``.

    ``wrapper``: another wrapper class to expose instead (an old API, say). ``kernel_module``: build the
    wrapper class as a :class:`ModuleRaggedWrapper` around this module, making ``calls_per_run`` module
    calls per ``run()``. ``trtllm``: whether ``module.prefill`` has ``trtllm_ragged_attention_deepseek``
    (:func:`trtllm_ragged_function`, its calls in ``module.trtllm_calls``), as 0.7.2.post1 has.
    """
    module = types.ModuleType("flashinfer")
    module.__version__ = version
    module.created = []
    module.trtllm_calls = []
    module.prefill = types.ModuleType("flashinfer.prefill")
    if trtllm:
        module.prefill.trtllm_ragged_attention_deepseek = trtllm_ragged_function(module.trtllm_calls)
    if wrapper is None and kernel_module is not None:
        attrs = {"registry": module.created, "_cached_module": kernel_module, "calls_per_run": calls_per_run}
        wrapper = type("BatchPrefillWithRaggedKVCacheWrapper", (ModuleRaggedWrapper,), attrs)
    elif wrapper is None:
        wrapper = type("BatchPrefillWithRaggedKVCacheWrapper", (FakeRaggedWrapper,), {"registry": module.created})
    module.BatchPrefillWithRaggedKVCacheWrapper = wrapper
    return module


# --- FlashAttention-4 (flash_attn.cute) -----------------------------------------------------------------


def _fa4_dequantised(t, descale, cu_seqlens):
    """fp8 ``t`` ``[T, H, D]`` in float32, each sequence's rows times its factors (``descale`` ``[B, H]``, as
    FlashAttention-4 takes them); rows past ``cu_seqlens[-1]`` times 1."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    factors = torch.repeat_interleave(descale, lengths, dim=0)
    factors = torch.cat([factors, factors.new_ones(t.shape[0] - factors.shape[0], t.shape[1])])
    return t.float() * factors[..., None]


def fa4_module(internal: bool = True, arch: int = 100) -> types.ModuleType:
    """``flash_attn.cute`` (flash-attn-4 4.0.0b36) as the FLASH_ATTN backend reads it.

    ``flash_attn_varlen_func`` has the real signature and returns ``(out, lse)``, ``lse`` float32
    ``[H, total_q]`` in natural log (``-inf`` for rows without keys), or ``(out, None)`` without
    ``return_lse``. Like the real one it compiles a kernel variant the first time it meets it, through
    ``interface.cute.compile`` (``cutlass.cute.compile``), looked up at the call so that a replacement
    installed there takes effect. Variants are keyed on ``(dtype, Dqk, Dv, causal, max_seqlen_q <= 128,
    more than 256 sequences)``, the parts of the real compile key that a varlen call can change (the last
    is ``BIN_BATCH_SEARCH_THRESH``).
    ``module.compiled`` lists the variants compiled; ``module.calls`` what each call received, with
    ``entry`` naming the function called. With ``internal``, ``module.interface._flash_attn_fwd`` is the
    forward beneath it, with the real signature's leading parameters, returning ``(out, lse, None, None,
    None)`` as 4.0.0b36's does. It takes fp8 e4m3 inputs as the real one does: on a GPU of ``arch`` 10x only,
    with a float32 ``[B, H]`` descale factor for each of q, k and v, into a bfloat16 output.
    """
    module = types.ModuleType("flash_attn.cute")
    module.__version__ = "4.0.0b36"
    module.calls = []
    module.compiled = []
    cache: dict[tuple, Any] = {}

    def cute_compile(*args: Any, **kwargs: Any) -> Callable[..., None]:
        module.compiled.append(args[0])
        return lambda *a, **k: None

    module.interface = types.ModuleType("flash_attn.cute.interface")
    module.interface.cute = types.SimpleNamespace(compile=cute_compile)

    def compile_for(q, v, cu_seqlens_q, max_seqlen_q, causal) -> None:
        variant = (q.dtype, q.shape[-1], v.shape[-1], causal, max_seqlen_q <= 128, cu_seqlens_q.shape[0] - 1 > 256)
        if variant not in cache:
            cache[variant] = module.interface.cute.compile(variant)

    def forward(entry, q, k, v, qv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, min_seqlen_k, seqused_q,
                seqused_k, gather_kv_indices, page_table, softmax_scale, causal, window_size, learnable_sink, softcap,
                num_splits, score_mod, mask_mod, block_sparse_tensors, return_lse):  # fmt: skip
        unsupported = dict(
            qv=qv, min_seqlen_k=min_seqlen_k, seqused_q=seqused_q, seqused_k=seqused_k,
            gather_kv_indices=gather_kv_indices, page_table=page_table, learnable_sink=learnable_sink,
            score_mod=score_mod, mask_mod=mask_mod, block_sparse_tensors=block_sparse_tensors,
        )  # fmt: skip
        used = [name for name, value in unsupported.items() if value is not None]
        if used or tuple(window_size) != (None, None) or softcap or num_splits != 1:
            raise NotImplementedError(f"the FlashAttention-4 stand-in computes plain varlen attention, not {used}")
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise NotImplementedError("the FlashAttention-4 stand-in computes varlen attention only")
        module.calls.append(dict(
            entry=entry, q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal, return_lse=return_lse,
            capturing=_is_capturing(),
        ))  # fmt: skip
        check_kernel_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        compile_for(q, v, cu_seqlens_q, max_seqlen_q, causal)
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        out, lse = kernel_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, -math.inf)
        return out, (lse if return_lse else None)

    def flash_attn_varlen_func(
        q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
        min_seqlen_k=None, seqused_q=None, seqused_k=None, gather_kv_indices=None, page_table=None,
        softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1,
        pack_gqa=None, deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None,
        block_sparse_tensors=None, aux_tensors=None, aux_scalars=None, return_lse=False, scheduler_metadata=None,
        seqlen_k_per_split=None, disable_scheduler_metadata=False, gather_bwd_recompute_p=False,
        gather_bwd_token_chunk=None,
    ):  # fmt: skip
        return forward(
            "flash_attn_varlen_func", q, k, v, qv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            min_seqlen_k, seqused_q, seqused_k, gather_kv_indices, page_table, softmax_scale, causal, window_size,
            learnable_sink, softcap, num_splits, score_mod, mask_mod, block_sparse_tensors, return_lse,
        )  # fmt: skip

    def _flash_attn_fwd(
        q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None, max_seqlen_q=None,
        max_seqlen_k=None, min_seqlen_k=None, page_table=None, softmax_scale=None, causal=False, softcap=None,
        window_size_left=None, window_size_right=None, learnable_sink=None, tile_mn=None, mma_pv_is_rs=None,
        intra_wg_overlap=None, num_threads=384, num_splits=1, pack_gqa=None, _arch=None, score_mod=None,
        mask_mod=None, block_sparse_tensors=None, return_lse=False, out=None, lse=None, aux_tensors=None,
        aux_scalars=None, q_descale=None, k_descale=None, v_descale=None, gather_kv_indices=None,
        scheduler_metadata=None, seqlen_k_per_split=None, disable_scheduler_metadata=False,
        gather_bwd_recompute_p=False,
    ):  # fmt: skip
        descales = (q_descale, k_descale, v_descale)
        if q.dtype == torch.float8_e4m3fn:
            assert arch // 10 == 10, "FP8 is only supported on SM100 (compute capability 10.x) for FA4 CuTe."
            batch, heads = cu_seqlens_q.shape[0] - 1, k.shape[1]
            for name, d in zip(("q_descale", "k_descale", "v_descale"), descales):
                assert d is not None and d.dtype == torch.float32 and d.shape == (batch, heads), name
                assert d.is_contiguous(), name
            module.calls.append(dict(entry="_flash_attn_fwd", fp8=True, descales=descales, capturing=_is_capturing()))
            compile_for(q, v, cu_seqlens_q, max_seqlen_q, causal)
            q, k, v = (
                _fa4_dequantised(t, d, cu) for t, d, cu in ((q, q_descale, cu_seqlens_q), (k, k_descale, cu_seqlens_k),
                                                          (v, v_descale, cu_seqlens_k))
            )  # fmt: skip
            scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
            out, lse = kernel_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, -math.inf)
            return out.to(torch.bfloat16), (lse if return_lse else None), None, None, None
        assert all(d is None for d in descales), "q_descale/k_descale/v_descale are only supported for FP8 inputs"
        out, lse = forward(
            "_flash_attn_fwd", q, k, v, qv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, min_seqlen_k,
            seqused_q, seqused_k, gather_kv_indices, page_table, softmax_scale, causal,
            (window_size_left, window_size_right), learnable_sink, softcap or 0.0, num_splits, score_mod, mask_mod,
            block_sparse_tensors, return_lse,
        )  # fmt: skip
        return out, lse, None, None, None

    if internal:
        module.interface._flash_attn_fwd = _flash_attn_fwd
    module.flash_attn_varlen_func = flash_attn_varlen_func
    return module


# --- FlashAttention-3 (flash_attn_interface, hopper/) ---------------------------------------------------


def fa3_module(variant: str = "new") -> types.ModuleType:
    """``flash_attn_interface`` (flash-attention's hopper/) in the generations of its return convention.

    ``old``: no flag, always ``(out, lse)`` (late 2024); ``new``: ``return_attn_probs`` (2025 main);
    ``lse_flag``: ``return_softmax_lse`` (vLLM's fork); ``no_lse``: a build that never returns the LSE.
    ``module.calls`` records each call, with ``flag`` the LSE flag it was given.
    """
    module = types.ModuleType("flash_attn_interface")
    module.calls = []

    def run(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, flag):
        module.calls.append(dict(
            q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
            softmax_scale=softmax_scale, causal=causal, flag=flag,
        ))  # fmt: skip
        check_kernel_inputs(q, k, v, cu_q, cu_k, max_q, max_k)
        # store_zero writes -inf; the softmax epilogue writes +inf: both mean "no keys".
        return kernel_attention(q, k, v, cu_q, cu_k, softmax_scale, causal, -math.inf if variant == "old" else math.inf)

    if variant == "old":

        def flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False,
            q_descale=None, k_descale=None, v_descale=None, window_size=(-1, -1), softcap=0.0, num_splits=1,
            pack_gqa=None, deterministic=False,
        ):  # fmt: skip
            return run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, None)

    elif variant == "new":

        def flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None, seqused_k=None,
            softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None,
            window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
            deterministic=False, sm_margin=0, return_attn_probs=False,
        ):  # fmt: skip
            flag = ("return_attn_probs", return_attn_probs)
            args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, flag)
            out, lse = run(*args)
            return (out, lse) if return_attn_probs else out

    elif variant == "lse_flag":

        def flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=None, softmax_scale=None,
            causal=False, window_size=(-1, -1), softcap=0.0, return_softmax_lse=False, out=None,
        ):  # fmt: skip
            flag = ("return_softmax_lse", return_softmax_lse)
            args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, flag)
            result = run(*args)
            return result if return_softmax_lse else result[0]

    elif variant == "no_lse":

        def flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False
        ):
            return run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, None)[0]

    else:
        raise ValueError(f"unknown FlashAttention-3 variant {variant!r}")

    module.flash_attn_varlen_func = flash_attn_varlen_func
    return module


# --- FlashAttention-2 (flash_attn) and PyTorch's bundled copy ---------------------------------------------


def fa2_attention(calls: list[dict], call: dict[str, Any], *, value_name: str):
    """FlashAttention-2's varlen forward (``mha_varlen_fwd``, in flash-attn and in PyTorch's copy): one head
    size for q, k and v, and ``+inf`` in the LSE of rows without keys.

    ``call`` holds the arguments under flash-attn's names (``q``, ``cu_seqlens_q``, ``softmax_scale``, ...),
    whatever the caller's own; it is appended to ``calls`` first, so a test reads what the kernel ran on."""
    calls.append(call)
    q, k, v, cu_q, cu_k = call["q"], call["k"], call["v"], call["cu_seqlens_q"], call["cu_seqlens_k"]
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]):
        raise RuntimeError(f"{value_name} must have shape (total_k, num_heads_k, head_size_og)")
    check_kernel_inputs(q, k, v, cu_q, cu_k, call["max_seqlen_q"], call["max_seqlen_k"])
    return kernel_attention(q, k, v, cu_q, cu_k, call["softmax_scale"], call["causal"], math.inf)


def fa2_module() -> types.ModuleType:
    """``flash_attn`` 2.8: one head dim for q, k, v; ``return_attn_probs`` gives ``(out, lse, S_dmask)``."""
    module = types.ModuleType("flash_attn")
    module.__version__ = "2.8.3"
    module.calls = []

    def flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
        causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
        return_attn_probs=False, block_table=None,
    ):  # fmt: skip
        out, lse = fa2_attention(module.calls, dict(
            q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
            window_size=window_size, return_attn_probs=return_attn_probs,
        ), value_name="v")  # fmt: skip
        return (out, lse, torch.empty(0, dtype=q.dtype)) if return_attn_probs else out

    module.flash_attn_varlen_func = flash_attn_varlen_func
    return module


def bundled_op() -> Callable[..., Any]:
    """``torch.ops.aten._flash_attention_forward`` as its schema declares it, with the keyword-only tail
    every supported torch (2.6 and newer) has. ``op.calls`` records each call."""
    calls: list[dict] = []

    def _flash_attention_forward(
        query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *,
        scale=None, window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None,
    ):  # fmt: skip
        out, lse = fa2_attention(calls, dict(
            q=query, k=key, v=value, cu_seqlens_q=cum_seq_q, cu_seqlens_k=cum_seq_k, max_seqlen_q=max_q,
            max_seqlen_k=max_k, dropout_p=dropout_p, causal=is_causal, return_debug_mask=return_debug_mask,
            softmax_scale=scale, window_size_left=window_size_left,
        ), value_name="value")  # fmt: skip
        rng_state = torch.empty(2, dtype=torch.int64)
        return out, lse, rng_state, torch.empty(()), torch.empty(0, dtype=query.dtype)

    _flash_attention_forward.calls = calls
    return _flash_attention_forward


#: The FLASH_ATTN chain's implementation names, best first.
FLASH_ATTN_NAMES = ("flash_attn.cute", "flash_attn_interface", "flash_attn", "torch.ops.aten._flash_attention_forward")

_FA_BUILDERS: dict[str, Callable[[], Any]] = {
    "flash_attn.cute": fa4_module,
    "flash_attn_interface": fa3_module,
    "flash_attn": fa2_module,
    "torch.ops.aten._flash_attention_forward": bundled_op,
}


def flash_attn_libraries(*names: str, fa3: str = "new") -> dict[str, Any]:
    """Stand-ins for the named implementations, for ``FlashAttnBackend(libraries=...)``; the others are absent.

    ``fa3``: the ``flash_attn_interface`` variant (see :func:`fa3_module`).
    """
    unknown = set(names) - set(FLASH_ATTN_NAMES)
    if unknown:
        raise ValueError(f"no stand-in for {sorted(unknown)}; choose from {FLASH_ATTN_NAMES}")
    return {name: fa3_module(fa3) if name == "flash_attn_interface" else _FA_BUILDERS[name]() for name in names}


# --- what each stand-in models, for tests/test_standins.py -------------------------------------------------


@dataclass(frozen=True)
class Modelled:
    """A stand-in callable and the real one it models: ``module`` imported, then ``attribute`` (dotted) read."""

    name: str
    standin: Callable[..., Any]
    module: str
    attribute: str


def modelled() -> list[Modelled]:
    """Every stand-in callable with the real callable it models."""
    wrapper = FakeRaggedWrapper
    real_wrapper = "BatchPrefillWithRaggedKVCacheWrapper"
    return [
        Modelled("flashinfer wrapper __init__", wrapper.__init__, "flashinfer", f"{real_wrapper}.__init__"),
        Modelled("flashinfer wrapper plan", wrapper.plan, "flashinfer", f"{real_wrapper}.plan"),
        Modelled("flashinfer wrapper run", wrapper.run, "flashinfer", f"{real_wrapper}.run"),
        Modelled("flashinfer trtllm_ragged_attention_deepseek", trtllm_ragged_function([]), "flashinfer.prefill",
                 "trtllm_ragged_attention_deepseek"),
        Modelled("FlashAttention-4", fa4_module().flash_attn_varlen_func, "flash_attn.cute", "flash_attn_varlen_func"),
        # The private forward the adapter calls, with the fp8 descale keywords FLASH_ATTN's fp8 path passes.
        Modelled("FlashAttention-4 forward", fa4_module().interface._flash_attn_fwd, "flash_attn.cute.interface",
                 "_flash_attn_fwd"),
        *(
            Modelled(f"FlashAttention-3 ({v})", fa3_module(v).flash_attn_varlen_func, "flash_attn_interface",
                     "flash_attn_varlen_func")
            for v in ("old", "new", "no_lse")
        ),
        # vLLM's fork of FlashAttention names the LSE flag return_softmax_lse.
        Modelled("FlashAttention-3 (lse_flag)", fa3_module("lse_flag").flash_attn_varlen_func, "vllm.vllm_flash_attn",
                 "flash_attn_varlen_func"),
        Modelled("FlashAttention-2", fa2_module().flash_attn_varlen_func, "flash_attn", "flash_attn_varlen_func"),
    ]  # fmt: skip


# --- a measured cost table ---------------------------------------------------------------------------------

#: A stand-in GPU's host cost per call (µs) of each backend: TRITON cheapest to call, FLASHINFER dearest.
STANDIN_HOST_US = {"FLASHINFER": 30.0, "FLASH_ATTN": 15.0, "TRITON": 5.0}
#: Its device time per unit of :meth:`mla_ops.cost_table.SizeClass.work` (µs): FLASHINFER the fastest kernels.
STANDIN_DEVICE_US_PER_WORK = {"FLASHINFER": 1e-6, "FLASH_ATTN": 1.5e-6, "TRITON": 2e-6}
#: Its device time of the smallest call (µs), the launch latency.
STANDIN_LAUNCH_US = 3.0


def standin_device_us(backend: str, size: Any) -> float:
    """The stand-in GPU's device time of one call of ``size`` (a SizeClass) on ``backend``."""
    return STANDIN_LAUNCH_US + STANDIN_DEVICE_US_PER_WORK[backend] * size.work()


def cost_table(
    sizes: list[Any],
    capability: str = "9.0",
    dims: tuple[int, int] = (192, 128),
    dtype: str = "bfloat16",
    backends: tuple[str, ...] = ("FLASHINFER", "FLASH_ATTN", "TRITON"),
    **fields: Any,
) -> dict[str, Any]:
    """The JSON of a table measured on the stand-in GPU (:data:`STANDIN_HOST_US`, :func:`standin_device_us`) for
    ``sizes`` (SizeClasses), as ``python -m mla_ops tune`` writes it with this machine's versions; ``fields``
    replace top-level fields. Small calls are TRITON's (host-bound), large ones FLASHINFER's."""
    from mla_ops import cost_table as ct

    data = {
        "schema": ct.SCHEMA,
        "gpu": "Stand-in GPU",
        "capability": capability,
        "versions": ct.library_versions(),
        "command": "python -m mla_ops tune (stand-in)",
        "created": "2026-12-05T00:00:00Z",
        "host_us": {b: STANDIN_HOST_US[b] for b in backends},
        "entries": [
            {
                "dtype": dtype,
                "dims": list(dims),
                "path": size.path,
                "class": list(size[1:]),
                "device_us": {b: standin_device_us(b, size) for b in backends},
            }
            for size in sizes
        ],
    }
    data.update(fields)
    return data
