"""Launching a compiled Triton kernel again without Triton's per-call dispatch.

:class:`CachedLaunch` keeps each compiled variant after its first launch and, per layout, the finished
argument list (:class:`FixedLaunch`, :class:`KnownLayout`, kept in a kernel function's :class:`LaunchCache`), so
a repeated call replaces only its tensors; :data:`KNOWN_LAUNCHER_CALLS` names the Triton launchers it may call
directly, :class:`Runtime` is what a launch reads of the running Triton and PyTorch, and :class:`TorchScratch`
supplies device-side descriptors' scratch from PyTorch's allocator.
Design: docs/design/triton-kernels.md (The launcher).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import os
import re
import struct
import textwrap
from collections.abc import Callable, Hashable
from typing import Any, ClassVar, NamedTuple, Protocol

import torch

from ..runtime.capture import current_cuda_device
from .triton_compat import COMPILE_OPTIONS

try:  # Triton >= 3.4: runtime hooks live in triton.knobs
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton: JIT launches only
    _knobs = None

try:  # Triton >= 3.3: the allocator of kernels that need global scratch memory
    from triton.runtime import _allocation
except ImportError:  # pragma: no cover - older Triton: no kernel asks for scratch
    _allocation = None

try:
    from torch._C import _cuda_getCurrentRawStream as _current_stream
except ImportError:  # pragma: no cover - a CPU-only build of torch
    _current_stream = None

__all__ = [
    "NATIVE_COUNTER_CODE",
    "RUNTIME",
    "CachedLaunch",
    "FixedLaunch",
    "KnownLayout",
    "LaunchCache",
    "LaunchPlan",
    "NativeLaunch",
    "Relaunch",
    "Runtime",
    "interpreting",
    "remember",
]


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET`` set and not 0): on CPU tensors, in
    numpy, with no compiled variant to launch directly."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


#: Layouts remembered per kernel; past this many (a serving loop sees a new token count per batch) the
#: table starts over, which costs one slower launch per layout.
MAX_LAYOUTS = 4096


class Runtime:
    """What a launch reads of the running Triton and PyTorch: Triton's ``knobs`` (where its launch hooks are
    installed; ``None`` before Triton 3.4) and ``current_stream(device_index)``, the raw handle of a device's
    current stream (``None`` in a CPU-only build of torch).

    :data:`RUNTIME` is this process's; a :class:`CachedLaunch` or :class:`FixedLaunch` given another (tests
    hand them stand-ins) launches through that one instead.
    """

    __slots__ = ("current_stream", "knobs")

    def __init__(self, knobs: Any = _knobs, current_stream: Callable[[int], int] | None = _current_stream) -> None:
        self.knobs = knobs
        self.current_stream = current_stream

    @property
    def direct(self) -> bool:
        """Whether a compiled variant can be launched without the JIT function: both are there."""
        return self.knobs is not None and self.current_stream is not None

    def hooks(self) -> tuple[Any, Any]:
        """Triton's launch enter/exit hooks, or ``(None, None)`` when none is installed.

        Triton 3.6 keeps them as ``HookChain`` objects that are present even when empty; passing an empty
        chain would make the launcher build launch metadata and call into Python twice for nothing.
        """
        runtime = self.knobs.runtime
        enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
        if getattr(enter, "calls", True) or getattr(leave, "calls", True):
            return enter, leave
        return None, None


#: This process's runtime, read by every launcher unless it is given another.
RUNTIME = Runtime()


#: Alignment of the blocks of PyTorch's CUDA caching allocator.
_TORCH_BLOCK_ALIGNMENT = 512


def _torch_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Triton's allocator protocol: ``size`` bytes aligned to ``alignment`` on the current device,
    allocated on its current stream (the launch's: ``stream`` is that stream's handle), zeroed.

    Zeroed because a descriptor built on the device (``tma.make_tensor_descriptor``) is written field by
    field over what the scratch held: every field is replaced, but the first reads see the allocator's
    leftovers, which compute-sanitizer's initcheck reports (``benchmarks/sanitize.py``). Only the Gluon
    kernel asks for scratch, a few hundred bytes per program, so the memset is one small kernel per launch.
    """
    if alignment <= _TORCH_BLOCK_ALIGNMENT:
        return torch.zeros(size, dtype=torch.uint8, device="cuda")
    buffer = torch.zeros(size + alignment, dtype=torch.uint8, device="cuda")
    offset = -buffer.data_ptr() % alignment
    return buffer[offset : offset + size]


class TorchScratch:
    """Within the block, Triton's launcher allocates kernels' global scratch with :func:`_torch_scratch`.

    Triton keeps its allocator in a context variable (per thread); the previous one is restored on exit.
    A class rather than a ``contextlib.contextmanager`` generator: it runs around launches, where microseconds count.
    """

    __slots__ = ("token",)

    def __enter__(self) -> None:
        self.token = None if _allocation is None else _allocation._allocator.set(_torch_scratch)

    def __exit__(self, *exc: object) -> None:
        if self.token is not None:
            _allocation._allocator.reset(self.token)


#: What a launch of a kernel without scratch runs in instead of :class:`TorchScratch`.
_NO_SCRATCH = contextlib.nullcontext()


def _needs_scratch(compiled: Any) -> bool:
    """Whether a compiled kernel asks its launcher for global scratch memory (device-side descriptors)."""
    return getattr(getattr(compiled, "metadata", None), "global_scratch_size", 0) > 0


#: How a known launcher's ``__call__`` hands the kernel's arguments to its C ``launch``: after the four hook and
#: metadata arguments, one by one (Triton 3.6), or after the scratch buffers and the launcher's argument annotations
#: and signature, as one tuple (3.7 to 3.9).
SPREAD, PACKED = "spread", "packed"

#: SHA-256 of the dedented source of each ``CudaLauncher.__call__`` whose forwarding :meth:`FixedLaunch.__call__`
#: reproduces, with how it forwards. The C ``launch`` takes its arguments positionally, in an order that changes
#: between Triton releases, so any other source is called through ``__call__``.
KNOWN_LAUNCHER_CALLS: dict[str, str] = {
    "ead77febd3d441d474bb8bc0126006c821d25c5ba32235acd60673c9cb83cc78": SPREAD,  # 3.6
    "c1aca52436e131d463ada3a9c2072b5574f11ed211c8f252b1b872f5aa8c4a27": PACKED,  # 3.7
    "6371e159a7f254ac32b6b42c216d73581f90fba1a03f6605bc3e78a4462fb1b5": PACKED,  # 3.8
    "4c93e15e00f89b49707f128c7597ae5d4500b3917a5b4de32c18ee927ed6b7c8": PACKED,  # 3.9
}


@functools.cache
def _forwarding(launcher_cls: type) -> str | None:
    """How ``launcher_cls.__call__`` forwards (:data:`KNOWN_LAUNCHER_CALLS`), or ``None`` for a source not known."""
    try:
        source = textwrap.dedent(inspect.getsource(launcher_cls.__call__))
    except (OSError, TypeError):
        return None
    return KNOWN_LAUNCHER_CALLS.get(hashlib.sha256(source.encode()).hexdigest())


def _native_launch(compiled: Any) -> tuple | None:
    """``(launch, middle, packed)`` of a compiled kernel whose launcher's ``__call__`` is one this module knows
    (:data:`KNOWN_LAUNCHER_CALLS`) and that needs no scratch memory, else ``None``: its C ``launch``, what
    ``__call__`` passes it between the stream and the kernel's arguments when no launch hook is installed, and
    whether those arguments go as one tuple.

    The known ``__call__`` methods only allocate the scratch buffers (none here; 3.8 and 3.9 ask the driver for a
    profile buffer only of a nonzero size) and forward to the C ``launch`` with flags and annotations from the
    launcher (3.8 and 3.9 also add the arguments of Triton's GPU sanitizer when it is on: such a launcher is called
    through ``__call__``); calling ``launch`` directly skips one Python frame and its closures per launch.
    """
    run = getattr(compiled, "run", None)
    style = None if run is None else _forwarding(type(run))
    if style is None or getattr(run, "gsan_enabled", False):
        return None
    try:
        launch, coop, pdl = run.launch, run.launch_cooperative_grid, run.launch_pdl
        scratch = run.global_scratch_size, run.profile_scratch_size
        function, metadata = compiled.function, compiled.packed_metadata
        if style == SPREAD:
            middle = (function, coop, pdl, None, None, metadata, None, None, None)
        else:
            middle = (function, coop, pdl, metadata, None, None, None, None, None, run.arg_annotations,
                      run.kernel_signature)  # fmt: skip
    except AttributeError:
        return None
    return (launch, middle, style == PACKED) if callable(launch) and scratch == (0, 0) else None


#: How the native launch (``mla_ops/native/csrc/attention_launch.cpp``, ``ParamKind``) stores a parameter of each of
#: Triton's scalar types; a pointer parameter is kind 0. A kernel with a parameter of another type is not
#: launched natively.
NATIVE_KINDS = {"i32": 1, "i64": 2, "fp32": 3, "f32": 3, "i1": 4, "i8": 4, "i16": 5, "u32": 6, "u64": 7}
_NATIVE_FLOAT_BITS = 3
_NATIVE_POINTER = 0
#: Bytes the native launch passes for a parameter of each kind (a pointer is 8).
_NATIVE_BYTES = {_NATIVE_POINTER: 8, 1: 4, 2: 8, 3: 4, 4: 1, 5: 2, 6: 4, 7: 8}
#: Bytes of a PTX parameter of each fundamental type.
_PTX_BYTES = {"8": 1, "16": 2, "32": 4, "64": 8}
#: One parameter of a PTX entry: its type (``.u64``, ``.f32``, ``.b8``...), whether it is a pointer, and an
#: array size (a host TMA descriptor's ``.b8 x[128]``).
_PTX_PARAM = re.compile(r"\.param\s+(?:\.align\s+\d+\s+)?\.[a-z](\d+)(\s+\.ptr)?[^,)\[]*(\[\d+\])?")


def native_abi(compiled: Any) -> bool:
    """Whether a compiled kernel takes exactly the parameters a native launch passes: one per argument of its
    signature that is not a constexpr (a pointer, or a scalar of :data:`NATIVE_KINDS` in its width), then two
    pointers, the global and the profile scratch buffers. Read from the kernel's PTX entry, so it holds for
    whatever Triton compiled it (3.6 to 3.9 alike: ``benchmarks/compile_sm90.py`` checks the tabled variants);
    ``False`` where the PTX or the signature is missing or differs.
    """
    asm = getattr(compiled, "asm", None)
    ptx = asm.get("ptx") if hasattr(asm, "get") else None
    signature = getattr(getattr(compiled, "src", None), "signature", None)
    if not isinstance(ptx, str) or not isinstance(signature, dict):
        return False
    entry = ptx.find(".entry")
    start, end = ptx.find("(", entry), ptx.find(")", entry)
    if entry < 0 or not entry < start < end:
        return False
    found = [
        (_PTX_BYTES.get(bits, 0), bool(pointer), bool(array))
        for bits, pointer, array in _PTX_PARAM.findall(ptx[start : end + 1])
    ]
    expected = []
    for kind_name in signature.values():
        if kind_name == "constexpr":
            continue
        pointer = isinstance(kind_name, str) and kind_name.startswith("*")
        kind = _NATIVE_POINTER if pointer else NATIVE_KINDS.get(kind_name)
        if kind is None:
            return False
        expected.append((_NATIVE_BYTES[kind], kind == _NATIVE_POINTER, False))
    expected += [(8, True, False)] * 2  # the scratch buffers
    return found == expected


#: A leading argument's code in a :class:`NativeLaunch` for a fresh zeroed int32 per launch (the Gluon kernel's work
#: counter), after the attention kernels' seven tensor codes (``TensorCode`` in the C++ launcher).
NATIVE_COUNTER_CODE = 7


class NativeLaunch(NamedTuple):
    """A :class:`FixedLaunch` as the driver's ``cuLaunchKernel`` takes it, for a launcher in C++.

    ``kinds[i]`` and ``values[i]`` describe the kernel's ``i``-th parameter (the constexprs left out, as
    Triton's launcher leaves them out): kind 0 is a pointer whose value is the caller's code for the
    tensor to pass; the others are :data:`NATIVE_KINDS`, with the value itself (a float as its 32 bits).
    The kernel takes two more parameters after these, its global and profile scratch buffers. The profile
    buffer is passed as null (a kernel that needs one has no native launch); the global one, where
    ``scratch_bytes`` is not 0 (kernels that build TMA descriptors on the device), is allocated per launch
    from PyTorch's caching allocator on the launch's stream and zeroed, as :class:`TorchScratch` supplies it
    to Triton's launcher, 512-byte aligned (``scratch_align`` at most that).
    """

    function: int  # the CUfunction handle
    grid: tuple[int, int, int]
    block: int  # threads per program: 32 * num_warps
    shared_bytes: int
    kinds: tuple[int, ...]
    values: tuple[int, ...]
    scratch_bytes: int = 0  # the whole grid's global scratch: programs x num_ctas x the kernel's per-program size


class FixedLaunch:
    """A compiled variant with its device, its grid and every argument after the leading ones fixed.

    Calling it with the leading arguments launches the variant on the current stream of its device,
    which must be the current device: whoever keeps a ``FixedLaunch`` checks that before each call. The
    stream and Triton's launch hooks are read from ``runtime`` at each call.
    """

    __slots__ = (
        "abi", "compiled", "device_index", "grid", "middle", "native", "needs_scratch", "packed", "runtime", "tail",
    )  # fmt: skip

    def __init__(
        self, compiled: Any, device_index: int, grid: tuple[int, ...], tail: tuple, runtime: Runtime = RUNTIME
    ) -> None:
        self.compiled = compiled
        self.runtime = runtime
        self.device_index = device_index
        self.grid = (*grid, 1, 1)[:3]
        self.tail = tail
        self.needs_scratch = _needs_scratch(compiled)
        # The C launch, and what CudaLauncher.__call__ would pass it between the stream and the kernel's arguments:
        # no scratch buffers, no launch metadata, no hooks (built once: this runs on every launch).
        self.native, self.middle, self.packed = _native_launch(compiled) or (None, None, False)
        self.abi: bool | None = None  # native_abi(compiled), read at the first native_launch

    def __call__(self, leading: tuple) -> None:
        runtime = self.runtime
        stream = runtime.current_stream(self.device_index)
        enter, leave = runtime.hooks()
        grid_0, grid_1, grid_2 = self.grid
        if enter is None and self.native is not None:
            if self.packed:
                self.native(grid_0, grid_1, grid_2, stream, *self.middle, (*leading, *self.tail))
            else:
                self.native(grid_0, grid_1, grid_2, stream, *self.middle, *leading, *self.tail)
            return
        compiled = self.compiled
        if enter is None:
            metadata = None
        else:
            metadata = compiled.launch_metadata(self.grid, stream, *leading, *self.tail)
        with TorchScratch() if self.needs_scratch else _NO_SCRATCH:
            compiled.run(
                grid_0, grid_1, grid_2, stream, compiled.function, compiled.packed_metadata, metadata, enter, leave,
                *leading, *self.tail,
            )  # fmt: skip

    def native_launch(self, leading_codes: tuple[int, ...]) -> NativeLaunch | None:
        """This launch as a :class:`NativeLaunch`, the leading arguments given by ``leading_codes`` (one code
        per leading argument, each a pointer), or ``None`` where a launch in C++ could differ from
        :meth:`__call__`'s: profile scratch memory, global scratch aligned beyond the caching allocator's 512
        bytes, a cooperative, programmatic-dependent or clustered launch, a parameter type outside
        :data:`NATIVE_KINDS`, or a kernel whose parameters are not the ones a native launch passes
        (:func:`native_abi`, read from its PTX: so it serves any Triton release that compiles kernels so, not only
        those whose launcher's forwarding this module knows). Global scratch is described by its size
        (``NativeLaunch.scratch_bytes``), which the C++ launcher allocates per launch.

        The C++ table keeps the kernel's function handle, which Triton 3.8 on unloads when the compiled kernel is
        collected; the compiled kernel stays referenced by this launch's :class:`CachedLaunch` for the process.

        ``None`` too while Triton's launch hooks are installed: the native launcher, which reads them on every
        call as :meth:`__call__` does, would hand every call of the layout back anyway.
        """
        if self.runtime.hooks() != (None, None):
            return None
        compiled = self.compiled
        metadata = compiled.metadata
        scratch_bytes = 0
        if self.needs_scratch:
            # As Triton's launcher sizes it: per program and CTA, for the whole grid; the caching allocator's
            # blocks are 512-byte aligned, which must cover the kernel's alignment.
            if getattr(metadata, "global_scratch_align", 1) > _TORCH_BLOCK_ALIGNMENT:
                return None
            grid_0, grid_1, grid_2 = self.grid
            scratch_bytes = grid_0 * grid_1 * grid_2 * getattr(metadata, "num_ctas", 1) * metadata.global_scratch_size
        if getattr(metadata, "launch_cooperative_grid", False) or getattr(metadata, "launch_pdl", False):
            return None
        # A profile scratch buffer (Triton's profiler instrumentation) would be passed null: the kernel writes it.
        if getattr(metadata, "num_ctas", 1) != 1 or getattr(metadata, "profile_scratch_size", 0):
            return None
        if self.abi is None:
            self.abi = native_abi(compiled)
        if not self.abi:
            return None
        signature = getattr(getattr(compiled, "src", None), "signature", None)
        if not isinstance(signature, dict) or len(signature) != len(leading_codes) + len(self.tail):
            return None
        kinds, values = [], []
        for index, kind_name in enumerate(signature.values()):
            if kind_name == "constexpr":  # Triton's launcher passes nothing for these
                continue
            if not isinstance(kind_name, str):
                return None
            if index < len(leading_codes):
                if not kind_name.startswith("*"):
                    return None
                kinds.append(_NATIVE_POINTER)
                values.append(leading_codes[index])
                continue
            kind = NATIVE_KINDS.get(kind_name)
            value = self.tail[index - len(leading_codes)]
            if kind is None or not isinstance(value, (int, float)):
                return None
            if kind == _NATIVE_FLOAT_BITS:
                value = struct.unpack("<I", struct.pack("<f", value))[0]  # as Triton's pack_fp32 converts it
            kinds.append(kind)
            values.append(int(value))
        return NativeLaunch(
            int(compiled.function), self.grid, 32 * metadata.num_warps, metadata.shared, tuple(kinds), tuple(values),
            scratch_bytes,
        )  # fmt: skip


class Relaunch(Protocol):
    """What a kernel function keeps of a layout's launch (:class:`FixedLaunch` is one): called with the call's
    leading arguments, it launches again; :meth:`native_launch` describes it for the C++ launcher, or is ``None``."""

    def __call__(self, leading: tuple) -> None: ...

    def native_launch(self, leading_codes: tuple[int, ...]) -> NativeLaunch | None: ...


class KnownLayout:
    """What a kernel function keeps of a layout it launched before, for its next call of that layout: the
    :class:`FixedLaunch`, templates of its two outputs (``torch.empty_like`` of each gives a fresh output,
    see :func:`mla_ops.runtime.alloc.template`) and whether the caller's input check has accepted the layout.
    The launch is a :class:`FixedLaunch`, or another :class:`Relaunch` that a kernel function calls alike."""

    __slots__ = ("checked", "launch", "lse_template", "out_template")

    def __init__(self, launch: Relaunch, out_template: torch.Tensor, lse_template: torch.Tensor, checked: bool):
        self.launch = launch
        self.out_template = out_template
        self.lse_template = lse_template
        self.checked = checked


def remember(table: dict, layout: Hashable, entry: FixedLaunch | KnownLayout) -> None:
    """``table[layout] = entry``, starting the table over past :data:`MAX_LAYOUTS` entries."""
    if len(table) >= MAX_LAYOUTS:
        table.clear()
    table[layout] = entry


class LaunchCache:
    """What a kernel function keeps between calls in this process: ``known``, the layouts it launched before
    (see :func:`remember`), and a subclass's other tables (:attr:`TABLES`) and launchers.

    Tests start from :meth:`reset` and put back :meth:`state`'s with :meth:`restore`, on the instance, rather
    than patching module globals; whatever a test replaced on it in between (a table, a launcher, a method)
    is put back too. :meth:`reset` keeps the launchers and their compiled variants, which depend on nothing a
    test changes and would take seconds to compile again.
    """

    #: The tables :meth:`reset` empties.
    TABLES: ClassVar[tuple[str, ...]] = ("known",)

    def __init__(self) -> None:
        self.known: dict[Hashable, Any] = {}

    def reset(self) -> None:
        """Forget every table's entries, as in a new process (new empty tables: a saved state keeps its own)."""
        for name in self.TABLES:
            setattr(self, name, {})

    def state(self) -> dict[str, Any]:
        """What :meth:`restore` puts back: the instance's attributes as they are now."""
        return dict(vars(self))

    def restore(self, state: dict[str, Any]) -> None:
        """Put back what :meth:`state` returned, dropping any attribute set since (an instance's own ``launch``)."""
        vars(self).clear()
        vars(self).update(state)


class LaunchPlan(NamedTuple):
    """Everything one launch of a kernel needs: ``kernel[grid](*args, **constexprs, **options)``; ``key`` names
    the compiled variant for :class:`CachedLaunch`, whose relaunches replace the first ``leading`` arguments
    (the tensors)."""

    key: tuple
    grid: tuple[int]
    args: tuple
    constexprs: dict
    options: dict
    leading: int


class CachedLaunch:
    """A ``@triton.jit`` kernel whose compiled variants are launched directly after their first launch.

    Args:
        kernel: the ``triton.jit`` function. Its constexpr parameters must all come after the others,
            which is how this package's kernels are written.
        runtime: what its direct launches read the stream and Triton's hooks from.
    """

    def __init__(self, kernel: Any, runtime: Runtime = RUNTIME) -> None:
        self.kernel = kernel
        self.runtime = runtime
        self.compiled: dict[tuple, Any] = {}
        params = getattr(kernel, "params", None)  # absent under TRITON_INTERPRET=1: JIT launches only
        self.constexpr_names = [p.name for p in params if p.is_constexpr] if params is not None else []
        self.enabled = params is not None and runtime.direct
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
        *,
        leading: int = 0,
        **options: Any,
    ) -> FixedLaunch | None:
        """Launch on ``device`` with ``grid``: ``args`` (the non-constexpr arguments, in order),
        ``constexprs`` (by name) and Triton launch ``options`` (``num_warps``, ``num_stages``).

        Returns the :class:`FixedLaunch` that launched, whose every argument after the first ``leading``
        is fixed (a caller may keep it and call it with new leading arguments: see the module
        docstring), or ``None`` where the launch went through the JIT function (the variant's first
        launch, another device than the current one, or no direct launches here).
        """
        direct = self.enabled and device.type == "cuda" and device.index == current_cuda_device()
        compiled = self.compiled.get(key) if direct else None
        if compiled is None:
            with TorchScratch():  # the variant is not known yet, nor whether it needs scratch
                launched = self.kernel[grid](*args, **constexprs, **options, **COMPILE_OPTIONS)
            if direct and launched is not None:
                self.compiled[key] = launched
            return None
        fixed = self._fixed(compiled, device, grid, args, constexprs, leading)
        fixed(args[:leading])
        return fixed

    def launch(self, plan: LaunchPlan, device: torch.device) -> FixedLaunch | None:
        """:meth:`__call__` with a :class:`LaunchPlan`'s parts."""
        return self(plan.key, device, plan.grid, plan.args, plan.constexprs, leading=plan.leading, **plan.options)

    def fixed_launch(self, plan: LaunchPlan, device: torch.device) -> FixedLaunch | None:
        """The :class:`FixedLaunch` that :meth:`launch` would return for ``plan``, without launching: ``None``
        where its variant has not been launched directly on ``device`` (the current device) before."""
        if not (self.enabled and device.type == "cuda" and device.index == current_cuda_device()):
            return None
        compiled = self.compiled.get(plan.key)
        if compiled is None:
            return None
        return self._fixed(compiled, device, plan.grid, plan.args, plan.constexprs, plan.leading)

    def _fixed(
        self, compiled: Any, device: torch.device, grid: tuple[int, ...], args: tuple, constexprs: dict, leading: int
    ) -> FixedLaunch:
        tail = (*args[leading:], *(constexprs[name] for name in self.constexpr_names))
        return FixedLaunch(compiled, device.index, grid, tail, self.runtime)


def pointer_alignment(*tensors: torch.Tensor | None) -> tuple[bool, ...]:
    """Whether each tensor's data starts on 16 bytes: the alignment Triton specialises pointers on."""
    return tuple(t is not None and t.data_ptr() % 16 == 0 for t in tensors)
