"""The MLA ops under ``torch.compile``'s CUDA-graph trees (``mode="reduce-overhead"``).

A tree replays its graphs without running any Python, so a backend that plans each batch on the host
(FLASHINFER) cannot run inside them: its plan would be the one made when the graph was recorded.

The routing rule: while ``torch.compile`` traces for CUDA-graph trees without :func:`compile_options`
(:func:`routes_in_graph`), :func:`mla_ops.prefill` and :func:`mla_ops.prefill_context_chunk` call
twins of the ops (:data:`IN_GRAPH_TWINS`) whose kernels select with ``in_graph=True``: the best backend
that reads the offsets on the device (TRITON or FLASH_ATTN). An explicit override naming a backend that
plans on the host raises ``ValueError`` there (:func:`mla_ops.selector.select_backend`), never falls
back. So automatic selection compiles with the plain mode although FLASHINFER leads the SM90 list.

To keep FLASHINFER itself, :func:`compile_options` returns the mode's Inductor options plus a graph pass
that moves exactly the host-planned calls to ``cudagraph_unsafe``-tagged twins of the ops, and Inductor's
graph partitioning, which then runs the twins (and the getitems that unpack their outputs) eagerly
between graphs that replay everything else. TRITON and FLASH_ATTN read ``cu_seqlens`` on the device and
stay in the graphs.

.. code-block:: python

    compiled = torch.compile(model, fullgraph=True, options=mla_ops.compile_options("reduce-overhead"))

Under these options a host-planned call's offsets must enter the compiled function as inputs: the
backend recognises a batch by the offsets tensor's address and version counter, and a tensor that a
replayed graph computes is rewritten in place by every replay. The pass refuses such a call.

Model code that calls ``torch.ops.mla.prefill`` itself is not routed: without these options the ops'
fake kernels refuse a host-planning backend at compile time (:func:`check_graph_trees`), instead of
letting the tree fail at its first run.

This module imports nothing of Inductor until :func:`compile_options` is called: importing Inductor
takes seconds, and the fake kernels call :func:`check_graph_trees` in every compile.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch

from .config import DEEPSEEK_V3
from .selector import backend_for, route
from .version import __version__

#: Marks the graph pass's instances; :func:`check_graph_trees` looks for it in Inductor's config.
_PASS_MARK = "_mla_ops_host_planned_ops_pass"

#: Twins of the two attention ops, which :mod:`mla_ops.ops` defines with the same schemas and kernels
#: and tagged ``cudagraph_unsafe``. The graph pass moves the calls whose backend plans on the host to
#: these, and Inductor then runs them between the graphs. They are not part of the public contract.
HOST_PLANNED_TWINS = {"prefill": "prefill_host_planned", "prefill_context_chunk": "prefill_context_chunk_host_planned"}

#: Twins of the two attention ops that the Python API calls while ``torch.compile`` traces for CUDA-graph
#: trees without :func:`compile_options` (:func:`routes_in_graph`). :mod:`mla_ops.ops` defines them with
#: the same schemas, validation and fake kernels (less the :func:`check_graph_trees` refusal); their
#: kernels select with ``in_graph=True``. They are not part of the public contract.
IN_GRAPH_TWINS = {"prefill": "prefill_in_graph", "prefill_context_chunk": "prefill_context_chunk_in_graph"}

#: Older torch has no such tag; without it the twins exist untagged and compile_options refuses to use them.
GRAPH_UNSAFE_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


@functools.cache
def host_planned_ops_pass() -> type:
    """The graph pass class, a ``torch._inductor.custom_graph_pass.CustomGraphPass`` (built on first use)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class HostPlannedOpsPass(CustomGraphPass):
        """Moves each ``mla::prefill`` / ``mla::prefill_context_chunk`` call whose backend plans on the
        host to its ``cudagraph_unsafe`` twin, and raises ``RuntimeError`` when such a call's offsets are
        computed inside the graph (see :func:`_check_offsets_come_from_outside`). Runs ``previous`` (an
        already configured post-grad pre-pass, or a list of them) first. The backend of a call is
        decided from its inputs' device, dtype and head dims, as the op routes it at run time."""

        def __init__(self, previous: Any = None) -> None:
            self.previous = previous
            setattr(self, _PASS_MARK, True)

        def __call__(self, graph: torch.fx.Graph) -> None:
            for p in self._previous():
                p(graph)
            twins = {
                getattr(torch.ops.mla, name).default: getattr(torch.ops.mla, twin).default
                for name, twin in HOST_PLANNED_TWINS.items()
            }
            for node in graph.nodes:
                if node.op != "call_function" or node.target not in twins:
                    continue
                q, v = (_argument(node, i, name) for i, name in ((0, "q"), (2, "v")))
                if q is None or v is None:
                    continue
                backend = backend_for(q, v)
                if backend.plans_on_host:
                    _check_offsets_come_from_outside(node, backend.name)
                    node.target = twins[node.target]

        def uuid(self) -> Any:
            # Inductor's cache key. What the pass does follows the backend selection, so the key holds
            # the routes of DeepSeek's head dims on the current device (which reflect the override, the
            # environment variable and the installed libraries). Other head dims are not in it: a stale
            # entry for them only fails loudly (capture refuses to plan) or runs a call between graphs.
            # A pass without a uuid is keyed by its repr, which holds its address: never a stale hit.
            previous = tuple(p.uuid() if hasattr(p, "uuid") else repr(p) for p in self._previous())
            return ("mla_ops.HostPlannedOpsPass", __version__, _selection_fingerprint(), previous)

        def _previous(self) -> list[Any]:
            passes = self.previous if isinstance(self.previous, (list, tuple)) else [self.previous]
            return [p for p in passes if p is not None]

    return HostPlannedOpsPass


def _argument_node(node: torch.fx.Node, index: int, name: str) -> Any:
    """What an op call passes for its argument ``name`` (at ``index``), positionally or by keyword."""
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


def _argument(node: torch.fx.Node, index: int, name: str) -> torch.Tensor | None:
    """The traced (fake) value of an op call's tensor argument, or ``None`` where the graph lacks it."""
    arg = _argument_node(node, index, name)
    value = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _check_offsets_come_from_outside(node: torch.fx.Node, backend: str) -> None:
    """Refuse a host-planned call whose offsets are computed inside the compiled graph.

    A host-planning backend recognises a batch by its offsets tensor's address and version counter.
    Offsets that a replayed graph computes live in the tree's memory pool: every replay rewrites the
    same address with no version bump, so a new batch would match the previous batch's plan. Offsets
    that enter the graph as inputs (or views of them, or constants) keep their own identity.
    """
    op_name = node.target._opname  # type: ignore[union-attr]
    schema = node.target._schema  # type: ignore[union-attr]
    for index, name in ((i, a.name) for i, a in enumerate(schema.arguments) if a.name.startswith("cu_seqlens")):
        source = _argument_node(node, index, name)
        while isinstance(source, torch.fx.Node) and source.op == "call_function" and _is_view(source.target):
            source = source.args[0]
        if not isinstance(source, torch.fx.Node) or source.op in ("placeholder", "get_attr"):
            continue
        raise RuntimeError(
            f"mla::{op_name}: {name} is computed inside the compiled function (by {source.format_node()}), "
            f"and {backend} plans on the host from it. Under CUDA-graph trees each replay rewrites such a "
            "tensor in place, at the same address, so a new batch could not be told from the last one and "
            f"would reuse its plan. Compute {name} outside the compiled function and pass it in, or select "
            "a backend that reads the offsets on the device (MLA_OPS_PREFILL_BACKEND=TRITON)"
        )


def _is_view(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and bool(getattr(target, "is_view", False))


def _selection_fingerprint() -> tuple[str, ...]:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    names = [str(device)]
    for dtype in (torch.bfloat16, torch.float16):
        try:
            names.append(route(device, dtype, DEEPSEEK_V3.qk_head_dim, DEEPSEEK_V3.v_head_dim).name)
        except ValueError as exc:  # no valid backend: the message says which, and so differs with the cause
            names.append(str(exc))
    return tuple(names)


def compile_options(mode: str = "reduce-overhead") -> dict[str, Any]:
    """Inductor options for ``torch.compile(model, options=...)``: those of ``mode`` and, when the mode
    uses CUDA-graph trees, the graph pass and partitioning that let FLASHINFER's calls run between
    the graphs (see the module docstring).

    ``torch.compile`` takes ``mode`` or ``options``, not both; these replace ``mode``. A graph with no
    host-planned call is compiled as under ``mode`` alone.

    Args:
        mode: a ``torch.compile`` mode, e.g. ``"reduce-overhead"``.

    Returns:
        A new ``dict`` of Inductor options.

    Raises:
        ValueError: for a mode ``torch.compile`` does not know.
        RuntimeError: for a CUDA-graph mode when this torch cannot partition graphs around tagged ops.
    """
    from torch._inductor import config as inductor_config
    from torch._inductor import list_mode_options

    modes = list_mode_options()
    if mode not in modes:
        raise ValueError(f"compile_options: unknown torch.compile mode {mode!r}; use one of {sorted(modes)}")
    options: dict[str, Any] = dict(modes[mode])
    if not options.get("triton.cudagraphs"):
        return options
    if not GRAPH_UNSAFE_TAGS or not hasattr(inductor_config, "graph_partition"):
        raise RuntimeError(
            f"torch {torch.__version__} cannot run ops between the CUDA graphs of a tree (it lacks the "
            "cudagraph_unsafe op tag or Inductor's graph_partition), which a backend that plans on the host "
            "(FLASHINFER) needs. Use torch 2.11 or newer, or capture torch.cuda.CUDAGraph yourself with "
            "mla_ops.plan_cuda_graph, or select a backend that reads the offsets on the device "
            "(MLA_OPS_PREFILL_BACKEND=TRITON) and compile with mode='reduce-overhead'"
        )
    options["graph_partition"] = True
    options["post_grad_custom_pre_pass"] = host_planned_ops_pass()(inductor_config.post_grad_custom_pre_pass)
    return options


#: Device types whose calls :func:`check_graph_trees` judges. Only CUDA has CUDA-graph trees; tests add
#: ``"cpu"`` to exercise the check on a machine without a GPU.
CHECKED_DEVICE_TYPES: tuple[str, ...] = ("cuda",)


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
        return {
            "triton.cudagraphs": True,
            "graph_partition": getattr(inductor_config, "graph_partition", False),
            "post_grad_custom_pre_pass": inductor_config.post_grad_custom_pre_pass,
        }
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        get_config = getattr(tx.output.compiler_fn, "get_compiler_config", None) if tx is not None else None
        options = get_config() if get_config is not None else None
    except Exception:  # a private surface of Dynamo: absent or changed means "not known", never a failure
        return None
    return options if isinstance(options, dict) else None


def _builds_unpartitioned_trees(options: dict[str, Any]) -> bool:
    """Whether ``options`` build CUDA-graph trees without :func:`compile_options`' pass and partitioning."""
    if not options.get("triton.cudagraphs"):
        return False
    configured = options.get("post_grad_custom_pre_pass")
    passes = configured if isinstance(configured, (list, tuple)) else [configured]
    installed = any(getattr(p, _PASS_MARK, False) for p in passes)
    return not (installed and options.get("graph_partition"))


def routes_in_graph() -> bool:
    """Whether the ``torch.compile`` now tracing builds CUDA-graph trees without :func:`compile_options`'
    pass and partitioning: there the Python API calls the :data:`IN_GRAPH_TWINS`.

    ``False`` outside ``torch.compile``, and when the compile's options cannot be read (a Dynamo backend
    other than Inductor's). Dynamo does not guard on the result: a compiled frame belongs to one
    ``torch.compile`` call, whose options do not change.
    """
    from torch._guards import TracingContext

    if TracingContext.try_get() is None:  # not under torch.compile
        return False
    options = _options_being_compiled()
    return options is not None and _builds_unpartitioned_trees(options)


# Dynamo calls the function while it traces and keeps the result as a constant, instead of tracing into
# it (which would break the graph). This is what torch.compiler.assume_constant_result does; applying it
# here would import Dynamo (seconds, and Triton) with the package. tests/test_graph_tree_routing.py checks
# that the decorator still sets nothing else.
routes_in_graph._dynamo_marked_constant = True  # type: ignore[attr-defined]


def check_graph_trees(op: str, q: torch.Tensor, v: torch.Tensor) -> None:
    """Refuse, while ``torch.compile`` traces for CUDA-graph trees without :func:`compile_options`, a
    call whose backend plans on the host.

    Called by the ops' fake kernels, so the mistake surfaces at compile time, while Dynamo traces, with
    its remedy, rather than as an allocator-pool failure at the tree's first run. ``op`` is
    ``"mla::prefill"`` or ``"mla::prefill_context_chunk"``; ``q``/``v`` are the op's (fake) inputs.
    """
    if q.device.type not in CHECKED_DEVICE_TYPES:
        return
    from torch._guards import TracingContext

    if TracingContext.try_get() is None:  # not under torch.compile
        return
    backend = backend_for(q, v)
    if not backend.plans_on_host:
        return
    options = _options_being_compiled()
    if options is None or not _builds_unpartitioned_trees(options):
        return
    raise RuntimeError(
        f"{op}: the {backend.name} backend plans each batch on the host, which a CUDA-graph tree "
        "(torch.compile mode='reduce-overhead') cannot do before its replays. Calls through "
        "mla_ops.prefill, mla_ops.prefill_context_chunk and mla_ops.prefill_with_context are routed "
        "automatically to the best backend that reads the offsets on the device: call those instead of "
        f"torch.ops.{op.replace('::', '.')}. To keep this backend, compile with "
        "torch.compile(model, options=mla_ops.compile_options('reduce-overhead')) (or the compile_options "
        "of the CUDA-graph mode you use): the same mode, with these calls run between the graphs. "
        "Alternatively select a backend that reads the offsets on the device (MLA_OPS_PREFILL_BACKEND=TRITON), "
        "or capture torch.cuda.CUDAGraph yourself with mla_ops.plan_cuda_graph"
    )
