"""What differs between the Triton releases the kernels support (:data:`SUPPORTED_RELEASES`), in one place.

The ``tl.dot`` kernels use only Triton's stable language. The Hopper kernel in Gluon
(:mod:`mla_ops.kernels.attention_sm90`) uses ``triton.experimental.gluon``, whose API changes between
releases; every name it takes from Gluon that is spelled differently in some release is bound here.

- The TMA copy into shared memory: ``tma.async_copy_global_to_shared`` in Triton 3.6, renamed
  ``tma.async_load`` in 3.7 (3.7 and 3.8 have no old name; 3.9 keeps it only to raise "has been removed;
  call async_load instead").

- Register pressure: with Triton 3.8 and 3.9 the kernel as written for 3.6 spills in every partition;
  :func:`lean_registers` picks spellings that fit there and leaves 3.6 and 3.7 compiling as before.
- Floating-point contraction: :data:`COMPILE_OPTIONS` asks for it explicitly, for every release.

This module imports Triton only when a Gluon name is asked for, so that the version checks work without it.
"""

from __future__ import annotations

from typing import Any

#: Options every launch of the package's kernels passes. FMA contraction, on by default through Triton 3.9, is
#: asked for explicitly: the kernels' arithmetic is written for it (a score's scaling and max subtraction fuse
#: into one FMA), Triton 3.9 warns on every compile that leaves it to the default, and 3.10 turns the default off.
COMPILE_OPTIONS: dict[str, Any] = {"enable_fp_fusion": True}

#: Triton releases (major.minor) the package supports and tests: pyproject.toml's range, the releases
#: ``benchmarks/compile_matrix.sh`` compiles the kernels with.
SUPPORTED_RELEASES = ("3.6", "3.7", "3.8", "3.9")


def release(version: str) -> str:
    """``major.minor`` of a Triton version string (``"3.8.0+git1a2b"`` -> ``"3.8"``)."""
    return ".".join(version.split(".")[:2])


def gluon_triton_reason(version: str) -> str | None:
    """Why the Hopper kernel in Gluon does not run with Triton ``version``, or ``None`` for the releases it
    is adapted to (:data:`SUPPORTED_RELEASES`); elsewhere the ``tl.dot`` kernel runs every call."""
    if release(version) in SUPPORTED_RELEASES:
        return None
    return (
        f"its Gluon (Triton's experimental language) is adapted to Triton {', '.join(SUPPORTED_RELEASES)}, "
        f"and Gluon's API changes between releases (installed: {version})"
    )


def lean_registers(version: str) -> bool:
    """Whether the Gluon kernel takes its register-lean spellings under Triton ``version`` (3.8 on).

    With Triton 3.8 and 3.9 the kernel as 3.6 compiles it fits its partitions' budgets only by spilling
    (56-84 bytes per thread, in both consumers and the producer; ``benchmarks/compile_sm90.py``), and no
    other split of the register file helps (consumers at 224 or 240 registers spill more). Three spellings
    that compute the same make it fit with 0 spills: the producer hands the consumers each item's sequence
    with its number (they no longer search ``cu_seqlens_q`` over four warps, whose shared-memory reduction
    held addresses across the loops), the last ``P @ V`` is conditioned on values live anyway instead of a
    predicate kept across the loops, and the causal mask compares constants against one bound per row
    instead of holding the tile's key positions in registers (on the chunk path that spelling spills
    with 3.8 and 3.9, so it is left to the causal one). 3.6 and 3.7, whose code is the one timed on the
    H200, compile exactly as before.
    """
    return tuple(int(x) for x in release(version).split(".")) >= (3, 8)


def tma_load() -> Any:
    """Gluon's Hopper TMA copy of a tile from global into shared memory:
    ``(descriptor, coordinates, barrier, destination)``."""
    from triton.experimental.gluon.language.nvidia.hopper import tma

    load = getattr(tma, "async_load", None)  # Triton >= 3.7
    return load if load is not None else tma.async_copy_global_to_shared
