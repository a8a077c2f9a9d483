"""Two structural properties of the package.

1. The import graph of ``mla_ops`` (with ``mla_ops.meta``, which lives in ``meta/``) has no cycle. Every
   import counts: at module level, inside functions, and under ``TYPE_CHECKING``, with relative imports
   resolved. A cycle works only as long as nothing in it reads a name too early, and breaks on the next
   innocent reordering.
2. Three views of backend selection agree, for a grid of head dims and simulated devices: the rules that
   ``python -m mla_ops info`` prints (its "automatic choice when every library is installed"),
   ``select_backend`` with every library present, and the ops' routing from what a tensor shows,
   ``(dtype, Dqk, Dv)``; and where a cost table ranks the backends by size class, info's size-class table,
   ``select_backend(size=...)`` and the per-call route from a call's shapes (``route_call``, and ``route_checked``
   from the sizes the ops' input check read), which are all
   the native library's launch layouts record (tests/test_cost_table.py), in and out of the batch-invariant mode.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import standins
import torch

from mla_ops import DeviceCapability, MLADimensions, SelectorConfig, cost_table, set_batch_invariant
from mla_ops.backends.base import VarlenCall
from mla_ops.backends.flash_attn import FlashAttnBackend
from mla_ops.backends.flashinfer import FlashInferBackend
from mla_ops.cli.info import selection_rules, size_class_table
from mla_ops.cost_table import SizeClass, size_class
from mla_ops.meta.checks import checked_attention_sizes
from mla_ops.selector import (
    _routes,
    backend_installed,
    route,
    route_call,
    route_checked,
    routing_entry,
    select_backend,
)

ROOT = Path(__file__).resolve().parent.parent
#: Import name -> source folder, as pyproject.toml's package-dir maps them.
PACKAGES = {"mla_ops": ROOT / "mla_ops", "mla_ops.meta": ROOT / "meta"}


# --- the import graph ---------------------------------------------------------------------------------


def package_modules(packages: Mapping[str, Path]) -> dict[str, tuple[Path, bool]]:
    """Every module of the packages: ``{dotted name: (file, is_package)}``."""
    modules = {}
    for name, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            dotted = ".".join((name, *parts[:-1])) if is_package else ".".join((name, *parts))
            modules.setdefault(dotted, (path, is_package))
    return modules


def _imported(node: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    """The dotted names an ``import`` statement reads, relative ones resolved against ``module``."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            parts = module.split(".")
            anchor = parts if is_package else parts[:-1]
            base_parts = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join(base_parts + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        for alias in node.names:
            yield f"{base}.{alias.name}"  # a submodule, if there is one by that name
            yield base


def import_graph(packages: Mapping[str, Path]) -> dict[str, set[str]]:
    """``{module: modules of the packages it imports}``, from every import statement in its source."""
    modules = package_modules(packages)
    graph: dict[str, set[str]] = {}
    for module, (path, is_package) in modules.items():
        edges = graph[module] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = list(_imported(node, module, is_package))
            if isinstance(node, ast.ImportFrom):
                # ``from pkg import name``: an edge to the submodule ``pkg.name`` where it exists, else to ``pkg``.
                for sub, base in zip(names[::2], names[1::2]):
                    target = sub if sub in modules else base
                    if target in modules:
                        edges.add(target)
            else:
                edges.update(n for n in names if n in modules)
        edges.discard(module)
    return graph


def find_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as ``[a, b, ..., a]``, or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph(PACKAGES)
    assert {"mla_ops", "mla_ops.meta", "mla_ops.meta.checks", "mla_ops.backends.flash_attn"} <= graph.keys()
    # The walk sees imports inside functions: TRITON imports its kernels only when it runs them.
    assert "mla_ops.kernels.attention" in graph["mla_ops.backends.triton"]
    assert "mla_ops.meta.checks" in graph["mla_ops.backends.flashinfer"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_sees_imports_in_functions_and_type_checking_blocks(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .. import a\n")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import f\nimport os\n"
    )
    graph = import_graph({"pkg": pkg})
    assert graph == {"pkg": set(), "pkg.sub": {"pkg.a"}, "pkg.a": {"pkg.sub.b"}, "pkg.sub.b": {"pkg.a"}}
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.a"]
    (pkg / "sub" / "b.py").write_text("import os\n")
    assert find_cycle(import_graph({"pkg": pkg})) is None


# --- selection: the rules, select_backend and the ops' routing agree -------------------------------------

DIMS = sorted(
    {MLADimensions(nope, rope, v) for nope in (64, 128, 192) for rope in (0, 64) for v in (64, 128, 256)}
    | {MLADimensions(128, 64, 128), MLADimensions(192, 64, 256)}
)
CAPABILITIES = [None, DeviceCapability(8, 0), DeviceCapability(8, 9), DeviceCapability(9, 0), DeviceCapability(10, 0)]


def _rules_choice(capability: DeviceCapability | None, config: SelectorConfig) -> str:
    last = selection_rules(capability, config).splitlines()[-1]
    assert last.startswith("  automatic choice when every library is installed: "), last
    return last.rsplit(": ", 1)[1]


def _selected(capability: DeviceCapability | None, config: SelectorConfig) -> str:
    try:
        return select_backend(capability, config).name
    except ValueError:
        return "none"


def _routed(capability: DeviceCapability | None, dtype: torch.dtype, dqk: int, dv: int) -> str:
    """What the ops run for tensors of ``dtype`` with these head dims (all a tensor shows)."""
    try:
        if capability is None:
            return route(torch.device("cpu"), dtype, dqk, dv).name
        # route() on a CUDA device builds this config from the head dims and asks the device's capability.
        return select_backend(capability, SelectorConfig(dtype, MLADimensions.from_head_dims(dqk, dv))).name
    except ValueError:
        return "none"


@pytest.fixture
def every_library_installed():
    """Triton for real; FlashInfer and every FlashAttention implementation as stand-ins."""
    pytest.importorskip("triton", reason="TRITON's library is part of 'every library installed'")
    flashinfer = FlashInferBackend(library=standins.flashinfer_module(), workspace_bytes=1 << 20)
    flash_attn = FlashAttnBackend(libraries=standins.flash_attn_libraries(*standins.FLASH_ATTN_NAMES))
    with backend_installed(flashinfer), backend_installed(flash_attn):
        yield


@pytest.mark.usefixtures("every_library_installed")
@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: "cpu" if c is None else f"sm{c.major}{c.minor}")
def test_rules_selection_and_routing_agree(capability):
    disagreements = []
    for dims in DIMS:
        for dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn):
            config = SelectorConfig(dtype, dims)
            views = (
                _rules_choice(capability, config),
                _selected(capability, config),
                _routed(capability, dtype, dims.qk_head_dim, dims.v_head_dim),
            )
            if len(set(views)) != 1:
                disagreements.append(
                    f"{tuple(dims)} {dtype}: rules {views[0]}, select_backend {views[1]}, route {views[2]}"
                )
    assert not disagreements, "\n".join(disagreements)


# --- size-aware routing: info's size-class table, select_backend and the ops' per-call route agree ----------------

#: Measured classes of the stand-in table (new tokens and chunks, host-bound to device-bound) and unmeasured ones.
MEASURED_SIZES = [
    SizeClass.of(True, 16, 16, 16, 1, 16, 16),
    SizeClass.of(True, 1024, 1024, 16, 1, 1024, 1024),
    SizeClass.of(True, 16384, 16384, 128, 2, 8192, 8192),
    SizeClass.of(False, 64, 1024, 16, 1, 64, 1024),
    SizeClass.of(False, 1024, 32768, 128, 4, 256, 8192),
]
UNMEASURED_SIZES = [
    SizeClass.of(True, 3, 3, 16, 2, 2, 2),
    SizeClass.of(True, 200000, 200000, 128, 1, 200000, 200000),
    SizeClass.of(False, 4096, 512, 16, 64, 64, 8),
]


def _info_choices(capability: DeviceCapability, config: SelectorConfig) -> dict[SizeClass, str]:
    """The choice ``info`` prints per measured size class (its lines start with the class's bounds)."""
    lines = size_class_table(capability, config).splitlines()
    by_bounds = {line[2:60].rstrip(): line.rsplit(None, 1)[1] for line in lines if line[2:6] in ("new ", "chun")}
    return {size: by_bounds[size.bounds()] for size in MEASURED_SIZES if size.bounds() in by_bounds}


def _call_of(size: SizeClass) -> VarlenCall:
    """A call (CPU tensors without data) whose size class is ``size``: each size at its class's lower bound."""
    rows_q, rows_k, heads, seqs, max_q, max_k = (0 if bits == 0 else 1 << (bits - 1) for bits in size[1:])
    q = torch.empty(rows_q, heads, 192, dtype=torch.bfloat16)
    k = q if size.causal else torch.empty(rows_k, heads, 192, dtype=torch.bfloat16)
    v = torch.empty(k.shape[0], heads, 128, dtype=torch.bfloat16)
    cu_q = torch.empty(seqs + 1, dtype=torch.int32)
    cu_k = cu_q if size.causal else torch.empty(seqs + 1, dtype=torch.int32)
    return VarlenCall(q, k, v, cu_q, cu_k, max_q, max_q if size.causal else max_k, 0.1, size.causal)


@pytest.mark.usefixtures("every_library_installed")
@pytest.mark.parametrize("invariant", [False, True], ids=["sized", "batch-invariant"])
@pytest.mark.parametrize("capability", CAPABILITIES[1:], ids=lambda c: f"sm{c.major}{c.minor}")
def test_size_classes_info_selection_and_routing_agree(tmp_path, capability, invariant):
    # SM90 has a (stand-in) table; the other families have none and keep the fixed order at every size.
    cost_table.LOCATIONS.user_dir = tmp_path
    (tmp_path / "sm90.json").write_text(json.dumps(standins.cost_table(MEASURED_SIZES)))
    set_batch_invariant(invariant)
    config = SelectorConfig(torch.bfloat16, MLADimensions(128, 64, 128))
    info = _info_choices(capability, config)
    assert bool(info) == (capability == DeviceCapability(9, 0) and not invariant)
    # What the ops run for a call of the class: the route the ops cache for this configuration, as a GPU would.
    _routes[(torch.device("cpu"), torch.bfloat16, 192, 128, False)] = routing_entry(capability, config)
    ranked = capability == DeviceCapability(9, 0) and not invariant
    disagreements, chosen = [], set()
    for size in MEASURED_SIZES + UNMEASURED_SIZES:
        assert size_class(_call_of(size)) == size
        call = _call_of(size)
        views = [
            select_backend(capability, config, size=size).name,
            route_call(call).name,
            route_checked(call, checked_attention_sizes(*call)).name,
        ]
        if size in info:
            views.append(info[size])
        if not ranked:  # one backend for every size: the rules' choice
            views.append(_rules_choice(capability, config))
        chosen.update(views)
        if len(set(views)) != 1:
            disagreements.append(f"{size.bounds()}: {views}")
    assert not disagreements, "\n".join(disagreements)
    if ranked:  # the stand-in table makes small calls TRITON's and large ones FLASHINFER's
        assert {"TRITON", "FLASHINFER"} <= chosen
    else:
        assert len(chosen) == 1
        assert not (invariant and capability == DeviceCapability(9, 0)) or chosen == {"FLASH_ATTN"}
