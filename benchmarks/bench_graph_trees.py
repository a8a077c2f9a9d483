#!/usr/bin/env python
"""Step time of a stack of MLA layers under torch.compile's CUDA-graph trees, per backend, against eager.

A stack of :class:`mla_ops.model.MLAAttention` layers (DeepSeek-V3's head dims, H=16, hidden 2048, 4
layers by default) runs serving-sized ragged batches, each with one chunk of cached context, in two
modes per backend:

- **eager**, with the backend forced;
- **CUDA-graph trees**: ``torch.compile(stack, fullgraph=True, dynamic=False, mode="reduce-overhead")``.
  TRITON and FLASH_ATTN are forced, and their calls replay inside the graphs (mode ``reduce-overhead``).
  FLASHINFER plans each batch on the host, so it cannot run inside the graphs, and forced there it is
  refused; its row measures what a user who leaves it to automatic selection gets (mode
  ``reduce-overhead, automatic``): the layers' calls inside the graphs routed to the best backend that
  reads the offsets on the device, named in the ``in_graph`` column. That row is measured where
  automatic selection picks FLASHINFER, and recorded as not measured elsewhere.

Every step is a new batch: the same token totals (so the same shapes, one recorded graph) split
differently over the sequences, with the offsets passed in as inputs of the compiled function, as a
serving engine passes them, and ``max_seqlen`` set to the token total (a bound every backend accepts).
The batches are generated once per size from ``--seed`` and every backend and mode runs the same list:
``--warmup-steps`` untimed steps (compilation and graph recording happen there), then ``--steps`` timed
ones, each from an idle device, so a step's time holds the host's work (FLASHINFER's eager plans
included).
The compiled output of a timed batch is compared with the eager one, and a graph recorded during the
timed steps, or a tree that skipped CUDA graphs, is reported.

Writes ``graph_trees.csv``, ``graph_trees.md`` and ``graph_trees.env.json`` into
``benchmarks/results/<gpu-slug>/`` (or ``--out``). Without a GPU it times the eager REFERENCE step of
a tiny stack and records the compiled modes as not measured (CUDA-graph trees need CUDA).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The shared modules live next to this script, which is not part of a package.
from benchlib import cli, timing
from benchlib import methods as M
from benchlib import problems as P
from benchlib import report as R

if TYPE_CHECKING:
    import torch

#: The columns of graph_trees.csv, and of graph_trees.md for those with a header.
FIELDS = R.Fields(
    ("size", "batch"),
    "new_tokens",
    "num_seqs",
    "context_tokens",
    "layers",
    "heads",
    "hidden",
    ("backend", "backend"),
    ("mode", "mode"),
    ("in_graph", "in the graphs"),
    "steps",
    ("step_ms", "step ms", ".3f"),
    ("step_ms_min", "range", R.span("step_ms_min", "step_ms_max", ".3f")),
    "step_ms_max",
    ("layer_ms", "ms/layer", ".3f"),
    ("eager_over_mode", "eager / mode", ".2f"),
    ("rel_diff_vs_eager", "rel diff vs eager", ".1e"),
    ("graphs_recorded_while_timed", "graphs recorded while timed", "d"),
    ("cudagraph_skips", "cudagraph skips", "d"),
    ("status", "status"),
    ("note", "note"),
)
#: Largest ``||compiled - eager|| / ||eager||`` accepted: the same bf16 layers, fused differently by
#: Inductor, differ by rounding only.
REL_DIFF_TOL = 2e-2
GPU_DEFAULTS = {"layers": 4, "heads": 16, "hidden": 2048, "sizes": "512x8+2048,2048x16+4096,8192x32+8192"}
CPU_DEFAULTS = {"layers": 2, "heads": 2, "hidden": 256, "sizes": "16x2+32,48x4+64"}
EAGER = "eager"
#: The compiled mode of a backend that reads the offsets on the device: forced, inside the graphs.
GRAPH_TREES = "reduce-overhead"
#: The compiled mode of a backend that plans on the host: automatic selection, whose calls inside the
#: graphs are routed to a backend that reads the offsets on the device.
AUTOMATIC = "reduce-overhead, automatic"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser(
        __doc__.split("\n\n")[0]
        + " Writes graph_trees.csv, graph_trees.md and graph_trees.env.json. Defaults differ on CPU (a tiny stack)."
    )
    cli.add_backends(parser)
    cli.add_stack(parser, GPU_DEFAULTS)
    parser.add_argument(
        "--sizes",
        help="comma-separated batch sizes NEWxSEQS+CTX: new tokens over sequences, plus context tokens in one "
        f"chunk (default {GPU_DEFAULTS['sizes']})",
    )
    parser.add_argument("--steps", type=int, default=30, help="timed steps per backend and mode, each a new batch")
    parser.add_argument("--warmup-steps", type=int, default=5, help="untimed steps first (compile, record graphs)")
    parser.add_argument("--no-compile", action="store_true", help="eager steps only")
    cli.add_out_dir(parser)
    cli.add_device(parser)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup_steps < 0:
        parser.error("--steps must be positive and --warmup-steps not negative")
    return args


def recorded_graphs(device: torch.device) -> int | None:
    """:func:`benchlib.methods.recorded_graphs`, or ``None`` where Inductor's private API has changed."""
    try:
        return M.recorded_graphs(device)
    except Exception:  # private API: its absence must not stop the benchmark
        return None


def graph_tree_mode(row: dict[str, Any]) -> str:
    """The compiled mode of a backend: :data:`AUTOMATIC` for one that plans on the host (FLASHINFER),
    :data:`GRAPH_TREES` otherwise."""
    backend = row["backend"]
    return AUTOMATIC if backend is not None and backend.plans_on_host else GRAPH_TREES


def in_graph_choice(row: dict[str, Any], capability: Any, config: Any) -> tuple[str | None, str | None]:
    """``(backend the calls run inside the graphs, None)`` for ``row`` in its :func:`graph_tree_mode`, or
    ``(None, why it is not measured)``. ``capability``/``config``: the device's and the stack's, as
    ``mla_ops.select_backend`` takes them."""
    import mla_ops

    name = row["name"]
    if graph_tree_mode(row) == GRAPH_TREES:
        return name, None
    try:
        automatic = mla_ops.select_backend(capability, config).name
        inside = mla_ops.select_backend(capability, config, in_graph=True).name
    except ValueError as exc:  # an override set in the environment, or no backend for the graphs
        return None, f"{AUTOMATIC}: {exc}"
    if automatic != name:
        return None, (
            f"{AUTOMATIC}: automatic selection picks {automatic} here, not {name}; forced, {name} is refused "
            "inside CUDA-graph trees"
        )
    return inside, None


def measure_mode(
    row: dict[str, Any], mode: str, stack: Any, batches: list[Any], args: argparse.Namespace, device: torch.device
) -> tuple[dict[str, Any], Any]:
    """One backend in one mode: step times, graph-tree counters, and the output of the first timed batch."""
    import torch

    import mla_ops

    out: dict[str, Any] = {"steps": args.steps}
    selection = contextlib.nullcontext() if mode == AUTOMATIC else mla_ops.prefill_backend(row["name"])
    with torch.no_grad(), selection:
        if mode == EAGER:
            forward = stack
        else:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            forward = torch.compile(stack, fullgraph=True, dynamic=False, mode="reduce-overhead")
        step = lambda batch: forward(*P.batch_args(batch))
        for batch in batches[: args.warmup_steps]:
            step(batch)
        before = recorded_graphs(device) if mode != EAGER else None
        timed = iter(batches[args.warmup_steps :])
        times = timing.measure(lambda: step(next(timed)), device, samples=args.steps, flush_l2=False, sync_each=True)
        if mode != EAGER:
            after = recorded_graphs(device)
            if before is not None and after is not None:
                out["graphs_recorded_while_timed"] = after - before
            out["cudagraph_skips"] = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
        # The first timed batch again, for the check; a tree's output is overwritten by its next replay.
        result = step(batches[args.warmup_steps]).clone()
    out.update(
        step_ms=times.median_ms,
        step_ms_min=times.min_ms,
        step_ms_max=times.max_ms,
        layer_ms=times.median_ms / args.layers,
    )
    return out, result


def measure_backend(
    row: dict[str, Any],
    modes: dict[str, str],
    size: P.ServingSize,
    stack: Any,
    batches: list[Any],
    args: argparse.Namespace,
    device: torch.device,
) -> list[dict[str, Any]]:
    """One CSV row per mode of one backend on one batch size; the compiled modes are checked against eager.

    ``modes``: each mode to measure, with the backend that runs inside the graphs in it ("" for eager)."""
    import torch

    base = {"size": size.label, "new_tokens": size.new_tokens, "num_seqs": size.num_seqs,
            "context_tokens": size.context_tokens, "layers": args.layers, "heads": args.heads,
            "hidden": args.hidden, "backend": row["name"]}  # fmt: skip
    rows: list[dict[str, Any]] = []
    eager_output = eager_ms = None
    for mode, in_graph in modes.items():
        print(f"{size.label}: {row['name']} {mode}{f' (in the graphs: {in_graph})' if in_graph else ''}...", flush=True)
        labels = {**base, "mode": mode, "in_graph": in_graph}
        try:
            result, output = measure_mode(row, mode, stack, batches, args, device)
        except Exception as exc:
            rows.append({**labels, "status": "error", "note": R.short_error(exc, 300)})
            print(f"  error: {R.short_error(exc, 300)}", flush=True)
            if device.type == "cuda":
                torch._dynamo.reset()
            continue
        out = {**labels, **result, "status": "ok"}
        notes = []
        if mode == EAGER:
            eager_output, eager_ms = output, result["step_ms"]
        else:
            if eager_ms is not None:
                out["eager_over_mode"] = eager_ms / result["step_ms"]
            if eager_output is not None:
                out["rel_diff_vs_eager"] = M.relative_difference(output, eager_output)
                if out["rel_diff_vs_eager"] > REL_DIFF_TOL:
                    out["status"] = "WRONG"
            if result.get("cudagraph_skips"):
                notes.append("the tree skipped CUDA graphs (ran without them)")
            if result.get("graphs_recorded_while_timed"):
                notes.append("graphs were recorded during the timed steps")
        out["note"] = "; ".join(notes)
        rows.append(out)
        line = [f"step {result['step_ms']:8.3f} ms (range {result['step_ms_min']:.3f}..{result['step_ms_max']:.3f})"]
        if "eager_over_mode" in out:
            line.append(f"eager / mode {out['eager_over_mode']:.2f}")
        if "rel_diff_vs_eager" in out:
            line.append(f"rel diff vs eager {out['rel_diff_vs_eager']:.1e}")
        print("  " + ", ".join(line) + ("" if out["status"] == "ok" else f"  {out['status']}"), flush=True)
    return rows


def render_markdown(rows: list[dict[str, Any]], env: dict[str, Any], args: argparse.Namespace) -> str:
    """The rows as a Markdown page with the environment record."""
    intro = (
        f"{P.stack_description(args)}. Per backend and mode: the median time of a forward over {args.steps} "
        f"timed steps, each a new batch (the same batches for every backend and mode, after {args.warmup_steps} "
        "untimed steps), each from an idle device. *reduce-overhead*: the backend forced, inside the graphs. "
        "*reduce-overhead, automatic*: a backend that plans on the host, left to automatic selection; *in the "
        "graphs* names the backend its calls were routed to there. *eager / mode*: the backend's eager step time "
        "over this mode's (above 1: the graphs are faster). *rel diff vs eager*: ||compiled - eager|| / ||eager|| "
        "on the first timed batch."
    )
    return R.results_page("MLA layers under CUDA-graph trees", env, intro, FIELDS.table(rows))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    device, dtype = P.setup_device(args, GPU_DEFAULTS, CPU_DEFAULTS)
    cuda = device.type == "cuda"
    sizes = [P.parse_serving_size(text, "--sizes") for text in args.sizes.split(",")]
    started = time.perf_counter()
    backends, env = R.start_run(
        "bench_graph_trees.py",
        argv,
        device,
        dtype,
        **P.stack_settings(args),
        steps=args.steps,
        warmup_steps=args.warmup_steps,
        sizes=[s.label for s in sizes],
    )
    timed, not_measured, stack = M.start_stack(args, backends, env, device, dtype, "")
    if not cuda and not args.no_compile:
        not_measured["CUDA-graph trees"] = "torch.compile's mode='reduce-overhead' needs a CUDA device"
    modes = {row["name"]: {EAGER: ""} for row in timed}
    if cuda and not args.no_compile:
        import mla_ops

        capability = mla_ops.DeviceCapability.of(device)
        config = mla_ops.SelectorConfig(dtype, mla_ops.MLADimensions.from_head_dims(P.DQK, P.DV))
        for row in timed:
            in_graph, why_not = in_graph_choice(row, capability, config)
            if in_graph is None:
                not_measured[f"{row['name']} {graph_tree_mode(row)}"] = why_not
            else:
                modes[row["name"]][graph_tree_mode(row)] = in_graph
    rows = []
    for size in sizes:
        batches = P.serving_batches(stack.layers[0], size, args.warmup_steps + args.steps, args.seed)
        for row in timed:
            rows += measure_backend(row, modes[row["name"]], size, stack, batches, args, device)
        del batches
        if cuda:
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    R.finish_run(
        args.out, device, "graph_trees", FIELDS.keys, rows, env, not_measured, started,
        lambda: render_markdown(rows, env, args),
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
