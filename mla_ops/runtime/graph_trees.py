"""The MLA ops under ``torch.compile``'s CUDA-graph trees (``mode="reduce-overhead"``).

:func:`routes_in_graph` (whether a trace is for CUDA-graph trees), :data:`IN_GRAPH_TWINS` (the ops' twins
whose kernels never run a backend that plans on the host), :func:`check_graph_trees` (the fake kernels'
compile-time refusal for direct op calls) and the deprecated :func:`compile_options`. It reads PyTorch
internals, listed in the design page, and imports nothing of Inductor or Dynamo at import time.
Design: docs/design/graph-trees.md.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch

from ..selector import host_planner_for

#: Twins of the two attention ops that the Python API calls while ``torch.compile`` traces for CUDA-graph
#: trees (:func:`routes_in_graph`). :mod:`mla_ops.ops` defines them with the same schemas, validation and
#: fake kernels (less the :func:`check_graph_trees` refusal); their kernels select with ``in_graph=True``.
#: They are not part of the public contract.
IN_GRAPH_TWINS = {"prefill": "prefill_in_graph", "prefill_context_chunk": "prefill_context_chunk_in_graph"}

#: Device types whose calls :func:`check_graph_trees` judges. Only CUDA has CUDA-graph trees; tests add
#: ``"cpu"`` to exercise the check on a machine without a GPU.
CHECKED_DEVICE_TYPES: tuple[str, ...] = ("cuda",)


def compile_options(mode: str = "reduce-overhead") -> dict[str, Any]:
    """Deprecated: the Inductor options of ``mode``, unchanged. Compile with ``mode=...`` instead.

    This used to add a graph pass that ran FLASHINFER's calls between the graphs of a CUDA-graph tree.
    Calls through the Python API are now routed inside the trees to a backend that reads the offsets on
    the device, which measured faster (benchmarks/results/h200/graph_trees.md), so
    ``torch.compile(model, mode=mode)`` is all that is needed. Kept for one release.

    Args:
        mode: a ``torch.compile`` mode, e.g. ``"reduce-overhead"``.

    Returns:
        A new ``dict``: ``torch._inductor.list_mode_options()[mode]``.

    Raises:
        ValueError: for a mode ``torch.compile`` does not know.
    """
    from torch._inductor import list_mode_options

    modes = list_mode_options()
    if mode not in modes:
        raise ValueError(f"compile_options: unknown torch.compile mode {mode!r}; use one of {sorted(modes)}")
    warnings.warn(
        "mla_ops.compile_options is deprecated and returns the mode's Inductor options unchanged: calls to "
        "FLASHINFER through the Python API (mla_ops.prefill, mla_ops.prefill_context_chunk, "
        "mla_ops.prefill_with_context) are now routed to a backend that reads the offsets on the device inside "
        f"CUDA-graph trees, so torch.compile(model, mode={mode!r}) is all that is needed",
        DeprecationWarning,
        stacklevel=2,
    )
    return dict(modes[mode])


def _options_being_compiled() -> dict[str, Any] | None:
    """The Inductor options of the ``torch.compile`` now tracing, or ``None`` outside one.

    Read in two places, because the fake kernels run in two phases. While Dynamo traces, Inductor's
    config is not yet patched with the mode's options, but the backend Dynamo will call carries them
    (``get_compiler_config``). While Inductor compiles, they are patched into its config. Reading only
    the latter misses every compile whose Inductor phase is served from a cache (AOTAutograd's and the
    FX graph cache), which then skip the fake kernels.
    """
    inductor_config = sys.modules.get("torch._inductor.config")
    if inductor_config is not None and inductor_config.triton.cudagraphs:
        return {"triton.cudagraphs": True}
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        get_config = getattr(tx.output.compiler_fn, "get_compiler_config", None) if tx is not None else None
        options = get_config() if get_config is not None else None
    except Exception:  # a private surface of Dynamo: absent or changed means "not known", never a failure
        return None
    return options if isinstance(options, dict) else None


def routes_in_graph() -> bool:
    """Whether the ``torch.compile`` now tracing builds CUDA-graph trees: there the Python API calls the
    :data:`IN_GRAPH_TWINS`, and the ops' fake kernels refuse a host-planning backend (:func:`check_graph_trees`).

    ``False`` outside ``torch.compile``, and when the compile's options cannot be read (a Dynamo backend
    other than Inductor's). Dynamo does not guard on the result: a compiled frame belongs to one
    ``torch.compile`` call, whose options do not change.
    """
    from torch._guards import TracingContext

    if TracingContext.try_get() is None:  # not under torch.compile
        return False
    options = _options_being_compiled()
    return options is not None and bool(options.get("triton.cudagraphs"))


# Dynamo calls the function while it traces and keeps the result as a constant, instead of tracing into
# it (which would break the graph). This is what torch.compiler.assume_constant_result does; applying it
# here would import Dynamo (seconds, and Triton) with the package. tests/test_graph_tree_routing.py checks
# that the decorator still sets nothing else.
routes_in_graph._dynamo_marked_constant = True  # type: ignore[attr-defined]


def check_graph_trees(op: str, q: torch.Tensor, v: torch.Tensor) -> None:
    """Refuse, while ``torch.compile`` traces for CUDA-graph trees, a call whose backend plans on the host.

    Called by the ops' fake kernels, so the mistake surfaces at compile time, while Dynamo traces, with
    its remedy, rather than as an allocator-pool failure at the tree's first run. ``op`` is
    ``"mla::prefill"`` or ``"mla::prefill_context_chunk"``; ``q``/``v`` are the op's (fake) inputs.
    """
    if q.device.type not in CHECKED_DEVICE_TYPES or not routes_in_graph():
        return
    # Whichever backend a call of any size may route to: a cost table may rank a host planner first for some.
    backend = host_planner_for(q, v)
    if backend is None:
        return
    raise RuntimeError(
        f"{op}: the {backend.name} backend plans each batch on the host, which a CUDA-graph tree "
        "(torch.compile mode='reduce-overhead') cannot do before its replays. Calls through "
        "mla_ops.prefill, mla_ops.prefill_context_chunk and mla_ops.prefill_with_context are routed "
        "automatically inside CUDA-graph trees to the best backend that reads the offsets on the device: call "
        f"those instead of torch.ops.{op.replace('::', '.')}. Alternatively select a backend that reads the "
        "offsets on the device (MLA_OPS_PREFILL_BACKEND=FLASH_ATTN or TRITON), or capture torch.cuda.CUDAGraph "
        "yourself with mla_ops.plan_cuda_graph"
    )
