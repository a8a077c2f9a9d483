"""Two facts about tensors and streams that several backends need: whether the current stream is
capturing a CUDA graph, and a tensor's version counter. A leaf module: it imports only torch."""

from __future__ import annotations

import torch


def is_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (``False`` on a CPU-only build of torch)."""
    try:
        return torch.cuda.is_current_stream_capturing()
    except RuntimeError:  # a CPU-only build of torch cannot capture
        return False


def version_of(t: torch.Tensor) -> int | None:
    """The tensor's version counter, or ``None`` for tensors made under ``torch.inference_mode``
    (which have none, so in-place writes to them cannot be detected)."""
    try:
        return t._version
    except RuntimeError:
        return None
