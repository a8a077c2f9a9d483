#!/usr/bin/env python
"""Time a warp-specialised Gluon attention kernel against TRITON and FlashInfer's fa3 on the tuning shapes.

The experiment asks whether Triton, written in Gluon (its explicit-layout language, where a kernel states
its own partitions, mbarriers and wgmma waits), reaches FlashAttention-3's throughput on the H200 where
the package's ``tl.dot`` kernel stops at 0.65-0.77x (``benchlib/gluon_attention.py`` says what the kernel
does and what it does not cover). For each ``--variants`` entry (``STAGES,BLOCK_N``) it first checks the
kernel on ragged batches against the package's fp32 reference (both paths, empty sequences, padding
rows), then times it on ``tune_triton.py``'s shapes, next to the package's TRITON kernel with its table
configuration and, when FlashInfer is installed, its fa3 kernel. Writes ``--out`` (CSV) and an
``.env.json`` beside it, and prints the table.

Usage::

    python benchmarks/probe_gluon_attention.py --out benchmarks/results/h200/gluon_attention.csv
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The shared modules and tune_triton.py live next to this script, which is not part of a package.
import tune_triton as TT
from benchlib import cli, timing
from benchlib import methods as M
from benchlib import problems as P
from benchlib import report as R

DEFAULT_VARIANTS = "2,128;2,64"


class GluonRaw(M.Method):
    """``benchlib.gluon_attention.attention_gluon`` with ``stages`` K/V buffers and ``block_n``-key tiles."""

    kind = "direct"

    def __init__(self, stages: int, block_n: int) -> None:
        self.stages, self.block_n = stages, block_n
        self.name = f"gluon[{stages},{block_n}]"

    def prepare(self, p: P.Problem) -> M.Prepared:
        from benchlib.gluon_attention import attention_gluon

        q, k, v, cu_q, cu_k, max_q, _, scale = p.attention_args()
        causal, stages, block_n = p.causal, self.stages, self.block_n

        def fn() -> Any:
            return attention_gluon(q, k, v, cu_q, cu_k, max_q, scale, causal, block_n=block_n, stages=stages)

        return M.Prepared(fn, M._pair)


def parse_variants(text: str) -> list[tuple[int, int]]:
    """``"2,64;3,64"`` -> ``[(2, 64), (3, 64)]``; raises ``ValueError`` saying what is wrong."""
    variants = []
    for part in text.split(";"):
        try:
            stages, block_n = (int(x) for x in part.split(","))
        except ValueError:
            raise ValueError(
                f"--variants takes 'STAGES,BLOCK_N;...', e.g. {DEFAULT_VARIANTS!r}; got {part!r}"
            ) from None
        if stages < 1 or block_n not in (32, 64, 128):
            raise ValueError(f"--variants: STAGES >= 1 and BLOCK_N of 32, 64 or 128, got {part!r}")
        variants.append((stages, block_n))
    return variants


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser(__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="CSV file to write (one row per method and shape)")
    parser.add_argument(
        "--variants", default=DEFAULT_VARIANTS, help=f"'STAGES,BLOCK_N;...' (default {DEFAULT_VARIANTS})"
    )
    parser.add_argument("--no-flashinfer", action="store_true", help="skip timing FlashInfer fa3")
    parser.add_argument("--warmup", type=float, default=25, help="warm-up time per measurement, ms (default 25)")
    parser.add_argument("--rep", type=float, default=100, help="measuring time per measurement, ms (default 100)")
    args = parser.parse_args(argv)
    try:
        args.variant_list = parse_variants(args.variants)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def check(method: M.Method, device: Any) -> str | None:
    """Run ``method`` on ``tune_triton.CHECK_SHAPES`` against the reference; the problem found, or ``None``."""
    import torch

    for shape in TT.CHECK_SHAPES:
        p = P.make_problem(shape, device, torch.bfloat16, seed=1, padding_rows=3)
        checked = M.check_and_time(method, p, M.reference_outputs(p), timed=False)
        if checked.status != "ok":
            detail = checked.note or f"out error {checked.rel_err:.3g}, lse error {checked.lse_err}"
            return f"{shape.suite}: {checked.status} ({detail})"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    device = P.require_cuda("probe_gluon_attention.py", "running Gluon kernels")
    _, env = R.start_run("probe_gluon_attention.py", argv, device, torch.bfloat16)
    meta = {key: env[key] for key in ("gpu", "torch", "cuda", "triton", "flashinfer", "python")}
    TT.log(" | ".join(f"{k}={v}" for k, v in meta.items()))
    started = time.time()
    problems = {TT.label(s): P.make_problem(s, device, torch.bfloat16) for s in TT.SHAPES}
    methods: list[M.Method] = [GluonRaw(*v) for v in args.variant_list] + [M.TritonRaw()]
    table: dict[str, dict[str, float]] = {}
    # The timed shapes are too large for the fp32 reference: each method's result there is compared with
    # TRITON's (its own check passed on the ragged batches), as the largest per-row relative difference.
    triton = M.TritonRaw()
    expected = {name: triton.prepare(p).fn() for name, p in problems.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fields = [*meta, "kind", "path", "shape", "heads", "config", "ms", "tflops", "diff_vs_triton", "error"]
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        writer.writeheader()
        for method in methods:
            TT.log(f"{method.name}  ({time.time() - started:.0f} s)")
            try:
                problem = check(method, device)
            except Exception as exc:  # a kernel the compiler rejects is a result, not a crash
                problem = R.short_error(exc, 300)
            if problem is not None:
                TT.log(f"    rejected: {problem}")
                writer.writerow({**meta, "kind": method.name, "shape": "check", "error": problem})
                continue
            for name, p in problems.items():
                try:
                    ms = timing.measure(method.prepare(p).fn, device, warmup_ms=args.warmup, rep_ms=args.rep).median_ms
                except Exception as exc:
                    TT.log(f"    {name}: {R.short_error(exc)}")
                    writer.writerow({**meta, "kind": method.name, "shape": name, "error": repr(exc)})
                    continue
                tflops = p.shape.flops() / ms / 1e9
                out, lse = method.prepare(p).fn()
                ref_out, ref_lse = expected[name]
                diff, lse_diff = M.compare(out, lse, ref_out.float(), ref_lse, rows=sum(p.q_lens))
                del out, lse
                table.setdefault(name, {})[method.name] = tflops
                TT.log(
                    f"    {name:<18} {ms:8.3f} ms  {tflops:7.1f} TFLOP/s  vs TRITON: out {diff:.2g}, lse {lse_diff:.2g}"
                )
                row = {"kind": method.name, "path": p.shape.suite, "shape": name, "heads": p.heads}
                writer.writerow(
                    {**meta, **row, "ms": f"{ms:.4f}", "tflops": f"{tflops:.1f}", "diff_vs_triton": f"{diff:.3g}"}
                )
        fa3 = TT.time_flashinfer(args, problems, device, writer, meta)
    names = [m.name for m in methods]
    TT.log("")
    TT.log("TFLOP/s" + "".join(f"  {n:>16}" for n in names) + "  fa3" * bool(fa3))
    for shape, row in table.items():
        cells = "".join(f"  {row[n]:16.1f}" if n in row else f"  {'-':>16}" for n in names)
        ratio = ""
        if shape in fa3:
            best = max((row[n] for n in names[:-1] if n in row), default=None)
            ratio = f"  {fa3[shape]:.1f}" + (f"  (best Gluon {best / fa3[shape]:.2f}x fa3)" if best else "")
        TT.log(f"  {shape:<18}{cells}{ratio}")
    R.write_json(args.out.with_name(args.out.name.removesuffix(".csv") + ".env.json"), env)
    TT.log(f"wrote {args.out} in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
