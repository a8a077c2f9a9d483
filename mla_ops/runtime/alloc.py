"""Fresh output tensors for less host time than ``torch.empty`` takes.

:func:`empty` is ``torch.empty_like`` of a cached zero-stride template per shape, dtype and device: the same
result as ``torch.empty`` for more than one element, at about 40 % less host time per eager op call.
Design: docs/design/ops.md (Host time). It imports only torch and :mod:`mla_ops.runtime.capture`.
"""

from __future__ import annotations

import math

import torch

from .capture import is_capturing

__all__ = ["empty", "template"]

#: Templates kept per (shape, dtype, device); past this many (a serving loop meets a new token count
#: per batch) the table starts over, which costs one ``torch.empty`` per shape.
MAX_TEMPLATES = 4096

#: The templates, by ``(shape, dtype, device)``: this module's only state (clearing it is always safe).
TEMPLATES: dict[tuple, torch.Tensor] = {}


def template(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """The template whose ``torch.empty_like`` is ``torch.empty(shape, dtype=dtype, device=device)``, or
    ``None`` where there is none: one element or none (``empty_like`` would keep the template's zero
    strides), or during CUDA-graph capture (a template made there would hold on to the graph's private
    memory pool after the graph is gone). A caller that allocates one shape again and again may keep it."""
    key = (shape, dtype, device)
    found = TEMPLATES.get(key)
    if found is None:
        if math.prod(shape) <= 1 or is_capturing():
            return None
        if len(TEMPLATES) >= MAX_TEMPLATES:
            TEMPLATES.clear()
        # Made in whichever mode: empty_like's result follows the mode of each call, not the template's.
        found = TEMPLATES[key] = torch.empty((), dtype=dtype, device=device).expand(shape)
    return found


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)``: a new contiguous tensor, uninitialised.

    ``shape`` is a tuple of ints. The result is the same as ``torch.empty``'s in shape, strides, dtype
    and device, and, like it, an inference tensor exactly when called under ``torch.inference_mode``.
    """
    found = TEMPLATES.get((shape, dtype, device))
    if found is None:
        found = template(shape, dtype, device)
        if found is None:
            return torch.empty(shape, dtype=dtype, device=device)
    return torch.empty_like(found)
