"""Launching a compiled Triton kernel again without Triton's per-call dispatch.

``kernel[grid](*args)`` on a ``@triton.jit`` function binds the arguments, computes their
specialisation (pointer alignment, integer divisibility), hashes a cache key, looks the compiled
kernel up and checks its globals: tens of microseconds of Python per launch, which on small eager
batches is the whole cost of the op. :class:`CachedLaunch` does that once per *variant* and then calls
the compiled kernel's launcher directly.

A variant is named by a key that the caller builds, and the key must determine Triton's
specialisation of every argument: the caller puts in it the exact value of every integer argument
that Triton specialises (not only its divisibility), each pointer's 16-byte alignment, the dtypes,
the constexpr values and the launch options. A key finer than Triton's costs a compile that Triton's
cache then answers; a coarser one would launch the wrong binary, so never leave a specialised input
out.

Used only on CUDA tensors whose device is the current device (the launcher, like Triton's own, loads
the kernel into the current context), with a Triton that has the ``knobs`` runtime of 3.4 and newer;
anywhere else every launch goes through the JIT function, as before.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

try:  # Triton >= 3.4: runtime hooks live in triton.knobs
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton: JIT launches only
    _knobs = None

try:
    from torch._C import _cuda_getCurrentRawStream as _current_stream
except ImportError:  # pragma: no cover - a CPU-only build of torch
    _current_stream = None

__all__ = ["CachedLaunch"]


class CachedLaunch:
    """A ``@triton.jit`` kernel whose compiled variants are launched directly after their first launch.

    Args:
        kernel: the ``triton.jit`` function. Its constexpr parameters must all come after the others,
            which is how this package's kernels are written.
    """

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.compiled: dict[tuple, Any] = {}
        params = getattr(kernel, "params", None)  # absent under TRITON_INTERPRET=1: JIT launches only
        self.constexpr_names = [p.name for p in params if p.is_constexpr] if params is not None else []
        self.enabled = params is not None and _knobs is not None and _current_stream is not None
        if self.enabled:
            names = list(inspect.signature(kernel.fn).parameters)
            if names[len(names) - len(self.constexpr_names) :] != self.constexpr_names:
                raise ValueError(f"{kernel.fn.__name__}: constexpr parameters must come last")

    def __call__(
        self,
        key: tuple,
        device: torch.device,
        grid: tuple[int, ...],
        args: tuple,
        constexprs: dict[str, Any],
        **options: Any,
    ) -> None:
        """Launch on ``device`` with ``grid``: ``args`` (the non-constexpr arguments, in order),
        ``constexprs`` (by name) and Triton launch ``options`` (``num_warps``, ``num_stages``)."""
        direct = self.enabled and device.type == "cuda" and device.index == torch.cuda.current_device()
        compiled = self.compiled.get(key) if direct else None
        if compiled is None:
            launched = self.kernel[grid](*args, **constexprs, **options)
            if direct and launched is not None:
                self.compiled[key] = launched
            return
        full = (*args, *(constexprs[name] for name in self.constexpr_names))
        stream = _current_stream(device.index)
        grid_0, grid_1, grid_2 = (*grid, 1, 1)[:3]
        enter, leave = _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook
        metadata = compiled.launch_metadata(grid, stream, *full) if enter is not None else None
        compiled.run(
            grid_0, grid_1, grid_2, stream, compiled.function, compiled.packed_metadata, metadata, enter, leave, *full
        )


def pointer_alignment(*tensors: torch.Tensor | None) -> tuple[bool, ...]:
    """Whether each tensor's data starts on 16 bytes: the alignment Triton specialises pointers on."""
    return tuple(t is not None and t.data_ptr() % 16 == 0 for t in tensors)
