"""FLASH_ATTN: FlashAttention's varlen forward kernel, through the first implementation present.

The chain, best first: ``flash_attn.cute`` (FlashAttention-4), ``flash_attn_interface`` (FlashAttention-3),
``flash_attn`` (FlashAttention-2) and PyTorch's bundled FlashAttention-2, the last two with ``v`` widened to
``Dqk`` (without a copy where its storage allows). :meth:`FlashAttnBackend.warmup` compiles FlashAttention-4's
variants ahead of CUDA-graph capture. fp8 inputs run through FlashAttention-4 on SM100 (untested on hardware).
Design: docs/design/backends.md (FLASH_ATTN), docs/design/fp8.md.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import inspect
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..runtime.capture import is_capturing, on_device
from ..specs import FP8_DTYPE, SUPPORTED_DTYPES, DeviceCapability, SelectorConfig
from .base import Fp8Scales, PrefillBackend, VarlenCall, dtype_name

_SM80 = DeviceCapability(8, 0)
_SM90 = DeviceCapability(9, 0)

# FlashAttention loads tiles with 16-byte vector copies, so every row and head must start on a
# 16-byte boundary: the base pointer and the token and head strides (in bytes) must be multiples of 16.
_ALIGN_BYTES = 16


# --- what each implementation serves ------------------------------------------------------------


def _fa4_capability(capability: DeviceCapability) -> str | None:
    # flash_attn/cute/interface.py validates head dims for SM90 and SM100/SM110 only
    # (_validate_head_dims); its SM80 and SM120 paths check nothing and are not used here.
    if capability.major in (9, 10, 11):
        return None
    return f"FlashAttention-4 (flash_attn.cute) is used on compute capability 9.x, 10.x and 11.x, got {capability}"


def _fa4_dims(capability: DeviceCapability | None, dqk: int, dv: int) -> list[str]:
    # _validate_head_dims (flash-attn-4 4.0.0b36), with 16-bit inputs (alignment 8): SM90 takes both
    # dims in [8, 256]; SM100/SM110 take both in [8, 128], DeepSeek's (192, 128), (256, 256), and
    # Dv = 512 with Dqk = 64 or 512.
    if dqk % 8 or dv % 8:
        return ["FlashAttention-4 (flash_attn.cute) needs head dims that are multiples of 8"]
    if capability is None or capability.major == 9:
        if 8 <= dqk <= 256 and 8 <= dv <= 256:
            return []
        return ["FlashAttention-4 (flash_attn.cute) on SM90 supports head dims from 8 to 256"]
    if (
        (8 <= dqk <= 128 and 8 <= dv <= 128)
        or (dqk, dv) in ((192, 128), (256, 256))
        or (dv == 512 and dqk in (64, 512))
    ):
        return []
    return [
        "FlashAttention-4 (flash_attn.cute) on SM100 supports head dims up to 128, (192, 128), (256, 256), "
        "and Dv = 512 with Dqk in (64, 512)"
    ]


def _fa3_capability(capability: DeviceCapability) -> str | None:
    # flash-attention hopper/flash_api.cpp: "Only Hopper supports different V headdim".
    if capability != _SM90:
        return f"FlashAttention-3 (flash_attn_interface) needs compute capability 9.0 (Hopper), got {capability}"
    return None


def _fa3_dims(capability: DeviceCapability | None, dqk: int, dv: int) -> list[str]:
    # flash-attention hopper/flash_api.cpp (mha_fwd, FlashAttention-3 3.0.x): head_size and
    # head_size_v must be multiples of 8 (16-bit dtypes), head_size <= 256, and "If V headdim is
    # different from Q/K dim, we only support Q/K headdim in (128, 192] and V headdim in (96, 128],
    # or (Q/K <= 64 and V <= 512)".
    label = "FlashAttention-3 (flash_attn_interface)"
    reasons = []
    if dqk % 8 or dv % 8:
        reasons.append(f"{label} needs head dims that are multiples of 8")
    if dqk > 256:
        reasons.append(f"{label} supports Dqk up to 256")
    elif dv != dqk and not ((128 < dqk <= 192 and 96 < dv <= 128) or (dqk <= 64 and dv <= 512)):
        reasons.append(
            f"{label} supports Dv != Dqk only for Dqk in (128, 192] with Dv in (96, 128], or Dqk <= 64 with Dv <= 512"
        )
    return reasons


def _fa2_capability(label: str) -> Callable[[DeviceCapability], str | None]:
    def rule(capability: DeviceCapability) -> str | None:
        if capability < _SM80:
            return f"{label} needs compute capability 8.0 or newer, got {capability}"
        return None

    return rule


def _fa2_dims(label: str) -> Callable[[DeviceCapability | None, int, int], list[str]]:
    # FlashAttention-2 (flash-attn csrc/flash_attn/flash_api.cpp and PyTorch's copy in
    # aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp, mha_varlen_fwd): one head size
    # for q, k and v, "head_size must be a multiple of 8" and "at most 256". The narrower side is
    # padded up to the wider one.
    def rule(capability: DeviceCapability | None, dqk: int, dv: int) -> list[str]:
        width = max(dqk, dv)
        if width > 256:
            return [f"{label} supports head dims up to 256, and the padded head dim max(Dqk, Dv) is {width}"]
        if width % 8:
            return [f"{label} needs the padded head dim max(Dqk, Dv) = {width} to be a multiple of 8"]
        return []

    return rule


@dataclass(frozen=True)
class _Kind:
    """One link of the chain: its name, and the devices and head dims its kernels serve."""

    name: str
    label: str
    pads_v: bool
    capability_rule: Callable[[DeviceCapability], str | None]
    dims_rule: Callable[[DeviceCapability | None, int, int], list[str]]
    #: Whether its kernels may write an LSE of ``+inf`` for a row that sees no key (FlashAttention-2's
    #: early exit, FlashAttention-3's softmax epilogue in newer trees), which the package's contract
    #: spells ``-inf``; FlashAttention-4 writes ``-inf`` already.
    empty_lse_posinf: bool = False

    def capability_reason(self, capability: DeviceCapability) -> str | None:
        """Why this implementation has no kernels for ``capability``, or ``None`` when it has."""
        return self.capability_rule(capability)

    def dim_reasons(self, capability: DeviceCapability | None, dqk: int, dv: int) -> list[str]:
        """Why this implementation cannot serve ``(Dqk, Dv)`` heads on ``capability`` (empty when it can)."""
        return self.dims_rule(capability, dqk, dv)


_FA2_LABEL = "FlashAttention-2 (flash_attn)"
_BUNDLED_LABEL = "PyTorch's bundled FlashAttention-2 (torch.ops.aten._flash_attention_forward)"
_FA4 = _Kind("flash_attn.cute", "FlashAttention-4 (flash_attn.cute)", False, _fa4_capability, _fa4_dims)
_FA3 = _Kind("flash_attn_interface", "FlashAttention-3 (flash_attn_interface)", False, _fa3_capability, _fa3_dims, True)
_FA2 = _Kind("flash_attn", _FA2_LABEL, True, _fa2_capability(_FA2_LABEL), _fa2_dims(_FA2_LABEL), True)
_BUNDLED = _Kind(
    "torch.ops.aten._flash_attention_forward",
    _BUNDLED_LABEL,
    True,
    _fa2_capability(_BUNDLED_LABEL),
    _fa2_dims(_BUNDLED_LABEL),
    True,
)
_KINDS = (_FA4, _FA3, _FA2, _BUNDLED)


# --- shared tensor plumbing -----------------------------------------------------------------------


def _is_aligned(t: torch.Tensor, element_offset: int = 0) -> bool:
    """Whether every ``[token, head]`` row of ``t`` ``[T, H, D]`` (shifted by ``element_offset``) starts
    on 16 bytes. Runs on every call for q, k and v, so it is written out for three dimensions."""
    size = t.element_size()
    if (t.data_ptr() + element_offset * size) % _ALIGN_BYTES:
        return False
    (tokens, heads, _), (token_stride, head_stride, _) = t.shape, t.stride()
    return (tokens == 1 or token_stride * size % _ALIGN_BYTES == 0) and (
        heads == 1 or head_stride * size % _ALIGN_BYTES == 0
    )


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when FlashAttention can read it, else a contiguous copy (a fresh, aligned allocation)."""
    if _is_aligned(t):
        return t
    return torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)


# Below this many elements the word view's extra Python calls cost more than the copy saves.
_WORD_COPY_MIN_ELEMENTS = 1 << 16


def _as_words(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` reinterpreted as 8-byte words along its last dimension, or ``None`` when that is not possible.

    The padding and slicing copies are strided copies; moving 8-byte words instead of 2-byte elements
    gives the copy kernel a quarter of the elements and fully coalesced 256-byte warp accesses.
    """
    if t.numel() < _WORD_COPY_MIN_ELEMENTS or t.element_size() not in (1, 2, 4):
        return None
    ratio = 8 // t.element_size()
    if t.stride(-1) != 1 or t.shape[-1] % ratio or t.storage_offset() % ratio:
        return None
    if any(s % ratio for s in t.stride()[:-1]):
        return None
    return t.view(torch.int64)


def _pad_columns(t: torch.Tensor, width: int) -> torch.Tensor:
    """A copy of ``t`` ``[N, H, D]`` zero-padded on the right to ``[N, H, width]`` (one pass over ``t``)."""
    out = t.new_empty((*t.shape[:-1], width))
    src = _as_words(t)
    if src is not None and width % (8 // t.element_size()) == 0:
        dst, used = out.view(torch.int64), src.shape[-1]
        dst[..., :used].copy_(src)
        dst[..., used:].zero_()
    else:
        out[..., : t.shape[-1]].copy_(t)
        out[..., t.shape[-1] :].zero_()
    return out


def _columns(t: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """``t[..., first : first + count]`` as a new contiguous tensor."""
    words = _as_words(t)
    ratio = 8 // t.element_size()
    if words is not None and first % ratio == 0 and count % ratio == 0:
        return words[..., first // ratio : (first + count) // ratio].contiguous().view(t.dtype)
    return t[..., first : first + count].contiguous()


def widen_v(v: torch.Tensor, width: int) -> tuple[torch.Tensor, int, str]:
    """``v`` ``[Tk, H, Dv]`` presented as ``[Tk, H, width]``, for kernels that need ``Dv == Dqk``.

    Returns ``(v_wide, first_column, how)``: the output columns ``first_column : first_column + Dv``
    of an attention over ``v_wide`` are the attention over ``v``. ``how`` is ``"window-before"`` or
    ``"window-after"`` when ``v_wide`` is a wider window over ``v``'s own storage (no copy; the extra
    columns hold whatever the storage holds there), ``"copy"`` when ``v`` was copied into a
    zero-padded buffer, and ``"none"`` when ``v`` is already ``width`` wide.
    """
    num_tokens, num_heads, dv = v.shape
    pad = width - dv
    if pad == 0:
        return _aligned(v), 0, "none"
    if num_tokens > 0 and v.stride(-1) == 1:
        offset = v.storage_offset()
        shape = (num_tokens, num_heads, width)
        # The last element a [Tk, H, width] window starting at `start` reaches is start + span + width - 1.
        span = (num_tokens - 1) * v.stride(0) + (num_heads - 1) * v.stride(1)
        if offset >= pad and _is_aligned(v, -pad):
            return v.as_strided(shape, v.stride(), offset - pad), pad, "window-before"
        storage_elements = v.untyped_storage().nbytes() // v.element_size()
        if offset + span + width <= storage_elements and _is_aligned(v):
            return v.as_strided(shape, v.stride(), offset), 0, "window-after"
    return _pad_columns(v, width), 0, "copy"


def _finish(
    kind: _Kind,
    out: torch.Tensor,
    lse: torch.Tensor,
    num_tokens: int,
    num_heads: int,
    first: int,
    dv: int,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bring a kernel's ``(out, lse)`` to the package conventions.

    ``out`` ``[T, H, >= first + Dv]`` -> ``[T, H, Dv]`` contiguous; ``lse`` float32 ``[H, T]`` with
    FlashAttention's ``+inf`` for rows without keys turned into ``-inf``. The output of those rows is
    already 0: FlashAttention-2's early exit writes zeros to O and ``+inf`` to the LSE
    (csrc/flash_attn/src/flash_fwd_kernel.h, "We exit early and write 0 to gO and gLSE"),
    FlashAttention-3's ``store_zero`` epilogue writes zeros and ``-inf`` (its softmax epilogue, in newer
    trees, ``+inf``), and FlashAttention-4 zeroes
    the accumulator of a tile with no key block and writes ``-inf`` for a row whose sum is 0
    (``flash_attn/cute/softmax.py``, ``finalize``). So the ``+inf`` pass runs only for the kinds that
    need it, and only for context chunks: causal self-attention has no such rows (every token sees
    itself).
    """
    if out.shape[-1] != dv or not out.is_contiguous():
        out = _columns(out, first, dv)
    if lse.shape != (num_heads, num_tokens) or lse.dtype != torch.float32:
        raise RuntimeError(
            f"{kind.label} returned a softmax LSE of shape {tuple(lse.shape)} and dtype {lse.dtype}; the FLASH_ATTN "
            f"backend reads the varlen layout float32 [H, total_q] = [{num_heads}, {num_tokens}], which older "
            "releases do not use. Upgrade the library, or select another backend with MLA_OPS_PREFILL_BACKEND"
        )
    if not lse.is_contiguous():
        lse = lse.contiguous()
    if kind.empty_lse_posinf and not causal:
        # One in-place pass: +inf (no keys) -> -inf; -inf stays; NaN stays NaN so that it is not hidden.
        lse.nan_to_num_(nan=math.nan, posinf=-math.inf, neginf=-math.inf)
    return out, lse


# --- the three adapters -----------------------------------------------------------------------------


class _Adapter:
    """A loaded implementation: the function to call and how to call it."""

    kind: _Kind
    #: Whether it runs fp8 inputs with their descale factors (only FlashAttention-4's forward does).
    takes_descales: bool = False

    def __init__(self, function: Callable[..., Any], version: str | None) -> None:
        self.function = function
        self.version = version

    def describe(self) -> str:
        version = f" {self.version}" if self.version else ""
        how = (
            "native Dv != Dqk, no padding"
            if not self.kind.pads_v
            else "v widened to Dqk (a window over its storage when there is room, else one zero-padded copy), "
            "output sliced back to Dv"
        )
        return f"{self.kind.label}{version}: {how}"

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
        """Run the kernel; arguments, outputs and conventions are those of :meth:`PrefillBackend.attention`."""
        num_tokens, num_heads, dqk = q.shape
        dv = v.shape[-1]
        q, k = _aligned(q), _aligned(k)
        first = 0
        if not self.kind.pads_v:
            v = _aligned(v)
        elif dv < dqk:
            v, first, _ = widen_v(v, dqk)
        else:
            # Dv >= Dqk: zero columns added to q and k leave every score q.k unchanged.
            v = _aligned(v)
            if dv > dqk:
                q, k = _pad_columns(q, dv), _pad_columns(k, dv)
        out, lse = self._call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal)
        return _finish(self.kind, out, lse, num_tokens, num_heads, first, dv, causal)

    def _call(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
        raise NotImplementedError


#: The keyword arguments the FlashAttention-4 adapter passes after ``q, k, v``.
_FA4_KEYWORDS = (
    "cu_seqlens_q",
    "cu_seqlens_k",
    "max_seqlen_q",
    "max_seqlen_k",
    "softmax_scale",
    "causal",
    "return_lse",
)


#: The keyword arguments of FlashAttention-4's forward that take fp8 inputs' descale factors.
_FA4_DESCALES = ("q_descale", "k_descale", "v_descale")


def _takes(function: Callable[..., Any], names: tuple[str, ...]) -> bool:
    """Whether ``function`` takes every keyword in ``names``."""
    try:
        params = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    return all(name in params for name in names)


def fa4_forward(interface: Any) -> Callable[..., Any] | None:
    """``interface._flash_attn_fwd`` (``flash_attn.cute.interface``) when it takes ``q, k, v`` first and
    every keyword in :data:`_FA4_KEYWORDS`, else ``None``.

    ``flash_attn_varlen_func`` is this function wrapped in a ``torch.autograd.Function`` that saves
    tensors for a backward the ops never run; calling the forward itself costs less host time per
    call. It returns ``(out, lse, ...)`` in flash-attn-4 4.0.0b36, and the adapter reads only the
    first two; a release whose function differs in the checked ways is called through
    ``flash_attn_varlen_func`` instead.
    """
    function = getattr(interface, "_flash_attn_fwd", None)
    if not callable(function):
        return None
    try:
        params = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return None
    if list(params)[:3] != ["q", "k", "v"] or any(name not in params for name in _FA4_KEYWORDS):
        return None
    return function


class _FA4Adapter(_Adapter):
    """``flash_attn.cute`` (FlashAttention-4, pip ``flash-attn-4``).

    flash-attn-4 4.0.0b36 (flash_attn/cute/interface.py): ``flash_attn_varlen_func(q, k, v, qv=None,
    cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, ..., softmax_scale=None,
    causal=False, ..., return_lse=False, ...)``. With ``return_lse=True`` it returns ``(out, lse)``:
    ``out`` ``[total_q, H, Dv]`` and ``lse`` float32 ``[H, total_q]``, natural log, which are the
    package's conventions already. The adapter calls the forward beneath it, ``forward`` (see
    :func:`fa4_forward`), where the installed release has one it recognises, with the same arguments.
    A kernel variant is compiled by ``cutlass.cute.compile`` when its just-in-time cache misses;
    ``jit`` is that ``cutlass.cute`` module, so that a compile under CUDA-graph capture can be refused
    before it starts.
    """

    kind = _FA4

    def __init__(
        self,
        function: Callable[..., Any],
        version: str | None,
        jit: Any = None,
        forward: Callable[..., Any] | None = None,
    ) -> None:
        super().__init__(function, version)
        self.jit = jit
        self.entry = forward if forward is not None else function
        # Only its forward takes the descale factors (4.0.0b36's public flash_attn_varlen_func takes none).
        self.takes_descales = forward is not None and _takes(forward, _FA4_DESCALES)

    def describe(self) -> str:
        text = super().describe()
        return text if self.entry is self.function else f"{text}; calls its forward without the autograd wrapper"

    def forward_fp8(
        self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, descales
    ):
        """:meth:`forward` of fp8 inputs, ``descales`` the forward's ``q_descale``, ``k_descale`` and ``v_descale``
        (float32 ``[B, H]``); ``out`` is bfloat16, the only output of FlashAttention-4's fp8 kernels."""
        num_tokens, num_heads, _ = q.shape
        q, k, v = _aligned(q), _aligned(k), _aligned(v)
        out, lse = self._call(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, descales
        )
        return _finish(self.kind, out, lse, num_tokens, num_heads, 0, v.shape[-1], causal)

    def _call(
        self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, descales=None
    ):
        def run():
            return self.entry(
                q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal, return_lse=True,
                **(descales or {}),
            )  # fmt: skip

        if self.jit is None or not is_capturing():
            result = run()
        else:
            variant = (
                f"{str(q.dtype).removeprefix('torch.')}, Dqk={q.shape[-1]}, Dv={v.shape[-1]}, causal={causal}, "
                f"{cu_seqlens_q.shape[0] - 1} sequences, max_seqlen_q={max_seqlen_q}"
            )
            with _compile_refused(self.jit, variant):
                result = run()
        return result[0], result[1]


@contextlib.contextmanager
def _compile_refused(jit: Any, variant: str) -> Iterator[None]:
    """Within the block, a just-in-time compile through ``jit.compile`` raises ``RuntimeError``."""
    original = jit.compile

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"FlashAttention-4 would compile a kernel ({variant}) inside CUDA-graph capture, which cannot "
            "load new code. Compile it before capturing: run `python -m mla_ops warmup --backend FLASH_ATTN` "
            "(with --dtype/--dims/--heads of your model), or make one eager call with the same dtype, head "
            "dims, number of sequences and max_seqlen bound as the captured call"
        )

    jit.compile = refuse
    try:
        yield
    finally:
        jit.compile = original


class _FA3Adapter(_Adapter):
    """``flash_attn_interface.flash_attn_varlen_func`` (FlashAttention-3, hopper/).

    Signatures seen in flash-attention's hopper/flash_attn_interface.py:

    - late-2024 trees: ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k,
      max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False, q_descale=None, k_descale=None,
      v_descale=None, window_size=(-1, -1), softcap=0.0, num_splits=1, pack_gqa=None,
      deterministic=False)``, which always returns ``(out, softmax_lse)``;
    - 2025 main: ``(..., max_seqlen_k, seqused_q=None, seqused_k=None, softmax_scale=None,
      causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None, window_size=(-1, -1),
      attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0,
      return_attn_probs=False)``, which returns ``out`` unless ``return_attn_probs=True``, then
      ``(out, softmax_lse)``;
    - forks (vLLM's) name the flag ``return_softmax_lse``.

    So the flag is passed only when the signature has it, and the result's type decides. Varlen
    outputs: ``out`` ``[total_q, H, Dv]``, ``softmax_lse`` float32 ``[H, total_q]``, natural log.
    """

    kind = _FA3

    def __init__(self, function: Callable[..., Any], version: str | None) -> None:
        super().__init__(function, version)
        try:
            parameters = inspect.signature(function).parameters
        except (TypeError, ValueError):  # a builtin without a signature: rely on the result's type
            parameters = {}
        self.lse_flag = next((n for n in ("return_attn_probs", "return_softmax_lse") if n in parameters), None)

    def _call(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
        flags = {self.lse_flag: True} if self.lse_flag else {}
        result = self.function(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            softmax_scale=softmax_scale, causal=causal, **flags,
        )  # fmt: skip
        if isinstance(result, torch.Tensor):
            raise RuntimeError(
                "flash_attn_interface.flash_attn_varlen_func returned only the output, not the softmax LSE "
                "that chunked prefill merges with; upgrade flash-attention's hopper build"
            )
        return result[0], result[1]


class _FA2Adapter(_Adapter):
    """``flash_attn.flash_attn_varlen_func`` (FlashAttention-2).

    flash-attn 2.6 to 2.8 (flash_attn/flash_attn_interface.py): ``flash_attn_varlen_func(q, k, v,
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
    return_attn_probs=False, block_table=None)``. It returns ``out`` ``[total_q, H, D]``, or with
    ``return_attn_probs=True`` ``(out, softmax_lse, S_dmask)`` where ``softmax_lse`` is float32
    ``[H, total_q]`` (natural log; the fake kernel allocates ``(num_heads, total_q)``). ``S_dmask``
    is only computed when ``dropout_p > 0``, so asking for the LSE costs nothing.
    """

    kind = _FA2

    def _call(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
        out, lse, _ = self.function(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            softmax_scale=softmax_scale, causal=causal, return_attn_probs=True,
        )  # fmt: skip
        return out, lse


class _BundledAdapter(_Adapter):
    """``torch.ops.aten._flash_attention_forward``, PyTorch's bundled FlashAttention-2.

    Schema (torch 2.13; 2.6-2.11 have a subset of the keyword-only tail)::

        _flash_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? cum_seq_q,
            Tensor? cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, bool is_causal,
            bool return_debug_mask, *, float? scale=None, SymInt? window_size_left=None,
            SymInt? window_size_right=None, Tensor? seqused_k=None, Tensor? alibi_slopes=None, ...)
            -> (Tensor output, Tensor softmax_logsumexp, Tensor rng_state, Tensor unused,
                Tensor debug_attn_mask)

    Only the positional arguments and ``scale=`` are passed, which every supported torch accepts.
    With ``cum_seq_q`` given it runs ``mha_varlen_fwd``, which allocates ``softmax_lse`` as
    ``{num_heads, total_q}`` float32 (and torch's meta kernel agrees), and, when ``max_k == 0``,
    zero-fills the output and fills the LSE with ``+inf``.
    """

    kind = _BUNDLED

    def _call(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
        # mha_varlen_fwd checks that both offset tensors are contiguous.
        result = self.function(
            q, k, v, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), max_seqlen_q, max_seqlen_k,
            0.0, causal, False, scale=softmax_scale,
        )  # fmt: skip
        return result[0], result[1]


# --- loading the chain ------------------------------------------------------------------------------


def _bundled_forward_op() -> Callable[..., Any]:
    """PyTorch's bundled FlashAttention forward op; raises when this torch build has none."""
    if torch.version.cuda is None:
        raise RuntimeError(f"torch {torch.__version__} is not a CUDA build")
    available = getattr(torch.backends.cuda, "is_flash_attention_available", None)
    if available is not None and not available():
        raise RuntimeError(f"torch {torch.__version__} was built without FlashAttention")
    return torch.ops.aten._flash_attention_forward.default


def _import(kind: _Kind) -> Any:
    """The installed library of ``kind``: a module, or the bundled op."""
    if kind is _BUNDLED:
        return _bundled_forward_op()
    return importlib.import_module(kind.name)


def _adapter(kind: _Kind, library: Any) -> _Adapter:
    if kind is _BUNDLED:
        return _BundledAdapter(library, f"torch {torch.__version__}")
    if kind is _FA4:
        interface = getattr(library, "interface", None)
        try:
            version = importlib.metadata.version("flash-attn-4")
        except importlib.metadata.PackageNotFoundError:
            version = None
        return _FA4Adapter(
            library.flash_attn_varlen_func, version, getattr(interface, "cute", None), fa4_forward(interface)
        )
    adapter_class = _FA3Adapter if kind is _FA3 else _FA2Adapter
    return adapter_class(library.flash_attn_varlen_func, getattr(library, "__version__", None))


@dataclass(frozen=True)
class _Chain:
    present: tuple[_Adapter, ...]
    absent: dict[str, str]  # implementation name -> why it could not be loaded


def _no_keys(q: torch.Tensor, dv: int, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The result when no row has a key: ``out`` 0 (in ``dtype``, by default q's) and ``lse`` ``-inf``."""
    num_tokens, num_heads, _ = q.shape
    out = q.new_zeros((num_tokens, num_heads, dv), dtype=dtype)
    lse = torch.full((num_heads, num_tokens), -math.inf, dtype=torch.float32, device=q.device)
    return out, lse


_NOTHING = (
    "none of flash_attn.cute, flash_attn_interface, flash_attn, or a CUDA build of torch with FlashAttention is "
    "available; install flash-attn-4 (pip install 'mla_ops[flash-attn]'), flash-attn, or a CUDA build of torch"
)


#: Why fp8 calls need FlashAttention-4's forward, for messages.
_FP8_NEEDS = (
    "fp8 inputs need FlashAttention-4 (pip install flash-attn-4) whose forward takes descale factors "
    "(flash_attn.cute.interface._flash_attn_fwd's q_descale, k_descale, v_descale, as in 4.0.0b36)"
)
#: What info says of the fp8 path: no Blackwell GPU has run it here.
FP8_UNTESTED = "fp8: FlashAttention-4's fp8 forward, descales per sequence and head; untested on hardware"

#: flash-attn-4 (4.0.0b36) compiles another scheduler variant for batches of more than 256 sequences
#: (``BIN_BATCH_SEARCH_THRESH`` in flash_attn/cute/interface.py), so warm-up runs a batch this large too.
_FA4_MANY_SEQUENCES = 300


# --- the backend ----------------------------------------------------------------------------------------


class FlashAttnBackend(PrefillBackend):
    """FlashAttention (FA4, FA3, FA2, or PyTorch's bundled FA2), whichever is present; see the module docstring.

    Args:
        libraries: what to use instead of importing, by implementation name (``"flash_attn.cute"``,
            ``"flash_attn_interface"``, ``"flash_attn"``, ``"torch.ops.aten._flash_attention_forward"``):
            a module with ``flash_attn_varlen_func``, or the bundled op; a missing or ``None`` entry is
            absent. Tests install stand-ins this way. By default each implementation is imported when the
            backend is first asked about (``flash_attn.cute`` takes seconds to import).
    """

    name = "FLASH_ATTN"
    # fp8 through FlashAttention-4 on SM100 (dtype_reasons, library_reasons, attention_fp8).
    dtypes = (*SUPPORTED_DTYPES, FP8_DTYPE)
    # Every implementation in the chain computes a sequence's query tiles over its own keys, without splitting
    # them across programs (num_splits=1, the default of FA3 and FA4): nothing in a tile reads another sequence.
    batch_invariant = True

    def __init__(self, libraries: Mapping[str, Any] | None = None) -> None:
        self._libraries = libraries
        self._chain: _Chain | None = None
        self._routes: dict[tuple[torch.device, int, int], _Adapter] = {}

    def chain(self) -> _Chain:
        """The implementations found (loaded once), and why the others are absent."""
        if self._chain is None:
            present: list[_Adapter] = []
            absent: dict[str, str] = {}
            for kind in _KINDS:
                try:
                    if self._libraries is None:
                        library = _import(kind)
                    else:
                        library = self._libraries.get(kind.name)
                        if library is None:
                            raise ImportError(f"{kind.name} is not installed")
                    present.append(_adapter(kind, library))
                except Exception as exc:  # a broken install (bad CUDA library, ABI mismatch) is "absent" too
                    absent[kind.name] = f"{type(exc).__name__}: {exc}"
            self._chain = _Chain(tuple(present), absent)
        return self._chain

    def choose(self, capability: DeviceCapability | None, dqk: int, dv: int) -> tuple[_Adapter | None, list[str]]:
        """The first present implementation that serves the device and dims, and why earlier ones did not."""
        skipped: list[str] = []
        chain = self.chain()
        for kind in _KINDS:
            adapter = next((a for a in chain.present if a.kind is kind), None)
            if adapter is None:
                skipped.append(f"{kind.name}: not available ({chain.absent.get(kind.name, 'not loaded')})")
                continue
            why = kind.capability_reason(capability) if capability is not None else None
            reasons = [why] if why else kind.dim_reasons(capability, dqk, dv)
            if not reasons:
                return adapter, skipped
            skipped.append(f"{kind.name}: {'; '.join(reasons)}")
        return None, skipped

    def pads_v(self, capability: DeviceCapability, config: SelectorConfig) -> bool:
        """Whether the implementation that would run ``config`` here widens ``v`` (a FlashAttention-2)."""
        adapter, _ = self.choose(capability, config.head_dim_qk, config.head_dim_v)
        return adapter is not None and adapter.kind.pads_v

    # The rules judge the whole chain, whatever is installed (rule_reasons is a pure function of its
    # arguments); library_reasons then checks what is installed here.

    def capability_reasons(self, capability: DeviceCapability) -> list[str]:
        details = [r for r in (kind.capability_reason(capability) for kind in _KINDS) if r is not None]
        if len(details) < len(_KINDS):
            return []
        return [f"compute capability {capability} is not supported: {'; '.join(details)}"]

    def dtype_reasons(self, dtype: torch.dtype, capability: DeviceCapability | None) -> list[str]:
        # flash-attn-4 4.0.0b36 asserts compute capability 10.x for fp8 inputs.
        if dtype == FP8_DTYPE and capability is not None and capability.major != 10:
            return [
                f"dtype {dtype_name(dtype)} runs on SM100 (compute capability 10.x) only: FlashAttention-4's fp8 "
                f"kernels are Blackwell's, not {capability}'s"
            ]
        return super().dtype_reasons(dtype, capability)

    def combination_reasons(self, capability: DeviceCapability, config: SelectorConfig) -> list[str]:
        if config.dtype != FP8_DTYPE:
            return []
        dims = _FA4.dim_reasons(capability, config.head_dim_qk, config.head_dim_v)
        return [f"fp8 inputs run on FlashAttention-4 only: {'; '.join(dims)}"] if dims else []

    def head_dim_reasons(self, head_dim_qk: int, head_dim_v: int, capability: DeviceCapability | None) -> list[str]:
        kinds = _KINDS
        if capability is not None:
            kinds = tuple(k for k in kinds if k.capability_reason(capability) is None) or kinds
        per_kind = [kind.dim_reasons(capability, head_dim_qk, head_dim_v) for kind in kinds]
        if any(not reasons for reasons in per_kind):
            return []
        details = "; ".join(r for reasons in per_kind for r in reasons)
        return [f"head dims (Dqk={head_dim_qk}, Dv={head_dim_v}) are not supported: {details}"]

    def library_reasons(self, capability: DeviceCapability | None, config: SelectorConfig) -> list[str]:
        if not self.chain().present:
            return [_NOTHING]
        if capability is None or self.rule_reasons(capability, config):
            return []  # the rules already say why, or there is no device to pick a link for
        adapter, skipped = self.choose(capability, config.head_dim_qk, config.head_dim_v)
        if adapter is not None:
            if config.dtype == FP8_DTYPE and not adapter.takes_descales:
                return [f"{_FP8_NEEDS}; installed: {adapter.describe()}"]
            return []
        return [
            f"no installed FlashAttention implementation serves compute capability {capability} with head dims "
            f"(Dqk={config.head_dim_qk}, Dv={config.head_dim_v}): {'; '.join(skipped)}"
        ]

    def describe(self, capability: DeviceCapability | None, config: SelectorConfig) -> str:
        """Which implementation runs ``config`` on ``capability`` (default: this machine's GPU), and why."""
        try:
            if capability is None and torch.cuda.is_available():
                capability = DeviceCapability(*torch.cuda.get_device_capability())
            adapter, skipped = self.choose(capability, config.head_dim_qk, config.head_dim_v)
        except Exception as exc:
            return f"unknown (probing FlashAttention failed: {exc!r})"
        chosen = adapter.describe() if adapter is not None else "none usable"
        if config.dtype == FP8_DTYPE and adapter is not None and adapter.takes_descales:
            chosen = f"{chosen}; {FP8_UNTESTED}"
        return f"{chosen} [skipped: {'; '.join(skipped)}]" if skipped else chosen

    def warmup(self, device: torch.device, config: SelectorConfig, num_heads: int) -> None:
        """Compile the kernel variants the ops will launch for ``config`` (FlashAttention-4 builds them on
        first use): both paths, with a ``max_seqlen`` bound inside one query tile and one beyond it, with a
        few sequences and with more than 256 (FA4 schedules each of these differently), with contiguous
        and with strided ``v``. Nothing to do for the other implementations, whose kernels are prebuilt."""
        device = torch.device(device)
        reasons = self.reasons(DeviceCapability.of(device), config)
        if reasons:
            raise ValueError(f"cannot warm up {self.name} for {config!r} on {device}: {reasons}")
        dqk, dv = config.head_dim_qk, config.head_dim_v
        gen = torch.Generator(device="cpu").manual_seed(0)
        attend = self.attention
        if config.dtype == FP8_DTYPE:  # unit factors; each call passes them as [B, H], so one variant serves all
            ones = torch.ones(num_heads, dtype=torch.float32, device=device)
            scales = Fp8Scales(ones, ones, ones, torch.bfloat16)

            def attend(call: VarlenCall) -> tuple[torch.Tensor, torch.Tensor]:
                return self.attention_fp8(call, scales)

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(device=device, dtype=config.dtype)

        def offsets(lengths: list[int]) -> torch.Tensor:
            return torch.tensor([0, *lengths], dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)

        # (new tokens, one chunk's slices): three sequences, one with an empty slice; then a batch past
        # flash-attn-4's BIN_BATCH_SEARCH_THRESH (256 sequences), mostly empty ones, as a graph pads them.
        many = _FA4_MANY_SEQUENCES
        batches = [([3, 0, 5], [4, 0, 0]), ([1] * 8 + [0] * (many - 8), [1] * 4 + [0] * (many - 4))]
        q, k, kv = rand(10, num_heads, dqk), rand(10, num_heads, dqk), rand(10, num_heads, dqk + dv)
        scale = dqk**-0.5
        # attention() expects the tensors' device to be current, as the ops make it; so must this.
        with on_device(device):
            for lengths, slices in batches:
                cu, cu_k = offsets(lengths), offsets(slices)
                for v in (rand(10, num_heads, dv), kv[..., dqk:]):
                    for bound in (8, 4096):
                        attend(VarlenCall(q, k, v, cu, cu, bound, bound, scale, True))
                        attend(VarlenCall(q, k[:4], v[:4], cu, cu_k, bound, bound, scale, False))
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def _adapter_for(self, q: torch.Tensor, v: torch.Tensor) -> _Adapter:
        key = (q.device, q.shape[-1], v.shape[-1])
        adapter = self._routes.get(key)
        if adapter is None:
            adapter, skipped = self.choose(DeviceCapability.of(q.device), q.shape[-1], v.shape[-1])
            if adapter is None:
                raise ValueError(
                    f"FLASH_ATTN has no implementation for head dims (Dqk={q.shape[-1]}, Dv={v.shape[-1]}) on "
                    f"{q.device}: {'; '.join(skipped)}. Select another backend with MLA_OPS_PREFILL_BACKEND"
                )
            self._routes[key] = adapter
        return adapter

    def attention(self, call: VarlenCall) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal = call
        max_seqlen_q, max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
        # Host-side ints and shapes alone decide these cases (no sync): no tokens, no sequences (the
        # kernels reject a batch of 0), no query rows (a grid of 0 blocks is a launch error), no keys.
        if q.shape[0] == 0 or cu_seqlens_q.shape[0] == 1 or k.shape[0] == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
            return _no_keys(q, v.shape[-1])
        return self._adapter_for(q, v).forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, float(softmax_scale), causal
        )

    def attention_fp8(self, call: VarlenCall, scales: Fp8Scales) -> tuple[torch.Tensor, torch.Tensor]:
        """FlashAttention-4's fp8 forward (SM100). Its descale factors are per sequence and head (float32
        ``[B, H]``), so the op's per-head ones are repeated over the batch's sequences (``B * H`` floats); its
        output is bfloat16, converted where ``scales.out_dtype`` is float16. Untested on hardware."""
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal = call
        max_seqlen_q, max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
        if q.shape[0] == 0 or cu_seqlens_q.shape[0] == 1 or k.shape[0] == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
            return _no_keys(q, v.shape[-1], scales.out_dtype)
        adapter = self._adapter_for(q, v)
        if not adapter.takes_descales:
            raise ValueError(
                f"FLASH_ATTN cannot run fp8 inputs here: {_FP8_NEEDS}; installed: {adapter.describe()}. Select "
                "another backend with MLA_OPS_PREFILL_BACKEND (TRITON runs fp8 on SM89 and newer)"
            )
        batch = cu_seqlens_q.shape[0] - 1
        descales = {
            name: d.unsqueeze(0).expand(batch, d.shape[0]).contiguous() for name, d in zip(_FA4_DESCALES, scales)
        }
        out, lse = adapter.forward_fp8(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, float(softmax_scale), causal, descales
        )
        if out.dtype != scales.out_dtype:
            out = out.to(scales.out_dtype)
        return out, lse
