"""The registry of MLA prefill backends.

Each backend lives in its own module and is imported only when first asked for, so that importing
``mla_ops`` never imports FlashInfer, flash-attn or Triton. Adding a backend means adding its module
and one line here (and placing it in the selector's priority lists).
"""

from __future__ import annotations

import enum
import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import PrefillBackend


class PrefillBackendEnum(enum.Enum):
    """Every known backend, mapped to ``"module:Class"`` of its implementation."""

    REFERENCE = "mla_ops.backends.reference:ReferenceBackend"
    TRITON = "mla_ops.backends.triton:TritonBackend"
    FLASH_ATTN = "mla_ops.backends.flash_attn:FlashAttnBackend"
    FLASHINFER = "mla_ops.backends.flashinfer:FlashInferBackend"

    def get_class(self) -> type[PrefillBackend]:
        """Import and return the backend class. Raises ``ImportError`` if its module cannot load."""
        module_name, _, class_name = self.value.partition(":")
        module = importlib.import_module(module_name)
        return getattr(module, class_name)

    @classmethod
    def from_name(cls, name: str) -> PrefillBackendEnum:
        """Look a backend up by name, case-insensitively; raises ``ValueError`` naming the choices."""
        try:
            return cls[name.strip().upper()]
        except KeyError:
            choices = ", ".join(member.name for member in cls)
            raise ValueError(f"unknown MLA prefill backend {name!r}; choose one of: {choices}") from None
