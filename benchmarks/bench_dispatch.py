#!/usr/bin/env python
"""Per-call overhead of the MLA ops: routing, op dispatch, and the backend against its raw library call.

On a tiny problem (default T=16 tokens in one sequence, H=16, (Dqk, Dv) = (192, 128)), where the
kernels take a few microseconds, it measures per call:

1. ``mla_ops.selector.backend_for(q, v)`` alone (the warm routing lookup);
2. ``torch.ops.mla.prefill`` end to end (and ``mla_ops.prefill``, the Python wrapper over it);
3. the selected backend's ``prefill`` classmethod called directly (no dispatch, no input checks);
4. the raw library call (FlashInfer's planned wrapper, PyTorch's bundled FlashAttention-2, the
   package's Triton launcher, or the reference math on CPU);

and reports (2)-(3), the op's own overhead, and (2)-(4). The same for ``prefill_context_chunk`` and
for ``merge_attn_states``. On CUDA it also captures N calls in a CUDA graph, where the backend can be
captured, and times replays: there the host cost disappears and what remains is device time.

Writes ``dispatch.csv``, ``dispatch.md`` and ``dispatch.env.json`` into
``benchmarks/results/<gpu-slug>/`` (or ``--out``). See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The helpers live next to this script, which is not part of a package.
import _common as C
import bench_prefill as BP

if TYPE_CHECKING:
    import torch

CSV_FIELDS = [
    "path",
    "backend",
    "auto_selected",
    "tokens",
    "heads",
    "routing_us",
    "api_us",
    "op_us",
    "direct_us",
    "raw_us",
    "raw_call",
    "op_minus_direct_us",
    "op_minus_raw_us",
    "graph_op_us",
    "graph_raw_us",
    "note",
]


def graph_us(
    fn: Callable[[], Any], device: torch.device, calls: int, replays: int, before: Callable[[], None] | None = None
) -> float:
    """Device time per call, in µs, of ``calls`` calls of ``fn`` captured in one CUDA graph.

    ``before`` runs first, outside capture (host-side planning). ``fn`` is warmed up on a side stream,
    as PyTorch's CUDA-graph notes recommend, then captured and replayed ``replays`` times.
    """
    import torch

    if before is not None:
        before()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize(device)
    samples = []
    for _ in range(5):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize(device)
        samples.append(begin.elapsed_time(end) * 1e3 / (replays * calls))
    del graph
    return sorted(samples)[len(samples) // 2]


def raw_call(name: str, p: BP.Problem, fi_backend: str) -> tuple[str, Callable[[], Any]] | None:
    """The raw library call that backend ``name`` wraps, as ``(description, fn)``; ``None`` if it has none."""
    t, causal = p.tensors, p.causal
    if name == "FLASHINFER":
        method = BP.FlashInferRaw(fi_backend)
        return method.implementation, method.prepare(p).fn
    if name == "FLASH_ATTN":
        method = BP.FlashAttn2Raw()
        return "aten._flash_attention_forward (bundled FA2), v padded beforehand", method.prepare(p).fn
    if name == "TRITON":
        from mla_ops.kernels.attention import attention_triton

        args = (t["q"], t["k"], t["v"], t["cu_q"], t["cu_k"], t["max_q"], t["max_k"], p.scale)
        return "mla_ops.kernels.attention.attention_triton", lambda: attention_triton(*args, causal=causal)
    if name == "REFERENCE":
        from mla_ops.backends.reference import attention_reference

        args = (t["q"], t["k"], t["v"], t["cu_q"], t["cu_k"], p.scale)
        return "mla_ops.backends.reference.attention_reference", lambda: attention_reference(*args, causal=causal)
    return None


def raw_graph_call(name: str, p: BP.Problem, fi_backend: str) -> Callable[[], Any] | None:
    """A capturable form of the raw call (FlashInfer needs a ``use_cuda_graph`` wrapper), or ``None``."""
    if name != "FLASHINFER":
        found = raw_call(name, p, fi_backend)
        return None if found is None else found[1]
    import flashinfer
    import torch

    t, heads = p.tensors, p.shape.heads
    ws = torch.empty(128 * 2**20, dtype=torch.uint8, device=p.device)
    qo_buf, kv_buf = t["cu_q"].clone(), t["cu_k"].clone()
    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
        ws, "NHD", use_cuda_graph=True, qo_indptr_buf=qo_buf, kv_indptr_buf=kv_buf, backend=fi_backend
    )
    w.plan(
        t["cu_q"].cpu(),
        t["cu_k"].cpu(),
        heads,
        heads,
        BP.DQK,
        head_dim_vo=BP.DV,
        causal=p.causal,
        sm_scale=p.scale,
        q_data_type=p.dtype,
        kv_data_type=p.dtype,
    )
    return lambda: w.run(t["q"], t["k"], t["v"], return_lse=True)


def measure_backend(
    name: str, cls: type, path: str, p: BP.Problem, args: argparse.Namespace, device: torch.device, auto: str
) -> dict[str, Any]:
    """One row: routing, API, op, direct and raw per-call costs (and graph costs on CUDA) for one path."""
    import torch

    import mla_ops
    from mla_ops.selector import backend_for

    t = p.tensors
    row: dict[str, Any] = {
        "path": path,
        "backend": name,
        "auto_selected": name == auto,
        "tokens": args.tokens,
        "heads": args.heads,
    }
    notes = []
    if path == "prefill":
        op_args = (t["q"], t["k"], t["v"], t["cu_q"], t["max_q"], p.scale)
        op, api, direct = torch.ops.mla.prefill, mla_ops.prefill, cls.prefill
    else:
        op_args = (t["q"], t["k"], t["v"], t["cu_q"], t["cu_k"], t["max_q"], t["max_k"], p.scale)
        op, api, direct = torch.ops.mla.prefill_context_chunk, mla_ops.prefill_context_chunk, cls.prefill_context_chunk
    with mla_ops.prefill_backend(name):
        q, v = t["q"], t["v"]
        fns = {
            "routing_us": (lambda: backend_for(q, v), 10 * args.iters),  # ~1 µs: more calls for the same time
            "api_us": (lambda: api(*op_args), args.iters),
            "op_us": (lambda: op(*op_args), args.iters),
            "direct_us": (lambda: direct(*op_args), args.iters),
        }
        try:
            found = raw_call(name, p, args.fi_backend)
        except Exception as exc:
            found = None
            notes.append(f"raw call unavailable: {C.short_error(exc)}")
        if found is not None:
            row["raw_call"], raw_fn = found
            fns["raw_us"] = (raw_fn, args.iters)
        row.update(C.per_call_us(fns, device, args.rounds))
        row["op_minus_direct_us"] = row["op_us"] - row["direct_us"]
        if "raw_us" in row:
            row["op_minus_raw_us"] = row["op_us"] - row["raw_us"]
        if device.type == "cuda" and not args.no_graph and name == "REFERENCE":
            notes.append("not capturable: REFERENCE reads the offsets on the host")
        elif device.type == "cuda" and not args.no_graph:
            chunks = [] if path == "prefill" else [t["cu_k"]]
            try:
                row["graph_op_us"] = graph_us(
                    lambda: op(*op_args),
                    device,
                    args.graph_calls,
                    args.graph_replays,
                    before=lambda: mla_ops.plan_cuda_graph(t["cu_q"], cu_seqlens_k=chunks),
                )
            except Exception as exc:
                notes.append(f"op not capturable: {C.short_error(exc)}")
            finally:
                mla_ops.release_cuda_graph_buffers()
                torch.cuda.synchronize(device)
            try:
                fn = raw_graph_call(name, p, args.fi_backend)
                if fn is not None:
                    row["graph_raw_us"] = graph_us(fn, device, args.graph_calls, args.graph_replays)
            except Exception as exc:
                notes.append(f"raw call not capturable: {C.short_error(exc)}")
    row["note"] = "; ".join(notes)
    return row


def measure_merge(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The merge op against the function it dispatches to."""
    import torch

    import mla_ops
    from mla_ops.backends.reference import merge_attn_states_reference

    p = BP.make_problem(BP.Shape("merge", args.heads, (args.tokens,)), device, getattr(torch, args.dtype), args.seed)
    merge_args = BP._merge_args(p)
    if device.type == "cuda":
        from mla_ops.ops import merge_kernel

        kernel = merge_kernel()
        backend = f"{kernel.__module__}.{kernel.__qualname__}"
    else:
        kernel, backend = merge_attn_states_reference, "merge_attn_states_reference (CPU key)"
    row: dict[str, Any] = {"path": "merge_attn_states", "backend": backend, "tokens": args.tokens, "heads": args.heads}
    fns = {
        "api_us": (lambda: mla_ops.merge_attn_states(*merge_args), args.iters),
        "op_us": (lambda: torch.ops.mla.merge_attn_states(*merge_args), args.iters),
        "direct_us": (lambda: kernel(*merge_args), args.iters),
    }
    row.update(C.per_call_us(fns, device, args.rounds))
    row["op_minus_direct_us"] = row["op_us"] - row["direct_us"]
    row["note"] = "direct: the function the op dispatches to"
    if device.type == "cuda" and not args.no_graph:
        try:
            row["graph_op_us"] = graph_us(
                lambda: torch.ops.mla.merge_attn_states(*merge_args), device, args.graph_calls, args.graph_replays
            )
            row["graph_raw_us"] = graph_us(lambda: kernel(*merge_args), device, args.graph_calls, args.graph_replays)
        except Exception as exc:
            row["note"] += f"; not capturable: {C.short_error(exc)}"
    return row


def render_markdown(rows: list[dict[str, Any]], env: dict[str, Any]) -> str:
    """The results as Markdown: header, the table, and what the columns mean."""
    headers = [
        "path",
        "backend",
        "auto",
        "routing µs",
        "mla_ops.* µs",
        "torch.ops.mla.* µs",
        "direct µs",
        "raw µs",
        "op − direct",
        "op − raw",
        "graph op µs",
        "graph raw µs",
        "raw call / note",
    ]
    table = []
    for r in rows:
        detail = "; ".join(x for x in (r.get("raw_call"), r.get("note")) if x)
        table.append(
            [
                r["path"],
                r["backend"],
                "yes" if r.get("auto_selected") else "",
                *(
                    C.fmt(r.get(k), ".2f")
                    for k in (
                        "routing_us",
                        "api_us",
                        "op_us",
                        "direct_us",
                        "raw_us",
                        "op_minus_direct_us",
                        "op_minus_raw_us",
                        "graph_op_us",
                        "graph_raw_us",
                    )
                ),
                detail,
            ]
        )
    shape = f"T={rows[0]['tokens']}, H={rows[0]['heads']}, (Dqk, Dv) = ({BP.DQK}, {BP.DV})" if rows else ""
    return "\n".join(
        [
            f"# MLA op dispatch overhead: {env.get('gpu')}, {env.get('dtype')}, {shape}",
            "",
            f"Command: `{env.get('command', '')}`",
            "",
            "Per-call wall time in µs (median over rounds of back-to-back calls; on CUDA the larger of host issue "
            "cost and device time). *op − direct* is the cost of the op layer (dispatcher, input checks, "
            "routing); *op − raw* adds the backend's own wrapping (output allocation, LSE conversion, padding). "
            "*graph* columns: device time per call inside a replayed CUDA graph. Design goal: op − raw <= 5 µs.",
            "",
            C.markdown_table(headers, table),
            "",
            "## Environment",
            "",
            C.env_markdown({k: v for k, v in env.items() if k != "command"}),
            "",
        ]
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(
            "Per-call overhead of the mla ops on a tiny problem: routing lookup, torch.ops.mla.* end to end, "
            "the backend's classmethod called directly, and the raw library call (plus CUDA-graph replay on "
            "GPU). Writes dispatch.csv, dispatch.md and dispatch.env.json."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--out", type=Path, help="output folder (default: benchmarks/results/<gpu-slug>/)")
    parser.add_argument("--backends", nargs="+", metavar="NAME", help="backends to measure (default: all valid here)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens T (one sequence; the chunk has T keys too)")
    parser.add_argument("--heads", type=int, default=16, help="heads H")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--iters", type=int, help="calls per round (default: 2000 on GPU, 100 on CPU)")
    parser.add_argument("--rounds", type=int, default=9, help="rounds; the median is reported")
    parser.add_argument("--graph-calls", type=int, default=50, help="calls captured in one CUDA graph")
    parser.add_argument("--graph-replays", type=int, default=20, help="replays per timing sample")
    parser.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph measurements")
    parser.add_argument(
        "--flashinfer-backend",
        dest="fi_backend",
        default="auto",
        help="backend of the raw FlashInfer call: auto (fa3 on SM90, else fa2), fa2, fa3, ...",
    )
    parser.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda if available)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.heads < 1:
        parser.error("--tokens and --heads must be positive")
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

    device = C.pick_device(args.device)
    dtype = getattr(torch, args.dtype)
    if args.iters is None:
        args.iters = 2000 if device.type == "cuda" else 100
    if device.type == "cpu":
        # One thread: the figures are host overheads, and on a shared machine a thread pool waiting for
        # cores would swamp them.
        torch.set_num_threads(1)
    if args.fi_backend == "auto":
        cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        args.fi_backend = "fa3" if cap == (9, 0) else "fa2"
    started = time.perf_counter()
    backends = C.backend_table(device, dtype, BP.DQK, BP.DV)
    env = C.collect_env(device, dtype, BP.DQK, BP.DV, backends)
    env.update(
        command=" ".join(["python benchmarks/bench_dispatch.py", *(sys.argv[1:] if argv is None else argv)]),
        timer="time.perf_counter around back-to-back calls (device synchronised per round); CUDA events for graphs",
        iters=args.iters,
        torch_threads=torch.get_num_threads(),
        rounds=args.rounds,
        graph_calls=args.graph_calls,
    )
    auto = env["auto_selected_backend"].split(" ")[0]
    if args.backends:
        known = {row["name"] for row in backends}
        unknown = [b for b in args.backends if b.upper() not in known]
        if unknown:
            raise SystemExit(f"--backends: unknown {unknown}; choose from {', '.join(sorted(known))}")
        wanted = {b.upper() for b in args.backends}
        backends = [row for row in backends if row["name"] in wanted]
    print(f"device: {env['gpu']} ({device}); T={args.tokens}, H={args.heads}, {args.dtype}; auto-selected: {auto}")

    rows: list[dict[str, Any]] = []
    not_measured: dict[str, str] = {}
    causal = BP.make_problem(BP.Shape("causal", args.heads, (args.tokens,)), device, dtype, args.seed)
    chunk = BP.make_problem(BP.Shape("chunk", args.heads, (args.tokens,), (args.tokens,)), device, dtype, args.seed)
    for row in backends:
        name = row["name"]
        if not row["valid"]:
            not_measured[name] = "not valid here: " + "; ".join(row["reasons"])
            continue
        if device.type == "cpu" and name != "REFERENCE":
            not_measured[name] = "the ops' CPU dispatch key always runs REFERENCE"
            continue
        if device.type == "cuda" and name == "REFERENCE" and not args.backends:
            not_measured[name] = "host-synchronising debug path on CUDA (pass --backends REFERENCE to measure it)"
            continue
        for path, problem in (("prefill", causal), ("prefill_context_chunk", chunk)):
            print(f"{name} {path}...", flush=True)
            try:
                result = measure_backend(name, row["class"], path, problem, args, device, auto)
            except Exception as exc:
                result = {
                    "path": path,
                    "backend": name,
                    "tokens": args.tokens,
                    "heads": args.heads,
                    "note": f"failed: {C.short_error(exc)}",
                }
            rows.append(result)
            print(
                "  "
                + ", ".join(
                    f"{k} {C.fmt(result.get(k), '.2f')}"
                    for k in ("routing_us", "op_us", "direct_us", "raw_us", "graph_op_us", "graph_raw_us")
                )
                + "  "
                + result.get("note", "")
            )
    print("merge_attn_states...", flush=True)
    try:
        rows.append(measure_merge(args, device))
    except Exception as exc:
        rows.append({"path": "merge_attn_states", "backend": "—", "note": f"failed: {C.short_error(exc)}"})
    for name, why in not_measured.items():
        print(f"not measured: {name}: {why}")
    env["not_measured"] = not_measured
    env["elapsed_s"] = round(time.perf_counter() - started, 1)

    out_dir = args.out or C.default_out_dir(device)
    out_dir.mkdir(parents=True, exist_ok=True)
    C.write_csv(out_dir / "dispatch.csv", CSV_FIELDS, rows)
    C.write_json(out_dir / "dispatch.env.json", env)
    (out_dir / "dispatch.md").write_text(render_markdown(rows, env))
    print(f"wrote dispatch.csv, dispatch.md, dispatch.env.json to {out_dir} in {env['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
