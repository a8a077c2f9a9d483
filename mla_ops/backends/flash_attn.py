"""FLASH_ATTN: FlashAttention's varlen forward kernel, through the first implementation present.

The chain, best first (the first one that is importable *and* serves the device and head dims wins):

1. ``flash_attn_interface`` (FlashAttention-3, built from flash-attention's ``hopper/``), SM90 only.
   Its kernels take ``Dv != Dqk`` natively, so nothing is padded.
2. ``flash_attn`` (FlashAttention-2), SM80 and newer. Its kernels need one head dim for q, k and v,
   so ``v`` is widened to ``Dqk`` and the output is sliced back to ``Dv``.
3. PyTorch's bundled FlashAttention-2, ``torch.ops.aten._flash_attention_forward`` (present in CUDA
   builds of torch), widened the same way.

Widening ``v`` without copying it. Attention is linear in the columns of ``v``: output column ``c``
is ``P @ v[:, c]``, where ``P`` depends on ``q`` and ``k`` only. The columns added to reach ``Dqk``
therefore only feed output columns that are sliced away, and they may hold anything, even NaN. In
MLA, ``v`` is usually a view such as ``kv_nope[..., 128:]`` of a ``[T, H, 256]`` tensor, so the
storage holds ``Dqk - Dv`` readable elements right before (or after) every row of ``v``; a wider
``as_strided`` window over the same storage is then a valid ``[T, H, Dqk]`` input and costs nothing.
Otherwise ``v`` is copied once into a zero-padded ``[T, H, Dqk]`` buffer.

Every implementation reads ``cu_seqlens`` on the device and treats ``max_seqlen`` as an upper bound
(it only sizes the launch grid), so this backend never synchronises with the host and can be
captured in a CUDA graph with ``max_seqlen`` set to the token budget.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..config import DEEPSEEK_V3, DeviceCapability, MLADimensions, SelectorConfig
from .base import PrefillBackend

_SM80 = DeviceCapability(8, 0)
_SM90 = DeviceCapability(9, 0)

# FlashAttention loads tiles with 16-byte vector copies, so every row and head must start on a
# 16-byte boundary: the base pointer and the token and head strides (in bytes) must be multiples of 16.
_ALIGN_BYTES = 16


# --- what each implementation serves ------------------------------------------------------------


@dataclass(frozen=True)
class _Kind:
    """One link of the chain: its name, and the devices and head dims its kernels serve."""

    name: str
    label: str
    pads_v: bool

    def capability_reason(self, capability: DeviceCapability) -> str | None:
        """Why this implementation has no kernels for ``capability``, or ``None`` when it has."""
        if not self.pads_v:
            # flash-attention hopper/flash_api.cpp: "Only Hopper supports different V headdim".
            if capability != _SM90:
                return f"{self.label} needs compute capability 9.0 (Hopper), got {capability}"
            return None
        if capability < _SM80:
            return f"{self.label} needs compute capability 8.0 or newer, got {capability}"
        return None

    def dim_reasons(self, dqk: int, dv: int) -> list[str]:
        """Why this implementation cannot serve ``(Dqk, Dv)`` heads (empty when it can)."""
        if not self.pads_v:
            # flash-attention hopper/flash_api.cpp (mha_fwd, FlashAttention-3 3.0.x): head_size and
            # head_size_v must be multiples of 8 (16-bit dtypes), head_size <= 256, and
            # "If V headdim is different from Q/K dim, we only support Q/K headdim in (128, 192] and V
            # headdim in (96, 128], or (Q/K <= 64 and V <= 512)".
            reasons = []
            if dqk % 8 or dv % 8:
                reasons.append(f"{self.label} needs head dims that are multiples of 8")
            if dqk > 256:
                reasons.append(f"{self.label} supports Dqk up to 256")
            elif dv != dqk and not ((128 < dqk <= 192 and 96 < dv <= 128) or (dqk <= 64 and dv <= 512)):
                reasons.append(
                    f"{self.label} supports Dv != Dqk only for Dqk in (128, 192] with Dv in (96, 128], "
                    "or Dqk <= 64 with Dv <= 512"
                )
            return reasons
        # FlashAttention-2 (flash-attn csrc/flash_attn/flash_api.cpp and PyTorch's copy in
        # aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp, mha_varlen_fwd): one head
        # size for q, k and v, "head_size must be a multiple of 8" and "at most 256". The narrower
        # side is padded up to the wider one.
        width = max(dqk, dv)
        if width > 256:
            return [f"{self.label} supports head dims up to 256, and the padded head dim max(Dqk, Dv) is {width}"]
        if width % 8:
            return [f"{self.label} needs the padded head dim max(Dqk, Dv) = {width} to be a multiple of 8"]
        return []


_FA3 = _Kind("flash_attn_interface", "FlashAttention-3 (flash_attn_interface)", pads_v=False)
_FA2 = _Kind("flash_attn", "FlashAttention-2 (flash_attn)", pads_v=True)
_BUNDLED = _Kind(
    "torch.ops.aten._flash_attention_forward",
    "PyTorch's bundled FlashAttention-2 (torch.ops.aten._flash_attention_forward)",
    pads_v=True,
)
_KINDS = (_FA3, _FA2, _BUNDLED)


# --- shared tensor plumbing -----------------------------------------------------------------------


def _is_aligned(t: torch.Tensor, element_offset: int = 0) -> bool:
    """Whether every ``[token, head]`` row of ``t`` (shifted by ``element_offset``) starts on 16 bytes."""
    size = t.element_size()
    if (t.data_ptr() + element_offset * size) % _ALIGN_BYTES:
        return False
    return all(n == 1 or (s * size) % _ALIGN_BYTES == 0 for n, s in zip(t.shape[:-1], t.stride()[:-1]))


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
    label: str,
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
    (csrc/flash_attn/src/flash_fwd_kernel.h, "We exit early and write 0 to gO and gLSE"), and
    FlashAttention-3's ``store_zero`` epilogue writes zeros and ``-inf``. Causal self-attention has no
    such rows (every token sees itself), so that pass only runs for context chunks.
    """
    if out.shape[-1] != dv or not out.is_contiguous():
        out = _columns(out, first, dv)
    if lse.shape != (num_heads, num_tokens) or lse.dtype != torch.float32:
        raise RuntimeError(
            f"{label} returned a softmax LSE of shape {tuple(lse.shape)} and dtype {lse.dtype}; the FLASH_ATTN "
            f"backend reads the varlen layout float32 [H, total_q] = [{num_heads}, {num_tokens}], which older "
            "releases do not use. Upgrade the library, or select another backend with MLA_OPS_PREFILL_BACKEND"
        )
    if not lse.is_contiguous():
        lse = lse.contiguous()
    if not causal:
        # One in-place pass: +inf (no keys) -> -inf; -inf stays; NaN stays NaN so that it is not hidden.
        lse.nan_to_num_(nan=math.nan, posinf=-math.inf, neginf=-math.inf)
    return out, lse


# --- the three adapters -----------------------------------------------------------------------------


class _Adapter:
    """A loaded implementation: the function to call and how to call it."""

    kind: _Kind

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

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        softmax_scale: float,
        causal: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the kernel; inputs and outputs in the package conventions (see :class:`PrefillBackend`)."""
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
        return _finish(self.kind.label, out, lse, num_tokens, num_heads, first, dv, causal)

    def _call(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
        raise NotImplementedError


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


def _load_fa3() -> _Adapter:
    module = importlib.import_module("flash_attn_interface")
    return _FA3Adapter(module.flash_attn_varlen_func, getattr(module, "__version__", None))


def _load_fa2() -> _Adapter:
    module = importlib.import_module("flash_attn")
    return _FA2Adapter(module.flash_attn_varlen_func, getattr(module, "__version__", None))


def _bundled_forward_op() -> Callable[..., Any]:
    """PyTorch's bundled FlashAttention forward op; raises when this torch build has none."""
    if torch.version.cuda is None:
        raise RuntimeError(f"torch {torch.__version__} is not a CUDA build")
    available = getattr(torch.backends.cuda, "is_flash_attention_available", None)
    if available is not None and not available():
        raise RuntimeError(f"torch {torch.__version__} was built without FlashAttention")
    return torch.ops.aten._flash_attention_forward.default


def _load_bundled() -> _Adapter:
    return _BundledAdapter(_bundled_forward_op(), f"torch {torch.__version__}")


@dataclass(frozen=True)
class _Chain:
    present: tuple[_Adapter, ...]
    absent: dict[str, str]  # implementation name -> why it could not be loaded


@functools.cache
def _chain() -> _Chain:
    present: list[_Adapter] = []
    absent: dict[str, str] = {}
    # The loaders are looked up here, at call time, so that tests can substitute them.
    for kind, load in ((_FA3, _load_fa3), (_FA2, _load_fa2), (_BUNDLED, _load_bundled)):
        try:
            present.append(load())
        except Exception as exc:  # a broken install (bad CUDA library, ABI mismatch) is "absent" too
            absent[kind.name] = f"{type(exc).__name__}: {exc}"
    return _Chain(tuple(present), absent)


_routes: dict[tuple[torch.device, int, int], _Adapter] = {}


def reset_implementation_cache() -> None:
    """Forget which FlashAttention implementations were found (e.g. after installing one)."""
    _chain.cache_clear()
    _routes.clear()


def _choose(capability: DeviceCapability | None, dqk: int, dv: int) -> tuple[_Adapter | None, list[str]]:
    """The first present implementation that serves the device and dims, and why earlier ones did not."""
    skipped: list[str] = []
    chain = _chain()
    for kind in _KINDS:
        adapter = next((a for a in chain.present if a.kind is kind), None)
        if adapter is None:
            skipped.append(f"{kind.name}: not available ({chain.absent.get(kind.name, 'not loaded')})")
            continue
        why = kind.capability_reason(capability) if capability is not None else None
        reasons = [why] if why else kind.dim_reasons(dqk, dv)
        if not reasons:
            return adapter, skipped
        skipped.append(f"{kind.name}: {'; '.join(reasons)}")
    return None, skipped


def _adapter_for(q: torch.Tensor, v: torch.Tensor) -> _Adapter:
    key = (q.device, q.shape[-1], v.shape[-1])
    adapter = _routes.get(key)
    if adapter is None:
        adapter, skipped = _choose(DeviceCapability.of(q.device), q.shape[-1], v.shape[-1])
        if adapter is None:
            raise ValueError(
                f"FLASH_ATTN has no implementation for head dims (Dqk={q.shape[-1]}, Dv={v.shape[-1]}) on "
                f"{q.device}: {'; '.join(skipped)}. Select another backend with MLA_OPS_PREFILL_BACKEND"
            )
        _routes[key] = adapter
    return adapter


def _no_keys(q: torch.Tensor, dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The result when no row has a key: ``out`` 0 and ``lse`` ``-inf``."""
    num_tokens, num_heads, _ = q.shape
    out = q.new_zeros((num_tokens, num_heads, dv))
    lse = torch.full((num_heads, num_tokens), -math.inf, dtype=torch.float32, device=q.device)
    return out, lse


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    max_seqlen_q, max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
    # Host-side ints and shapes alone decide these cases (no sync): no tokens, no sequences (the
    # kernels reject a batch of 0), no query rows (a grid of 0 blocks is a launch error), no keys.
    if q.shape[0] == 0 or cu_seqlens_q.shape[0] == 1 or k.shape[0] == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
        return _no_keys(q, v.shape[-1])
    return _adapter_for(q, v).forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, float(softmax_scale), causal
    )


# --- the backend ----------------------------------------------------------------------------------------


class FlashAttnBackend(PrefillBackend):
    """FlashAttention (FA3, FA2, or PyTorch's bundled FA2), whichever is present; see the module docstring."""

    name = "FLASH_ATTN"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            if _chain().present:
                return None
        except Exception as exc:  # never raise from an availability probe
            return f"probing FlashAttention failed: {exc!r}"
        return (
            "none of flash_attn_interface, flash_attn, or a CUDA build of torch with FlashAttention is available; "
            "install flash-attn or a CUDA build of torch"
        )

    # The selection rules judge the whole chain, whatever is installed (configuration_reasons is a pure
    # function of its arguments); validate_configuration then checks what is installed here.

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return any(kind.capability_reason(capability) is None for kind in _KINDS)

    @classmethod
    def mla_dimension_reasons(cls, dims: MLADimensions, capability: DeviceCapability | None) -> list[str]:
        kinds = _KINDS
        if capability is not None:
            kinds = tuple(k for k in kinds if k.capability_reason(capability) is None) or kinds
        dqk, dv = dims.qk_head_dim, dims.v_head_dim
        per_kind = [kind.dim_reasons(dqk, dv) for kind in kinds]
        if any(not reasons for reasons in per_kind):
            return []
        details = "; ".join(r for reasons in per_kind for r in reasons)
        return [f"head dims (Dqk={dqk}, Dv={dv}) are not supported: {details}"]

    @classmethod
    def configuration_reasons(cls, capability: DeviceCapability | None, config: SelectorConfig) -> list[str]:
        reasons = super().configuration_reasons(capability, config)
        if capability is not None and not cls.supports_compute_capability(capability):
            # Say which implementation wants what, instead of the base class's bare sentence.
            generic = f"compute capability {capability} is not supported"
            details = "; ".join(r for r in (kind.capability_reason(capability) for kind in _KINDS) if r is not None)
            reasons = [f"{generic}: {details}" if r == generic else r for r in reasons]
        return reasons

    @classmethod
    def validate_configuration(cls, capability: DeviceCapability | None, config: SelectorConfig) -> list[str]:
        reasons = super().validate_configuration(capability, config)
        if reasons or capability is None:
            return reasons
        # The chain covers this configuration and something is installed; is it the right link?
        dims = config.mla_dimensions
        try:
            adapter, skipped = _choose(capability, dims.qk_head_dim, dims.v_head_dim)
        except Exception as exc:  # validation reports, never raises
            return [f"probing FlashAttention failed: {exc!r}"]
        if adapter is None:
            reasons.append(
                f"no installed FlashAttention implementation serves compute capability {capability} with head dims "
                f"(Dqk={dims.qk_head_dim}, Dv={dims.v_head_dim}): {'; '.join(skipped)}"
            )
        return reasons

    @classmethod
    def implementation(cls, capability: DeviceCapability | None = None, dims: MLADimensions = DEEPSEEK_V3) -> str:
        """Which implementation runs ``dims`` on ``capability`` (default: this machine's GPU), and why."""
        try:
            if capability is None and torch.cuda.is_available():
                capability = DeviceCapability(*torch.cuda.get_device_capability())
            adapter, skipped = _choose(capability, dims.qk_head_dim, dims.v_head_dim)
        except Exception as exc:
            return f"unknown (probing FlashAttention failed: {exc!r})"
        chosen = adapter.describe() if adapter is not None else "none usable"
        return f"{chosen} [skipped: {'; '.join(skipped)}]" if skipped else chosen

    @classmethod
    def prefill(cls, q, k, v, cu_seqlens, max_seqlen, softmax_scale):
        return _attention(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale, causal=True)

    @classmethod
    def prefill_context_chunk(cls, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale):
        return _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal=False)
