"""The interface every MLA prefill backend implements.

A backend is an object. The registry creates one per process (``PrefillBackendEnum.X.backend()``), the
selector hands it to the ops, and whatever state it keeps lives on it. A test builds its own instance around
a stand-in library and installs it with :func:`mla_ops.selector.backend_installed`.

A backend writes:

- the class attributes below;
- :meth:`PrefillBackend.attention`, one method for both paths (``causal`` tells them apart), and, where
  the library's own LSE is base 2, :meth:`~PrefillBackend.attention_for_merge`, which may skip converting it;
- where ``dtypes`` lists :data:`~mla_ops.specs.FP8_DTYPE`, :meth:`~PrefillBackend.attention_fp8`;
- where the defaults do not fit, the reason hooks :meth:`~PrefillBackend.capability_reasons`,
  :meth:`~PrefillBackend.dtype_reasons`, :meth:`~PrefillBackend.head_dim_reasons` and
  :meth:`~PrefillBackend.library_reasons`, each returning
  a list of reasons a user can act on (empty: fine). Only this base class composes them;
- :meth:`~PrefillBackend.describe`, and :meth:`~PrefillBackend.warmup`,
  :meth:`~PrefillBackend.plan_cuda_graph`, :meth:`~PrefillBackend.release_cuda_graph_state` where it
  compiles just in time or plans on the host.

Design: docs/design/backends.md.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import ClassVar, NamedTuple

import torch

from ..specs import SUPPORTED_DTYPES, DeviceCapability, SelectorConfig

_SM80 = DeviceCapability(8, 0)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


class VarlenCall(NamedTuple):
    """One ragged attention call, as the ops hand it to a backend (and to the native library) once its inputs
    are validated: the argument list of both ops' paths, in one value.

    ``q`` ``[Tq, H, Dqk]``, ``k`` ``[Tk, H, Dqk]``, ``v`` ``[Tk, H, Dv]`` (bf16 or fp16, last-dimension stride
    1, one device); ``cu_seqlens_q``/``cu_seqlens_k`` int32 ``[B+1]`` offsets; ``max_seqlen_q``/``max_seqlen_k``
    upper bounds of the sequences' lengths; ``softmax_scale`` the scale of ``q @ k^T``. ``causal=True`` is the
    new-tokens path: ``k``/``v`` are the new tokens themselves and ``cu_seqlens_k`` is ``cu_seqlens_q`` (the
    same tensor). ``causal=False`` is a context chunk: ``k``/``v`` hold the chunk, packed as ``cu_seqlens_k``
    says, and a sequence may have no keys. Being a tuple, it unpacks in the field order in one step.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    softmax_scale: float
    causal: bool


class MergeCall(NamedTuple):
    """One merge of two partial attention results over disjoint key sets, as the ops hand it to a merge
    function (:mod:`mla_ops.runtime.merge_dispatch`): the argument list of the reference, Triton and native
    merges, in one value.

    ``prefix_out``/``suffix_out`` ``[T, H, Dv]`` bf16 or fp16, last-dimension stride 1; ``prefix_lse``/
    ``suffix_lse`` float32 ``[H, T]``, any strides, where ``-inf`` or ``+inf`` marks a side that attended to no
    key. ``prefix_lse_base2``/``suffix_lse_base2``: that side's LSE is in base 2 (``log2`` of the sum), as some
    libraries return it; the merge converts it (``lse * ln 2``) as it reads it.
    """

    prefix_out: torch.Tensor
    prefix_lse: torch.Tensor
    suffix_out: torch.Tensor
    suffix_lse: torch.Tensor
    prefix_lse_base2: bool = False
    suffix_lse_base2: bool = False


#: An input check a merge function calls with a :class:`MergeCall`'s four tensors before it merges them; it
#: raises for inputs it refuses (``mla.merge_attn_states`` passes :func:`mla_ops.meta.checks.check_merge_inputs`).
MergeCheck = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class Fp8Scales(NamedTuple):
    """How an fp8 call's inputs dequantise, and the dtype of its output: the real ``q`` is
    ``q.float() * q_descale[h]`` on head ``h`` (``k`` and ``v`` alike).

    Each descale is float32 ``[H]`` on ``q``'s device, a stride-0 view where the caller gave one factor for
    every head; ``out_dtype`` is bfloat16 or float16.
    """

    q_descale: torch.Tensor
    k_descale: torch.Tensor
    v_descale: torch.Tensor
    out_dtype: torch.dtype


class PrefillBackend(abc.ABC):
    """Base class of the MLA prefill backends."""

    #: The name used in the registry, in ``MLA_OPS_PREFILL_BACKEND`` and in messages.
    name: ClassVar[str] = ""
    #: The dtypes of ``q``/``k``/``v`` the backend takes; :data:`~mla_ops.specs.FP8_DTYPE` among them means
    #: it implements :meth:`attention_fp8`.
    dtypes: ClassVar[tuple[torch.dtype, ...]] = SUPPORTED_DTYPES
    #: Whether the backend runs on CPU tensors.
    runs_on_cpu: ClassVar[bool] = False
    #: Whether the backend plans each batch on the host from ``cu_seqlens``. Such a backend needs
    #: :func:`mla_ops.plan_cuda_graph` around manual CUDA graphs, and cannot follow a new batch inside
    #: a CUDA-graph tree, which replays without running Python (see :mod:`mla_ops.runtime.graph_trees`).
    plans_on_host: ClassVar[bool] = False
    #: Whether the native library (:mod:`mla_ops.native`) can repeat the backend's CUDA launches by itself:
    #: the ops then hand it each call's launch (:func:`mla_ops.native.remember_attention`).
    launches_natively: ClassVar[bool] = False
    #: Whether each sequence's ``out`` and ``lse`` are bitwise the same whatever else is in its batch, in the
    #: batch-invariant mode (:mod:`mla_ops.invariance`): only such backends are chosen or forced there.
    batch_invariant: ClassVar[bool] = False
    #: Whether :meth:`attention_fp8` takes key-major values (``v.stride(0) == 1``, as
    #: ``mla_ops.quantize_fp8(v, key_major=True)`` makes them); the fp8 ops give the others ``v.contiguous()``.
    takes_key_major_values: ClassVar[bool] = False

    # --- reason hooks: override what differs -----------------------------------------------------

    def capability_reasons(self, capability: DeviceCapability) -> list[str]:
        """Why the backend has no kernels for a CUDA device of ``capability`` (default: SM80 or newer)."""
        if capability < _SM80:
            return [f"compute capability {capability} is not supported (needs 8.0 or newer)"]
        return []

    def dtype_reasons(self, dtype: torch.dtype, capability: DeviceCapability | None) -> list[str]:
        """Why the backend's kernels do not take ``dtype`` inputs on ``capability`` (default: ``dtypes`` says)."""
        if dtype not in self.dtypes:
            names = ", ".join(dtype_name(d) for d in self.dtypes)
            return [f"dtype {dtype_name(dtype)} is not supported (use {names})"]
        return []

    def head_dim_reasons(self, head_dim_qk: int, head_dim_v: int, capability: DeviceCapability | None) -> list[str]:
        """Why the backend's kernels do not serve ``(Dqk, Dv)`` heads on ``capability`` (``None``: CPU)."""
        return []

    def combination_reasons(self, capability: DeviceCapability, config: SelectorConfig) -> list[str]:
        """Why the backend's kernels for ``config``'s dtype do not serve its head dims on ``capability``, where each
        passes its own rule above (default: none; FLASH_ATTN runs fp8 through one of its implementations only)."""
        return []

    def library_reasons(self, capability: DeviceCapability | None, config: SelectorConfig) -> list[str]:
        """Why what is installed on this machine cannot serve ``config`` (empty: it can).

        Import the library lazily here. The base class catches anything this raises and reports it.
        """
        return []

    # --- composed here only ------------------------------------------------------------------------

    def rule_reasons(self, capability: DeviceCapability | None, config: SelectorConfig) -> list[str]:
        """Why the backend's kernels do not cover ``config`` on ``capability``, whatever is installed.

        A pure function of its arguments: the selection rules that ``info --capability`` prints.
        """
        reasons: list[str] = []
        if capability is None:
            if not self.runs_on_cpu:
                reasons.append("runs on CUDA devices only, not on CPU")
        else:
            reasons += self.capability_reasons(capability)
        reasons += self.dtype_reasons(config.dtype, capability)
        reasons += self.head_dim_reasons(config.head_dim_qk, config.head_dim_v, capability)
        if capability is not None and not reasons:
            reasons += self.combination_reasons(capability, config)
        return reasons

    def reasons(self, capability: DeviceCapability | None, config: SelectorConfig) -> list[str]:
        """Every reason this backend cannot serve ``config`` on ``capability`` here; empty means valid.

        :meth:`rule_reasons` plus what this machine's libraries say. Never raises.
        """
        try:
            library = self.library_reasons(capability, config)
        except Exception as exc:  # an availability probe reports, never raises
            library = [f"availability check failed: {type(exc).__name__}: {exc}"]
        return library + self.rule_reasons(capability, config)

    # --- description and lifecycle -------------------------------------------------------------------
    # The three hooks below are optional no-ops (hence noqa B027): most backends compile nothing ahead
    # of time and plan nothing on the host.

    def describe(self, capability: DeviceCapability | None, config: SelectorConfig) -> str:
        """What the backend runs for ``config`` on ``capability``: one line for ``python -m mla_ops info``."""
        return self.name.lower()

    def warmup(self, device: torch.device, config: SelectorConfig, num_heads: int) -> None:  # noqa: B027
        """Compile or load whatever the backend builds on first use, so that neither the first call
        nor a CUDA-graph capture meets a just-in-time build. Backends without one keep this no-op."""

    def plan_cuda_graph(self, cu_seqlens: torch.Tensor, cu_seqlens_k: Sequence[torch.Tensor]) -> None:  # noqa: B027
        """Plan host-side state for CUDA graphs that read these static offset buffers, with the offsets
        they now hold. Called by :func:`mla_ops.plan_cuda_graph`, before capture and every replay."""

    def release_cuda_graph_state(self) -> None:  # noqa: B027
        """Drop whatever :meth:`plan_cuda_graph` built."""

    # --- execution ---------------------------------------------------------------------------------

    @abc.abstractmethod
    def attention(self, call: VarlenCall) -> tuple[torch.Tensor, torch.Tensor]:
        """Ragged attention of ``call.q`` over ``call.k``/``call.v``, on validated inputs (:class:`VarlenCall`
        gives the shapes and both paths). All tensors sit on one device, and the ops call this with that device
        current
        (:func:`mla_ops.runtime.capture.on_device`), so a library that launches on the current device and
        stream runs where the tensors are; a caller outside the ops does the same.

        Returns ``(out, lse)`` in the package's conventions: ``out`` ``[Tq, H, Dv]`` contiguous in the
        dtype of ``q``; ``lse`` float32 ``[H, Tq]`` contiguous, natural log, ``-inf`` for a row that
        attends to no key. Convert the library's LSE base, layout and empty-row value here, never in
        callers. Rows past ``cu_seqlens_q[-1]`` are padding: their ``out`` is unspecified.
        """

    def attention_for_merge(self, call: VarlenCall) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """:meth:`attention` for a result that goes straight into the merge and nowhere else.

        Returns ``(out, lse, lse_base2)``: ``out`` as :meth:`attention` returns it; ``lse`` float32
        ``[H, Tq]`` of any strides, in base 2 (``log2`` of each row's sum) when ``lse_base2`` is True,
        else natural log, ``-inf`` or ``+inf`` for a row without keys. The merge functions read such an
        LSE directly (their ``*_lse_base2`` keywords), so a library whose LSE is base 2 saves the
        conversion kernel that :meth:`attention` launches. Default: :meth:`attention`, natural log.
        """
        out, lse = self.attention(call)
        return out, lse, False

    def attention_fp8(self, call: VarlenCall, scales: Fp8Scales) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`attention` of fp8 inputs: ``call.q``/``k``/``v`` are :data:`~mla_ops.specs.FP8_DTYPE`, dequantised
        by ``scales`` (:class:`Fp8Scales`); ``out`` is in ``scales.out_dtype``, ``lse`` as :meth:`attention`'s.

        Only backends whose ``dtypes`` list FP8_DTYPE implement it; the selector routes fp8 calls to no other.
        """
        raise NotImplementedError(f"the {self.name} MLA prefill backend has no fp8 kernels")
