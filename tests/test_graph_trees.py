"""CUDA-graph trees on CPU: the options :func:`mla_ops.compile_options` builds, the graph pass that
moves host-planned calls to their ``cudagraph_unsafe`` twins, and the compile-time refusal of a
host-planning backend without those options.

Here a host-planning route is simulated by caching a FLASHINFER backend built around the ``flashinfer``
stand-in (tests/standins.py) as the route of a CPU configuration (``selector._routes``, the cache the ops
read; automatic selection always gives CPU tensors REFERENCE). The ops then run the stand-in, so results
stay checkable. tests/test_gpu_e2e.py compiles the MLA layer with these options on a real device.
"""

from __future__ import annotations

import contextlib
import re
from unittest import mock

import pytest
import standins
import torch
from torch._guards import TracingContext, tracing
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code
from torch._subclasses.fake_tensor import FakeTensorMode
from utils import cu_seqlens_of, make_batch, make_qkv

import mla_ops
from mla_ops import DeviceCapability, graph_trees, ops, selector
from mla_ops.backends.base import PrefillBackend
from mla_ops.backends.flashinfer import FlashInferBackend
from mla_ops.backends.triton import TritonBackend
from mla_ops.graph_trees import host_planned_ops_pass

BF16 = torch.bfloat16


def host_planner() -> FlashInferBackend:
    """A FLASHINFER backend around the stand-in: it plans on the host, and runs on CPU tensors."""
    return FlashInferBackend(
        library=standins.flashinfer_module(), workspace_bytes=1 << 20, capability=DeviceCapability(9, 0)
    )


@contextlib.contextmanager
def routed(backend: PrefillBackend | type, device="cpu", dtype=BF16, dims=(192, 128)):
    """Make the ops' router return ``backend`` (an instance, or a class to instantiate) for this configuration,
    as a GPU would cache it."""
    if isinstance(backend, type):
        backend = host_planner() if backend is FlashInferBackend else backend()
    selector.clear_cache()
    selector._routes[(torch.device(device), dtype, *dims, False)] = backend
    try:
        yield backend
    finally:
        selector.clear_cache()


def test_backends_that_plan_on_the_host() -> None:
    planners = {m.name for m in mla_ops.PrefillBackendEnum if m.backend_class().plans_on_host}
    assert planners == {"FLASHINFER"}


# --- the twins ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ops.HOST_PLANNED_TWINS))
def test_twins_have_the_ops_schema_and_the_unsafe_tag(name) -> None:
    op, twin = getattr(torch.ops.mla, name).default, getattr(torch.ops.mla, ops.HOST_PLANNED_TWINS[name]).default
    assert str(twin._schema).replace(ops.HOST_PLANNED_TWINS[name], name, 1) == str(op._schema)
    assert torch.Tag.cudagraph_unsafe in twin.tags and torch.Tag.cudagraph_unsafe not in op.tags


def test_twins_compute_what_the_ops_compute() -> None:
    b = make_batch([5, 0, 9], 2, 192, 128, BF16, strided_v=True, seed=3)
    _, k, v = make_qkv(7, 2, 192, 128, BF16, strided_v=True, generator=torch.Generator().manual_seed(4))
    cu_k = cu_seqlens_of([3, 0, 4])
    args = (b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen, 0.07)
    for got, want in zip(torch.ops.mla.prefill_host_planned(*args), torch.ops.mla.prefill(*args)):
        assert torch.equal(got, want)
    args = (b.q, k, v, b.cu_seqlens, cu_k, b.max_seqlen, 4, 0.07)
    for got, want in zip(
        torch.ops.mla.prefill_context_chunk_host_planned(*args), torch.ops.mla.prefill_context_chunk(*args)
    ):
        assert torch.equal(got, want)


def test_twins_pass_opcheck() -> None:
    b = make_batch([5, 0, 9], 2, 192, 128, BF16, strided_v=True, seed=3)
    torch.library.opcheck(torch.ops.mla.prefill_host_planned, (b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen, 0.07))


# --- compile_options ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["default", "max-autotune-no-cudagraphs"])
def test_modes_without_cuda_graphs_are_returned_unchanged(mode) -> None:
    assert mla_ops.compile_options(mode) == torch._inductor.list_mode_options(mode)


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graph_modes_get_partitioning_and_the_pass(mode) -> None:
    options = mla_ops.compile_options(mode)
    graph_pass = options.pop("post_grad_custom_pre_pass")
    assert options == {**torch._inductor.list_mode_options(mode), "graph_partition": True}
    assert isinstance(graph_pass, host_planned_ops_pass()) and graph_pass.previous is None
    assert graph_pass.uuid() is not None  # so that Inductor caches the compile


def test_an_existing_post_grad_pass_is_kept_and_runs_first() -> None:
    seen = []
    with inductor_config.patch(post_grad_custom_pre_pass=lambda graph: seen.append(graph)):
        graph_pass = mla_ops.compile_options()["post_grad_custom_pre_pass"]
    graph = torch.fx.Graph()
    graph_pass(graph)
    assert seen == [graph]


def test_a_list_of_existing_passes_runs_in_order_and_keys_the_cache() -> None:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    seen = []

    class Named(CustomGraphPass):
        def __init__(self, name: str) -> None:
            self.name = name

        def __call__(self, graph: torch.fx.Graph) -> None:
            seen.append(self.name)

        def uuid(self) -> str:
            return f"named-{self.name}"

    with inductor_config.patch(post_grad_custom_pre_pass=[Named("a"), Named("b")]):
        graph_pass = mla_ops.compile_options()["post_grad_custom_pre_pass"]
    graph_pass(torch.fx.Graph())
    assert seen == ["a", "b"]
    assert graph_pass.uuid()[-1] == ("named-a", "named-b")


def test_the_cache_key_follows_the_selection() -> None:
    graph_pass = mla_ops.compile_options()["post_grad_custom_pre_pass"]
    automatic = graph_pass.uuid()
    with mla_ops.prefill_backend("TRITON"):  # on CPU the override changes nothing: REFERENCE runs, and keys
        assert graph_pass.uuid() == automatic
    with routed(FlashInferBackend):
        host_planned = graph_pass.uuid()
    with routed(TritonBackend):
        assert graph_pass.uuid() not in (host_planned, automatic)


def test_the_options_are_accepted_by_torch_compile() -> None:
    # torch.compile validates option names when it is called, so a renamed Inductor knob fails here.
    torch.compile(lambda x: x + 1, options=mla_ops.compile_options())


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown torch.compile mode 'fast'; use one of \[.*'reduce-overhead'"):
        mla_ops.compile_options("fast")


def test_a_torch_without_the_tag_is_explained(monkeypatch) -> None:
    monkeypatch.setattr(graph_trees, "GRAPH_UNSAFE_TAGS", ())
    with pytest.raises(RuntimeError, match=r"cannot run ops between the CUDA graphs of a tree .* torch 2.11 or newer"):
        mla_ops.compile_options()
    assert mla_ops.compile_options("default") == {}


# --- the graph pass, compiled end to end on CPU ---------------------------------------------------------


def _compile_and_run(options):
    torch._dynamo.reset()
    b = make_batch([5, 0, 9], 2, 192, 128, BF16, strided_v=True, seed=1)
    _, k, v = make_qkv(7, 2, 192, 128, BF16, strided_v=True, generator=torch.Generator().manual_seed(2))
    chunks = [mla_ops.ContextChunk(k, v, cu_seqlens_of([3, 0, 4]), 4)]

    def attend(q, k, v, cu, max_seqlen, chunks):
        return mla_ops.prefill_with_context(q, k, v, cu, max_seqlen, chunks)

    compiled = torch.compile(attend, fullgraph=True, options=options)
    (out, lse), code = run_and_get_code(compiled, b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen, chunks)
    want_out, want_lse = attend(b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen, chunks)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    return "\n".join(code)


def test_the_pass_moves_host_planned_calls_to_the_twins() -> None:
    with routed(FlashInferBackend) as backend:
        code = _compile_and_run(mla_ops.compile_options())
    assert backend.plan_count == 2, "the twins ran the routed backend: one plan for the new tokens, one for the chunk"
    assert "mla.prefill_host_planned.default" in code
    assert "mla.prefill_context_chunk_host_planned.default" in code
    assert "mla.merge_attn_states.default" in code  # the merge never plans; it stays


def test_the_pass_leaves_device_side_backends_alone() -> None:
    with routed(TritonBackend):
        code = _compile_and_run(mla_ops.compile_options())
    assert "mla.prefill.default" in code and "mla.prefill_context_chunk.default" in code
    assert "host_planned" not in code


# --- the fake kernels' compile-time check ------------------------------------------------------------


def _trace_prefill(backend, cudagraphs: bool, with_options: bool = False, under_compile: bool = True):
    """Run ``mla.prefill``'s fake kernel on fake CUDA tensors, as AOT tracing would."""
    mode = FakeTensorMode()
    with mode:
        q = torch.empty(6, 2, 192, device="cuda", dtype=BF16)
        v = torch.empty(6, 2, 128, device="cuda", dtype=BF16)
        cu = torch.empty(3, device="cuda", dtype=torch.int32)
    patches = {"triton.cudagraphs": cudagraphs}
    if with_options:
        patches.update({k: v for k, v in mla_ops.compile_options().items() if k != "triton.cudagraphs"})
    with routed(backend, device=q.device), inductor_config.patch(patches), mode:
        if not under_compile:
            return torch.ops.mla.prefill(q, q, v, cu, 4, 0.1)
        with tracing(TracingContext(mode)):
            return torch.ops.mla.prefill(q, q, v, cu, 4, 0.1)


def test_graph_trees_refuse_a_host_planner_without_the_options() -> None:
    with pytest.raises(RuntimeError) as info:
        _trace_prefill(FlashInferBackend, cudagraphs=True)
    message = str(info.value)
    assert message.startswith("mla::prefill: the FLASHINFER backend plans each batch on the host")
    assert "options=mla_ops.compile_options('reduce-overhead')" in message


def test_graph_trees_accept_what_can_be_replayed() -> None:
    out, lse = _trace_prefill(TritonBackend, cudagraphs=True)
    assert out.shape == (6, 2, 128) and lse.shape == (2, 6)
    _trace_prefill(FlashInferBackend, cudagraphs=True, with_options=True)
    _trace_prefill(FlashInferBackend, cudagraphs=False)
    _trace_prefill(FlashInferBackend, cudagraphs=True, under_compile=False)


# --- where Inductor puts the partition boundaries ------------------------------------------------------


def _partition_bodies(code: str) -> list[str]:
    """The bodies of the ``partition_N`` functions in Inductor's output code (what CUDA graphs replay)."""
    bodies = []
    for head in re.finditer(r"^def partition_\d+\(args\):\n", code, flags=re.M):
        end = re.compile(r"^\S", flags=re.M).search(code, head.end())
        bodies.append(code[head.end() : end.start() if end else len(code)])
    return bodies


def _partitioned_code(options) -> str:
    """Compile a small function around ``mla.prefill`` as Inductor compiles it for a GPU.

    Partitioning only splits GPU nodes, so every scheduler node claims to be on a GPU here; the CPU
    kernels still run (and CUDA graphs are skipped for CPU inputs), which is enough to read where
    the partition boundaries fall in the output code.
    """
    from torch._inductor.scheduler import BaseSchedulerNode

    def attend(q, k, v, cu, max_seqlen):
        out, lse = torch.ops.mla.prefill(q * 2, k, v, cu, max_seqlen, 0.1)
        return out * 4, lse * 2  # scaling by powers of two is exact, so compiled and eager agree

    b = make_batch([5, 0, 9], 2, 192, 128, BF16, seed=1)
    torch._dynamo.reset()
    with mock.patch.object(BaseSchedulerNode, "is_gpu", lambda self: True), routed(FlashInferBackend):
        compiled = torch.compile(attend, fullgraph=True, options=options)
        (out, lse), code = run_and_get_code(compiled, b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen)
        want_out, want_lse = attend(b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    return "\n".join(code)


GETITEM = re.compile(r"buf\d+ = buf\d+\[\d\]")


@pytest.mark.skipif(not hasattr(inductor_config, "graph_partition"), reason="this torch has no graph partitioning")
def test_partitions_around_the_twin_receive_tensors() -> None:
    code = _partitioned_code(mla_ops.compile_options())
    bodies = _partition_bodies(code)
    assert len(bodies) == 2, "one graph before the attention call and one after it"
    assert not any("mla." in body for body in bodies), "the host-planned call runs between the graphs"
    assert not any(GETITEM.search(body) for body in bodies), "its (out, lse) is unpacked between the graphs too"
    assert "torch.ops.mla.prefill_host_planned.default(" in code


@pytest.mark.skipif(
    not hasattr(inductor_config, "custom_should_partition_ops"), reason="this torch has no custom_should_partition_ops"
)
def test_partitioning_by_op_name_would_hand_a_tuple_to_the_next_graph() -> None:
    # Why compile_options does not use custom_should_partition_ops: Inductor then leaves the getitems
    # that unpack the op's (out, lse) in the next partition, whose input is the tuple; CUDA-graph trees
    # assert on it when they record (seen on an H200 with torch 2.11).
    options = {"triton.cudagraphs": True, "graph_partition": True, "custom_should_partition_ops": ["mla::prefill"]}
    bodies = _partition_bodies(_partitioned_code(options))
    assert any(GETITEM.search(body) for body in bodies)


def test_the_pass_reads_keyword_arguments_and_skips_calls_it_cannot_type() -> None:
    graph = torch.fx.Graph()
    q, k, v, cu = (graph.placeholder(name) for name in ("q", "k", "v", "cu"))
    with FakeTensorMode():
        q.meta["val"] = torch.empty(6, 2, 192, dtype=BF16)
        v.meta["val"] = torch.empty(6, 2, 128, dtype=BF16)
    by_keyword = graph.call_function(
        torch.ops.mla.prefill.default,
        (),
        {"q": q, "k": k, "v": v, "cu_seqlens": cu, "max_seqlen": 4, "softmax_scale": 0.1},
    )
    untyped = graph.call_function(torch.ops.mla.prefill.default, (k, k, k, cu, 4, 0.1))  # k has no traced value
    with routed(FlashInferBackend):
        mla_ops.compile_options()["post_grad_custom_pre_pass"](graph)
    assert by_keyword.target is torch.ops.mla.prefill_host_planned.default
    assert untyped.target is torch.ops.mla.prefill.default


# --- offsets a replayed graph computes ------------------------------------------------------------------


def _graph_with_offsets(make_offsets, op: str = "prefill"):
    """An FX graph calling ``op`` with offsets built from a placeholder by ``make_offsets(graph, node)``."""
    graph = torch.fx.Graph()
    q, k, v, cu = (graph.placeholder(name) for name in ("q", "k", "v", "cu"))
    with FakeTensorMode():
        q.meta["val"] = torch.empty(6, 2, 192, dtype=BF16)
        v.meta["val"] = torch.empty(6, 2, 128, dtype=BF16)
    offsets = make_offsets(graph, cu)
    if op == "prefill":
        call = graph.call_function(torch.ops.mla.prefill.default, (q, k, v, offsets, 4, 0.1))
    else:
        call = graph.call_function(torch.ops.mla.prefill_context_chunk.default, (q, k, v, cu, offsets, 4, 4, 0.1))
    return graph, call


def _run_pass(graph, backend=FlashInferBackend) -> None:
    with routed(backend):
        mla_ops.compile_options()["post_grad_custom_pre_pass"](graph)


def _cumsum(graph, cu):
    return graph.call_function(torch.ops.aten.cumsum.default, (cu, 0))


@pytest.mark.parametrize(
    "make_offsets",
    [
        pytest.param(lambda graph, cu: cu, id="input"),
        pytest.param(lambda graph, cu: graph.call_function(torch.ops.aten.slice.Tensor, (cu, 0, 0, 3)), id="view"),
        pytest.param(lambda graph, cu: graph.get_attr("offsets_constant"), id="constant"),
    ],
)
def test_offsets_from_outside_the_graph_are_planned_between_the_graphs(make_offsets) -> None:
    graph, call = _graph_with_offsets(make_offsets)
    _run_pass(graph)
    assert call.target is torch.ops.mla.prefill_host_planned.default


@pytest.mark.parametrize("op, name", [("prefill", "cu_seqlens"), ("prefill_context_chunk", "cu_seqlens_k")])
def test_offsets_computed_in_the_graph_are_refused_for_a_host_planner(op, name) -> None:
    graph, call = _graph_with_offsets(_cumsum, op)
    with pytest.raises(RuntimeError) as info:
        _run_pass(graph)
    message = str(info.value)
    assert message.startswith(f"mla::{op}: {name} is computed inside the compiled function (by %cumsum")
    assert f"Compute {name} outside the compiled function and pass it in" in message
    assert "MLA_OPS_PREFILL_BACKEND=TRITON" in message
    assert call.target is getattr(torch.ops.mla, op).default


def test_offsets_computed_in_the_graph_are_fine_for_a_device_side_backend() -> None:
    graph, call = _graph_with_offsets(_cumsum)
    _run_pass(graph, TritonBackend)
    assert call.target is torch.ops.mla.prefill.default


def test_torch_compile_reports_offsets_computed_inside() -> None:
    torch._dynamo.reset()
    b = make_batch([5, 0, 9], 2, 192, 128, BF16, seed=1)
    lengths = torch.tensor([5, 0, 9], dtype=torch.int32)

    def attend(q, k, v, lengths):
        cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
        return mla_ops.prefill(q, k, v, cu, 9)

    compiled = torch.compile(attend, fullgraph=True, options=mla_ops.compile_options())
    with routed(FlashInferBackend), pytest.raises(Exception, match=r"mla::prefill: cu_seqlens is computed inside"):
        compiled(b.q, b.k, b.v, lengths)
