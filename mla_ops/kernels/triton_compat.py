"""What differs between the Triton releases the kernels support (:data:`SUPPORTED_RELEASES`), in one place.

The ``tl.dot`` kernels use only Triton's stable language. The Hopper kernel in Gluon
(:mod:`mla_ops.kernels.attention_sm90`) uses ``triton.experimental.gluon``, whose API changes between
releases; every name it takes from Gluon that is spelled differently in some release is bound here.

- The TMA copy into shared memory: ``tma.async_copy_global_to_shared`` in Triton 3.6, renamed
  ``tma.async_load`` in 3.7 (3.7 and 3.8 have no old name; 3.9 keeps it only to raise "has been removed;
  call async_load instead").
- The barrier of a program's threads: ``gl.thread_barrier()`` in Triton 3.6, ``gl.barrier()`` from 3.7 on
  (which, on one CTA as here, emits the same ``debug_barrier``).

One difference is not in the API, and has no adapter: with Triton 3.8 and 3.9 ptxas spills a few words
in the Gluon kernel (56-84 bytes per thread for the table's variant, against none with 3.6 and 3.7:
``benchmarks/compile_matrix.sh``), a predicate register saved once per work item in each consumer
warpgroup and a few values of the producer warp. Other splits of the register file between the
partitions spill as much or more (consumers at 240 registers: 48 bytes; at 224: 184; the producer at 24:
184), and so does holding all of a warpgroup's tiles in one branch, so that the predicate need not live
across the loops (none on the chunk path, 96 bytes on the causal one); the kernel stays as checked on the
H200 with 3.6, and whether the spills cost time with 3.8 is for a GPU run to say.

This module imports Triton only when a Gluon name is asked for, so that the version checks work without it.
"""

from __future__ import annotations

from typing import Any

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


def tma_load() -> Any:
    """Gluon's Hopper TMA copy of a tile from global into shared memory:
    ``(descriptor, coordinates, barrier, destination)``."""
    from triton.experimental.gluon.language.nvidia.hopper import tma

    load = getattr(tma, "async_load", None)  # Triton >= 3.7
    return load if load is not None else tma.async_copy_global_to_shared


def thread_barrier() -> Any:
    """Gluon's barrier of all the threads of a program (no arguments)."""
    from triton.experimental.gluon import language as gl

    barrier = getattr(gl, "barrier", None)  # Triton >= 3.7
    return barrier if barrier is not None else gl.thread_barrier
