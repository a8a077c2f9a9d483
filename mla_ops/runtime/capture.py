"""Three facts about tensors, streams and devices that several backends need: whether the current
stream is capturing a CUDA graph, a tensor's version counter, and how to launch on a tensor's device.
A leaf module: it imports only torch."""

from __future__ import annotations

import contextlib

import torch

#: ``torch.cuda.current_device()`` without its Python frame and lazy-initialisation check: the C binding
#: it calls, which initialises CUDA itself when needed. ``None`` in a build of torch without CUDA, where
#: no tensor can be on a CUDA device to ask about.
current_cuda_device = getattr(torch._C, "_cuda_getDevice", None)

# One shared no-op context: ``nullcontext`` keeps no state, so it can be entered any number of times.
_NO_SWITCH = contextlib.nullcontext()


#: What ``torch.cuda.is_current_stream_capturing()`` calls, without its Python frame: the C binding (which
#: initialises no CUDA context), or in a build of torch without CUDA a stand-in that raises RuntimeError.
_stream_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)


def is_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (``False`` on a CPU-only build of torch)."""
    if _stream_capturing is None:
        return False
    try:
        return _stream_capturing()
    except RuntimeError:  # a CPU-only build of torch cannot capture
        return False


def version_of(t: torch.Tensor) -> int | None:
    """The tensor's version counter, or ``None`` for tensors made under ``torch.inference_mode``
    (which have none, so in-place writes to them cannot be detected)."""
    try:
        return t._version
    except RuntimeError:
        return None


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """A context in which ``device`` is the current CUDA device; the previous one is restored on exit.

    Kernel libraries launch on the *current* device and on that device's current stream, whatever
    device their tensors live on: Triton's ``JITFunction.run`` asks ``torch.cuda.current_device()``
    for the device to compile for and launch on, and its launcher accepts any pointer that unified
    addressing can resolve, so a tensor on ``cuda:1`` launched while ``cuda:0`` is current runs on the
    wrong GPU, on a stream that is not ordered with ``cuda:1``'s work (or faults). Code that launches
    kernels on tensors that may sit on another GPU enters this context first, as PyTorch's own
    operators do with their device guard.

    A shared no-op when ``device`` is not a CUDA device or is already current (the common case:
    one query of the current device, no switch). Inside CUDA-graph capture on a stream of ``device``
    that device is current already, so nothing changes there either.
    """
    if device.type != "cuda" or device.index is None or device.index == current_cuda_device():
        return _NO_SWITCH
    return torch.cuda.device(device.index)
