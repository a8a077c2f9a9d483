#!/usr/bin/env python
"""Per-call overhead of the MLA ops: routing, op dispatch, and the backend against its raw library call.

On a tiny problem (default T=16 tokens in one sequence, H=16, (Dqk, Dv) = (192, 128)), where the
kernels take a few microseconds, it measures per call:

1. ``mla_ops.selector.route_checked(call, sizes)`` alone, the warm routing lookup the ops make after their
   input check (``sizes``: what the check read, ``mla_ops.meta.checks.checked_attention_sizes``): under the
   row's backend forced (*routing*), and with none forced (*auto routing*: the automatic choice, by the call's
   size class where this GPU has a cost table);
2. ``torch.ops.mla.prefill`` end to end (and ``mla_ops.prefill``, the Python wrapper over it);
3. the backend's ``attention`` method called directly (no dispatch, no input checks);
4. the raw library call its backend makes (FlashInfer's planned wrapper, the FlashAttention
   implementation FLASH_ATTN runs here, the package's Triton kernel function, or the reference math
   on CPU);

and reports (2)-(3), the op's own overhead, and (2)-(4). The same for ``prefill_context_chunk``, for
a layer's attention with one context chunk (``mla_ops.prefill_with_context``, which eagerly calls the
fused op ``mla.prefill_with_chunk``, against the backend's two ``attention_for_merge`` calls and the merge,
and the raw calls merged), and for ``merge_attn_states``. On CUDA it also captures N calls in a CUDA graph,
where the backend can be captured, and times replays: there the host cost disappears and what remains is
device time.

Writes ``dispatch.csv``, ``dispatch.md`` and ``dispatch.env.json`` into
``benchmarks/results/<gpu-slug>/`` (or ``--out``). See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The shared modules live next to this script, which is not part of a package.
from benchlib import attribution as A
from benchlib import cli, timing
from benchlib import methods as M
from benchlib import problems as P
from benchlib import report as R

if TYPE_CHECKING:
    import torch

#: The columns of dispatch.csv, and of dispatch.md (the per-call figures in µs) for those with a header.
FIELDS = R.Fields(
    ("path", "path"),
    ("backend", "backend"),
    ("auto_selected", "auto", lambda row: "yes" if row.get("auto_selected") else ""),
    "tokens",
    "heads",
    ("routing_us", "routing µs", ".2f"),
    ("routing_auto_us", "auto routing µs", ".2f"),
    ("api_us", "mla_ops.* µs", ".2f"),
    ("op_us", "torch.ops.mla.* µs", ".2f"),
    ("direct_us", "direct µs", ".2f"),
    ("raw_us", "raw µs", ".2f"),
    "raw_call",  # in the Markdown table with the note
    ("op_minus_direct_us", "op − direct", ".2f"),
    ("op_minus_raw_us", "op − raw", ".2f"),
    ("op_minus_raw_q1_us", "op − raw, 1st quartile", ".2f"),
    ("op_minus_raw_q3_us", "op − raw, 3rd quartile", ".2f"),
    ("op_minus_raw_interleaved_us", "op − raw, interleaved samples [quartiles]", lambda row: interleaved_cell(row)),
    "op_minus_raw_interleaved_q1_us",
    "op_minus_raw_interleaved_q3_us",
    "interleaved_samples",
    ("raw_outputs_us", "raw, op's outputs µs", ".2f"),
    ("op_minus_raw_outputs_us", "op − raw, op's outputs", ".2f"),
    ("graph_op_us", "graph op µs", ".2f"),
    ("graph_raw_us", "graph raw µs", ".2f"),
    ("host_issue_us", "op host issue µs", ".2f"),
    ("host_issue_raw_us", "raw host issue µs", ".2f"),
    ("note", "raw call / note", R.text("raw_call", "note")),
)


def per_call_series(
    fns: dict[str, Callable[[], Any]], iters: dict[str, int], device: torch.device, rounds: int
) -> dict[str, list[float]]:
    """Per-call wall time in µs of each function in each of ``rounds`` rounds: the mean time of
    ``iters[name]`` back-to-back calls, the functions taking turns within each round (in reverse order in
    odd rounds).

    The device is synchronised before each batch of calls and the timer stops after the last call's work,
    so a figure is the larger of the host's issue cost and the device's execution time per call.
    """
    per_fn = {name: {"calls_per_sample": n, "warmup_calls": max(3, n // 10)} for name, n in iters.items()}
    series = timing.alternating(
        fns, device, rounds, per_fn=per_fn, reverse_odd_rounds=True, samples=1, flush_l2=False, sync_each=True
    )
    return {name: [1e3 * value for value in values] for name, values in series.items()}


def per_call_us(
    fns: dict[str, Callable[[], Any]], iters: dict[str, int], device: torch.device, rounds: int
) -> dict[str, float]:
    """Each function's median over the rounds of :func:`per_call_series`, in µs per call."""
    return {name: statistics.median(values) for name, values in per_call_series(fns, iters, device, rounds).items()}


def interleaved_cell(row: dict[str, Any]) -> str:
    """The Markdown cell of the interleaved op − raw: the median and, in brackets, the quartiles."""
    if row.get("op_minus_raw_interleaved_us") in (None, ""):
        return "—"
    low, high = row["op_minus_raw_interleaved_q1_us"], row["op_minus_raw_interleaved_q3_us"]
    return f"{R.fmt(row['op_minus_raw_interleaved_us'], '.2f')} [{R.fmt(low, '.2f')}, {R.fmt(high, '.2f')}]"


def record_interleaved(
    out: dict[str, Any], op: Callable[[], Any], raw: Callable[[], Any], device: torch.device, args: argparse.Namespace
) -> None:
    """op − raw from ``--interleaved-samples`` samples of each taken in turns (:func:`benchlib.timing.interleaved`),
    each sample ``--sample-calls`` back-to-back calls: the median and quartiles of the per-sample differences, in
    µs per call. A pair of samples lies milliseconds apart, so drift that a round of ``--iters`` calls per
    function still spans (a shared host's load changing within a round) cancels too."""
    count = args.interleaved_samples
    if count <= 0:
        return
    samples = timing.interleaved(
        {"op": op, "raw": raw}, device, calls_per_sample=args.sample_calls, flush_l2=False, sync_each=True,
        min_samples=count, max_samples=count,
    )  # fmt: skip
    difference = timing.difference_of_rounds([1e3 * t for t in samples["op"]], [1e3 * t for t in samples["raw"]])
    out["op_minus_raw_interleaved_us"] = difference.median
    out["op_minus_raw_interleaved_q1_us"], out["op_minus_raw_interleaved_q3_us"] = difference.low, difference.high
    out["interleaved_samples"] = difference.rounds


def record_series(out: dict[str, Any], series: dict[str, list[float]]) -> None:
    """Each function's median into ``out``, and the op's differences from its direct and raw calls as the
    median of the per-round differences (:func:`benchlib.timing.difference_of_rounds`): the op and the
    call it is compared with ran in the same round, so a host that slows down between rounds does not
    enter the difference. For op − raw, the quartiles of the per-round differences too."""
    out.update({name: statistics.median(values) for name, values in series.items()})
    for other, key in (("direct_us", "op_minus_direct_us"), ("raw_us", "op_minus_raw_us"),
                       ("raw_outputs_us", "op_minus_raw_outputs_us")):  # fmt: skip
        if other in series:
            difference = timing.difference_of_rounds(series["op_us"], series[other])
            out[key] = difference.median
            if other == "raw_us":
                out["op_minus_raw_q1_us"], out["op_minus_raw_q3_us"] = difference.low, difference.high


def graph_us(
    fn: Callable[[], Any], device: torch.device, calls: int, replays: int, before: Callable[[], None] | None = None
) -> float:
    """Device time per call, in µs, of ``calls`` calls of ``fn`` captured in one CUDA graph.

    ``before`` runs first, outside capture (host-side planning). The graph is replayed ``replays`` times
    per sample, five samples; the median is reported.
    """
    if before is not None:
        before()

    def calls_of_fn() -> None:
        for _ in range(calls):
            fn()

    graph, _ = M.capture_cuda_graph(calls_of_fn, device)
    graph.replay()
    replay = timing.measure(graph.replay, device, samples=5, calls_per_sample=replays, flush_l2=False)
    del graph
    return replay.median_ms * 1e3 / calls


def raw_graph_call(name: str, raw: M.Method, p: P.Problem, fi_kernel: str) -> Callable[[], Any]:
    """A capturable form of the raw call: FlashInfer needs a ``use_cuda_graph`` wrapper."""
    if name != "FLASHINFER":
        return raw.prepare(p).fn
    w = M.flashinfer_wrapper(p.device, fi_kernel, p.cu_q, p.cu_k, p.heads, p.dtype, p.scale, p.causal, cuda_graph=True)
    q, k, v = p.q, p.k, p.v
    return lambda: w.run(q, k, v, return_lse=True)


def row_start(path: str, name: str, args: argparse.Namespace, auto: str | None = None) -> dict[str, Any]:
    """The fields every row of a path and backend starts with (``auto_selected`` when ``auto`` is given)."""
    row: dict[str, Any] = {"path": path, "backend": name, "tokens": args.tokens, "heads": args.heads}
    if auto is not None:
        row["auto_selected"] = name == auto
    return row


def record_graph_op(
    out: dict[str, Any],
    notes: list[str],
    name: str,
    fn: Callable[[], Any],
    device: torch.device,
    args: argparse.Namespace,
    cu_q: torch.Tensor,
    chunk_offsets: list[torch.Tensor],
) -> bool:
    """``out["graph_op_us"]``: ``fn`` captured in a CUDA graph after ``mla_ops.plan_cuda_graph(cu_q,
    chunk_offsets)`` and replayed, or a note in ``notes`` why not. ``False`` where no capture was tried
    (not on CUDA, ``--no-graph``, or REFERENCE, which reads the offsets on the host)."""
    import torch

    import mla_ops

    if device.type != "cuda" or args.no_graph:
        return False
    if name == "REFERENCE":
        notes.append("not capturable: REFERENCE reads the offsets on the host")
        return False
    try:
        out["graph_op_us"] = graph_us(
            fn,
            device,
            args.graph_calls,
            args.graph_replays,
            before=lambda: mla_ops.plan_cuda_graph(cu_q, cu_seqlens_k=chunk_offsets),
        )
    except Exception as exc:
        notes.append(f"op not capturable: {R.short_error(exc)}")
    finally:
        mla_ops.release_cuda_graph_buffers()
        torch.cuda.synchronize(device)
    return True


def measure_backend(
    row: dict[str, Any], path: str, p: P.Problem, args: argparse.Namespace, device: torch.device, auto: str
) -> dict[str, Any]:
    """One row: routing, API, op, direct and raw per-call costs (and graph costs on CUDA) for one path."""
    import torch

    import mla_ops
    from mla_ops.backends.base import VarlenCall
    from mla_ops.meta.checks import checked_attention_sizes
    from mla_ops.selector import route_checked

    name, backend = row["name"], row["backend"]
    out = row_start(path, name, args, auto)
    notes = []
    q, k, v, cu_q, cu_k, max_q, max_k, scale = p.attention_args()
    call = VarlenCall(q, k, v, cu_q, cu_q if path == "prefill" else cu_k, max_q, max_q if path == "prefill" else max_k,
                      scale, path == "prefill")  # fmt: skip
    sizes = checked_attention_sizes(*call)
    if path == "prefill":
        op_args = (q, k, v, cu_q, max_q, scale)
        op, api = torch.ops.mla.prefill, mla_ops.prefill
    else:
        op_args = (q, k, v, cu_q, cu_k, max_q, max_k, scale)
        op, api = torch.ops.mla.prefill_context_chunk, mla_ops.prefill_context_chunk
    with mla_ops.prefill_backend(name):
        fns = {
            "routing_us": lambda: route_checked(call, sizes),
            "api_us": lambda: api(*op_args),
            "op_us": lambda: op(*op_args),
            "direct_us": M.DirectMethod(name, backend).prepare(p).fn,
        }
        iters = {"routing_us": 10 * args.iters}  # ~1 µs: more calls for the same time
        raw = M.raw_method_for(name, backend, device, args.fi_backend)
        why = "it has none" if raw is None else raw.unavailable(device)
        if why is None:
            try:
                fns["raw_us"] = raw.prepare(p).fn
                out["raw_call"] = raw.implementation
            except Exception as exc:
                why = R.short_error(exc)
        if why is not None:
            notes.append(f"raw call unavailable: {why}")
        if name == "FLASHINFER" and why is None:  # the one raw call whose outputs differ from the op's
            try:
                fns["raw_outputs_us"] = M.FlashInferRaw(args.fi_backend, natural_lse=True).prepare(p).fn
            except Exception as exc:
                notes.append(f"raw call with the op's outputs unavailable: {R.short_error(exc)}")
        record_series(out, per_call_series(fns, {n: iters.get(n, args.iters) for n in fns}, device, args.rounds))
        if "raw_us" in fns:
            record_interleaved(out, fns["op_us"], fns["raw_us"], device, args)
        chunks = [] if path == "prefill" else [cu_k]
        # No backend forced: the route the ops take by default, by size class where a cost table ranks the backends.
        with mla_ops.prefill_backend(None):
            auto_route = {"routing_auto_us": lambda: route_checked(call, sizes)}
            record_series(out, per_call_series(auto_route, {"routing_auto_us": 10 * args.iters}, device, args.rounds))
        captured = record_graph_op(out, notes, name, lambda: op(*op_args), device, args, cu_q, chunks)
        if captured and "raw_us" in out:
            try:
                fn = raw_graph_call(name, raw, p, args.fi_backend)
                out["graph_raw_us"] = graph_us(fn, device, args.graph_calls, args.graph_replays)
            except Exception as exc:
                notes.append(f"raw call not capturable: {R.short_error(exc)}")
    out["note"] = "; ".join(notes)
    return out


#: The path name of the one-chunk layer rows.
LAYER_PATH = "prefill_with_context, 1 chunk"


def measure_layer(
    row: dict[str, Any], causal: P.Problem, chunk: P.Problem, args: argparse.Namespace, device: torch.device, auto: str
) -> dict[str, Any]:
    """One row for a layer's attention with one context chunk: the new tokens of ``causal`` over
    themselves and over ``chunk``'s keys, merged. *mla_ops.** is ``mla_ops.prefill_with_context`` (eagerly
    one call of the fused op), *torch.ops.mla.** the fused op ``mla.prefill_with_chunk`` itself, *direct*
    what that op calls: the backend's two ``attention_for_merge`` calls and the merge function, *raw* the
    backend's library calls merged as ``bench_layers.py``'s raw layers merge them
    (:class:`benchlib.methods.RawLayerAttention`)."""
    import torch

    import mla_ops

    name, backend = row["name"], row["backend"]
    out = row_start(LAYER_PATH, name, args, auto)
    notes = []
    q, k, v, cu, _, max_q, _, scale = causal.attention_args()
    k_c, v_c, cu_k, max_k = chunk.k, chunk.v, chunk.cu_k, chunk.max_k
    chunks = [mla_ops.ContextChunk(k_c, v_c, cu_k, max_k)]
    fused_args = (q, k, v, cu, max_q, k_c, v_c, cu_k, max_k, scale)
    fused = torch.ops.mla.prefill_with_chunk
    direct = A.backend_attention(backend, device, for_merge=True)

    with mla_ops.prefill_backend(name):
        fns = {
            "api_us": lambda: mla_ops.prefill_with_context(q, k, v, cu, max_q, chunks, scale),
            "op_us": lambda: fused(*fused_args),
            "direct_us": lambda: direct(q, k, v, cu, max_q, chunks, scale),
        }
        raw = M.raw_method_for(name, backend, device, args.fi_backend)
        why = "it has none" if raw is None else raw.unavailable(device)
        if why is None:
            try:
                layer = M.RawLayerAttention(raw, device)
                layer.plan(cu, [cu_k], args.heads, causal.dtype, scale)
                fns["raw_us"] = lambda: layer(q, k, v, cu, max_q, chunks, scale)
                out["raw_call"] = f"{raw.implementation}, twice, and the merge"
            except Exception as exc:
                why = R.short_error(exc)
        if why is not None:
            notes.append(f"raw calls unavailable: {why}")
        record_series(out, per_call_series(fns, dict.fromkeys(fns, args.iters), device, args.rounds))
        if "raw_us" in fns:
            record_interleaved(out, fns["op_us"], fns["raw_us"], device, args)
        record_graph_op(out, notes, name, lambda: fused(*fused_args), device, args, cu, [cu_k])
    out["note"] = "; ".join(notes)
    return out


def measure_merge(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """The merge op against the function it dispatches to (the native merge where it is loaded), and, where
    the op runs the native merge, the Triton merge as the op's Python kernel would call it, for comparison."""
    import torch

    import mla_ops
    from mla_ops import native
    from mla_ops.backends.base import MergeCall
    from mla_ops.meta.checks import check_merge_inputs
    from mla_ops.runtime.merge_dispatch import merge_kernel

    p = P.make_problem(P.Shape("merge", args.heads, (args.tokens,)), device, getattr(torch, args.dtype), args.seed)
    merge_args = p.merge
    merge_call = MergeCall(*merge_args)
    kernel = merge_kernel(device)  # on CUDA: builds and loads the native merge where it can
    backend = f"{kernel.__module__}.{kernel.__qualname__}" + ("" if device.type == "cuda" else " (CPU key)")
    row: dict[str, Any] = {"path": "merge_attn_states", "backend": backend, "tokens": args.tokens, "heads": args.heads}
    fns = {
        "api_us": lambda: mla_ops.merge_attn_states(*merge_args),
        "op_us": lambda: torch.ops.mla.merge_attn_states(*merge_args),
        "direct_us": lambda: kernel(merge_call),
    }
    triton = None  # the Triton merge as the op's Python kernel calls it, where the op runs the native one
    if device.type == "cuda" and native.is_loaded():
        from mla_ops.kernels.merge import merge_attn_states_triton

        triton = fns["triton_us"] = lambda: merge_attn_states_triton(merge_call, check=check_merge_inputs)
    parts = merge_parts(merge_args, device)
    if parts is not None:
        fns["raw_us"], fns["alloc_us"], fns["launch_us"] = parts
        row["raw_call"] = MERGE_PARTS
    timed = per_call_us(fns, dict.fromkeys(fns, args.iters), device, args.rounds)
    split = (timed.pop("alloc_us"), timed.pop("launch_us")) if parts is not None else None
    triton_us = timed.pop("triton_us", None)
    row.update(timed)
    row["op_minus_direct_us"] = row["op_us"] - row["direct_us"]
    if parts is not None:
        row["op_minus_raw_us"] = row["op_us"] - row["raw_us"]
    row["note"] = "direct: the function the op dispatches to" + (
        f"; raw split: the two empty_like {split[0]:.2f} µs, the launch alone {split[1]:.2f} µs"
        if split is not None
        else "; raw: needs the Triton merge kernel launched directly (CUDA, Triton >= 3.4)"
    )
    if triton is not None:
        row["note"] += "; the op runs the native merge's C++ kernel (mla_ops.native)"
    if device.type == "cuda" and not args.no_graph:
        try:
            row["graph_op_us"] = graph_us(fns["op_us"], device, args.graph_calls, args.graph_replays)
            row["graph_raw_us"] = graph_us(fns["direct_us"], device, args.graph_calls, args.graph_replays)
        except Exception as exc:
            row["note"] += f"; not capturable: {R.short_error(exc)}"
    rows = [row]
    if triton is not None:
        rows.append(
            {
                "path": "merge_attn_states",
                "backend": "mla_ops.kernels.merge.merge_attn_states_triton",
                "tokens": args.tokens,
                "heads": args.heads,
                "direct_us": triton_us,
                "raw_us": row.get("raw_us"),
                "raw_call": row.get("raw_call"),
                "note": "the Triton merge as the op's Python kernel calls it (with the op's input check), timed in "
                "the same rounds as the native op above: what the op costs without the native merge, less the "
                "dispatch floor",
            }
        )
        if device.type == "cuda" and not args.no_graph:
            rows[-1]["graph_raw_us"] = graph_us(triton, device, args.graph_calls, args.graph_replays)
    return rows


#: What the merge row's raw column times.
MERGE_PARTS = "the merge's fixed parts: two torch.empty_like of its outputs and one launch of the compiled kernel"


def merge_parts(merge_args: tuple, device: torch.device) -> tuple[Callable[[], Any], ...] | None:
    """The part of a merge call that no code of the package can drop: its outputs' two allocations (from
    templates, as a known layout makes them) and one launch of the compiled Triton kernel, the layout's
    arguments fixed. With the dispatch floor, it bounds the merge op from below on this host.

    Returns ``(both, allocations, launch)``: the two parts together, and each alone (the launch into
    outputs allocated once); ``None`` where the kernel is not launched directly (CPU, the interpreter, an
    older Triton)."""
    import torch

    if device.type != "cuda":
        return None
    from mla_ops.kernels import merge
    from mla_ops.runtime.alloc import template

    prefix_out = merge_args[0]
    num_tokens, num_heads, dv = prefix_out.shape
    out_template = template((num_tokens, num_heads, dv), prefix_out.dtype, prefix_out.device)
    lse_template = template((num_heads, num_tokens), torch.float32, prefix_out.device)
    if out_template is None or lse_template is None:  # one element or none: no template
        return None
    fixed = None
    for _ in range(2):  # the first launch compiles the variant through the JIT function, the second returns it
        out, lse = torch.empty_like(out_template), torch.empty_like(lse_template)
        fixed = merge.LAUNCHES.launch(*merge_args, out, lse, (False, False), None, None)
    if fixed is None:
        return None
    inputs = tuple(t.data_ptr() for t in merge_args)

    def parts() -> None:
        out, lse = torch.empty_like(out_template), torch.empty_like(lse_template)
        fixed((*inputs, out.data_ptr(), lse.data_ptr()))

    def allocations() -> None:
        torch.empty_like(out_template), torch.empty_like(lse_template)

    addresses = (*inputs, out.data_ptr(), lse.data_ptr())

    def launch() -> None:
        fixed(addresses)

    # The launch alone writes into the loop's last outputs by address: the function holds them, so that
    # they are not freed (and their memory handed to other tensors) while it is timed.
    launch.outputs = (out, lse)
    return parts, allocations, launch


def measure_dispatch_floor(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """What the dispatcher alone costs here: an op with ``mla.prefill``'s schema whose Python kernel
    only returns two preallocated tensors, through ``torch.ops`` against the kernel function called
    directly. No op with a Python kernel can cost less than this above its raw call."""
    import torch

    from mla_ops.ops import SCHEMAS

    p = P.make_problem(P.Shape("causal", args.heads, (args.tokens,)), device, getattr(torch, args.dtype), args.seed)
    q, k, v, cu_q, _, max_q, _, scale = p.attention_args()
    outputs = (torch.empty_like(v), torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=device))

    def kernel(q, k, v, cu_seqlens, max_seqlen, softmax_scale):
        return outputs

    # Registered for this measurement only, and removed afterwards, so that another run in the same
    # process (the tests call main() more than once) can register it again.
    lib = torch.library.Library("mla_bench", "FRAGMENT")
    try:
        lib.define("noop_" + SCHEMAS["prefill"])
        lib.impl("noop_prefill", kernel, "CPU")
        lib.impl("noop_prefill", kernel, "CUDA")
        op = torch.ops.mla_bench.noop_prefill
        fns = {
            "op_us": lambda: op(q, k, v, cu_q, max_q, scale),
            "direct_us": lambda: kernel(q, k, v, cu_q, max_q, scale),
        }
        row: dict[str, Any] = {"path": "dispatch floor", "backend": "no-op", "tokens": args.tokens, "heads": args.heads}
        row.update(per_call_us(fns, dict.fromkeys(fns, args.iters), device, args.rounds))
    finally:
        lib._destroy()
    row["op_minus_direct_us"] = row["op_us"] - row["direct_us"]
    row["note"] = "a Python kernel that returns preallocated outputs, registered with mla.prefill's schema"
    return row


#: The path name of the host-issue rows.
HOST_ISSUE_PATH = "prefill_context_chunk, host issue"
#: Their chunk on CUDA unless ``--host-chunk`` says otherwise: (new tokens, context keys). At H=16 its 131072
#: key rows times heads take TRITON's Gluon kernel on SM90, whose 0.13 ms outlasts any backend's host time.
DEFAULT_HOST_CHUNK = (1024, 8192)


def measure_host_issue(
    row: dict[str, Any], args: argparse.Namespace, device: torch.device, dtype: torch.dtype, auto: str
) -> dict[str, Any]:
    """One row: the host time of issuing one ``prefill_context_chunk`` op call, and one raw library call, on a
    chunk large enough that the kernel outlasts the host (``--host-chunk``: one sequence of NEW tokens over
    CONTEXT keys), where the per-call figures of the other rows are device time. For TRITON on SM90 this is
    the Gluon kernel's call (from ``TMA_MIN_KEY_ROWS`` key rows times heads)."""
    import torch

    import mla_ops

    name, backend = row["name"], row["backend"]
    new, context = args.host_chunk
    out = row_start(HOST_ISSUE_PATH, name, args, auto) | {"tokens": new}
    notes = [f"{new} new tokens over {context} keys"]
    p = P.make_problem(P.Shape("chunk", args.heads, (new,), (context,)), device, dtype, args.seed)
    q, k, v, cu_q, cu_k, max_q, max_k, scale = p.attention_args()
    op_args = (q, k, v, cu_q, cu_k, max_q, max_k, scale)

    def host_us(fn: Callable[[], Any]) -> float:
        return 1e3 * statistics.median(timing.host_issue(fn, device, args.host_calls, args.rounds))

    with mla_ops.prefill_backend(name):
        out["host_issue_us"] = host_us(lambda: torch.ops.mla.prefill_context_chunk(*op_args))
    raw = M.raw_method_for(name, backend, device, args.fi_backend)
    why = "it has none" if raw is None else raw.unavailable(device)
    if why is None:
        try:
            fn = raw.prepare(p).fn
            out["host_issue_raw_us"] = host_us(fn)
            out["raw_call"] = raw.implementation
        except Exception as exc:
            why = R.short_error(exc)
    if why is not None:
        notes.append(f"raw call unavailable: {why}")
    if name == "TRITON" and device.type == "cuda":
        from mla_ops.kernels.attention import large_batch_config

        large = large_batch_config(p.q, p.k, p.v, p.scale, False)
        notes.append("the tl.dot kernel" if large is None else "the Gluon kernel")
    out["note"] = "; ".join(notes)
    return out


def print_row(result: dict[str, Any]) -> None:
    """A row's per-call figures on one line, and its note."""
    keys = (
        "routing_us", "routing_auto_us", "api_us", "op_us", "direct_us", "raw_us", "graph_op_us", "graph_raw_us",
        "host_issue_us", "host_issue_raw_us",
    )  # fmt: skip
    figures = ", ".join(f"{k} {R.fmt(result.get(k), '.2f')}" for k in keys if k in result)
    print(f"  {figures}  {result.get('note', '')}")


def render_markdown(rows: list[dict[str, Any]], env: dict[str, Any]) -> str:
    """The results as Markdown: header, the table, and what the columns mean."""
    shape = f"T={rows[0]['tokens']}, H={rows[0]['heads']}, (Dqk, Dv) = ({P.DQK}, {P.DV})" if rows else ""
    intro = (
        "Per-call wall time in µs (median over rounds of back-to-back calls, the garbage collector paused as "
        "timeit does; on CUDA the larger of host issue "
        "cost and device time). *op − direct* is the cost of the op layer (dispatcher, input checks, "
        "routing); *op − raw* adds the backend's own wrapping (output allocation, LSE conversion, padding). "
        "The differences in the attention rows are medians of per-round differences (the functions take "
        "turns in each round, in reverse order every other round), not differences of the columns' medians; "
        "the quartile columns give the middle half of the rounds' op − raw. *op − raw, interleaved samples*: the "
        "median of per-sample differences of samples of a few calls of the op and of its raw call taken in "
        "turns, milliseconds apart (quartiles in brackets). "
        "*raw, op's outputs*: for FLASHINFER, whose raw call returns a base-2 [T, H] LSE, the library's own "
        'call that returns the op\'s natural-log [H, T] one (run(..., lse_base="ln", lse_layout="HN")); the '
        "other raw calls return the op's outputs already. "
        "*routing*: mla_ops.selector.route_checked alone (the route from the sizes the op's input check read) "
        "under the row's backend forced; *auto routing*: with none forced, the automatic route (by the call's "
        "size class where this GPU has a cost table, as the ops route by default). *graph* columns: device time "
        "per call inside a replayed CUDA graph. *host issue* columns (the "
        f"*{HOST_ISSUE_PATH}* rows): the host time of issuing one call on a chunk whose kernel outlasts it "
        "(time.perf_counter around back-to-back calls that queue on the device; for TRITON on SM90 the Gluon "
        "kernel's call), the op's and the raw library call's. The *dispatch floor* row is an op "
        "with mla.prefill's schema whose Python kernel only returns preallocated outputs: what the dispatcher "
        "alone costs on this host, below which no op with a Python kernel can go. The *prefill_with_context, 1 "
        "chunk* rows are a layer's attention with one context chunk: mla_ops.prefill_with_context, the fused op "
        "mla.prefill_with_chunk it calls eagerly, the backend's two attention_for_merge calls and the merge "
        "(direct: what that op calls), and "
        "the library's calls merged (raw). In the *merge_attn_states* rows, raw is the Triton merge's fixed parts "
        "(two torch.empty_like of its outputs and one launch of the compiled kernel): with the dispatch floor, "
        "the least a merge op with a Python kernel can cost on this host. Where the native merge is loaded, the "
        "op runs its C++ kernel, and a second row times the Triton merge function for comparison. Design "
        "goals: op − raw <= 5 µs; the merge op <= 15 µs."
    )
    return R.results_page("MLA op dispatch overhead", env, intro, FIELDS.table(rows), extra=[shape])


def _host_chunk(text: str) -> tuple[int, ...]:
    """``--host-chunk``'s value: ``(new, context)``, or ``()`` for 'none'."""
    if text.strip().lower() == "none":
        return ()
    try:
        new, context = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NEW,CONTEXT (two integers) or 'none', got {text!r}") from None
    if new < 1 or context < 1:
        raise argparse.ArgumentTypeError(f"NEW and CONTEXT must be positive, got {text!r}")
    return new, context


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser(
        "Per-call overhead of the mla ops on a tiny problem: routing lookup, torch.ops.mla.* end to end, the "
        "backend's attention method called directly, and the raw library call (plus CUDA-graph replay on GPU). "
        "Writes dispatch.csv, dispatch.md and dispatch.env.json."
    )
    cli.add_out_dir(parser)
    cli.add_backends(parser)
    parser.add_argument("--tokens", type=int, default=16, help="tokens T (one sequence; the chunk has T keys too)")
    parser.add_argument("--heads", type=int, default=16, help="heads H")
    parser.add_argument("--iters", type=int, help="calls per round (default: 2000 on GPU, 100 on CPU)")
    parser.add_argument("--rounds", type=int, default=9, help="rounds; the median is reported")
    parser.add_argument(
        "--interleaved-samples",
        type=int,
        default=200,
        help="samples of the op and of its raw call taken in turns, for the interleaved op − raw (0: skip it)",
    )
    parser.add_argument("--sample-calls", type=int, default=10, help="back-to-back calls per interleaved sample")
    parser.add_argument("--graph-calls", type=int, default=50, help="calls captured in one CUDA graph")
    parser.add_argument("--graph-replays", type=int, default=20, help="replays per timing sample")
    parser.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph measurements")
    parser.add_argument(
        "--host-chunk", type=_host_chunk, metavar="NEW,CONTEXT",
        help="the host-issue rows' chunk: NEW tokens over CONTEXT keys, one sequence (default: 1024,8192 on CUDA, "
        "none on CPU); 'none' skips those rows",
    )  # fmt: skip
    parser.add_argument(
        "--host-calls", type=int, default=20, help="calls issued back to back per host-issue round (default 20)"
    )
    parser.add_argument(
        "--merge-only",
        action="store_true",
        help="measure only the dispatch floor and merge_attn_states (e.g. with a large --tokens, where the "
        "attention paths would take long)",
    )
    parser.add_argument(
        "--flashinfer-backend",
        dest="fi_backend",
        default="auto",
        help="kernel of the raw FlashInfer call: auto (the one FLASHINFER runs: fa3 on SM90), fa2, fa3, ...",
    )
    cli.add_device(parser)
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.heads < 1:
        parser.error("--tokens and --heads must be positive")
    if args.host_calls < 1:
        parser.error("--host-calls must be at least 1")
    if args.interleaved_samples < 0 or args.sample_calls < 1:
        parser.error("--interleaved-samples must be 0 or more and --sample-calls at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    threads = torch.get_num_threads()
    try:
        return _run(args, argv)
    finally:
        torch.set_num_threads(threads)  # restore what a caller in the same process had


def _run(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    import torch

    device, dtype = P.setup_device(args, {"iters": 2000}, {"iters": 100})
    if device.type == "cpu":
        # One thread: the figures are host overheads, and on a shared machine a thread pool waiting for
        # cores would swamp them.
        torch.set_num_threads(1)
    args.fi_backend = M.flashinfer_kernel(device, args.fi_backend)
    started = time.perf_counter()
    backends, env = R.start_run(
        "bench_dispatch.py",
        argv,
        device,
        dtype,
        timer="CUDA events (time.perf_counter on CPU) around back-to-back calls, the device synchronised before "
        "each round's batch; CUDA events around graph replays",
        iters=args.iters,
        torch_threads=torch.get_num_threads(),
        rounds=args.rounds,
        graph_calls=args.graph_calls,
    )
    auto = env["auto_selected_backend"].split(" ")[0]
    timed, not_measured = M.backends_to_time(backends, device, args.backends)
    print(f"device: {env['gpu']} ({device}); T={args.tokens}, H={args.heads}, {args.dtype}; auto-selected: {auto}")

    rows: list[dict[str, Any]] = []
    causal = P.make_problem(P.Shape("causal", args.heads, (args.tokens,)), device, dtype, args.seed)
    chunk = P.make_problem(P.Shape("chunk", args.heads, (args.tokens,), (args.tokens,)), device, dtype, args.seed)
    for row in [] if args.merge_only else timed:
        measures = {
            "prefill": functools.partial(measure_backend, row, "prefill", causal, args, device, auto),
            "prefill_context_chunk": functools.partial(
                measure_backend, row, "prefill_context_chunk", chunk, args, device, auto
            ),
            LAYER_PATH: functools.partial(measure_layer, row, causal, chunk, args, device, auto),
        }
        for path, measure in measures.items():
            print(f"{row['name']} {path}...", flush=True)
            try:
                result = measure()
            except Exception as exc:
                result = row_start(path, row["name"], args) | {"note": f"failed: {R.short_error(exc)}"}
            rows.append(result)
            print_row(result)
    if args.host_chunk is None:
        args.host_chunk = DEFAULT_HOST_CHUNK if device.type == "cuda" else ()
    for row in [] if args.merge_only or not args.host_chunk else timed:
        print(f"{row['name']} {HOST_ISSUE_PATH}...", flush=True)
        try:
            result = measure_host_issue(row, args, device, dtype, auto)
        except Exception as exc:
            result = row_start(HOST_ISSUE_PATH, row["name"], args) | {"note": f"failed: {R.short_error(exc)}"}
        rows.append(result)
        print_row(result)
    print("dispatch floor...", flush=True)
    try:
        rows.append(measure_dispatch_floor(args, device))
    except Exception as exc:
        rows.append({"path": "dispatch floor", "backend": "—", "note": f"failed: {R.short_error(exc)}"})
    print("merge_attn_states...", flush=True)
    try:
        rows.extend(measure_merge(args, device))
    except Exception as exc:
        rows.append({"path": "merge_attn_states", "backend": "—", "note": f"failed: {R.short_error(exc)}"})
    R.finish_run(
        args.out, device, "dispatch", FIELDS.keys, rows, env, not_measured, started, lambda: render_markdown(rows, env)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
