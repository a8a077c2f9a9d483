#!/usr/bin/env python
"""Eager host cost of the op layer, per MLA layer, on a chunked-prefill batch.

A stack of :class:`mla_ops.model.MLAAttention` layers (DeepSeek-V3's head dims, H=16, hidden 2048 by
default) runs one batch of 512 new tokens over 8 sequences with one chunk of cached context, eagerly,
in two forms with the same weights:

- **op**: each layer's attention is ``mla_ops.prefill_with_context`` under ``prefill_backend(NAME)``:
  for the batch's one chunk, eagerly, one call of the internal op ``mla.prefill_with_chunk``, which does
  the work of ``mla.prefill``, ``mla.prefill_context_chunk`` and ``mla.merge_attn_states``;
- **raw**: each layer's attention calls the backend's library directly: FlashInfer's wrappers planned
  once for the batch, then ``run`` and ``flashinfer.merge_state``; the FlashAttention implementation
  FLASH_ATTN runs here (FlashAttention-4, or PyTorch's bundled FlashAttention-2 on ``v`` widened as the
  backend widens it) and the merge kernel; the Triton kernel function and the merge kernel.

The two take turns sample by sample, in rounds; a sample is one forward of the stack, timed from an idle
device (so it holds the host's issue time). The difference per layer is what the op layer costs an
eager model. The same batch is used in every step, so FLASHINFER plans once in both forms; a new batch
per step would add one plan per step to both. Without a GPU it compares REFERENCE with its own
functions on a tiny stack (a test of the script, not a measurement).

With ``--attribute``, it also splits the op cost into its parts (:mod:`benchlib.attribution`): the host
time of the layers' attention through the Python API, the fused op and the three ops called directly,
the dispatcher alone, the ops' kernels without the dispatcher, the backend, and the raw calls, in turns;
the differences give the API wrappers, what three op calls cost more than one, the dispatcher,
validation and routing, and the backend's wrapping, per layer.

The ``auto`` row runs the stack with no override, each call routed as a user's is (by size class where a cost
table ranks the backends), timed as the op stacks are: *auto / best op* is the fastest forced backend's time
per layer over auto's (1 where the automatic choice is the fastest).

Writes ``layers.csv``, ``layers.md`` and ``layers.env.json`` into ``benchmarks/results/<gpu-slug>/``
(or ``--out``).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Sequence
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

#: The columns of layers.csv, and of layers.md for those with a header.
FIELDS = R.Fields(
    ("backend", "backend"),
    "raw_call",  # in the Markdown table with the note
    "batch",
    "layers",
    "heads",
    "hidden",
    ("op_layer_ms", "op ms/layer", ".4f"),
    ("raw_layer_ms", "raw ms/layer", ".4f"),
    ("op_cost_us_per_layer", "op cost µs/layer", ".1f"),
    ("raw_over_op", "raw / op", ".3f"),
    ("raw_over_op_min", "rounds' range", R.span("raw_over_op_min", "raw_over_op_max", ".3f")),
    "raw_over_op_max",
    "rounds",
    ("rel_diff", "rel diff", ".1e"),
    ("best_op", "best op"),
    ("auto_over_best", "auto / best op", ".3f"),
    ("status", "status"),
    ("note", "raw call / note", R.text("raw_call", "note")),
    "attribution_samples",
    *(f"{form}_us" for form in A.FORMS),
    *(f"{form}_forward_us" for form in A.FORMS),
    *(A.part_key(part) for part in A.PARTS),
    A.TOTAL_KEY,
    A.REST_KEY,
)
#: The Markdown table of ``--attribute``: per backend, host µs per layer in the attention calls of each form,
#: and the parts of the op cost.
ATTRIBUTION_COLUMNS = [
    ("backend", R.text("backend")),
    *((form, R.num(f"{form}_us", ".1f")) for form in A.FORMS),
    *((part, R.num(A.part_key(part), ".1f")) for part in A.PARTS),
    ("api - raw", R.num(A.TOTAL_KEY, ".1f")),
    ("rest of the forward, api - raw", R.num(A.REST_KEY, ".1f")),
]
#: Forwards of each form that ``--attribute`` times when given without a number.
ATTRIBUTION_SAMPLES = 60
#: Largest ``||op - raw|| / ||raw||`` of the stacks' outputs accepted: both compute the same layers in
#: bf16 (same kernels; FLASHINFER's raw form merges with flashinfer.merge_state), so they differ by
#: rounding only, far below this.
REL_DIFF_TOL = 2e-2
GPU_DEFAULTS = {"layers": 4, "heads": 16, "hidden": 2048, "batch": "512x8+2048"}
CPU_DEFAULTS = {"layers": 2, "heads": 2, "hidden": 256, "batch": "32x4+64"}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser(
        __doc__.split("\n\n")[0]
        + " Writes layers.csv, layers.md and layers.env.json. Defaults differ on CPU (a tiny stack)."
    )
    cli.add_stack(parser, GPU_DEFAULTS)
    parser.add_argument(
        "--batch",
        help=f"NEWxSEQS+CTX: new tokens over sequences, plus context tokens in one chunk (default "
        f"{GPU_DEFAULTS['batch']})",
    )
    cli.add_backends(parser)
    cli.add_rounds(parser, "rounds of op and raw samples taken in turns")
    parser.add_argument(
        "--attribute",
        type=int,
        nargs="?",
        const=ATTRIBUTION_SAMPLES,
        metavar="SAMPLES",
        help="also split the op cost into API wrappers, three op calls for one, dispatcher, validation and routing, "
        "and backend wrapping, "
        f"from SAMPLES forwards of each form in turns (default {ATTRIBUTION_SAMPLES})",
    )
    cli.add_timer(parser)
    cli.add_out_dir(parser)
    cli.add_device(parser)
    args = parser.parse_args(argv)
    cli.check_rounds(parser, args)
    if args.attribute is not None and args.attribute < 1:
        parser.error(f"--attribute: give at least 1 sample, got {args.attribute}")
    return args


def measure_backend(
    row: dict[str, Any], stack: Any, batch: Any, args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    """One CSV row: the stack through the ops against the same stack calling the raw library."""
    import torch

    import mla_ops

    name = row["name"]
    out: dict[str, Any] = {
        "backend": name,
        "batch": args.size.label,
        "layers": args.layers,
        "heads": args.heads,
        "hidden": args.hidden,
        "rounds": args.rounds,
        "status": "error",
    }
    raw = M.raw_method_for(name, row["backend"], device, M.flashinfer_kernel(device))
    why = "it has no raw call" if raw is None else raw.unavailable(device)
    if why is not None:
        out["note"] = f"not measured: {why}"
        return out
    out["raw_call"] = raw.implementation
    attention = M.RawLayerAttention(raw, device)
    raw_stack = copy.deepcopy(stack)  # the same weights
    for layer in raw_stack.layers:
        layer.attention = attention
    first = stack.layers[0]
    chunk_offsets = [chunk.cu_seqlens_k for chunk in batch.context]
    attention.plan(batch.cu_seqlens, chunk_offsets, args.heads, first.o_proj.weight.dtype, first.softmax_scale)
    args_ = P.batch_args(batch)
    op = M.Prepared(lambda: stack(*args_), lambda r: (r, None), lambda: mla_ops.prefill_backend(name))
    plain = M.Prepared(lambda: raw_stack(*args_), lambda r: (r, None))
    with torch.no_grad():
        with op.context():
            out["rel_diff"] = M.relative_difference(op.fn(), plain.fn())
        ratio = M.overhead_ratio(
            op, plain, device, args.rounds, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, flush_l2=False, sync_each=True
        )
        if args.attribute:
            with op.context():  # the api, ops and kernels forms route to the backend by this override
                forms = A.attention_forms(row["backend"], device, attention)
                parts = A.attribute(stack, args_, forms, device, args.attribute)
            out["attribution_samples"] = parts.pop("samples")
            out["rel_diff"] = max(out["rel_diff"], parts.pop("forms_rel_diff"))
            out.update(parts)
    out.update(
        op_layer_ms=ratio.denominator_ms / args.layers,
        raw_layer_ms=ratio.numerator_ms / args.layers,
        op_cost_us_per_layer=(ratio.denominator_ms - ratio.numerator_ms) * 1e3 / args.layers,
        raw_over_op=ratio.median,
        raw_over_op_min=ratio.low,
        raw_over_op_max=ratio.high,
    )
    out["status"] = "ok" if out["rel_diff"] <= REL_DIFF_TOL else "WRONG"
    return out


def measure_auto(
    rows: list[dict[str, Any]], stack: Any, batch: Any, args: argparse.Namespace, device: torch.device
) -> dict[str, Any] | None:
    """The ``auto`` row: the stack with no override, timed as the backends' op stacks are (one forward per sample
    from an idle device, the median over ``args.rounds`` rounds), against the fastest of those (``rows``: the
    backends' rows); ``None`` where no backend was measured. (Two overrides cannot take turns sample by sample:
    changing one clears the routes, which the samples would then time.)"""
    import statistics

    import torch

    import mla_ops

    measured = [r for r in rows if r.get("status") == "ok" and r.get("op_layer_ms") is not None]
    if not measured:
        return None
    best = min(measured, key=lambda r: r["op_layer_ms"])
    args_ = P.batch_args(batch)
    out: dict[str, Any] = {"backend": "auto", "batch": args.size.label, "layers": args.layers, "heads": args.heads,
                           "hidden": args.hidden, "rounds": args.rounds, "best_op": best["backend"]}  # fmt: skip
    with torch.no_grad(), mla_ops.prefill_backend(None):
        auto_out = stack(*args_)
        medians = [
            timing.measure(
                lambda: stack(*args_), device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, flush_l2=False,
                sync_each=True,
            ).median_ms
            for _ in range(args.rounds)
        ]  # fmt: skip
        with mla_ops.prefill_backend(best["backend"]):
            out["rel_diff"] = M.relative_difference(auto_out, stack(*args_))
    out["op_layer_ms"] = statistics.median(medians) / args.layers
    out["auto_over_best"] = best["op_layer_ms"] / out["op_layer_ms"]
    out["status"] = "ok" if out["rel_diff"] <= REL_DIFF_TOL else "WRONG"
    return out


def render_markdown(rows: list[dict[str, Any]], env: dict[str, Any], args: argparse.Namespace) -> str:
    """The rows as a Markdown page with the environment record."""
    intro = (
        f"{P.stack_description(args)}, eager, on one batch of {args.size.label}. Per layer: the forward's time "
        f"through the ops and with the backend's raw library calls, medians over {args.rounds} rounds of samples "
        "taken in turns, each sample one forward from an idle device; *op cost* is their difference. *rel diff*: "
        "||op - raw|| / ||raw|| of the outputs (with `--attribute`, the largest of that and of every form's "
        "difference from the ops' output)."
    )
    table = FIELDS.table(rows)
    attributed = [row for row in rows if row.get(A.TOTAL_KEY) is not None]
    if attributed:
        forms = "; ".join(f"*{form}*: {what}" for form, what in A.FORMS.items())
        parts = "; ".join(f"*{part}* = {form} - {minus}" for part, (form, minus) in A.PARTS.items())
        table += (
            f"\n\n## Where the op cost goes\n\nHost µs per layer spent in the layers' attention calls, medians over "
            f"{attributed[0]['attribution_samples']} forwards of each form taken in turns (`--attribute`). Forms: "
            f"{forms}. Parts (medians of differences of neighbouring samples): {parts}; *rest of the forward*: "
            "the same difference, api - raw, of the host time outside the attention calls (the layers' other "
            "calls).\n\n" + R.rows_table(attributed, ATTRIBUTION_COLUMNS)
        )
    return R.results_page("MLA layers, ops against raw library calls", env, intro, table)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device, dtype = P.setup_device(args, GPU_DEFAULTS, CPU_DEFAULTS)
    args.size = P.parse_serving_size(args.batch, "--batch")
    started = time.perf_counter()
    backends, env = R.start_run(
        "bench_layers.py",
        argv,
        device,
        dtype,
        **P.stack_settings(args),
        batch=args.size.label,
        rounds=args.rounds,
        warmup_ms=args.warmup_ms,
        rep_ms=args.rep_ms,
    )
    timed, not_measured, stack = M.start_stack(args, backends, env, device, dtype, f", batch {args.size.label}")
    (batch,) = P.serving_batches(stack.layers[0], args.size, 1, args.seed, exact_bounds=True)
    print(f"new lengths {batch.new_lengths}, context lengths {batch.context_lengths}")
    rows = []
    for row in timed:
        print(f"{row['name']}: ops against raw calls, {args.rounds} rounds of samples taken in turns...", flush=True)
        try:
            result = measure_backend(row, stack, batch, args, device)
        except Exception as exc:
            result = {"backend": row["name"], "status": "error", "note": R.short_error(exc)}
        rows.append(result)
        if result.get("raw_over_op") is None:
            print(f"  {result.get('note', '')}")
            continue
        print(
            f"  op {result['op_layer_ms'] * 1e3:8.1f} µs/layer  raw {result['raw_layer_ms'] * 1e3:8.1f} µs/layer  "
            f"op cost {result['op_cost_us_per_layer']:6.1f} µs/layer  raw/op {result['raw_over_op']:.3f} "
            f"(rounds {result['raw_over_op_min']:.3f}..{result['raw_over_op_max']:.3f})  rel diff "
            f"{result['rel_diff']:.1e} {result['status']}",
            flush=True,
        )
        if result.get(A.TOTAL_KEY) is not None:
            forms = "  ".join(f"{form} {result[f'{form}_us']:.1f}" for form in A.FORMS)
            parts = "  ".join(f"{part} {result[A.part_key(part)]:.1f}" for part in A.PARTS)
            print(
                f"  attention host µs/layer: {forms}\n  parts: {parts}  (api - raw {result[A.TOTAL_KEY]:.1f}; "
                f"outside the attention calls {result[A.REST_KEY]:.1f})"
            )
    print(f"auto: the stack with no override, {args.rounds} rounds...", flush=True)
    auto = measure_auto(rows, stack, batch, args, device)
    if auto is not None:
        rows.append(auto)
        print(
            f"  auto {auto['op_layer_ms'] * 1e3:8.1f} µs/layer  auto / best op ({auto['best_op']}) "
            f"{auto['auto_over_best']:.3f}  rel diff {auto['rel_diff']:.1e} {auto['status']}",
            flush=True,
        )
    R.finish_run(
        args.out, device, "layers", FIELDS.keys, rows, env, not_measured, started,
        lambda: render_markdown(rows, env, args),
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
