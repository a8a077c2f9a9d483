#!/usr/bin/env python
"""Eager against CUDA-graph replay for a stack of MLA layers on small batches.

Small prefill batches are launch-bound: a layer is a dozen kernels of a few microseconds each. This
measures how much replaying the whole stack from one captured ``torch.cuda.CUDAGraph`` saves, per
backend: the median over five samples of ``--iters`` back-to-back forwards, eager and replayed, after
ten untimed ones, and the largest difference between the replayed and the eager output. Needs a
CUDA device; without one it says so and exits. Writes ``graphs.csv``, ``graphs.md`` and
``graphs.env.json`` into ``benchmarks/results/<gpu-slug>/`` (or ``--out``).

    python benchmarks/bench_graphs.py [--layers 4] [--heads 16] [--lengths 128,128,128,128]
"""

from __future__ import annotations

import argparse
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

#: The columns of graphs.csv, and of graphs.md for those with a header.
FIELDS = R.Fields(
    ("backend", "backend"),
    ("eager_ms", "eager ms", ".3f"),
    ("graph_ms", "graph ms", ".3f"),
    ("speedup", "speed-up", ".2f"),
    ("max_abs_diff", "max abs diff", ".1e"),
    ("note", "note"),
)


def measure(name: str, stack: Any, batch: Any, iters: int, device: torch.device) -> dict[str, Any]:
    """Median milliseconds per forward, eager and replayed, and the largest difference between them."""
    import torch

    import mla_ops

    args = P.batch_args(batch)
    forward = lambda: stack(*args)
    counts = {"samples": 5, "warmup_calls": 10, "calls_per_sample": iters, "flush_l2": False}
    try:
        with torch.no_grad(), mla_ops.prefill_backend(name):
            mla_ops.plan_cuda_graph(batch.cu_seqlens)
            graph, replayed = M.capture_cuda_graph(forward, device, warmup_calls=1)
            eager_ms = timing.measure(forward, device, **counts).median_ms
            graph_ms = timing.measure(graph.replay, device, **counts).median_ms
            graph.replay()
            diff = (replayed.float() - forward().float()).abs().max().item()
    finally:
        mla_ops.release_cuda_graph_buffers()
    return {
        "backend": name,
        "eager_ms": eager_ms,
        "graph_ms": graph_ms,
        "speedup": eager_ms / graph_ms,
        "max_abs_diff": diff,
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser(__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="layers in the stack")
    parser.add_argument("--heads", type=int, default=16, help="query heads")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size of the layers")
    parser.add_argument("--lengths", default="128,128,128,128", help="new tokens per sequence, comma-separated")
    parser.add_argument("--iters", type=int, default=50, help="forwards per timing sample")
    parser.add_argument("--backends", default="TRITON,FLASH_ATTN,FLASHINFER", help="comma-separated backends")
    cli.add_out_dir(parser)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        args.lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        parser.error(f"--lengths: expected comma-separated integers, got {args.lengths!r}")
    if args.layers < 1 or args.iters < 1 or min(args.lengths) < 0 or not any(args.lengths):
        parser.error("--layers and --iters must be positive, and --lengths must hold at least one token")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from mla_ops.model import random_batch

    device = P.require_cuda("bench_graphs.py", "capturing and replaying CUDA graphs")
    started = time.perf_counter()
    dtype = torch.bfloat16
    backends, env = R.start_run(
        "bench_graphs.py", argv, device, dtype, **P.stack_settings(args), lengths=args.lengths, iters=args.iters
    )
    timed, skipped = M.backends_to_time(backends, device, args.backends.split(","))
    print(f"# {env['gpu']}, torch {env['torch']}, {args.layers} layers, H={args.heads}, lengths {args.lengths}")
    M.warm_backends(timed, device, dtype, [args.heads])
    stack = P.stack_of(args, device, dtype)
    batch = random_batch(stack.layers[0], args.lengths, generator=torch.Generator().manual_seed(args.seed))
    rows = []
    for row in timed:
        print(f"{row['name']}: capturing and timing...", flush=True)
        try:
            result = measure(row["name"], stack, batch, args.iters, device)
        except Exception as exc:
            skipped[row["name"]] = R.short_error(exc)
            continue
        rows.append(result)
        print(
            f"{row['name']:<11} eager {result['eager_ms']:7.3f} ms  graph replay {result['graph_ms']:7.3f} ms  "
            f"speed-up {result['speedup']:5.2f}x  (max |replay - eager| {result['max_abs_diff']:.1e})",
            flush=True,
        )
    for name, why in skipped.items():
        rows.append({"backend": name, "note": f"skipped: {why}"})
    R.end_run(env, skipped, started)
    intro = (
        f"A stack of {args.layers} MLA layers (hidden {args.hidden}, H={args.heads}) on new tokens "
        f"{args.lengths}: milliseconds per forward, eager and replayed from one CUDA graph (median over five "
        f"samples of {args.iters} back-to-back forwards)."
    )
    md = R.results_markdown(f"CUDA-graph replay: {env['gpu']}", env, intro, FIELDS.table(rows))
    R.write_run(args.out or R.default_out_dir(device), "graphs", FIELDS.keys, rows, env, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
