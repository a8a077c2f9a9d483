"""The package's native library: built on first use, cached on disk, loaded once per process.

``mla_ops/native/csrc`` holds C++ kernels for the CUDA key of ``merge_attn_states``, ``prefill``,
``prefill_context_chunk`` and the fused ``prefill_with_chunk``. This module builds them (:func:`load`, with
PyTorch's extension builder, into ``$MLA_OPS_CACHE_DIR/native/<key>``), reports their status, and hands them
TRITON launches (:func:`remember_attention`); the attention ops' C++ kernels hold the CUDA key only while a
TRITON layout is remembered. ``MLA_OPS_NATIVE=0`` keeps the whole library unloaded (``MLA_OPS_NATIVE_MERGE``,
its deprecated name, still works for one release); ``MLA_OPS_NATIVE_LAUNCH=0`` loads it without handing it
launches. It imports only torch and the package's leaf :mod:`mla_ops.switches` (the extension builder when it
builds, the Triton kernels when it remembers a launch). Design: docs/design/native.md.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import subprocess
import sys
import sysconfig
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..switches import parse_switch

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: PyTorch's own lock file only
    fcntl = None

if TYPE_CHECKING:
    from ..backends.base import MergeCall, MergeCheck, VarlenCall

__all__ = [
    "LOADER",
    "SOURCES",
    "Loader",
    "attention_kernels_registered",
    "build_directory",
    "disable_setting",
    "forget_attention",
    "is_built",
    "is_loaded",
    "launch_status",
    "load",
    "merge",
    "remember_attention",
    "remembered_attention_layouts",
    "status",
    "unavailable_reason",
]

#: The native sources, in ``mla_ops/native/csrc``: the CUDA merge kernel, the merge op and the header between
#: them, and the attention ops' launcher.
SOURCES = ("merge_attn_states_kernel.cu", "merge_attn_states.cpp", "merge_attn_states.h", "attention_launch.cpp")

DISABLE_VARIABLE = "MLA_OPS_NATIVE"
#: The old name of :data:`DISABLE_VARIABLE`, read where that is unset; deprecated.
DEPRECATED_DISABLE_VARIABLE = "MLA_OPS_NATIVE_MERGE"
LAUNCH_VARIABLE = "MLA_OPS_NATIVE_LAUNCH"
CACHE_VARIABLE = "MLA_OPS_CACHE_DIR"

_CSRC = Path(__file__).resolve().parent / "csrc"


def disable_setting() -> tuple[str, str]:
    """``(name, value)`` of the setting that turns the library off: ``MLA_OPS_NATIVE``, else its deprecated
    name (which warns once per process), else ``(MLA_OPS_NATIVE, "1")``."""
    value = os.environ.get(DISABLE_VARIABLE)
    if value is not None:
        return DISABLE_VARIABLE, value
    value = os.environ.get(DEPRECATED_DISABLE_VARIABLE)
    if value is None:
        return DISABLE_VARIABLE, "1"
    if not LOADER.warned_deprecated_name:
        LOADER.warned_deprecated_name = True
        warnings.warn(
            f"{DEPRECATED_DISABLE_VARIABLE} is deprecated and will be removed in the next release: set "
            f"{DISABLE_VARIABLE}={value.strip()} instead (it turns off the whole native library, the merge and "
            "TRITON's launches, as the old name already did)",
            DeprecationWarning,
            stacklevel=3,
        )
    return DEPRECATED_DISABLE_VARIABLE, value


def switch(variable: str) -> bool:
    """The on/off setting ``variable`` (:data:`DISABLE_VARIABLE`, read under its deprecated name too, or
    :data:`LAUNCH_VARIABLE`): on where unset or ``1``, off for ``0``; raises ``ValueError`` naming the variable
    for any other value (``false``, ``no`` would otherwise leave it on without a word)."""
    if variable == DISABLE_VARIABLE:
        return parse_switch(*disable_setting(), default=True)
    return parse_switch(variable, os.environ.get(variable, ""), default=True)


def cache_root() -> Path:
    """Where builds (and tuned cost tables) are kept: ``$MLA_OPS_CACHE_DIR``, else ``$XDG_CACHE_HOME/mla_ops``,
    else ``~/.cache/mla_ops``; raises ``ValueError`` where the variable names something that exists but is not
    a directory."""
    text = os.environ.get(CACHE_VARIABLE)
    xdg = os.environ.get("XDG_CACHE_HOME")
    user_cache = Path(xdg) if xdg and os.path.isabs(xdg) else Path(os.path.expanduser("~")) / ".cache"
    root = Path(text) if text else user_cache / "mla_ops"
    if text and root.exists() and not root.is_dir():
        raise ValueError(f"{CACHE_VARIABLE}={text!r} is not a directory; name a directory (it is created if missing)")
    return root


def unavailable_reason() -> str | None:
    """Why the native library cannot be built here without trying (``None`` where it may be)."""
    name, value = disable_setting()
    if not parse_switch(name, value, default=True):
        return f"disabled by {name}=0"
    if torch.version.cuda is None:
        return "this build of torch has no CUDA" + (" (ROCm is not supported)" if torch.version.hip else "")
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    return None


def architectures() -> list[str]:
    """The ``major.minor`` architectures to build for: ``TORCH_CUDA_ARCH_LIST``'s, else the visible GPUs'."""
    listed = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if listed:
        return sorted(
            {arch.removesuffix("+PTX") for arch in listed.replace(",", ";").replace(" ", ";").split(";") if arch}
        )
    return sorted({"{}.{}".format(*torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())})


def _arch_flags(archs: list[str]) -> list[str]:
    flags = []
    for arch in archs:
        number = arch.replace(".", "")
        if not number.isalnum():
            raise ValueError(f"TORCH_CUDA_ARCH_LIST: cannot read architecture {arch!r}; write it as 9.0 or 10.0a")
        flags.append(f"-gencode=arch=compute_{number},code=sm_{number}")
    return flags


def build_key(
    sources: dict[str, bytes],
    torch_version: str,
    cuda_version: str | None,
    flags: list[str],
    python_abi: str = "",
    compilers: str = "",
) -> str:
    """The name of a build: a digest of everything the library depends on, so that a changed source, an
    upgraded torch (whose C++ ABI the library links against), another Python (the library includes its
    headers), another compiler or another GPU never loads a stale build."""
    digest = hashlib.sha256()
    for name in sorted(sources):
        digest.update(name.encode() + b"\0" + sources[name] + b"\0")
    digest.update(f"{torch_version}\0{cuda_version}\0{' '.join(flags)}\0{python_abi}\0{compilers}".encode())
    return digest.hexdigest()[:16]


def python_abi() -> str:
    """This interpreter's ABI tag (e.g. ``cpython-312-x86_64-linux-gnu``)."""
    return sysconfig.get_config_var("SOABI") or sys.implementation.cache_tag or sys.version


@functools.cache
def compilers() -> str:
    """The host C++ compiler and ``nvcc`` that a build would use, as their ``--version`` output (or
    ``missing``): run once per process, when a build is first named."""
    from torch.utils import cpp_extension

    nvcc = os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc") if cpp_extension.CUDA_HOME else "nvcc"
    found = []
    for command in (os.environ.get("CXX", "c++"), nvcc):
        try:
            done = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=30, check=False)
            lines = [line for line in done.stdout.splitlines() if line.strip()]
            found.append(f"{command}: {' | '.join(lines) or 'no version'}")
        except (OSError, subprocess.SubprocessError):
            found.append(f"{command}: missing")
    return "; ".join(found)


def build_directory(key: str) -> Path:
    """Where the build named ``key`` is kept: ``$MLA_OPS_CACHE_DIR/native/<key>``."""
    return cache_root() / "native" / key


#: Compiler flags of both sources; the architecture flags are added per build.
CXX_FLAGS = ["-O3"]
CUDA_FLAGS = ["-O3"]


def _build() -> tuple[Path, str, list[str]]:
    """The build directory, library name and architecture flags of this machine's build."""
    flags = _arch_flags(architectures())
    sources = {name: (_CSRC / name).read_bytes() for name in SOURCES}
    key = build_key(
        sources, torch.__version__, torch.version.cuda, CXX_FLAGS + CUDA_FLAGS + flags, python_abi(), compilers()
    )
    return build_directory(key), f"mla_ops_native_{key}", flags


def is_built() -> bool:
    """Whether this machine's build is in the cache already (then :func:`load` only loads it)."""
    if unavailable_reason() is not None:
        return False
    directory, name, _ = _build()
    return (directory / f"{name}.so").exists()


def _build_and_load() -> None:
    """Compile (where this exact build is not cached) and load the library; raises what the builder raises."""
    directory, name, flags = _build()
    directory.mkdir(parents=True, exist_ok=True)
    with _build_lock(directory):
        _compile_and_load(directory, name, flags)


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """Hold this build's lock: one process builds at a time, and a build killed midway cannot block the next.

    PyTorch's builder guards a build directory with a lock *file* (``lock``), which a process killed while
    building leaves behind, and every later build then waits for it forever. An ``flock`` on a file of
    our own is released by the system when its holder dies, so whoever holds it knows that a ``lock``
    file left in the directory belongs to no live build, and removes it.
    """
    with open(directory / "build.flock", "w") as held:
        if fcntl is not None:
            fcntl.flock(held, fcntl.LOCK_EX)
            stale = directory / "lock"
            if stale.exists():
                stale.unlink()
        yield


def _compile_and_load(directory: Path, name: str, flags: list[str]) -> None:
    from torch.utils import cpp_extension

    built = (directory / f"{name}.so").exists()
    if not built:
        print(
            f"mla_ops: compiling the native kernels (merge, TRITON launches) for sm {', '.join(architectures())} "
            f"into {directory} "
            "(once per torch version and GPU; seconds to a minute) ...",
            file=sys.stderr,
            flush=True,
        )
    start = time.perf_counter()
    cpp_extension.load(
        name=name,
        sources=[str(_CSRC / n) for n in SOURCES if not n.endswith(".h")],
        extra_cflags=CXX_FLAGS,
        extra_cuda_cflags=CUDA_FLAGS + flags,
        extra_include_paths=[str(_CSRC)],
        build_directory=str(directory),
        is_python_module=False,
        verbose=False,
    )
    if not built:
        print(f"mla_ops: native kernels ready in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)


class Loader:
    """What this process knows of the native library, and how it builds it: one instance, :data:`LOADER`.

    ``loaded`` is ``None`` until :func:`load` has tried, then whether the library is loaded (``reason`` says
    why not); ``launches`` whether TRITON launches are handed to it (``MLA_OPS_NATIVE_LAUNCH``, read when it
    loads); ``build`` compiles (where needed) and loads it. Tests replace ``build`` and start from
    :meth:`reset`, on this object, rather than patching module globals.
    """

    def __init__(self) -> None:
        self.build: Callable[[], None] = _build_and_load
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Forget what was tried, as in a new process (a library loaded already stays loaded in the process)."""
        self.loaded: bool | None = None
        self.reason: str | None = None
        self.launches = False
        self.warned_deprecated_name = False

    def state(self) -> dict[str, object]:
        """What :meth:`restore` puts back."""
        return {name: getattr(self, name) for name in ("loaded", "reason", "launches", "warned_deprecated_name")}

    def restore(self, state: dict[str, object]) -> None:
        """Put back what :meth:`state` returned, and the default ``build``."""
        for name, value in state.items():
            setattr(self, name, value)
        self.build = _build_and_load


#: This process's loader.
LOADER = Loader()


def load() -> bool:
    """Build and load the native library, once per process; whether it is loaded.

    Never raises for a failed build: it warns once, with the builder's error and what to do, and every
    CUDA call keeps running the Python kernels (the merge the Triton kernel). Call it outside CUDA-graph
    capture.
    """
    loader = LOADER
    if loader.loaded is not None:
        return loader.loaded
    with loader.lock:  # two threads' first merges build and load once
        if loader.loaded is None:
            _try_load(loader)
    return bool(loader.loaded)


def _try_load(loader: Loader) -> None:
    reason = unavailable_reason()
    if reason is None:
        try:
            loader.build()
        except Exception as exc:  # the builder raises OSError, RuntimeError, CalledProcessError, ...
            lines = [line for line in str(exc).strip().splitlines() if line.strip()]
            reason = f"{type(exc).__name__}: {lines[-1] if lines else 'no message'}"
            warnings.warn(
                f"mla_ops: could not build the native kernels ({reason}); merge_attn_states runs the Triton "
                "merge and TRITON's attention calls launch through Python, at more host time per call. It needs "
                "nvcc and ninja (the CUDA toolkit matching "
                f"torch's CUDA {torch.version.cuda}, and `pip install ninja`); set {DISABLE_VARIABLE}=0 "
                "to stop trying",
                RuntimeWarning,
                stacklevel=4,  # from _try_load, load and merge_kernel to the code that merged
            )
    loader.reason = reason
    loader.loaded = reason is None
    loader.launches = (
        reason is None
        and switch(LAUNCH_VARIABLE)
        and hasattr(torch.ops.mla_native, "remember_attention")  # what the library registers
    )


def is_loaded() -> bool:
    """Whether the native library is loaded in this process (it then runs every CUDA ``merge_attn_states``)."""
    return bool(LOADER.loaded)


def status(fallback: str = "Triton kernel") -> str:
    """What a CUDA merge runs, in one line for ``python -m mla_ops info``: the native kernel, or ``fallback``
    (what runs without it) with why; builds nothing."""
    if LOADER.loaded:
        return "native CUDA kernel"
    reason = LOADER.reason if LOADER.loaded is False else unavailable_reason()
    if reason is not None:
        return f"{fallback} (native kernel unavailable: {reason})"
    if is_built():
        return f"native CUDA kernel, built (loaded by the first CUDA merge; the {fallback} until then)"
    return f"{fallback} until the native kernel is built (by the first CUDA merge, or `python -m mla_ops warmup`)"


def launch_status() -> str:
    """How a CUDA call of a backend whose launches the library can repeat (TRITON) is launched, in words for
    ``python -m mla_ops info``; builds nothing."""
    if not switch(LAUNCH_VARIABLE):
        return f"launched through Python: {LAUNCH_VARIABLE}=0"
    if LOADER.loaded:
        return "a layout's repeated calls launched from C++" if LOADER.launches else "launched through Python"
    reason = LOADER.reason if LOADER.loaded is False else unavailable_reason()
    if reason is not None:
        return f"launched through Python: native library unavailable: {reason}"
    return "a layout's repeated calls launched from C++ once the native library is loaded (by the first CUDA call)"


def merge(call: MergeCall, *, check: MergeCheck | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The native merge (loaded first: see :func:`load`), with the arguments of
    :func:`mla_ops.kernels.merge.merge_attn_states_triton` and its results: ``out`` ``[T, H, Dv]`` contiguous
    in the inputs' dtype, ``lse`` float32 ``[H, T]`` contiguous, on the inputs' device and its current stream.

    The kernel checks its inputs as ``mla.merge_attn_states`` does, with its messages; ``check``, when given,
    is called first.
    """
    if check is not None:
        check(call[0], call[1], call[2], call[3])
    return torch.ops.mla_native.merge_attn_states(*call)


#: The attention ops as :func:`remember_attention` numbers them (``op`` in ``attention_launch.cpp``).
PREFILL, PREFILL_CONTEXT_CHUNK = 0, 1


def remember_attention(op: int, call: VarlenCall) -> bool:
    """Hand the library the launch that a TRITON call of ``op`` (:data:`PREFILL` or
    :data:`PREFILL_CONTEXT_CHUNK`) made for these inputs, so that the op's C++ kernel repeats it for every
    later call of their layout; whether it was handed. Loads the library first where that has not been
    tried (not during CUDA-graph capture: then it only returns ``False``).

    For the ops' Python kernels to call after a successful TRITON call, once their input check accepted
    these inputs: the C++ kernel skips that check for inputs of a remembered layout. For ``PREFILL`` the call
    holds ``cu_seqlens`` and ``max_seqlen`` as both the query and the key arguments, as that op's kernel makes it.
    Nothing is handed where the library is not loaded, ``MLA_OPS_NATIVE_LAUNCH=0`` is set, or the call's
    launch cannot be repeated natively (:func:`mla_ops.kernels.attention.known_native_launch`).
    """
    loader = LOADER
    if loader.loaded is None:
        from ..runtime.capture import is_capturing

        if is_capturing():
            return False
        load()
    if not loader.launches:
        return False
    from ..kernels.attention import known_native_launch

    launch = known_native_launch(call)
    if launch is None:
        return False
    from ..kernels.configs import CONFIG_ENV_VAR

    torch.ops.mla_native.remember_attention(
        op, *call[:8], launch.function, list(launch.grid), launch.block, launch.shared_bytes, list(launch.kinds),
        list(launch.values), os.environ.get(CONFIG_ENV_VAR), launch.scratch_bytes,
    )  # fmt: skip
    return True


def forget_attention() -> None:
    """Forget every launch handed to the library (the ops' routing may have changed:
    :func:`mla_ops.selector.clear_cache` calls this); a no-op where none can have been handed."""
    if LOADER.launches:
        torch.ops.mla_native.forget_attention()


def attention_kernels_registered() -> bool:
    """Whether the attention ops' CUDA key runs the library's C++ kernels now: only while a TRITON layout is
    remembered, so that calls of the other backends never pass through them."""
    return bool(torch.ops.mla_native.attention_kernels_registered()) if LOADER.launches else False


def remembered_attention_layouts() -> int:
    """How many input layouts the attention ops' C++ kernels launch by themselves now (0 where the library
    is not loaded or ``MLA_OPS_NATIVE_LAUNCH=0``)."""
    return int(torch.ops.mla_native.remembered_attention_layouts()) if LOADER.launches else 0
