"""The interface every MLA prefill backend implements.

A backend is a class with class methods only: it holds no per-call state, so the selector can hand
out the class itself and the op's dispatch costs one dict lookup. Backends that keep device state
(FlashInfer's planned wrappers) keep it in module-level caches behind these methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import torch

from ..config import SUPPORTED_DTYPES, DeviceCapability, MLADimensions, SelectorConfig

if TYPE_CHECKING:
    from ..graphs import GraphBuffer


class PrefillBackend:
    """Base class of the MLA prefill backends.

    Subclasses set the class attributes and implement :meth:`prefill`, :meth:`prefill_context_chunk`,
    and, where the defaults do not fit, :meth:`supports_compute_capability`,
    :meth:`mla_dimension_reasons` and :meth:`unavailable_reason`.

    Execution methods receive validated tensors in the package's conventions (see README) and must
    return ``(out, lse)``: ``out`` ``[T, H, Dv]`` contiguous in the dtype of ``q``; ``lse`` float32,
    natural log, ``[H, T]`` contiguous, ``-inf`` for rows that attend to no key.
    """

    #: The name used in the registry, in ``MLA_OPS_PREFILL_BACKEND`` and in messages.
    name: ClassVar[str] = ""
    #: The dtypes the backend computes in.
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = SUPPORTED_DTYPES
    #: When set, the only MLA dimensions the backend serves (the seed's "requires R1 dimensions").
    required_mla_dimensions: ClassVar[MLADimensions | None] = None
    #: Whether the backend runs on CPU tensors.
    supports_cpu: ClassVar[bool] = False
    #: Whether the backend plans each batch on the host from ``cu_seqlens``. Such a backend needs
    #: :func:`mla_ops.plan_cuda_graph` around manual CUDA graphs, and under CUDA-graph trees its ops
    #: must run between the graphs (:func:`mla_ops.compile_options`), since a tree replays without
    #: running any Python that could plan.
    plans_on_host: ClassVar[bool] = False

    # --- capability and configuration -----------------------------------------------------------

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        """Whether the backend has kernels for a CUDA device of this capability."""
        return capability >= DeviceCapability(8, 0)

    @classmethod
    def mla_dimension_reasons(cls, dims: MLADimensions, capability: DeviceCapability | None) -> list[str]:
        """Reasons the backend cannot serve these head dimensions on this device (empty: it can)."""
        return []

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why the backend's library cannot be used here, or ``None`` when it can. Never raises."""
        return None

    @classmethod
    def is_available(cls) -> bool:
        """Whether the backend's library is importable and usable here. Never raises."""
        try:
            return cls.unavailable_reason() is None
        except Exception:  # an availability probe must never take the caller down with it
            return False

    @classmethod
    def implementation(cls) -> str:
        """A short description of what the backend runs, shown by ``python -m mla_ops info``."""
        return cls.name.lower()

    @classmethod
    def configuration_reasons(cls, capability: DeviceCapability | None, config: SelectorConfig) -> list[str]:
        """Why the backend's kernels do not cover ``config`` on ``capability``, whatever is installed.

        A pure function of its arguments: the selection rules that ``info --capability`` prints.
        """
        reasons: list[str] = []
        if capability is None:
            if not cls.supports_cpu:
                reasons.append("runs on CUDA devices only, not on CPU")
        elif not cls.supports_compute_capability(capability):
            reasons.append(f"compute capability {capability} is not supported")
        if config.dtype not in cls.supported_dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in cls.supported_dtypes)
            reasons.append(f"dtype {str(config.dtype).removeprefix('torch.')} is not supported (use {names})")
        dims = config.mla_dimensions
        if cls.required_mla_dimensions is not None and dims != cls.required_mla_dimensions:
            reasons.append(f"requires MLA dimensions {tuple(cls.required_mla_dimensions)}, got {tuple(dims)}")
        else:
            reasons.extend(cls.mla_dimension_reasons(dims, capability))
        return reasons

    @classmethod
    def validate_configuration(cls, capability: DeviceCapability | None, config: SelectorConfig) -> list[str]:
        """Every reason this backend cannot serve ``config`` on ``capability`` here; empty means valid.

        ``capability`` is ``None`` for a CPU. This is :meth:`configuration_reasons` plus whether the
        backend's library is usable on this machine.
        """
        try:
            why = cls.unavailable_reason()
        except Exception as exc:  # an availability probe reports, never raises
            why = f"availability check failed: {exc!r}"
        reasons = [why] if why is not None else []
        return reasons + cls.configuration_reasons(capability, config)

    @classmethod
    def warmup(cls, device: torch.device, config: SelectorConfig, num_heads: int) -> None:
        """Compile or load whatever the backend builds on first use, so the first real call is fast.

        Called by ``python -m mla_ops warmup``; backends without a just-in-time step keep this no-op.
        """

    @classmethod
    def plan_cuda_graph(cls, new_tokens: GraphBuffer, chunks: Sequence[GraphBuffer]) -> None:
        """Re-plan host-side state for graphs that read these static offset buffers.

        Called by :func:`mla_ops.plan_cuda_graph` before capture and before every replay, with the
        offsets now in the buffers. Backends that read ``cu_seqlens`` on the device keep this no-op.
        """

    @classmethod
    def release_cuda_graph_state(cls) -> None:
        """Drop whatever :meth:`plan_cuda_graph` built."""

    # --- execution ------------------------------------------------------------------------------

    @classmethod
    def prefill(
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        softmax_scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal attention of each packed sequence over itself.

        Shapes: ``q``/``k`` ``[T, H, Dqk]``, ``v`` ``[T, H, Dv]``, ``cu_seqlens`` int32 ``[B+1]``.
        Returns ``out`` ``[T, H, Dv]`` and ``lse`` float32 ``[H, T]``.
        """
        raise NotImplementedError(f"{cls.name} does not implement prefill")

    @classmethod
    def prefill_context_chunk(
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        softmax_scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Non-causal attention of each sequence's new tokens over its chunk of cached context.

        Shapes: ``q`` ``[Tq, H, Dqk]``, ``k`` ``[Tk, H, Dqk]``, ``v`` ``[Tk, H, Dv]``,
        ``cu_seqlens_q``/``cu_seqlens_k`` int32 ``[B+1]``. Returns ``out`` ``[Tq, H, Dv]`` and
        ``lse`` float32 ``[H, Tq]``.
        """
        raise NotImplementedError(f"{cls.name} does not implement prefill_context_chunk")
