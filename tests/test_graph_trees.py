"""CUDA-graph trees on CPU: how :mod:`mla_ops.runtime.graph_trees` reads the options of the ``torch.compile`` being
traced, the fake kernels' compile-time refusal of a host-planning backend, and the deprecated
:func:`mla_ops.compile_options`.

Here a host-planning route is simulated by caching a FLASHINFER backend built around the ``flashinfer``
stand-in (tests/standins.py) as the route of a configuration (``selector._routes``, the cache the ops
read; automatic selection always gives CPU tensors REFERENCE). The routing rule itself is tested in
tests/test_graph_tree_routing.py; tests/test_serving.py checks that the refusal survives warm compile caches.
"""

from __future__ import annotations

import contextlib

import pytest
import standins
import torch
from torch._guards import TracingContext, tracing
from torch._inductor import config as inductor_config
from torch._subclasses.fake_tensor import FakeTensorMode

import mla_ops
from mla_ops import DeviceCapability, selector
from mla_ops.backends.flashinfer import FlashInferBackend
from mla_ops.backends.triton import TritonBackend
from mla_ops.runtime import graph_trees

BF16 = torch.bfloat16


@contextlib.contextmanager
def routed(backend_class: type, device: torch.device, dtype=BF16, dims=(192, 128)):
    """Make the ops' router return a new ``backend_class`` for this configuration, as a GPU would cache it
    (FLASHINFER around the stand-in)."""
    if backend_class is FlashInferBackend:
        backend = FlashInferBackend(
            library=standins.flashinfer_module(), workspace_bytes=1 << 20, capability=DeviceCapability(9, 0)
        )
    else:
        backend = backend_class()
    selector.clear_cache()
    selector._routes[(device, dtype, *dims, False)] = backend
    try:
        yield backend
    finally:
        selector.clear_cache()


def test_backends_that_plan_on_the_host() -> None:
    planners = {m.name for m in mla_ops.PrefillBackendEnum if m.backend_class().plans_on_host}
    assert planners == {"FLASHINFER"}


# --- reading the options of the torch.compile being traced -------------------------------------------


def _branch_on_routing(x: torch.Tensor) -> torch.Tensor:
    # routes_in_graph is a constant to Dynamo: it runs while Dynamo traces, and picks one branch.
    return x + 1 if graph_trees.routes_in_graph() else x - 1


@pytest.mark.parametrize(
    "compile_kwargs, builds_trees",
    [
        pytest.param({}, False, id="default"),
        pytest.param({"mode": "max-autotune-no-cudagraphs"}, False, id="max-autotune-no-cudagraphs"),
        pytest.param({"mode": "reduce-overhead"}, True, id="reduce-overhead"),
        pytest.param({"options": {"triton.cudagraphs": True}}, True, id="options"),
        pytest.param({"backend": "eager"}, False, id="eager-backend"),
    ],
)
def test_options_are_read_from_the_backend_while_dynamo_traces(monkeypatch, compile_kwargs, builds_trees) -> None:
    # While Dynamo traces, Inductor's config does not hold the mode's options yet: only the backend
    # Dynamo will call (get_compiler_config) tells. A backend without one (eager) is "not known".
    seen = []
    read = graph_trees._options_being_compiled
    monkeypatch.setattr(graph_trees, "_options_being_compiled", lambda: seen.append(read()) or seen[-1])
    torch._dynamo.reset()
    x = torch.zeros(3)
    got = torch.compile(_branch_on_routing, fullgraph=True, **compile_kwargs)(x)
    assert torch.equal(got, x + 1 if builds_trees else x - 1)
    assert len(seen) == 1 and not inductor_config.triton.cudagraphs
    if compile_kwargs.get("backend") == "eager":
        assert seen == [None]
    else:
        assert seen[0]["triton.cudagraphs"] is builds_trees


def test_nothing_is_routed_outside_torch_compile() -> None:
    with inductor_config.patch({"triton.cudagraphs": True}):
        assert graph_trees.routes_in_graph() is False
        assert torch.equal(_branch_on_routing(torch.zeros(2)), -torch.ones(2))


# --- the fake kernels' compile-time refusal -------------------------------------------------------------


def _trace_prefill(backend_class: type, cudagraphs: bool, under_compile: bool = True):
    """Run ``mla.prefill``'s fake kernel on fake CUDA tensors while Inductor compiles with ``cudagraphs``."""
    mode = FakeTensorMode()
    with mode:
        q = torch.empty(6, 2, 192, device="cuda", dtype=BF16)
        v = torch.empty(6, 2, 128, device="cuda", dtype=BF16)
        cu = torch.empty(3, device="cuda", dtype=torch.int32)
    with routed(backend_class, q.device), inductor_config.patch({"triton.cudagraphs": cudagraphs}), mode:
        if not under_compile:
            return torch.ops.mla.prefill(q, q, v, cu, 4, 0.1)
        with tracing(TracingContext(mode)):
            return torch.ops.mla.prefill(q, q, v, cu, 4, 0.1)


def test_graph_trees_refuse_a_host_planner_and_say_what_to_do() -> None:
    with pytest.raises(RuntimeError) as info:
        _trace_prefill(FlashInferBackend, cudagraphs=True)
    message = str(info.value)
    assert message.startswith("mla::prefill: the FLASHINFER backend plans each batch on the host")
    assert (
        "Calls through mla_ops.prefill, mla_ops.prefill_context_chunk and mla_ops.prefill_with_context are routed "
        "automatically inside CUDA-graph trees" in message
    )
    assert "instead of torch.ops.mla.prefill." in message
    assert "MLA_OPS_PREFILL_BACKEND=FLASH_ATTN or TRITON" in message
    assert "capture torch.cuda.CUDAGraph yourself with mla_ops.plan_cuda_graph" in message
    assert "compile_options" not in message


def test_graph_trees_accept_what_can_be_replayed() -> None:
    out, lse = _trace_prefill(TritonBackend, cudagraphs=True)
    assert out.shape == (6, 2, 128) and lse.shape == (2, 6)
    _trace_prefill(FlashInferBackend, cudagraphs=False)
    _trace_prefill(FlashInferBackend, cudagraphs=True, under_compile=False)


def test_only_checked_device_types_are_judged(monkeypatch) -> None:
    monkeypatch.setattr(graph_trees, "CHECKED_DEVICE_TYPES", ("cpu",))
    _trace_prefill(FlashInferBackend, cudagraphs=True)  # CUDA tensors, not judged


# --- the deprecated compile_options ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"])
def test_compile_options_returns_the_modes_options_with_a_deprecation_warning(mode) -> None:
    with pytest.warns(DeprecationWarning) as record:
        options = mla_ops.compile_options(mode)
    assert options == torch._inductor.list_mode_options()[mode]
    (warning,) = record
    assert warning.filename == __file__, "the warning points at the caller"
    message = str(warning.message)
    assert message.startswith("mla_ops.compile_options is deprecated and returns the mode's Inductor options unchanged")
    assert "routed to a backend that reads the offsets on the device inside CUDA-graph trees" in message
    assert f"torch.compile(model, mode={mode!r}) is all that is needed" in message


def test_compile_options_returns_a_new_dict(monkeypatch) -> None:
    # Some of Inductor's modes are module-level dicts ("lite"): the caller may edit what it gets.
    shared = {"triton.cudagraphs": True}
    monkeypatch.setattr(torch._inductor, "list_mode_options", lambda: {"reduce-overhead": shared})
    with pytest.warns(DeprecationWarning):
        options = mla_ops.compile_options("reduce-overhead")
    assert options == shared and options is not shared


def test_compile_options_refuses_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match=r"unknown torch.compile mode 'fast'; use one of \[.*'reduce-overhead'"):
        mla_ops.compile_options("fast")


def test_compile_options_are_accepted_by_torch_compile_and_route_as_the_mode() -> None:
    # torch.compile validates option names when it is called, so a renamed Inductor knob fails here.
    with pytest.warns(DeprecationWarning):
        options = mla_ops.compile_options("reduce-overhead")
    torch._dynamo.reset()
    x = torch.zeros(3)
    assert torch.equal(torch.compile(_branch_on_routing, fullgraph=True, options=options)(x), x + 1)
