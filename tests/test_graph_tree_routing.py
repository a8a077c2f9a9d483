"""The routing rule for CUDA-graph trees, on CPU.

Inside torch.compile's CUDA-graph trees (``mode="reduce-overhead"``) calls through the Python API go to
the ops' in-graph twins, whose kernels select with ``in_graph=True``: the best backend that reads the
offsets on the device, never one that plans on the host; an override naming such a backend raises.
Direct ``torch.ops.mla.*`` calls keep the compile-time refusal. Eager calls and compiles without
CUDA-graph trees are untouched.

The selector's rule is checked on simulated GPUs with every library installed (Triton for real, the
others as the stand-ins of tests/standins.py). To run routed calls on CPU, an H200's choices (with and
without ``in_graph``) are cached as the routes of CPU tensors (``selector._routes``, the cache the ops
read; automatic selection always gives CPU tensors REFERENCE), as tests/test_graph_trees.py does.
With every library installed, FLASH_ATTN runs FlashAttention-4's stand-in, which reads ``v`` as it is,
so it is the in-graph choice on SM90; with only a FlashAttention that pads ``v`` it ranks after TRITON.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import expecttest
import pytest
import standins
import torch
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code
from utils import cu_seqlens_of, make_batch, make_qkv

import mla_ops
from mla_ops import DeviceCapability, MLADimensions, SelectorConfig, selector
from mla_ops.backends.base import PrefillBackend, VarlenCall
from mla_ops.backends.flash_attn import FlashAttnBackend
from mla_ops.backends.flashinfer import FlashInferBackend
from mla_ops.backends.triton import TritonBackend
from mla_ops.runtime import graph_trees

BF16 = torch.bfloat16
SM80, SM90, SM100 = DeviceCapability(8, 0), DeviceCapability(9, 0), DeviceCapability(10, 0)
DEEPSEEK = MLADimensions(128, 64, 128)
WIDE = MLADimensions(192, 64, 256)
NON_MLA = MLADimensions(128, 0, 128)
ODD = MLADimensions(256, 64, 128)  # Dqk 320: no library serves it
CONFIG = SelectorConfig(BF16, DEEPSEEK)


@pytest.fixture
def all_installed() -> Iterator[FlashInferBackend]:
    """Every library present (Triton for real, the others as stand-ins); yields the FLASHINFER instance."""
    pytest.importorskip("triton", reason="TRITON's library is part of 'every library installed'")
    flashinfer = FlashInferBackend(library=standins.flashinfer_module(), workspace_bytes=1 << 20, capability=SM90)
    flash_attn = FlashAttnBackend(libraries=standins.flash_attn_libraries(*standins.FLASH_ATTN_NAMES))
    with selector.backend_installed(flashinfer), selector.backend_installed(flash_attn):
        yield flashinfer


# --- the selector's rule ------------------------------------------------------------------------------


@pytest.mark.usefixtures("all_installed")
class TestSelection(expecttest.TestCase):
    def test_choices_inside_and_outside_graph_trees(self) -> None:
        lines = []
        for cap in (SM80, SM90, SM100):
            for dims in (DEEPSEEK, WIDE, NON_MLA):
                for dtype in (BF16, torch.float16):
                    config = SelectorConfig(dtype, dims)
                    plain = selector.select_backend(cap, config)
                    inside = selector.select_backend(cap, config, in_graph=True)
                    assert not inside.plans_on_host
                    if not plain.plans_on_host:
                        assert inside is plain, "a backend that reads the offsets on the device is kept"
                    name = f"sm{cap.major}{cap.minor} {tuple(dims)} {str(dtype)[6:]}"
                    lines.append(f"{name}: {plain.name} -> in graph {inside.name}")
        self.assertExpectedInline(
            "\n".join(lines),
            """\
sm80 (128, 64, 128) bfloat16: FLASH_ATTN -> in graph FLASH_ATTN
sm80 (128, 64, 128) float16: FLASH_ATTN -> in graph FLASH_ATTN
sm80 (192, 64, 256) bfloat16: FLASH_ATTN -> in graph FLASH_ATTN
sm80 (192, 64, 256) float16: FLASH_ATTN -> in graph FLASH_ATTN
sm80 (128, 0, 128) bfloat16: FLASH_ATTN -> in graph FLASH_ATTN
sm80 (128, 0, 128) float16: FLASH_ATTN -> in graph FLASH_ATTN
sm90 (128, 64, 128) bfloat16: FLASHINFER -> in graph FLASH_ATTN
sm90 (128, 64, 128) float16: FLASHINFER -> in graph FLASH_ATTN
sm90 (192, 64, 256) bfloat16: FLASHINFER -> in graph FLASH_ATTN
sm90 (192, 64, 256) float16: FLASHINFER -> in graph FLASH_ATTN
sm90 (128, 0, 128) bfloat16: FLASHINFER -> in graph FLASH_ATTN
sm90 (128, 0, 128) float16: FLASHINFER -> in graph FLASH_ATTN
sm100 (128, 64, 128) bfloat16: FLASH_ATTN -> in graph FLASH_ATTN
sm100 (128, 64, 128) float16: FLASH_ATTN -> in graph FLASH_ATTN
sm100 (192, 64, 256) bfloat16: FLASHINFER -> in graph FLASH_ATTN
sm100 (192, 64, 256) float16: FLASH_ATTN -> in graph FLASH_ATTN
sm100 (128, 0, 128) bfloat16: FLASH_ATTN -> in graph FLASH_ATTN
sm100 (128, 0, 128) float16: FLASH_ATTN -> in graph FLASH_ATTN""",
        )

    def test_a_host_planning_override_is_refused_in_graph(self) -> None:
        with mla_ops.prefill_backend("FLASHINFER"):
            assert selector.select_backend(SM90, CONFIG).name == "FLASHINFER"  # outside the graphs: as before
            with self.assertRaises(ValueError) as ctx:
                selector.select_backend(SM90, CONFIG, in_graph=True)
        self.assertExpectedInline(
            str(ctx.exception),
            """Selected MLA prefill backend FLASHINFER cannot run inside CUDA-graph trees: it plans each batch on the host, which CUDA-graph trees (torch.compile mode='reduce-overhead') cannot do before their replays. Clear the override (mla_ops.set_prefill_backend(None), MLA_OPS_PREFILL_BACKEND unset) and calls through mla_ops.prefill and mla_ops.prefill_context_chunk inside the graphs run the best backend that reads the offsets on the device; or, to keep FLASHINFER, capture torch.cuda.CUDAGraph yourself and call mla_ops.plan_cuda_graph before capturing and before each replay""",  # noqa: E501
        )

    def test_the_environment_variable_is_refused_the_same_way(self) -> None:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(selector.ENV_VAR, "flashinfer")
            with pytest.raises(
                ValueError, match=r"^Selected MLA prefill backend FLASHINFER cannot run inside CUDA-graph"
            ):
                selector.select_backend(SM100, CONFIG, in_graph=True)

    def test_an_override_that_reads_the_offsets_on_the_device_is_kept(self) -> None:
        for name in ("TRITON", "FLASH_ATTN"):
            with mla_ops.prefill_backend(name):
                assert selector.select_backend(SM90, CONFIG, in_graph=True).name == name

    def test_an_invalid_override_gives_its_reasons_first(self) -> None:
        with mla_ops.prefill_backend("FLASHINFER"), pytest.raises(ValueError, match="is not valid for this config"):
            selector.select_backend(SM90, SelectorConfig(BF16, ODD), in_graph=True)

    def test_cpu_runs_reference_in_graph_too(self) -> None:
        assert selector.select_backend(None, CONFIG, in_graph=True).name == "REFERENCE"
        with mla_ops.prefill_backend("FLASHINFER"):
            assert selector.select_backend(None, CONFIG, in_graph=True).name == "REFERENCE"
            assert selector.route(torch.device("cpu"), BF16, 192, 128, in_graph=True).name == "REFERENCE"


@pytest.mark.parametrize(
    ("present", "inside"),
    [
        (standins.FLASH_ATTN_NAMES, "FLASH_ATTN"),
        (("flash_attn.cute",), "FLASH_ATTN"),
        (("flash_attn",), "TRITON"),
        (("torch.ops.aten._flash_attention_forward",), "TRITON"),
    ],
    ids=["every-flash-attention", "flash-attention-4", "flash-attention-2", "bundled-flash-attention-2"],
)
def test_sm90_in_graph_choice_follows_whether_flash_attn_pads_v(present, inside) -> None:
    # SM90's list is FLASHINFER, FLASH_ATTN, TRITON, with FLASH_ATTN after TRITON where the FlashAttention it
    # would run widens v (FlashAttention-2). Inside the graphs FLASHINFER is passed over, so what runs there
    # is FLASH_ATTN through FlashAttention-4, and TRITON when only a FlashAttention-2 is present.
    pytest.importorskip("triton", reason="TRITON is one of the candidates")
    flashinfer = FlashInferBackend(library=standins.flashinfer_module(), workspace_bytes=1 << 20, capability=SM90)
    flash_attn = FlashAttnBackend(libraries=standins.flash_attn_libraries(*present))
    with selector.backend_installed(flashinfer), selector.backend_installed(flash_attn):
        assert selector.select_backend(SM90, CONFIG).name == "FLASHINFER"
        assert selector.select_backend(SM90, CONFIG, in_graph=True).name == inside


def test_without_a_device_side_backend_every_reason_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    flashinfer = FlashInferBackend(library=standins.flashinfer_module(), workspace_bytes=1 << 20, capability=SM90)
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` fail
    with (
        selector.backend_installed(flashinfer),
        selector.backend_installed(FlashAttnBackend(libraries={})),
        selector.backend_installed(TritonBackend()),
    ):
        assert selector.select_backend(SM90, CONFIG).name == "FLASHINFER"
        with pytest.raises(ValueError) as info:
            selector.select_backend(SM90, CONFIG, in_graph=True)
    message = str(info.value)
    assert message.startswith("No valid MLA prefill backend found with SelectorConfig(dtype=torch.bfloat16")
    assert "FLASHINFER: [FLASHINFER plans each batch on the host, which CUDA-graph trees" in message
    assert "TRITON: [triton is not installed" in message
    assert "FLASH_ATTN: [none of flash_attn.cute" in message


def test_selections_inside_and_outside_graph_trees_are_cached_apart(
    monkeypatch: pytest.MonkeyPatch, all_installed
) -> None:
    calls = []
    real = selector.validate_backend
    monkeypatch.setattr(selector, "validate_backend", lambda b, cap, cfg: calls.append(b) or real(b, cap, cfg))
    for _ in range(50):
        assert selector.select_backend(SM90, CONFIG).name == "FLASHINFER"
        assert selector.select_backend(SM90, CONFIG, in_graph=True).name == "FLASH_ATTN"
    # One walk of the priority list for each: FLASHINFER; then FLASHINFER (passed over) and FLASH_ATTN.
    assert [b.name for b in calls] == ["FLASHINFER", "FLASHINFER", "FLASH_ATTN"]
    q, v = torch.empty(4, 2, 192, dtype=BF16), torch.empty(4, 2, 128, dtype=BF16)
    selector.backend_for(q, v)
    selector.backend_for(q, v, in_graph=True)
    assert set(selector._routes) == {(q.device, BF16, 192, 128, False), (q.device, BF16, 192, 128, True)}


def test_info_names_the_backend_inside_graph_trees(all_installed) -> None:
    from mla_ops.cli.info import machine_table

    def trees_line() -> str:
        (line,) = [s for s in machine_table(SM90, CONFIG, True).splitlines() if "CUDA-graph trees:" in s]
        return line

    assert trees_line() == "  CUDA-graph trees: FLASH_ATTN (FLASHINFER plans on the host)"
    with mla_ops.prefill_backend("TRITON"):
        assert trees_line() == "  CUDA-graph trees: TRITON too (it reads the offsets on the device)"
    with mla_ops.prefill_backend("FLASHINFER"):
        assert trees_line().startswith(
            "  CUDA-graph trees: none: Selected MLA prefill backend FLASHINFER cannot run inside CUDA-graph trees"
        )
    assert "CUDA-graph trees" not in machine_table(None, CONFIG, False)


# --- the in-graph twins ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(graph_trees.IN_GRAPH_TWINS))
def test_in_graph_twins_have_the_ops_schema_and_no_tag(name) -> None:
    twin_name = graph_trees.IN_GRAPH_TWINS[name]
    op, twin = getattr(torch.ops.mla, name).default, getattr(torch.ops.mla, twin_name).default
    assert str(twin._schema).replace(twin_name, name, 1) == str(op._schema)
    assert twin.tags == op.tags


@contextlib.contextmanager
def routes(plain: PrefillBackend, in_graph: PrefillBackend, dtype=BF16, dims=(192, 128)) -> Iterator[None]:
    """Make the ops' router return ``plain`` for CPU tensors of this configuration, and ``in_graph``
    when they select with ``in_graph=True``, as a GPU would cache its choices."""
    selector.clear_cache()
    for flag, backend in ((False, plain), (True, in_graph)):
        selector._routes[(torch.device("cpu"), dtype, *dims, flag)] = backend
    try:
        yield
    finally:
        selector.clear_cache()


@contextlib.contextmanager
def simulated_h200(flashinfer: FlashInferBackend) -> Iterator[PrefillBackend]:
    """Route CPU tensors of DeepSeek's head dims as an H200 selects: FLASHINFER outside CUDA-graph
    trees, and inside them what ``select_backend(SM90, ..., in_graph=True)`` picks (yielded)."""
    inside = selector.select_backend(SM90, CONFIG, in_graph=True)
    assert selector.select_backend(SM90, CONFIG) is flashinfer and inside.name == "FLASH_ATTN"
    with routes(flashinfer, inside):
        yield inside


def _chunk_inputs(seed: int = 3):
    b = make_batch([5, 0, 9], 2, 192, 128, BF16, strided_v=True, seed=seed)
    _, k, v = make_qkv(7, 2, 192, 128, BF16, strided_v=True, generator=torch.Generator().manual_seed(seed + 1))
    return b, k, v, cu_seqlens_of([3, 0, 4])


def test_in_graph_twins_select_with_in_graph(all_installed) -> None:
    b, k_c, v_c, cu_k = _chunk_inputs()
    new_tokens = (b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen, 0.07)
    chunk = (b.q, k_c, v_c, b.cu_seqlens, cu_k, b.max_seqlen, 4, 0.07)
    with simulated_h200(all_installed) as inside:
        for op, args, attention_args in (
            (
                "prefill",
                new_tokens,
                (b.q, b.k, b.v, b.cu_seqlens, b.cu_seqlens, b.max_seqlen, b.max_seqlen, 0.07, True),
            ),
            ("prefill_context_chunk", chunk, (*chunk, False)),
        ):
            twin = graph_trees.IN_GRAPH_TWINS[op]
            planned = all_installed.plan_count
            got = getattr(torch.ops.mla, twin)(*args)
            assert all_installed.plan_count == planned, f"mla::{twin} ran FLASHINFER"
            want = inside.attention(VarlenCall(*attention_args))
            assert all(torch.equal(g, w) for g, w in zip(got, want)), f"mla::{twin} did not run {inside.name}"
            getattr(torch.ops.mla, op)(*args)
            assert all_installed.plan_count == planned + 1, f"mla::{op} must still run FLASHINFER"


@pytest.mark.parametrize("twin", sorted(graph_trees.IN_GRAPH_TWINS.values()))
def test_in_graph_twins_pass_opcheck_and_validate_as_the_ops_do(twin) -> None:
    b, k_c, v_c, cu_k = _chunk_inputs()
    if twin == "prefill_in_graph":
        args = (b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen, 0.07)
    else:
        args = (b.q, k_c, v_c, b.cu_seqlens, cu_k, b.max_seqlen, 4, 0.07)
    op = getattr(torch.ops.mla, twin)
    torch.library.opcheck(op, args)
    bad = (args[0].float(), *args[1:])
    with pytest.raises(TypeError, match=r"q has dtype float32; only bfloat16 and float16 are supported"):
        op(*bad)


# --- the Python API under torch.compile --------------------------------------------------------------------


def test_routes_in_graph_is_false_outside_torch_compile() -> None:
    with inductor_config.patch({"triton.cudagraphs": True}):
        assert graph_trees.routes_in_graph() is False


def test_dynamo_takes_routes_in_graph_as_a_constant_as_the_public_decorator_would() -> None:
    # graph_trees marks the function itself, so as not to import Dynamo with the package; this fails if
    # torch.compiler.assume_constant_result ever needs more than that mark.
    def probe() -> None:
        pass

    marks = dict(vars(torch.compiler.assume_constant_result(probe)))
    assert marks and all(getattr(graph_trees.routes_in_graph, name, None) == value for name, value in marks.items())


def _attend(q, k, v, cu, max_seqlen, chunks):
    return mla_ops.prefill_with_context(q, k, v, cu, max_seqlen, chunks)


def _attend_directly(q, k, v, cu, max_seqlen, chunks):
    """The same through ``torch.ops.mla`` (one chunk), which the routing rule does not reach."""
    out, lse = torch.ops.mla.prefill(q, k, v, cu, max_seqlen, 0.07)
    (k_c, v_c, cu_k, max_k) = chunks[0]
    out_c, lse_c = torch.ops.mla.prefill_context_chunk(q, k_c, v_c, cu, cu_k, max_seqlen, max_k, 0.07)
    return torch.ops.mla.merge_attn_states(out_c, lse_c, out, lse)


def _args():
    b, k_c, v_c, cu_k = _chunk_inputs(seed=1)
    return b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen, [mla_ops.ContextChunk(k_c, v_c, cu_k, 4)]


def _compiled_run(fn, **compile_kwargs) -> tuple[tuple[torch.Tensor, torch.Tensor], str]:
    """``fn`` compiled with ``compile_kwargs`` and run once: its result and Inductor's output code."""
    torch._dynamo.reset()
    with torch.no_grad():
        result, code = run_and_get_code(torch.compile(fn, fullgraph=True, **compile_kwargs), *_args())
    return result, "\n".join(code)


def _eager_on(backend: PrefillBackend, fn=_attend) -> tuple[torch.Tensor, torch.Tensor]:
    """``fn`` run eagerly with every call routed to ``backend``."""
    with routes(backend, backend), torch.no_grad():
        return fn(*_args())


PLAIN = ("torch.ops.mla.prefill.default(", "torch.ops.mla.prefill_context_chunk.default(")
IN_GRAPH = ("torch.ops.mla.prefill_in_graph.default(", "torch.ops.mla.prefill_context_chunk_in_graph.default(")


@pytest.mark.parametrize(
    "compile_kwargs, calls, runs_flashinfer",
    [
        pytest.param({}, PLAIN, True, id="default"),
        pytest.param({"mode": "max-autotune-no-cudagraphs"}, PLAIN, True, id="max-autotune-no-cudagraphs"),
        pytest.param({"mode": "reduce-overhead"}, IN_GRAPH, False, id="reduce-overhead"),
        pytest.param({"mode": "max-autotune"}, IN_GRAPH, False, id="max-autotune"),
    ],
)
def test_the_api_routes_only_inside_graph_trees(all_installed, compile_kwargs, calls, runs_flashinfer) -> None:
    with simulated_h200(all_installed) as inside:
        (out, lse), code = _compiled_run(_attend, **compile_kwargs)
        planned = all_installed.plan_count
    assert all(call in code for call in calls), code
    assert sum(code.count(call) for call in PLAIN + IN_GRAPH) == 2, "one call of each op, no other"
    want_out, want_lse = _eager_on(all_installed if runs_flashinfer else inside)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert planned == (2 if runs_flashinfer else 0), "FLASHINFER plans the new tokens and the chunk, or does not run"


def test_eager_calls_are_not_routed(all_installed) -> None:
    with simulated_h200(all_installed):
        with torch.no_grad():
            out, lse = _attend(*_args())
        assert all_installed.plan_count == 2
    want_out, want_lse = _eager_on(all_installed)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


@pytest.fixture
def cpu_graph_tree_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the fake kernels' refusal judge CPU calls, as it judges CUDA calls."""
    monkeypatch.setattr(graph_trees, "CHECKED_DEVICE_TYPES", ("cpu", "cuda"))


def test_direct_op_calls_are_still_refused_and_told_of_the_api(all_installed, cpu_graph_tree_check) -> None:
    with simulated_h200(all_installed) as inside:
        with pytest.raises(Exception, match=r"mla::prefill: the FLASHINFER backend plans each batch") as info:
            _compiled_run(_attend_directly, mode="reduce-overhead")
        message = str(info.value)
        assert (
            "Calls through mla_ops.prefill, mla_ops.prefill_context_chunk and mla_ops.prefill_with_context" in message
        )
        assert "are routed automatically" in message and "instead of torch.ops.mla.prefill" in message
        # The same attention through the Python API compiles, and runs the backend chosen for the graphs.
        (out, lse), code = _compiled_run(_attend, mode="reduce-overhead")
        assert all(call in code for call in IN_GRAPH)
        assert all_installed.plan_count == 0
        # Without CUDA-graph trees the direct calls compile as before.
        _compiled_run(_attend_directly)
    want_out, want_lse = _eager_on(inside)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
