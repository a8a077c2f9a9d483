"""Varlen flash-attention forward for MLA prefill in Triton: the launcher of the kernels.

:func:`attention_triton` is the entry point for every GPU and Triton's interpreter. It resolves the
launch configuration (:mod:`mla_ops.kernels.configs`), hands large batches on Hopper to the Gluon kernel
(:mod:`mla_ops.kernels.attention_sm90`) where that kernel covers the inputs, and launches the ``tl.dot`` kernel
(:mod:`mla_ops.kernels.attention_kernel`) for everything else; a known input layout repeats its launch with only
the tensors' addresses replaced (:data:`LAUNCHES`), and :func:`known_native_launch` describes it for the
native library.
Design: docs/design/triton-kernels.md.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import triton
from triton.runtime.errors import OutOfResources

from ..backends.base import VarlenCall
from ..runtime.alloc import empty, template
from ..runtime.capture import current_cuda_device, on_device
from .attention_kernel import PAD_FILL_BLOCK, SEQ_CHUNK, attn_fwd_kernel
from .configs import (
    CONFIG_ENV_VAR,
    AttentionConfig,
    attention_config,
    config_env_value,
    env_attention_config,
    head_dim_split,
    large_batch_attention_config,
    shrink,
)
from .launch import (
    CachedLaunch,
    FixedLaunch,
    KnownLayout,
    LaunchCache,
    LaunchPlan,
    NativeLaunch,
    Relaunch,
    pointer_alignment,
    remember,
)
from .launch import interpreting as _interpreting
from .programs import program_layout
from .triton_compat import gluon_triton_reason

if TYPE_CHECKING:
    from ..backends.base import Fp8Scales

__all__ = [
    "LAUNCHES",
    "AttentionLaunches",
    "LaunchPlan",
    "attention_triton",
    "batch_invariant_config",
    "head_dim_split",
    "known_native_launch",
    "large_batch_config",
    "launch_plan",
]

_LOG2E = 1.4426950408889634


#: From this many key rows times heads on, a call takes the large-batch table's configuration (on
#: Hopper the Gluon kernel) where one is tabled. Set when that kernel's TMA descriptors were built on the
#: host for every launch: about 55 µs of host time (H200 host, Triton 3.6, 2026-12-01: 82 µs per eager
#: context-chunk call with descriptors, 27 µs without), so that below about 4096 keys at H=16 (512 at
#: H=128) the ``tl.dot`` kernel, relaunched without rebuilding anything, finished first. The kernel now
#: builds them itself and is relaunched too, zeroing its work counter and descriptor scratch (two small
#: memsets) per launch: 58.5 µs of host time per call instead of 255.7 (H200 host, Triton 3.6, 2026-12-05,
#: 1024 new tokens over 8192 keys at H=16, ``attention_triton`` called directly); the crossover is to be
#: measured again. The rule depends on shapes only, so
#: an eager warm-up run and a later CUDA-graph capture of the same shapes launch the same kernel (one
#: first met inside capture would compile there). An explicit configuration (argument or
#: ``MLA_OPS_TRITON_CONFIG``) is launched as given.
TMA_MIN_KEY_ROWS = 1 << 16


@functools.cache
def _sm90_module():
    """:mod:`mla_ops.kernels.attention_sm90`, or ``None`` where this Triton has no Gluon to build it."""
    try:
        from . import attention_sm90
    except ImportError:
        return None
    return attention_sm90


def gluon_unsupported_reason(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, config: AttentionConfig
) -> str | None:
    """Why the Gluon kernel (``config.gluon``) cannot run on these inputs here, or ``None``."""
    if not q.is_cuda:
        return "it runs on CUDA devices only (not in Triton's interpreter)"
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return f"it runs on SM90 (Hopper) GPUs only, not on {torch.cuda.get_device_name(q.device)}"
    reason = gluon_triton_reason(triton.__version__)
    if reason is not None:
        return reason
    module = _sm90_module()
    if module is None:
        return f"Triton {triton.__version__} has no Gluon (triton.experimental.gluon)"
    reason = module.sm90_unsupported_reason(q, k, v, softmax_scale, config.block_n, config.num_stages)
    return None if reason is None else f"it does not cover {reason}"


def _reads_key_major(call: VarlenCall, config: AttentionConfig | None) -> bool:
    """Whether :func:`attention_triton` runs the fp8 ``call``, whose ``v`` is not unit-stride in its channels, on the
    Gluon kernel (``config``, else the default choice) reading ``v`` as it is
    (:func:`~mla_ops.kernels.attention_sm90.values_read_directly`)."""
    q, k, v, cu_seqlens_q, _, _, _, softmax_scale, causal = call
    module = _sm90_module()
    if module is None or not module.values_read_directly(v, cu_seqlens_q.shape[0] - 1):
        return False
    if config is None:
        config = env_attention_config()
    if config is None:
        return large_batch_config(q, k, v, softmax_scale, causal) is not None
    return config.gluon and gluon_unsupported_reason(q, k, v, softmax_scale, config) is None


def large_batch_config(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool
) -> AttentionConfig | None:
    """The large-batch table's configuration that :func:`attention_triton` launches for these inputs by default, or
    ``None`` where its main table's serves them: from :data:`TMA_MIN_KEY_ROWS` key rows times heads, where one is
    tabled for q's device (:func:`~mla_ops.kernels.configs.large_batch_attention_config`, kept per device, dims,
    path and dtype in ``LAUNCHES.large_configs``) and the Gluon kernel covers the inputs."""
    if k.shape[0] * q.shape[1] < TMA_MIN_KEY_ROWS:
        return None
    device, dqk, dv, dtype = q.device, q.shape[2], v.shape[-1], q.dtype
    key = (device, dqk, dv, causal, dtype)
    large_configs = LAUNCHES.large_configs
    if key not in large_configs:
        large_configs[key] = large_batch_attention_config(device, dqk, dv, causal, dtype)
    large = large_configs[key]
    if large is None or gluon_unsupported_reason(q, k, v, softmax_scale, large) is not None:
        return None
    return large


def attention_triton(
    call: VarlenCall,
    *,
    config: AttentionConfig | None = None,
    scales: Fp8Scales | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged (varlen) attention forward with the Triton kernel.

    Args:
        call: the ragged call (:class:`~mla_ops.backends.base.VarlenCall`), whose fields are:
            ``q`` ``[Tq, H, Dqk]``, bfloat16 or float16, any strides with a last-dimension stride of 1;
            ``k`` ``[Tk, H, Dqk]``, same dtype and strides rule; ``v`` ``[Tk, H, Dv]``, same dtype, typically a
            strided view of a wider ``kv`` tensor. ``cu_seqlens_q``, int32 ``[B+1]`` on q's device: sequence
            ``b`` is query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``; rows past ``cu_seqlens_q[-1]`` are
            padding. ``cu_seqlens_k``, int32 ``[B+1]``: its keys are rows ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``
            of k/v (for the new-tokens path, ``cu_seqlens_q`` itself). ``max_seqlen_q``: an upper bound of the
            longest query slice (may be loose; the grid is sized from Tq and B, so a loose bound costs
            nothing). ``max_seqlen_k``: an upper bound of the longest key slice (only orders the programs for
            L2). ``softmax_scale``: multiplier of ``q @ k^T``. ``causal``: mask key ``j`` from query ``i`` of a
            sequence when ``j > i + len_k - len_q``; with ``cu_seqlens_k is cu_seqlens_q`` that is plain causal
            self-attention.
        config: launch configuration; by default ``MLA_OPS_TRITON_CONFIG`` or the table in
            :mod:`mla_ops.kernels.configs` for this device and ``(Dqk, Dv, causal, dtype)``, and for a
            call of at least :data:`TMA_MIN_KEY_ROWS` key rows times heads the large-batch table's
            entry (:func:`~mla_ops.kernels.configs.large_batch_attention_config`: the Gluon kernel on
            SM90) where the inputs suit it. A configuration with ``gluon`` runs
            :func:`mla_ops.kernels.attention_sm90.attention_sm90`; given explicitly, it raises
            ``ValueError`` with the reason where that kernel cannot run.
        scales: for ``float8_e4m3fn`` ``q``, ``k``, ``v`` (on SM89 and newer, or in the interpreter): their
            descale factors and the output's dtype (:class:`~mla_ops.backends.base.Fp8Scales`). Large fp8 calls
            run the Gluon kernel's fp8 variant on SM90 (the large-batch table's fp8 entry), the others the
            ``tl.dot`` kernel.

    Returns:
        ``out`` ``[Tq, H, Dv]`` contiguous in q's dtype (``scales.out_dtype`` for fp8) and ``lse`` float32
        ``[H, Tq]`` contiguous, natural log. Rows with no visible key get ``out = 0`` and ``lse = -inf``.
        Padding rows past ``cu_seqlens_q[-1]`` get ``lse = -inf``; their ``out`` is not written (unspecified).

    Nothing is read back to the host, so the call can be captured in a CUDA graph (once compiled).
    The kernel runs on q's device and that device's current stream, whichever device is current;
    the current device is the same after the call. Triton compiles and loads a kernel once per
    device, so warm up each device before capturing on it.
    """
    q, k, v, _, _, _, _, softmax_scale, causal = call
    num_tokens, num_heads, dqk = q.shape
    dv = v.shape[-1]
    dtype = q.dtype
    if scales is None:
        if dtype not in (torch.bfloat16, torch.float16) or k.dtype != dtype or v.dtype != dtype:
            raise TypeError(
                f"attention_triton: q, k, v must all be bfloat16 or float16, got {q.dtype}, {k.dtype}, {v.dtype}"
            )
        out_dtype = dtype
    else:
        if not dtype == k.dtype == v.dtype == torch.float8_e4m3fn:
            raise TypeError(
                f"attention_triton: with scales, q, k, v must all be float8_e4m3fn, got {q.dtype}, {k.dtype}, {v.dtype}"
            )
        out_dtype = scales.out_dtype
        if v.stride(-1) != 1 and v.numel() and not _reads_key_major(call, config):
            # Key-major values (mla_ops.quantize_fp8(v, key_major=True)) that the Gluon kernel does not read as
            # they are: every other path loads a key's channels contiguous.
            call = call._replace(v=v.contiguous())
            v = call.v
    q_stride, k_stride, v_stride = q.stride(), k.stride(), v.stride()
    usual = (
        dqk % 16 == 0 and 16 <= dqk <= 256 and dv % 16 == 0 and 16 <= dv <= 256
        and q_stride[-1] == 1 and k_stride[-1] == 1
        and (v_stride[-1] == 1 or (v_stride[0] == 1 and scales is not None))  # fp8: key-major, kept just above
    )  # fmt: skip
    if not usual:  # find what is wrong (an empty tensor may have any strides)
        for name, d in (("Dqk", dqk), ("Dv", dv)):
            if d % 16 or not 16 <= d <= 256:
                raise ValueError(f"attention_triton: {name} must be a multiple of 16 from 16 to 256, got {d}")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.numel() and t.stride(-1) != 1 and not (t is v and scales is not None and t.stride(0) == 1):
                raise ValueError(f"attention_triton: {name} must have stride 1 in its last dimension, got {t.stride()}")

    device = q.device
    if num_tokens == 0 or num_heads == 0:
        out_empty = empty((num_tokens, num_heads, dv), out_dtype, device)
        return out_empty, empty((num_heads, num_tokens), torch.float32, device)

    layout, (p_q, p_k, p_v, p_cu_q, p_cu_k), p_descales = _layout(call, config, scales)
    launches = LAUNCHES
    known = launches.known.get(layout)
    if known is not None and device.index == current_cuda_device():  # launches go to the current device
        out, lse = torch.empty_like(known.out_template), torch.empty_like(known.lse_template)
        # Concatenation, not unpacking: with bf16's empty tuple it costs nothing where a starred form builds a list.
        known.launch((p_q, p_k, p_v, out.data_ptr(), lse.data_ptr(), p_cu_q, p_cu_k) + p_descales)  # noqa: RUF005
        return out, lse
    out = empty((num_tokens, num_heads, dv), out_dtype, device)
    lse = empty((num_heads, num_tokens), torch.float32, device)
    if known is not None:  # q's device is not the current one
        with on_device(device):
            known.launch((p_q, p_k, p_v, out.data_ptr(), lse.data_ptr(), p_cu_q, p_cu_k) + p_descales)  # noqa: RUF005
        return out, lse

    key = None
    if config is None:
        config = env_attention_config()
        if config is None:
            key = (device, dqk, dv, causal, dtype)
            config = launches.table_configs.get(key)
            if config is None:
                config = launches.table_configs[key] = attention_config(device, dqk, dv, causal, dtype)
            large = large_batch_config(q, k, v, softmax_scale, causal)
            if large is not None:
                config = large
    if config.gluon:
        if key is None:  # requested explicitly: refused with the reason, never replaced
            reason = gluon_unsupported_reason(q, k, v, softmax_scale, config)
            if reason is not None:
                raise ValueError(
                    f"attention_triton: the Triton attention config {config} asks for the Gluon kernel, but {reason}; "
                    f"drop the 'gluon' flag (e.g. from {CONFIG_ENV_VAR})"
                )
        with on_device(device):
            fixed = launches.launch_sm90(call, out, lse, config, scales)
        _remember(layout, fixed, out, lse)
        return out, lse
    while True:
        try:
            # Triton launches on the current device and its current stream, not on q's device.
            with on_device(device):
                fixed = launches.launch((call, out, lse, config, scales))
            _remember(layout, fixed, out, lse)
            return out, lse
        except OutOfResources as exc:
            # The table is tuned for one GPU; on a smaller one, step down instead of failing. An
            # explicitly requested configuration is reported, not silently replaced.
            smaller = None if key is None else shrink(config)
            if smaller is None:
                raise RuntimeError(
                    f"Triton attention config {config} (BLOCK_M,BLOCK_N,num_warps,num_stages) does not fit this "
                    f"GPU for Dqk={dqk}, Dv={dv}: {exc}. Use a smaller BLOCK_N or num_stages (e.g. via "
                    f"{CONFIG_ENV_VAR})"
                ) from exc
            config = launches.table_configs[key] = smaller


def _remember(layout: tuple, fixed: Relaunch | None, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Keep ``fixed``, the launch that made ``out`` and ``lse``, for the later calls of ``layout``; nothing where the
    launch went through the JIT function (``fixed`` is ``None``: a variant's first launch) or the outputs cannot
    be templated."""
    if fixed is None:
        return
    out_template = template(out.shape, out.dtype, out.device)
    lse_template = template(lse.shape, torch.float32, lse.device)
    if out_template is not None and lse_template is not None:
        remember(LAUNCHES.known, layout, KnownLayout(fixed, out_template, lse_template, False))


def batch_invariant_config(
    device: torch.device, dqk: int, dv: int, causal: bool, dtype: torch.dtype
) -> AttentionConfig:
    """The one configuration that the batch-invariant mode launches for every batch on ``device``:
    ``MLA_OPS_TRITON_CONFIG``'s, else the table's (after any step-down), which calls below
    :data:`TMA_MIN_KEY_ROWS` key rows times heads run anyway, so small batches launch alike in both modes."""
    config = env_attention_config()
    if config is not None:
        return config
    key = (device, dqk, dv, causal, dtype)
    config = LAUNCHES.table_configs.get(key)
    if config is None:
        config = LAUNCHES.table_configs[key] = attention_config(device, dqk, dv, causal, dtype)
    return config


def _layout(call: VarlenCall, config: AttentionConfig | None, scales: Fp8Scales | None = None) -> tuple:
    """``(layout, addresses, descale_addresses)`` of :func:`attention_triton`'s ``call``, ``config`` and ``scales``: the
    key of its known launch, the five inputs' device addresses, and an fp8 call's three descale factors' (empty
    otherwise: a separate tuple, so that a bf16 call's hot path unpacks no starred tuple).

    The layout is everything the launch depends on but the addresses (see :func:`launch_plan`): shapes,
    strides, the inputs' alignment and devices (the outputs are fresh, contiguous and aligned, on q's
    device), the scalars, and what chooses the configuration: an explicit one, else
    MLA_OPS_TRITON_CONFIG's text, else the table for these shapes (whose entry changes only when a
    launch fails, before any layout is remembered). A layout seen before is launched again with only the
    addresses replaced, and without resolving the configuration again. The addresses are passed as
    integers (see FixedLaunch), so the layout records what Triton specialises on or checks in
    them: their 16-byte alignment and devices.
    """
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal = call
    p_q, p_k, p_v = q.data_ptr(), k.data_ptr(), v.data_ptr()
    p_cu_q, p_cu_k = cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr()
    inputs = (
        p_q % 16 == 0, p_k % 16 == 0, p_v % 16 == 0, p_cu_q % 16 == 0, p_cu_k % 16 == 0,
        k.get_device(), v.get_device(), cu_seqlens_q.get_device(), cu_seqlens_k.get_device(),
    )  # fmt: skip
    chooser = config_env_value() if config is None else config
    layout = (
        q.shape, q.stride(), k.shape[0], k.stride(), v.shape[-1], v.stride(), cu_seqlens_q.shape[0],
        max_seqlen_q > 0, max_seqlen_k, softmax_scale, causal, q.dtype, q.device, chooser, inputs,
    )  # fmt: skip
    if scales is None:
        return layout, (p_q, p_k, p_v, p_cu_q, p_cu_k), ()
    descales = scales[:3]
    p_descales = tuple(d.data_ptr() for d in descales)
    fp8 = (scales.out_dtype, *(d.stride(0) for d in descales), *(p % 16 == 0 for p in p_descales))
    return (*layout, fp8, *(d.get_device() for d in descales)), (p_q, p_k, p_v, p_cu_q, p_cu_k), p_descales


#: The tensor behind each leading argument of a plan (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k), as the
#: native launch codes them (``TensorCode`` in ``mla_ops/native/csrc/attention_launch.cpp``).
NATIVE_TENSOR_CODES = (0, 1, 2, 3, 4, 5, 6)


def known_native_launch(call: VarlenCall) -> NativeLaunch | None:
    """The launch that :func:`attention_triton` (with its default configuration) repeats for the layout of
    ``call``'s arguments (:class:`~mla_ops.backends.base.VarlenCall`, as :func:`attention_triton` takes it),
    in the form a launcher in C++ takes (:meth:`FixedLaunch.native_launch`, the tensors
    coded as :data:`NATIVE_TENSOR_CODES`); ``None`` where no launch of the layout is known (none made yet)
    or it cannot be made natively."""
    layout, _, _ = _layout(call, None)
    known = LAUNCHES.known.get(layout)
    return None if known is None else known.launch.native_launch(NATIVE_TENSOR_CODES)


#: How many leading kernel arguments change from call to call: the seven tensors, and for an fp8 call the three
#: descale factors after them.
_LEADING = 7
_LEADING_FP8 = 10


def launch_plan(
    call: VarlenCall,
    out: torch.Tensor,
    lse: torch.Tensor,
    config: AttentionConfig,
    scales: Fp8Scales | None = None,
) -> LaunchPlan:
    """The ``tl.dot`` kernel's arguments, grid, constexprs and options for one call of :func:`attention_triton`:
    its inputs ``call`` (:class:`~mla_ops.backends.base.VarlenCall`), its outputs, its configuration and, for an fp8
    call, its ``scales``.

    The tensors may be CPU stand-ins with the GPU tensors' shapes, strides and alignment, for compiling
    a variant ahead of time on a machine without a GPU (``benchmarks/compile_sm90.py``).
    """
    if config.gluon:
        raise ValueError(f"launch_plan: {config} runs the Gluon kernel (mla_ops.kernels.attention_sm90), not this one")
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal = call
    num_tokens, num_heads, dqk = q.shape
    dv = v.shape[-1]
    d_a, d_b = head_dim_split(dqk)
    d_v = 1 << (dv - 1).bit_length()
    block_m, block_n = config.block_m, config.block_n
    num_seqs = cu_seqlens_q.shape[0] - 1
    # max_seqlen_q only bounds the work, it does not size the grid (see the module docstring).
    programs = program_layout(
        num_tokens, num_heads, num_seqs, max_seqlen_q, max_seqlen_k, (dqk + dv) * q.element_size(), block_m
    )
    num_slots, heads_per_group, num_pad_programs = programs
    grid = programs.grid(num_heads)

    constexprs = dict(
        DQK=dqk, DV=dv, D_A=d_a, D_B=d_b, D_V=d_v, BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=bool(causal), SCALE_NONNEG=softmax_scale >= 0, OVERLAP=config.overlap_softmax,
        UPCAST=_interpreting() and q.dtype == torch.bfloat16, FP8=scales is not None, PAD_FILL=PAD_FILL_BLOCK,
        SEQ_CHUNK=SEQ_CHUNK,
    )  # fmt: skip
    strides = (
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
    )
    # bf16/fp16: no descale factors and no strides of theirs: None, which Triton compiles out, so those variants
    # have the kernel parameters and code they had before fp8 existed.
    descales = (None, None, None) if scales is None else tuple(scales[:3])
    descale_strides = tuple(None if d is None else d.stride(0) for d in descales)
    args = (
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *descales, *strides, lse.stride(0),
        num_tokens, num_heads, num_seqs, num_slots, heads_per_group, num_pad_programs, float(softmax_scale) * _LOG2E,
        *descale_strides,
    )  # fmt: skip
    options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    # Every integer Triton specialises (the strides and the head count) by value, every pointer by alignment.
    alignment = pointer_alignment(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *descales)
    key = (
        q.device.index, q.dtype, out.dtype, num_heads, strides, descale_strides, alignment,
        tuple(constexprs.values()), config.num_warps, config.num_stages,
    )  # fmt: skip
    return LaunchPlan(key, grid, args, constexprs, options, _LEADING if scales is None else _LEADING_FP8)


class AttentionLaunches(LaunchCache):
    """What :func:`attention_triton` keeps between calls in this process: one instance, :data:`LAUNCHES`.

    ``known``: the layouts launched before (see :func:`attention_triton`), their :class:`KnownLayout`; past
    ``MAX_LAYOUTS`` the table starts over. ``table_configs``: the table's configuration per (device, Dqk, Dv,
    causal, dtype), after any step-down forced by the compiler running out of shared memory or registers:
    one dict lookup per call. ``large_configs``: the large-batch configuration per the same key, or ``None``
    where none is tabled. ``launcher``: the ``tl.dot`` kernel's :class:`CachedLaunch`; ``sm90_launcher``: the
    Gluon kernel's, made at its first launch (``None`` before).
    """

    TABLES = ("known", "table_configs", "large_configs")

    def __init__(self) -> None:
        super().__init__()
        self.known: dict[tuple, KnownLayout] = {}
        self.table_configs: dict[tuple, AttentionConfig] = {}
        self.large_configs: dict[tuple, AttentionConfig | None] = {}
        self.launcher = CachedLaunch(attn_fwd_kernel)
        self.sm90_launcher: CachedLaunch | None = None

    def launch(self, plan_args: tuple) -> FixedLaunch | None:
        """Launch the kernel for :func:`launch_plan`'s arguments (call, out, lse, config, scales); returns the
        :class:`FixedLaunch` to launch the same layout with new addresses, or ``None`` where the launch went
        through the JIT function."""
        return self.launcher.launch(launch_plan(*plan_args), plan_args[0].q.device)

    def launch_sm90(
        self,
        call: VarlenCall,
        out: torch.Tensor,
        lse: torch.Tensor,
        config: AttentionConfig,
        scales: Fp8Scales | None = None,
    ) -> Relaunch | None:
        """Launch the Gluon kernel (:mod:`mla_ops.kernels.attention_sm90`, which must cover the call) with
        ``config``'s tile and stages; returns as :meth:`launch` does, the launch called with the seven addresses as
        the ``tl.dot`` kernel's is (:class:`~mla_ops.kernels.attention_sm90.CountedRelaunch` adds the work counter),
        or for an fp8 call (``scales``) with the ten, the descale factors' after them
        (:class:`~mla_ops.kernels.attention_sm90.TransposedRelaunch` also copies the values transposed first)."""
        module = _sm90_module()
        if self.sm90_launcher is None:
            self.sm90_launcher = CachedLaunch(module._attn_fwd_sm90)
        device = call.q.device
        plan = module.sm90_launch(
            call, out, lse, config.block_n, config.num_stages, scales=scales, pingpong=config.pingpong
        )
        fixed = self.sm90_launcher.launch(plan, device)
        if fixed is None:
            return None
        if scales is None:
            return module.CountedRelaunch(fixed, device)
        return module.TransposedRelaunch.of(fixed, call, plan, config.block_n, device)


#: This process's launch state of :func:`attention_triton`.
LAUNCHES = AttentionLaunches()
