"""TRITON: the package's own varlen flash-attention kernels (:mod:`mla_ops.kernels`).

It reads ``cu_seqlens`` on the device and never synchronises, so it runs unchanged under ``torch.compile``
and inside captured CUDA graphs; :meth:`TritonBackend.warmup` compiles its kernels ahead of time. Triton
itself is imported only when the kernels are first used, so this module imports (and reports why it is
unavailable) without it. Design: docs/design/triton-kernels.md.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable

import torch

from ..invariance import STATE
from ..kernels.configs import AttentionConfig, table_large_batch_config
from ..kernels.triton_compat import gluon_triton_reason
from ..specs import FP8_DTYPE, SUPPORTED_DTYPES, DeviceCapability, SelectorConfig
from .base import Fp8Scales, MergeCall, PrefillBackend, VarlenCall, dtype_name

#: Head sizes the kernel is built for: the QK split and the Dv tile are powers of two up to 256.
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 16
#: fp8 ``tl.dot`` needs the e4m3 tensor cores of Ada (SM89) and newer.
_FP8_CAPABILITY = DeviceCapability(8, 9)


def installed_triton_version() -> str | None:
    """The installed Triton's version, or ``None`` where it does not import."""
    try:
        return importlib.import_module("triton").__version__
    except Exception:
        return None


class TritonBackend(PrefillBackend):
    """Triton varlen attention: causal for new tokens, non-causal for context chunks, ``Dqk != Dv``.

    Serves SM80 and newer (the base class's rule): ``tl.dot`` on 16-bit inputs needs their tensor cores; fp8
    inputs need SM89 or newer.

    Args:
        triton_version: what :meth:`describe` asks for the installed Triton's version (tests pass others).
    """

    name = "TRITON"
    dtypes = (*SUPPORTED_DTYPES, FP8_DTYPE)
    launches_natively = True  # every launch of a known layout is a FixedLaunch (mla_ops.kernels.launch)
    # Programs start at each sequence's first row and loop over its keys alone; in the batch-invariant mode every
    # batch runs one configuration (attention below), where otherwise large batches switch kernel on SM90.
    batch_invariant = True
    # The Gluon kernel reads a one-sequence call's key-major values as they are; attention_triton makes the others
    # token-major.
    takes_key_major_values = True
    _kernel = None  # mla_ops.kernels.attention.attention_triton, once imported

    def __init__(self, triton_version: Callable[[], str | None] = installed_triton_version) -> None:
        self.triton_version = triton_version

    def library_reasons(self, capability: DeviceCapability | None, config: SelectorConfig) -> list[str]:
        try:
            importlib.import_module("triton")
        except ImportError:
            return ["triton is not installed (pip install 'mla_ops[triton]')"]
        return []

    def dtype_reasons(self, dtype: torch.dtype, capability: DeviceCapability | None) -> list[str]:
        if dtype == FP8_DTYPE and capability is not None and capability < _FP8_CAPABILITY:
            return [f"dtype {dtype_name(dtype)} needs compute capability {_FP8_CAPABILITY} or newer (fp8 tensor cores)"]
        return super().dtype_reasons(dtype, capability)

    def head_dim_reasons(self, head_dim_qk: int, head_dim_v: int, capability: DeviceCapability | None) -> list[str]:
        reasons = []
        for label, size in (("qk head dim (qk_nope + qk_rope)", head_dim_qk), ("v head dim", head_dim_v)):
            if size <= 0 or size % HEAD_DIM_MULTIPLE:
                reasons.append(f"{label} {size} is not a positive multiple of {HEAD_DIM_MULTIPLE}")
            elif size > MAX_HEAD_DIM:
                reasons.append(f"{label} {size} exceeds {MAX_HEAD_DIM}")
        return reasons

    def describe(self, capability: DeviceCapability | None, config: SelectorConfig) -> str:
        version = self.triton_version()
        where = f"Triton {version}" if version else "Triton (not installed)"
        text = f"{where}: mla_ops varlen flash-attention forward, QK split into power-of-two dots (192 = 128 + 64)"
        if config.dtype == FP8_DTYPE:
            return text + "; fp8 (e4m3) inputs: this kernel at every size, P @ V in e4m3 (the Gluon kernel has none)"
        dims = config.mla_dimensions
        large = capability is not None and any(
            table_large_batch_config(tuple(capability), dims.qk_head_dim, dims.v_head_dim, causal, config.dtype)
            for causal in (True, False)
        )
        if large and version is not None:
            # Name the kernel that runs large batches here, and why the Gluon one does not where it does not.
            reason = gluon_triton_reason(version)
            if reason is None and not importlib.util.find_spec("triton.experimental.gluon"):
                reason = f"Triton {version} has no Gluon (triton.experimental.gluon)"
            if reason is None:
                text += "; large batches: the Hopper kernel written in Gluon (TMA producer warp, two consumer "
                text += "warpgroups)"
            else:
                text += f"; large batches: this kernel too, not the Hopper kernel written in Gluon: {reason}"
        return text

    def attention(self, call: VarlenCall) -> tuple[torch.Tensor, torch.Tensor]:
        kernel = self._kernel
        if kernel is None:  # imported on first use, then kept: an import statement per call costs a microsecond
            from ..kernels.attention import attention_triton

            kernel = self._kernel = attention_triton
        if STATE.active and call.q.is_cuda:
            return kernel(call, config=_invariant_config(call))
        return kernel(call)

    def attention_fp8(self, call: VarlenCall, scales: Fp8Scales) -> tuple[torch.Tensor, torch.Tensor]:
        from ..kernels.attention import attention_triton

        config = _invariant_config(call) if STATE.active and call.q.is_cuda else None
        return attention_triton(call, config=config, scales=scales)

    def warmup(self, device: torch.device, config: SelectorConfig, num_heads: int) -> None:
        """Compile every kernel variant a model with ``config`` and ``num_heads`` heads will launch.

        Tiny ragged batches run both paths (with contiguous and with strided ``v``, an empty chunk,
        and padding rows), and the merge, so a later CUDA graph capture finds them compiled. Kernel
        arguments that vary per batch (token counts, offsets) are not specialised on, so these
        compilations serve every later batch.
        """
        from ..kernels.attention import attention_triton, gluon_unsupported_reason
        from ..kernels.configs import large_batch_attention_config
        from ..kernels.merge import merge_attn_states_triton

        device = torch.device(device)
        dims = config.mla_dimensions
        dqk, dv = dims.qk_head_dim, dims.v_head_dim
        reasons = self.reasons(DeviceCapability.of(device), config)
        if reasons:
            raise ValueError(f"cannot warm up {self.name} for {config!r} on {device}: {reasons}")
        scale = dqk**-0.5
        gen = torch.Generator(device="cpu").manual_seed(0)
        if config.dtype == FP8_DTYPE:
            self._warmup_fp8(device, dqk, dv, num_heads, gen)
            return

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(device=device, dtype=config.dtype)

        lengths = [3, 0, 5]
        cu = torch.tensor([0, 3, 3, 8], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, 4, 4, 4], dtype=torch.int32, device=device)  # one empty chunk slice
        q, k = rand(20, num_heads, dqk), rand(20, num_heads, dqk)  # 12 padding rows
        kv = rand(20, num_heads, dqk + dv)
        # Large batches (at least TMA_MIN_KEY_ROWS key rows times heads), which these tiny ones are not, may
        # take a configuration of their own (the Gluon kernel on SM90): compile it too, passing it
        # explicitly, for token counts that are and are not multiples of 16 (Triton specialises a
        # descriptor's row count on that).
        large_configs = []
        for causal in (True, False):
            large = large_batch_attention_config(device, dqk, dv, causal, config.dtype)
            if large is not None and gluon_unsupported_reason(q, k, kv[..., dqk:], scale, large) is None:
                large_configs.append((causal, large))
        for v in (rand(20, num_heads, dv), kv[..., dqk:]):
            out, lse = attention_triton(VarlenCall(q, k, v, cu, cu, max(lengths), max(lengths), scale, True))
            out_c, lse_c = attention_triton(VarlenCall(q, k[:4], v[:4], cu, cu_k, max(lengths), 4, scale, False))
            merge_attn_states_triton(MergeCall(out_c, lse_c, out, lse))
            for causal, explicit in large_configs:
                for rows in (12, 16):
                    if causal:
                        attention_triton(
                            VarlenCall(q[:rows], k[:rows], v[:rows], cu, cu, 5, 5, scale, True), config=explicit
                        )
                        continue
                    cu_rows = torch.tensor([0, rows, rows, rows], dtype=torch.int32, device=device)
                    for q_part in (q[:16], q):
                        attention_triton(
                            VarlenCall(q_part, k[:rows], v[:rows], cu, cu_rows, 5, rows, scale, False), config=explicit
                        )
        # An empty chunk tensor (no context in this chunk for any sequence) takes the pointer path.
        empty_k, empty_v = k[:0], v[:0]
        zeros = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
        attention_triton(VarlenCall(q, empty_k, empty_v, cu, zeros, max(lengths), 0, scale, False))
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def _warmup_fp8(self, device: torch.device, dqk: int, dv: int, num_heads: int, gen: torch.Generator) -> None:
        """:meth:`warmup` for fp8 inputs: both paths, contiguous and strided ``v``, per-head and per-tensor factors
        (a per-tensor factor is a stride-0 view, which Triton compiles apart), bfloat16 and float16 outputs; and the
        large-batch table's kernel (the Gluon kernel's fp8 variant on SM90) for each factor and output dtype."""
        from ..kernels.attention import attention_triton, gluon_unsupported_reason
        from ..kernels.configs import large_batch_attention_config

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(device=device, dtype=FP8_DTYPE)

        cu = torch.tensor([0, 3, 3, 8], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, 4, 4, 4], dtype=torch.int32, device=device)
        q, k, kv = rand(20, num_heads, dqk), rand(20, num_heads, dqk), rand(20, num_heads, dqk + dv)
        per_head = torch.ones(num_heads, dtype=torch.float32, device=device)
        per_tensor = per_head[:1].expand(num_heads)
        scale = dqk**-0.5
        large = []
        for causal in (True, False):
            config = large_batch_attention_config(device, dqk, dv, causal, FP8_DTYPE)
            if config is not None and gluon_unsupported_reason(q, k, kv[..., dqk:], scale, config) is None:
                large.append((causal, config))
        for i, v in enumerate((rand(20, num_heads, dv), kv[..., dqk:])):
            for factor in (per_head, per_tensor):
                for out_dtype in (torch.bfloat16, torch.float16):
                    scales = Fp8Scales(factor, factor, factor, out_dtype)
                    attention_triton(VarlenCall(q, k, v, cu, cu, 5, 5, scale, True), scales=scales)
                    attention_triton(VarlenCall(q, k[:4], v[:4], cu, cu_k, 5, 4, scale, False), scales=scales)
                    # The Gluon kernel reads a contiguous transposed copy of either v: its variants differ only in
                    # the factors and the output, while the copy's kernel is compiled for each v's strides.
                    gluon = i == 0 or (factor is per_head and out_dtype == torch.bfloat16)
                    for causal, explicit in large if gluon else ():
                        cu_keys, max_k = (cu, 5) if causal else (cu_k, 4)
                        attention_triton(
                            VarlenCall(q, k, v, cu, cu_keys, 5, max_k, scale, causal), config=explicit, scales=scales
                        )
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def _invariant_config(call: VarlenCall) -> AttentionConfig:
    """The batch-invariant mode's one configuration for ``call``'s device, dims, path and dtype: the switch to the
    large-batch kernel depends on the batch's total key rows, and a sequence's bits on the kernel that computed it."""
    from ..kernels.attention import batch_invariant_config

    q = call.q
    return batch_invariant_config(q.device, q.shape[2], call.v.shape[2], call.causal, q.dtype)
