#!/usr/bin/env python
"""Op overhead on the reference shapes: each backend's op against its own raw call, samples in turns.

Each backend's op (``mla_ops.prefill`` under ``prefill_backend(NAME)``) and the library call its
backend makes take turns, round after round, on the same tensors; the figure is the median over
rounds of (raw time / op time), computed by the same function as ``bench_prefill.py``'s ``ratio_raw``.
The raw calls: FlashInfer's planned ``wrapper.run`` for FLASHINFER; for FLASH_ATTN, the implementation
it runs here, called directly (FlashAttention-4's ``flash_attn.cute.flash_attn_varlen_func`` when
installed, else FlashAttention-3, FlashAttention-2 or PyTorch's bundled kernel); the Triton kernel
function for TRITON. When FLASH_ATTN runs a FlashAttention-2 kernel, it is also compared with that
kernel plus the copy into the contiguous ``[T, H, Dv]`` output the op contract requires (``+copy``),
which splits its gap into the copy's cost and the op layer's.

Without a GPU it compares REFERENCE with its own function on tiny shapes (a test of the script, not a
measurement).

    python benchmarks/bench_overhead.py [--rounds 7] [--out benchmarks/results/h200/overhead.csv]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The shared modules live next to this script, which is not part of a package.
from benchlib import cli
from benchlib import methods as M
from benchlib import problems as P
from benchlib import report as R

if TYPE_CHECKING:
    import torch

#: The columns of overhead.csv, and of overhead.md for those with a header.
FIELDS = R.Fields(
    ("backend", "backend"),
    ("shape", "shape"),
    ("heads", "heads"),
    ("op_ms", "op ms", ".4f"),
    ("raw_call", "raw call"),
    ("raw_ms", "raw ms", ".4f"),
    ("raw_over_op_median", "raw / op", ".3f"),
    ("raw_over_op_min", "rounds' range", R.span("raw_over_op_min", "raw_over_op_max", ".3f")),
    "raw_over_op_max",
    "rounds",
    ("note", "note"),
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser(__doc__.split("\n\n")[0])
    cli.add_rounds(parser, "rounds per pair, each of op and raw samples taken in turns")
    cli.add_timer(parser)
    cli.add_out_csv(parser)
    cli.add_backends(parser, help="backends to compare (default: all valid here)")
    cli.add_device(parser)
    args = parser.parse_args(argv)
    cli.check_rounds(parser, args)
    return args


def build_pairs(
    backends: list[dict[str, Any]], device: torch.device, wanted: Sequence[str] | None
) -> list[tuple[M.OpMethod, M.Method]]:
    """``(op, raw call)`` pairs, one per backend measured here (two for a FlashAttention-2 kernel)."""
    timed, skipped = M.backends_to_time(backends, device, wanted)
    fi_kernel = M.flashinfer_kernel(device)
    pairs = []
    for row in timed:
        name = row["name"]
        raw = M.raw_method_for(name, row["backend"], device, fi_kernel)
        why = "it has no raw call to compare with" if raw is None else raw.unavailable(device)
        if why is not None:
            skipped[name] = why
            continue
        op = M.OpMethod(name, row["implementation"], raw.name)
        pairs.append((op, raw))
        if isinstance(raw, M.FlashAttnRaw) and raw.impl.pads_v:
            pairs.append((op, M.FlashAttnRaw(raw.impl_name, contiguous_output=True)))
    for name, why in skipped.items():
        print(f"{name}: skipped ({why})")
    return pairs


def measure_pair(op: M.OpMethod, raw: M.Method, problem: P.Problem, reference: Any, args: argparse.Namespace) -> dict:
    """One CSV row: the op against the raw call on ``problem``, both checked first."""
    row: dict[str, Any] = {
        "backend": op.name,
        "shape": problem.shape.short_label,
        "heads": problem.heads,
        "raw_call": raw.name,
        "rounds": args.rounds,
    }
    checks = [M.check_and_time(method, problem, reference, timed=False) for method in (op, raw)]
    failed = [f"{m.name}: {c.status} {c.note}".strip() for m, c in zip((op, raw), checks) if c.status != "ok"]
    if failed:
        row["note"] = "not measured: " + "; ".join(failed)
        return row
    ratio = M.overhead_ratio(
        checks[0].prepared,
        checks[1].prepared,
        problem.device,
        args.rounds,
        warmup_ms=args.warmup_ms,
        rep_ms=args.rep_ms,
    )
    row.update(
        op_ms=ratio.denominator_ms,
        raw_ms=ratio.numerator_ms,
        raw_over_op_median=ratio.median,
        raw_over_op_min=ratio.low,
        raw_over_op_max=ratio.high,
    )
    return row


def render_markdown(rows: list[dict[str, Any]], env: dict[str, Any]) -> str:
    """The rows as a Markdown page with the environment record."""
    intro = (
        "Raw call time / op time: per round the median ratio of neighbouring op and raw samples (taken in turns "
        f"on the same tensors), and the median over {env.get('rounds')} rounds (above 1: the op is faster; "
        "target >= 0.97). Times are the medians over rounds."
    )
    return R.results_page("MLA op overhead", env, intro, FIELDS.table(rows))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    device, dtype = P.setup_device(args)
    cuda = device.type == "cuda"
    backends, env = R.start_run(
        "bench_overhead.py", argv, device, dtype, rounds=args.rounds, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms
    )
    pairs = build_pairs(backends, device, args.backends)
    if not pairs:
        raise SystemExit("bench_overhead: no backend can be compared with its raw call here (see the reasons above)")
    print(
        f"# {env['gpu']}, torch {env['torch']}, {args.dtype}, rounds={args.rounds}, "
        f"pairs: {', '.join(f'{op.name}/{raw.name}' for op, raw in pairs)}",
        flush=True,
    )
    compared = {op.name for op, _ in pairs}
    heads = [s.heads for s in P.reference_shapes(device)]
    M.warm_backends([r for r in backends if r["name"] in compared], device, dtype, heads, record=env)
    rows = []
    for shape in P.reference_shapes(device):
        problem = P.make_problem(shape, device, dtype, args.seed)
        reference = M.reference_outputs(problem)
        for op, raw in pairs:
            print(f"{op.name:<11} {shape.short_label:<8} H={shape.heads:<4} vs {raw.name}...", flush=True)
            row = measure_pair(op, raw, problem, reference, args)
            rows.append(row)
            if row.get("raw_over_op_median") is None:
                print(f"  {row['note']}", flush=True)
                continue
            print(
                f"{op.name:<11} {row['shape']:<8} H={shape.heads:<4} op {row['op_ms']:8.3f} ms  {raw.name:<15} "
                f"{row['raw_ms']:8.3f} ms  ratio {row['raw_over_op_median']:.3f} "
                f"(rounds {row['raw_over_op_min']:.3f}..{row['raw_over_op_max']:.3f})",
                flush=True,
            )
        del problem, reference
        if cuda:
            torch.cuda.empty_cache()
    if args.out:
        paths = R.write_results_beside(args.out, FIELDS.keys, rows, env, render_markdown(rows, env))
        print("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
