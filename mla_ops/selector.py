"""Device-capability selector for MLA prefill backends.

Selection works in three steps:

1. an explicit override (``set_prefill_backend``, the ``prefill_backend`` context manager, or the
   ``MLA_OPS_PREFILL_BACKEND`` environment variable) is validated and used, or it raises;
2. otherwise the priority list of the device's capability family is walked and the first valid
   backend wins; this is cached on ``(capability, config)``;
3. the ops cache the result per ``(device, dtype, Dqk, Dv)``, so a warm call costs one dict lookup.

The capability is an argument everywhere, so tests can simulate any GPU on a CPU-only machine.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator

import torch

from .backends.base import PrefillBackend
from .backends.registry import PrefillBackendEnum
from .config import DeviceCapability, MLADimensions, SelectorConfig

logger = logging.getLogger("mla_ops")

#: Environment variable naming a backend to use instead of automatic selection.
ENV_VAR = "MLA_OPS_PREFILL_BACKEND"

B = PrefillBackendEnum

# Orders follow measurements where we have them; README's performance section cites the figures and a
# benchmark that disagrees changes the order. SM90: benchmarks/results/h200/results.md, where on all 25
# attention shapes FLASHINFER (fa3) beat TRITON, which beat FLASH_ATTN (bundled FlashAttention-2).
_SM90 = [B.FLASHINFER, B.TRITON, B.FLASH_ATTN]
# Not measured here: flash-attn's FA2 is the usual leader on Ampere/Ada, FlashInfer fa2 next.
_SM80 = [B.FLASH_ATTN, B.FLASHINFER, B.TRITON]
# Not measured here. FlashInfer's CUTLASS kernel serves DeepSeek's (192, 128) heads on Blackwell; for
# the (256, 256) heads of the (192, 64, 256) configuration FlashAttention is preferred, as in the seed.
_SM100 = [B.FLASHINFER, B.FLASH_ATTN, B.TRITON]
_SM100_WIDE_HEADS = [B.FLASH_ATTN, B.FLASHINFER, B.TRITON]
_WIDE_HEAD_DIMS = MLADimensions(qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256)

_FAMILIES = "SM80/SM86/SM89 (Ampere, Ada), SM90 (Hopper) and SM100 (Blackwell)"


def backend_priorities(capability: DeviceCapability | None, dims: MLADimensions) -> list[PrefillBackendEnum]:
    """The backends to try, best first, for a device (``None`` for CPU) and MLA dimensions.

    Returns an empty list for a CUDA capability outside the supported families;
    :func:`unsupported_platform_reason` says why.
    """
    if capability is None:
        return [B.REFERENCE]
    if capability.major == 10:
        return list(_SM100_WIDE_HEADS if dims == _WIDE_HEAD_DIMS else _SM100)
    if capability == DeviceCapability(9, 0):
        return list(_SM90)
    if capability.major == 8:
        return list(_SM80)
    return []


def unsupported_platform_reason(capability: DeviceCapability) -> str:
    """Why ``capability`` has no priority list, and what to do about it."""
    return (
        f"no MLA prefill backend priority list for compute capability {capability}; "
        f"automatic selection covers {_FAMILIES}. Set {ENV_VAR} to force a backend that is valid here"
    )


def validate_backend(
    backend: PrefillBackendEnum, capability: DeviceCapability | None, config: SelectorConfig
) -> tuple[type[PrefillBackend] | None, list[str]]:
    """Load ``backend`` and validate it; returns ``(class or None, reasons)``; empty reasons mean valid."""
    try:
        cls = backend.get_class()
        return cls, cls.validate_configuration(capability, config)
    except ImportError:
        return None, ["ImportError"]


# --- explicit override --------------------------------------------------------------------------

_override: PrefillBackendEnum | None = None


def _coerce(name: str | PrefillBackendEnum) -> PrefillBackendEnum:
    return name if isinstance(name, PrefillBackendEnum) else PrefillBackendEnum.from_name(name)


def current_override() -> PrefillBackendEnum | None:
    """The backend forced by the Python API or, failing that, by ``MLA_OPS_PREFILL_BACKEND``."""
    if _override is not None:
        return _override
    name = os.environ.get(ENV_VAR, "").strip()
    return PrefillBackendEnum.from_name(name) if name else None


def set_prefill_backend(name: str | PrefillBackendEnum | None) -> None:
    """Force every later call onto backend ``name`` (``None`` returns to automatic selection).

    The backend is validated when an op first meets a configuration; if it is invalid there the op
    raises ``ValueError`` rather than falling back.
    """
    global _override
    _override = None if name is None else _coerce(name)
    clear_cache()


@contextlib.contextmanager
def prefill_backend(name: str | PrefillBackendEnum) -> Iterator[None]:
    """Context manager form of :func:`set_prefill_backend`; restores the previous setting on exit."""
    previous = _override
    set_prefill_backend(name)
    try:
        yield
    finally:
        set_prefill_backend(previous)


# --- selection ----------------------------------------------------------------------------------


def select_backend(capability: DeviceCapability | None, config: SelectorConfig) -> type[PrefillBackend]:
    """The backend class to run ``config`` on a device of ``capability`` (``None`` for CPU).

    Raises ``ValueError`` if an explicit override is invalid here, or if no backend is valid.
    """
    override = current_override()
    if override is not None:
        cls, reasons = validate_backend(override, capability, config)
        if reasons:
            raise ValueError(
                f"Selected MLA prefill backend {override.name} is not valid for this configuration. Reason: {reasons}"
            )
        assert cls is not None
        logger.info("Using %s MLA prefill backend (explicit override).", override.name)
        return cls
    return _auto_select(capability, config)


@functools.cache
def _auto_select(capability: DeviceCapability | None, config: SelectorConfig) -> type[PrefillBackend]:
    priorities = backend_priorities(capability, config.mla_dimensions)
    if not priorities:
        assert capability is not None
        raise ValueError(
            f"No valid MLA prefill backend found with {config!r}: {unsupported_platform_reason(capability)}."
        )
    all_reasons: dict[str, list[str]] = {}
    for backend in priorities:
        cls, reasons = validate_backend(backend, capability, config)
        if not reasons:
            assert cls is not None
            logger.info("Using %s MLA prefill backend.", backend.name)
            return cls
        all_reasons[backend.name] = reasons
    reasons_str = "{" + ", ".join(f"{name}: [{', '.join(r)}]" for name, r in all_reasons.items()) + "}"
    raise ValueError(f"No valid MLA prefill backend found with {config!r}. Reasons: {reasons_str}.")


# --- per-call routing ---------------------------------------------------------------------------

_routes: dict[tuple[torch.device, torch.dtype, int, int], type[PrefillBackend]] = {}


def backend_for(q: torch.Tensor, v: torch.Tensor) -> type[PrefillBackend]:
    """The backend that runs an op whose inputs are ``q`` ``[T, H, Dqk]`` and ``v`` ``[T, H, Dv]``.

    A warm call is one dict lookup. The override and the environment variable are read when a
    configuration is first seen; :func:`clear_cache` makes the next call read them again.
    """
    backend = _routes.get((q.device, q.dtype, q.shape[-1], v.shape[-1]))
    return route(q.device, q.dtype, q.shape[-1], v.shape[-1]) if backend is None else backend


def route(device: torch.device, dtype: torch.dtype, head_dim_qk: int, head_dim_v: int) -> type[PrefillBackend]:
    """The backend the ops run for tensors on ``device`` of ``dtype`` with these head dims; cached."""
    key = (device, dtype, head_dim_qk, head_dim_v)
    backend = _routes.get(key)
    if backend is None:
        config = SelectorConfig(dtype, MLADimensions.from_head_dims(head_dim_qk, head_dim_v))
        backend = _routes[key] = select_backend(DeviceCapability.of(device), config)
    return backend


def clear_cache() -> None:
    """Forget every cached selection, e.g. after changing ``MLA_OPS_PREFILL_BACKEND``."""
    _routes.clear()
    _auto_select.cache_clear()
