"""Replaying a planned FlashInfer wrapper's kernel call without ``run()``'s per-call Python.

:func:`record_run` makes one real ``run()`` call through a recording stand-in for the wrapper's module;
:class:`RecordedRun` repeats that module call with the next call's tensors, once a replay has matched
``run()`` bit for bit. Eager calls only. Design: docs/design/flashinfer.md (Replaying the planned kernel call).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["RecordedRun", "record_run"]

#: Per compiled module (by identity; FlashInfer caches its modules for the process, and the entry keeps
#: the module alive so that its id is not reused): whether a replay reproduced ``run()`` bit for bit.
_verified: dict[int, tuple[Any, bool]] = {}


class RecordedRun:
    """One planned ``run()``'s module call, repeated with new tensors.

    Calling it with ``(q, k, v, out, lse)`` (the shapes, dtypes and device of the recorded call, any
    strides ``run()`` accepts) writes what ``wrapper.run(q, k, v, out=out, lse=lse, return_lse=True)``
    writes: ``out`` ``[n, H, Dv]`` and FlashInfer's base-2 LSE, ``lse`` float32 ``[n, H]``.
    """

    __slots__ = ("args", "fn", "slots")

    def __init__(self, fn: Any, args: list, slots: tuple[int, int, int, int, int]) -> None:
        self.fn = fn
        self.args = args
        self.slots = slots

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
        args = self.args.copy()
        i_q, i_k, i_v, i_out, i_lse = self.slots
        args[i_q], args[i_k], args[i_v], args[i_out], args[i_lse] = q, k, v, out, lse
        self.fn(*args)


class _Recorder:
    """Stands in for a wrapper's compiled module during one ``run()``: forwards every attribute, and
    records the arguments of each ``ragged_run`` call before making it."""

    def __init__(self, module: Any) -> None:
        self._module = module
        self.calls: list[tuple] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def ragged_run(self, *args: Any) -> Any:
        self.calls.append(args)
        return self._module.ragged_run(*args)


def _slots(args: tuple, tensors: tuple[torch.Tensor, ...]) -> tuple[int, int, int, int, int] | None:
    """Where each of ``tensors`` stands in ``args``: exactly once each, or ``None``."""
    slots = []
    for t in tensors:
        found = [i for i, a in enumerate(args) if a is t]
        if len(found) != 1:
            return None
        slots.append(found[0])
    return tuple(slots)  # type: ignore[return-value]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers of its width, so that equal NaNs compare equal."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _replay_matches(run: RecordedRun, q, k, v, out: torch.Tensor, lse: torch.Tensor) -> bool:
    """Whether replaying ``run`` into fresh buffers reproduces ``out`` and ``lse`` exactly (one sync)."""
    out2, lse2 = torch.empty_like(out), torch.empty_like(lse)
    run(q, k, v, out2, lse2)
    return torch.equal(_bits(out2), _bits(out)) and torch.equal(_bits(lse2), _bits(lse))


def record_run(
    wrapper: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
) -> RecordedRun | None:
    """``wrapper.run(q, k, v, out=out, lse=lse, return_lse=True)``, recorded for replay.

    ``out`` is ``[n, H, Dv]`` contiguous, ``lse`` a contiguous float32 ``[n, H]`` buffer. Runs the call
    whatever happens; returns the :class:`RecordedRun` that repeats it, or ``None`` where replaying
    cannot be trusted (see the module docstring). The first recording of a module synchronises the
    device once, to compare its replay with ``run()``.
    """
    module = getattr(wrapper, "_cached_module", None)
    if module is None or not callable(getattr(module, "ragged_run", None)):
        wrapper.run(q, k, v, out=out, lse=lse, return_lse=True)
        return None
    recorder = _Recorder(module)
    wrapper._cached_module = recorder
    try:
        wrapper.run(q, k, v, out=out, lse=lse, return_lse=True)
    finally:
        wrapper._cached_module = module
    slots = _slots(recorder.calls[0], (q, k, v, out, lse)) if len(recorder.calls) == 1 else None
    if slots is None:
        return None
    args = list(recorder.calls[0])
    for i in slots:  # kept by the plan for the life of the batch: hold no reference to this call's tensors
        args[i] = None
    run = RecordedRun(module.ragged_run, args, slots)
    entry = _verified.get(id(module))  # the entry keeps its module alive: an id found is this module's
    if entry is None:
        entry = _verified[id(module)] = (module, _replay_matches(run, q, k, v, out, lse))
    return run if entry[1] else None
