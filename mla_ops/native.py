"""The package's native library: built on first use, cached on disk, loaded once per process.

``mla_ops/csrc`` holds C++ kernels for the CUDA key of four ops, which run a call without a Python frame:

- ``mla::merge_attn_states``: checks, outputs and one launch of the CUDA merge beside it;
- ``mla::prefill`` and ``mla::prefill_context_chunk``: a call whose inputs have the layout of an earlier
  call that ran the TRITON backend repeats that call's launch of the compiled Triton kernel (two outputs
  and one ``cuLaunchKernel``); every other call runs the ops' Python kernels, as without the library.
  :func:`remember_attention`, which the ops call after a TRITON call, hands it the launches;
  ``attention_launch.cpp`` says what a layout holds and why that is enough.
- ``mla::prefill_with_chunk``, the internal fused layer op: where both its parts' layouts are remembered,
  both launches and the native merge; every other call runs its Python kernel.

:func:`load` compiles the sources with PyTorch's extension builder (``torch.utils.cpp_extension.load``: it
needs ``nvcc`` and ``ninja``) into a directory keyed by the sources, the torch and CUDA versions and the
GPUs' architectures, then loads the library, which registers the C++ kernels over the Python ones. Until it
is loaded, and on any machine where it cannot be built, the ops' Python kernels run every CUDA call (the
merge through the Triton merge, :mod:`mla_ops.kernels.merge`).

The first CUDA merge or TRITON attention call outside CUDA-graph capture calls :func:`load` (``python -m
mla_ops warmup`` does it ahead of time), which prints a progress line while it compiles; a build that fails
is reported once, as a warning, and not tried again in that process.

Settings (read when :func:`load` first runs):

- ``MLA_OPS_NATIVE_MERGE=0``: never build or load the library (the Python kernels run every call).
- ``MLA_OPS_NATIVE_LAUNCH=0``: load it, but hand it no TRITON launch (the attention ops' Python kernels run).
- ``MLA_OPS_CACHE_DIR``: where builds are kept (default ``~/.cache/mla_ops``).
- ``TORCH_CUDA_ARCH_LIST`` (PyTorch's): the architectures to build for, e.g. ``"9.0;10.0"``; by default
  those of the visible GPUs.

It imports only torch (the extension builder when it builds, the Triton kernels when it remembers a launch).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: PyTorch's own lock file only
    fcntl = None

__all__ = [
    "SOURCES",
    "build_directory",
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

#: The native sources, in ``mla_ops/csrc``: the CUDA merge kernel, the merge op and the header between
#: them, and the attention ops' launcher.
SOURCES = ("merge_attn_states_kernel.cu", "merge_attn_states.cpp", "merge_attn_states.h", "attention_launch.cpp")

DISABLE_VARIABLE = "MLA_OPS_NATIVE_MERGE"
LAUNCH_VARIABLE = "MLA_OPS_NATIVE_LAUNCH"
CACHE_VARIABLE = "MLA_OPS_CACHE_DIR"

_CSRC = Path(__file__).resolve().parent / "csrc"

# None: not tried yet; True: loaded; False: tried and failed, or disabled (_reason says why).
_loaded: bool | None = None
_reason: str | None = None
# Whether TRITON launches are handed to the library (MLA_OPS_NATIVE_LAUNCH), read when it loads.
_launches = False
_load_lock = threading.Lock()


def switch(variable: str) -> bool:
    """The on/off setting ``variable`` (:data:`DISABLE_VARIABLE` or :data:`LAUNCH_VARIABLE`): on where unset
    or ``1``, off for ``0``; raises ``ValueError`` naming the variable for any other value (``false``, ``no``
    would otherwise leave it on without a word)."""
    text = os.environ.get(variable, "").strip()
    if text in ("", "1"):
        return True
    if text == "0":
        return False
    raise ValueError(f"{variable} must be 0 (off) or 1 (on, the default), got {text!r}")


def cache_root() -> Path:
    """Where builds are kept: ``$MLA_OPS_CACHE_DIR``, else ``~/.cache/mla_ops``; raises ``ValueError`` where
    the variable names something that exists but is not a directory."""
    text = os.environ.get(CACHE_VARIABLE)
    root = Path(text) if text else Path(os.path.expanduser("~")) / ".cache" / "mla_ops"
    if text and root.exists() and not root.is_dir():
        raise ValueError(f"{CACHE_VARIABLE}={text!r} is not a directory; name a directory (it is created if missing)")
    return root


def unavailable_reason() -> str | None:
    """Why the native library cannot be built here without trying (``None`` where it may be)."""
    if not switch(DISABLE_VARIABLE):
        return f"disabled by {DISABLE_VARIABLE}=0"
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


def build_key(sources: dict[str, bytes], torch_version: str, cuda_version: str | None, flags: list[str]) -> str:
    """The name of a build: a digest of everything the library depends on, so that a changed source, an
    upgraded torch (whose C++ ABI the library links against) or another GPU never loads a stale build."""
    digest = hashlib.sha256()
    for name in sorted(sources):
        digest.update(name.encode() + b"\0" + sources[name] + b"\0")
    digest.update(f"{torch_version}\0{cuda_version}\0{' '.join(flags)}".encode())
    return digest.hexdigest()[:16]


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
    key = build_key(sources, torch.__version__, torch.version.cuda, CXX_FLAGS + CUDA_FLAGS + flags)
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


def load() -> bool:
    """Build and load the native library, once per process; whether it is loaded.

    Never raises for a failed build: it warns once, with the builder's error and what to do, and every
    CUDA call keeps running the Python kernels (the merge the Triton kernel). Call it outside CUDA-graph
    capture.
    """
    if _loaded is not None:
        return _loaded
    with _load_lock:  # two threads' first merges build and load once
        if _loaded is None:
            _try_load()
    return _loaded


def _try_load() -> None:
    global _loaded, _reason, _launches
    _reason = unavailable_reason()
    if _reason is None:
        try:
            _build_and_load()
        except Exception as exc:  # the builder raises OSError, RuntimeError, CalledProcessError, ...
            lines = [line for line in str(exc).strip().splitlines() if line.strip()]
            _reason = f"{type(exc).__name__}: {lines[-1] if lines else 'no message'}"
            warnings.warn(
                f"mla_ops: could not build the native kernels ({_reason}); merge_attn_states runs the Triton "
                "merge and TRITON's attention calls launch through Python, at more host time per call. It needs "
                "nvcc and ninja (the CUDA toolkit matching "
                f"torch's CUDA {torch.version.cuda}, and `pip install ninja`); set {DISABLE_VARIABLE}=0 "
                "to stop trying",
                RuntimeWarning,
                stacklevel=4,  # from _try_load, load and merge_kernel to the code that merged
            )
    _loaded = _reason is None
    _launches = (
        _loaded
        and switch(LAUNCH_VARIABLE)
        and hasattr(torch.ops.mla_native, "remember_attention")  # what the library registers
    )


def is_loaded() -> bool:
    """Whether the native library is loaded in this process (it then runs every CUDA ``merge_attn_states``)."""
    return bool(_loaded)


def status(fallback: str = "Triton kernel") -> str:
    """What a CUDA merge runs, in one line for ``python -m mla_ops info``: the native kernel, or ``fallback``
    (what runs without it) with why; builds nothing."""
    if _loaded:
        return "native CUDA kernel"
    reason = _reason if _loaded is False else unavailable_reason()
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
    if _loaded:
        return "a layout's repeated calls launched from C++" if _launches else "launched through Python"
    reason = _reason if _loaded is False else unavailable_reason()
    if reason is not None:
        return f"launched through Python: native library unavailable: {reason}"
    return "a layout's repeated calls launched from C++ once the native library is loaded (by the first CUDA call)"


def merge(
    prefix_out: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_out: torch.Tensor,
    suffix_lse: torch.Tensor,
    *,
    prefix_lse_base2: bool = False,
    suffix_lse_base2: bool = False,
    check: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The native merge (loaded first: see :func:`load`), with the arguments of
    :func:`mla_ops.kernels.merge.merge_attn_states_triton` and its results: ``out`` ``[T, H, Dv]`` contiguous
    in the inputs' dtype, ``lse`` float32 ``[H, T]`` contiguous, on the inputs' device and its current stream.

    The kernel checks its inputs as ``mla.merge_attn_states`` does, with its messages; ``check``, when given,
    is called first.
    """
    if check is not None:
        check(prefix_out, prefix_lse, suffix_out, suffix_lse)
    return torch.ops.mla_native.merge_attn_states(
        prefix_out, prefix_lse, suffix_out, suffix_lse, prefix_lse_base2, suffix_lse_base2
    )


#: The attention ops as :func:`remember_attention` numbers them (``op`` in ``attention_launch.cpp``).
PREFILL, PREFILL_CONTEXT_CHUNK = 0, 1


def remember_attention(
    op: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
) -> bool:
    """Hand the library the launch that a TRITON call of ``op`` (:data:`PREFILL` or
    :data:`PREFILL_CONTEXT_CHUNK`) made for these inputs, so that the op's C++ kernel repeats it for every
    later call of their layout; whether it was handed. Loads the library first where that has not been
    tried (not during CUDA-graph capture: then it only returns ``False``).

    For the ops' Python kernels to call after a successful TRITON call, once their input check accepted
    these inputs: the C++ kernel skips that check for inputs of a remembered layout. For ``PREFILL`` pass
    ``cu_seqlens`` and ``max_seqlen`` as both the query and the key arguments, as that op's kernel does.
    Nothing is handed where the library is not loaded, ``MLA_OPS_NATIVE_LAUNCH=0`` is set, or the call's
    launch cannot be repeated natively (:func:`mla_ops.kernels.attention.known_native_launch`).
    """
    if _loaded is None:
        from .capture import is_capturing

        if is_capturing():
            return False
        load()
    if not _launches:
        return False
    from .kernels.attention import known_native_launch

    causal = op == PREFILL
    launch = known_native_launch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal)
    if launch is None:
        return False
    from .kernels.configs import CONFIG_ENV_VAR

    torch.ops.mla_native.remember_attention(
        op, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, launch.function,
        list(launch.grid), launch.block, launch.shared_bytes, list(launch.kinds), list(launch.values),
        os.environ.get(CONFIG_ENV_VAR),
    )  # fmt: skip
    return True


def forget_attention() -> None:
    """Forget every launch handed to the library (the ops' routing may have changed:
    :func:`mla_ops.selector.clear_cache` calls this); a no-op where none can have been handed."""
    if _launches:
        torch.ops.mla_native.forget_attention()


def remembered_attention_layouts() -> int:
    """How many input layouts the attention ops' C++ kernels launch by themselves now (0 where the library
    is not loaded or ``MLA_OPS_NATIVE_LAUNCH=0``)."""
    return int(torch.ops.mla_native.remembered_attention_layouts()) if _launches else 0
