"""The registry of MLA prefill backends: their names, their classes, and the process's instances.

Each backend lives in its own module and is imported only when first asked for; no backend module
imports its library at import time, so importing ``mla_ops`` never imports FlashInfer, flash-attn or
Triton. This is the only place that reads the ``"module:Class"`` strings. Adding a backend:
CONTRIBUTING.md (Adding a backend).
"""

from __future__ import annotations

import enum
import importlib

from .base import PrefillBackend


class PrefillBackendEnum(enum.Enum):
    """Every known backend, mapped to ``"module:Class"`` of its implementation."""

    REFERENCE = "mla_ops.backends.reference:ReferenceBackend"
    TRITON = "mla_ops.backends.triton:TritonBackend"
    FLASH_ATTN = "mla_ops.backends.flash_attn:FlashAttnBackend"
    FLASHINFER = "mla_ops.backends.flashinfer:FlashInferBackend"

    def backend_class(self) -> type[PrefillBackend]:
        """Import and return the backend class. Raises ``ImportError`` if its module cannot load."""
        module_name, _, class_name = self.value.partition(":")
        return getattr(importlib.import_module(module_name), class_name)

    def backend(self) -> PrefillBackend:
        """The process's instance of this backend, created on first use."""
        instance = _instances.get(self)
        if instance is None:
            instance = _instances[self] = self.backend_class()()
        return instance

    @classmethod
    def from_name(cls, name: str) -> PrefillBackendEnum:
        """Look a backend up by name, case-insensitively; raises ``ValueError`` naming the choices."""
        try:
            return cls[name.strip().upper()]
        except KeyError:
            choices = ", ".join(member.name for member in cls)
            raise ValueError(f"unknown MLA prefill backend {name!r}; choose one of: {choices}") from None


_instances: dict[PrefillBackendEnum, PrefillBackend] = {}


def created_backends() -> list[PrefillBackend]:
    """The backend instances this process has created so far (only they can hold state)."""
    return list(_instances.values())


def replace_backend(member: PrefillBackendEnum, backend: PrefillBackend | None) -> PrefillBackend | None:
    """Make ``backend`` the process's instance of ``member`` (``None``: create a fresh one on next use).

    Returns the previous instance. Selection caches hold instances: use
    :func:`mla_ops.selector.backend_installed`, which also clears them.
    """
    if backend is not None and backend.name != member.name:
        raise ValueError(f"a {backend.name} backend cannot stand in for {member.name}")
    previous = _instances.pop(member, None)
    if backend is not None:
        _instances[member] = backend
    return previous
