#!/usr/bin/env python
"""Sweep launch configurations of the Triton kernels on a CUDA GPU and print the best ones.

For DeepSeek's (Dqk, Dv) = (192, 128) in bfloat16 it times every candidate configuration on:

- the new-tokens (causal) path: 4 x 4096 tokens at H=16, 2 x 8192 at H=128, and a mixed batch
  [512, 1024, 2048, 3000, 700] at H=128 (the reference shapes of bench_prefill.py);
- the context-chunk (non-causal) path: 1024 new tokens over 8192 of context, at H=16 and H=128;

with ``v`` the strided view MLA produces, after first checking each candidate against the package's
reference on a small ragged batch (zero-length sequences, an empty chunk slice, padding rows). It
reports TFLOP/s (FLOPs = 2 * H * (Dqk + Dv) * pairs, pairs = s(s+1)/2 causal, sq * sk for a chunk),
the best configuration per shape, and FlashInfer's fa3 kernel on the same shapes when ``flashinfer``
imports, so the ratio comes from one run. It also sweeps the merge kernel (GB/s) at T=16384, H=128,
Dv=128. Results go to a CSV (``--out``, with ``<stem>.env.json`` beside it); the best configurations
are printed as lines to paste into ``mla_ops/kernels/configs.py``. With ``--dtype float8_e4m3fn`` it sweeps the
fp8 ops' kernel instead (inputs quantised per head, the ``tl.dot`` kernel only, the ratio against bf16 fa3) and
prints dtype-specific table entries. ``--shapes`` times other shapes of bench_prefill.py instead (ids with
wildcards, suites or tags), e.g. the long prompts an fp8 configuration is for. Needs a CUDA device.

Usage::

    python benchmarks/tune_triton.py --out results/tune.csv
    python benchmarks/tune_triton.py --out tune.csv --candidates "128,64,8,3;128,64,8,3,ovl" --no-flashinfer
    python benchmarks/tune_triton.py --out fp8.csv --dtype float8_e4m3fn --shapes causal-h128-1x16384 --no-merge
"""

from __future__ import annotations

import argparse
import csv
import math
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

#: The shapes timed by default: the reference causal shapes, then the chunk shapes.
SHAPES = (*(s for s in P.gpu_shapes() if "ref" in s.tags), *P.TUNING_CHUNK_SHAPES)


def chosen_shapes(patterns: Sequence[str]) -> list[P.Shape]:
    """:data:`SHAPES`, or the attention shapes of bench_prefill.py's GPU set (and :data:`SHAPES`) that ``patterns``
    name (``--shapes``: ids with shell wildcards, suites or tags)."""
    if not patterns:
        return list(SHAPES)
    known = [s for s in P.gpu_shapes() if s.suite != "merge"]
    known += [s for s in SHAPES if s not in known]
    return P.select_shapes(known, patterns, quick=False)


#: The ragged batches every candidate is checked on first (both paths; 3 padding rows).
CHECK_SHAPES = (
    P.Shape("causal", 16, (1, 17, 0, 127, 300, 64)),
    P.Shape("chunk", 16, (1, 17, 0, 127, 300, 64), (40, 0, 5, 130, 257, 64)),
)

#: Candidates for SM90 (227 KiB shared memory): the tl.dot kernel with the plain key loop and with each
#: tile's softmax overlapped with the previous tile's P @ V ("ovl"), and the Hopper kernel written in
#: Gluon (mla_ops.kernels.attention_sm90; SM90 only, elsewhere rejected), in tiles of 128 and 64 keys.
#: benchmarks/compile_sm90.py --configs tells which spill or have their wgmma serialised (with Triton 3.6:
#: the plain loop on the chunk path, and a few with 128-key tiles); they stay here as measured baselines.
DEFAULT_CANDIDATES = [
    "128,64,8,2",
    "128,64,8,3",
    "128,64,8,4",
    "128,128,8,2",
    "128,32,8,4",
    "64,64,4,3",
    "64,128,4,2",
    "128,64,8,2,ovl",
    "128,64,8,3,ovl",
    "128,64,8,4,ovl",
    "128,128,4,2,gluon,ovl,pers",
    "128,64,4,3,gluon,ovl,pers",
]
QUICK_CANDIDATES = ["128,64,8,3", "128,128,8,2", "128,64,8,3,ovl"]
#: fp8 candidates: e4m3 tiles take half the shared memory, so longer rings and 128-key tiles fit. Each compiles for
#: sm_90a without spills under Triton 3.6 (compile_sm90.py --dtype float8_e4m3fn --configs); "128,128,8,{2,3},ovl"
#: spill 64-128 bytes there and are left out.
FP8_CANDIDATES = [
    "128,64,8,2",
    "128,64,8,3",
    "128,64,8,4",
    "128,128,8,2",
    "128,128,8,3",
    "128,32,8,4",
    "64,128,4,3",
    "128,64,8,3,ovl",
    "128,64,8,4,ovl",
    # The Gluon kernel's fp8 variant: 128-key tiles in 4 buffers per ring (SM90_GLUON_FP8_ATTENTION) or 3, 64-key
    # tiles in 4 or 6; each compiles for sm_90a without spills under Triton 3.6 to 3.9 (docs/design/fp8.md).
    "128,128,4,4,gluon,ovl,pers",
    "128,128,4,3,gluon,ovl,pers",
    "128,64,4,4,gluon,ovl,pers",
    "128,64,4,6,gluon,ovl,pers",
    # The same with the consumers taking turns ('pp'): fp8 halves the products' time, not the exponentials'.
    "128,128,4,4,gluon,ovl,pers,pp",
    "128,128,4,3,gluon,ovl,pers,pp",
    "128,64,4,6,gluon,ovl,pers,pp",
]

MERGE_CANDIDATES = [(bt, w) for bt in (4, 8, 16, 32, 64) for w in (2, 4, 8)]


def log(*args: object) -> None:
    print(*args, flush=True)


def label(shape: P.Shape) -> str:
    """The CSV's shape label: ``4x4096 H16``, ``mixed H128``, ``1k over 8k H16``."""
    if shape.suite == "chunk":
        return f"{shape.q_lens[0] // 1024}k over {shape.k_lens[0] // 1024}k H{shape.heads}"
    return f"{shape.short_label} H{shape.heads}"


def check_candidate(config: Any, device: torch.device, dtype: torch.dtype, fp8: bool = False) -> str | None:
    """Run ``config`` on :data:`CHECK_SHAPES` against the reference (``fp8``: on the inputs quantised); the problem
    found, or ``None``."""
    method = M.TritonRaw(config, fp8)
    for shape in CHECK_SHAPES:
        p = P.make_problem(shape, device, dtype, seed=1, padding_rows=3)
        checked = M.check_and_time(method, p, M.reference_outputs(p), timed=False)
        if checked.status != "ok":
            detail = checked.note or f"out error {checked.rel_err:.3g}, lse error {checked.lse_err:.3g}"
            return f"{shape.suite}: {checked.status} ({detail})"
    return None


def sweep_attention(
    args: argparse.Namespace, problems: dict[str, P.Problem], device: torch.device, writer: Any, meta: dict
) -> tuple[dict, dict]:
    """Time every candidate on every problem; returns ({label: (tflops, config)}, {config: {label: tflops}})."""
    import torch

    from mla_ops.kernels.configs import AttentionConfig, table_attention_config

    fp8 = args.dtype == "float8_e4m3fn"
    built_in = FP8_CANDIDATES if fp8 else DEFAULT_CANDIDATES
    texts = args.candidates.split(";") if args.candidates else (QUICK_CANDIDATES if args.quick else built_in)
    candidates = [AttentionConfig.parse(t, "--candidates") for t in texts]
    cap = torch.cuda.get_device_capability(device)
    for causal in (True, False):
        table = table_attention_config(cap, P.DQK, P.DV, causal, getattr(torch, args.dtype))
        if table not in candidates:
            candidates.append(table)
        log(f"table config ({'causal' if causal else 'chunk'}): {table}")
    best: dict[str, tuple[float, Any]] = {}
    results: dict[Any, dict[str, float]] = {}
    started = time.time()
    for i, config in enumerate(candidates):
        log(f"[{i + 1}/{len(candidates)}] {config}  ({time.time() - started:.0f} s)")
        try:
            problem = check_candidate(config, device, torch.bfloat16, fp8)
        except Exception as exc:  # a configuration the compiler rejects is a result, not a crash
            problem = R.short_error(exc, 200)
        if problem is not None:
            log(f"    rejected: {problem}")
            writer.writerow({**meta, "kind": "triton", "shape": "check", "config": str(config), "error": problem})
            continue
        results[config] = {}
        method = M.TritonRaw(config, fp8)
        for name, p in problems.items():
            try:
                ms = timing.measure(method.prepare(p).fn, device, warmup_ms=args.warmup, rep_ms=args.rep).median_ms
            except Exception as exc:
                log(f"    {name}: {R.short_error(exc)}")
                writer.writerow({**meta, "kind": "triton", "shape": name, "config": str(config), "error": repr(exc)})
                continue
            tflops = p.shape.flops() / ms / 1e9
            results[config][name] = tflops
            log(f"    {name:<18} {ms:8.3f} ms  {tflops:7.1f} TFLOP/s")
            writer.writerow(
                {
                    **meta,
                    "kind": "triton",
                    "path": p.shape.suite,
                    "shape": name,
                    "heads": p.heads,
                    "config": str(config),
                    "ms": f"{ms:.4f}",
                    "tflops": f"{tflops:.1f}",
                }
            )
            if name not in best or tflops > best[name][0]:
                best[name] = (tflops, config)
    return best, results


def time_flashinfer(
    args: argparse.Namespace, problems: dict[str, P.Problem], device: torch.device, writer: Any, meta: dict
) -> dict[str, float]:
    """FlashInfer fa3 on the same problems, planned once per shape; {} when it is not timed."""
    if args.no_flashinfer:
        return {}
    method = M.FlashInferRaw("fa3")
    why = method.unavailable(device)
    if why is not None:
        log(f"flashinfer not timed: {why}")
        return {}
    log(f"flashinfer {meta['flashinfer']}: the first plan compiles the fa3 kernel (a minute or more)")
    out: dict[str, float] = {}
    for name, p in problems.items():
        started = time.time()
        try:
            ms = timing.measure(method.prepare(p).fn, device, warmup_ms=args.warmup, rep_ms=args.rep).median_ms
        except Exception as exc:
            log(f"    fa3 {name}: {R.short_error(exc)}")
            writer.writerow({**meta, "kind": "flashinfer-fa3", "shape": name, "error": repr(exc)})
            continue
        tflops = p.shape.flops() / ms / 1e9
        out[name] = tflops
        log(f"    fa3 {name:<18} {ms:8.3f} ms  {tflops:7.1f} TFLOP/s  (plan+bench {time.time() - started:.0f} s)")
        writer.writerow(
            {
                **meta,
                "kind": "flashinfer-fa3",
                "path": p.shape.suite,
                "shape": name,
                "heads": p.heads,
                "config": "fa3",
                "ms": f"{ms:.4f}",
                "tflops": f"{tflops:.1f}",
            }
        )
    return out


def sweep_merge(args: argparse.Namespace, device: torch.device, writer: Any, meta: dict) -> None:
    """Time every merge configuration at T=16384, H=128, Dv=128 (one LSE row in seven empty)."""
    import torch

    from mla_ops.backends.base import MergeCall
    from mla_ops.kernels.merge import merge_attn_states_triton

    shape = P.Shape("merge", 128, (16384,))
    p = P.make_problem(shape, device, torch.bfloat16, seed=2)
    p.merge[1][:, ::7] = -math.inf  # empty prefix rows: the kernel must give them weight 0
    reference = M.reference_outputs(p)
    tol = M.OUT_TOL_EPS * torch.finfo(torch.bfloat16).eps
    moved = shape.merge_bytes(2)
    log(f"merge T={shape.q_lens[0]} H={shape.heads} Dv={P.DV} bf16: {moved / 1e9:.2f} GB moved per call")
    best = None
    call = MergeCall(*p.merge)
    for block_t, warps in MERGE_CANDIDATES:
        run = lambda block_t=block_t, warps=warps: merge_attn_states_triton(call, block_t=block_t, num_warps=warps)
        rel, lse_err = M.compare(*run(), *reference)
        ok = rel <= tol and lse_err is not None and lse_err <= M.LSE_TOL
        ms = timing.measure(run, device, warmup_ms=args.warmup, rep_ms=args.rep).median_ms
        gbps = moved / ms / 1e6
        log(f"    block_t={block_t:<3} warps={warps}  {ms:7.3f} ms  {gbps:7.1f} GB/s{'' if ok else '  WRONG'}")
        writer.writerow(
            {
                **meta,
                "kind": "merge",
                "path": "merge",
                "shape": f"T{shape.q_lens[0]} H{shape.heads} Dv{P.DV}",
                "heads": shape.heads,
                "config": f"block_t={block_t},warps={warps}",
                "ms": f"{ms:.4f}",
                "gbps": f"{gbps:.1f}",
                "error": "" if ok else f"out error {rel:.3g}, lse error {lse_err}",
            }
        )
        if ok and (best is None or gbps > best[0]):
            best = (gbps, block_t, warps)
    if best is not None:
        log(f"best merge: block_t={best[1]}, warps={best[2]}: {best[0]:.1f} GB/s")
        log(f"  -> SM90_MERGE = MergeConfig(block_t={best[1]}, num_warps={best[2]})")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="CSV file to write (one row per candidate and shape)")
    cli.add_attention_configs(parser, "--candidates", "a built-in list")
    parser.add_argument("--quick", action="store_true", help="three candidates only (a smoke run)")
    parser.add_argument(
        "--dtype", choices=("bfloat16", "float8_e4m3fn"), default="bfloat16",
        help="the inputs (default bfloat16); float8_e4m3fn sweeps the fp8 ops' kernel on the shapes' inputs\n"
        "quantised per head, against bf16 fa3",
    )  # fmt: skip
    parser.add_argument(
        "--shapes", nargs="+", default=[], metavar="PATTERN",
        help="bench_prefill.py shape ids (shell wildcards), suites (causal, chunk) or tags (ref, long) to time\n"
        "instead of the tuning shapes (the 'ref' causal shapes and 1024 new over 8k at H=16 and H=128)",
    )  # fmt: skip
    parser.add_argument("--no-flashinfer", action="store_true", help="skip timing FlashInfer fa3")
    parser.add_argument("--no-merge", action="store_true", help="skip the merge kernel sweep")
    parser.add_argument("--warmup", type=int, default=25, help="warm-up time per measurement, ms (default 25)")
    parser.add_argument("--rep", type=int, default=100, help="measuring time per measurement, ms (default 100)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from mla_ops.kernels.configs import CONFIG_ENV_VAR

    device = P.require_cuda("tune_triton.py", "timing the Triton kernels")
    dtype = torch.bfloat16
    _, env = R.start_run("tune_triton.py", argv, device, dtype)
    clocks = R.query_clocks(device)
    meta = {
        "gpu": env["gpu"],
        "capability": env["compute_capability"],
        "clocks": f"{clocks['sm_clock_mhz']} MHz, {clocks['max_sm_clock_mhz']} MHz, {clocks['mem_clock_mhz']} MHz",
        "torch": env["torch"],
        "cuda": env["cuda"],
        "triton": env["triton"],
        "flashinfer": env["flashinfer"],
        "python": env["python"],
    }
    log(" | ".join(f"{k}={v}" for k, v in meta.items()))
    fields = [*meta, "kind", "path", "shape", "heads", "config", "ms", "tflops", "gbps", "ratio_vs_fa3", "error"]
    started = time.time()
    # About 3.5 GB for all of them, built once.
    shapes = chosen_shapes(args.shapes)
    problems = {label(s): P.make_problem(s, device, dtype) for s in shapes}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        writer.writeheader()
        best, results = sweep_attention(args, problems, device, writer, meta)
        fa3 = time_flashinfer(args, problems, device, writer, meta)
        problems.clear()
        torch.cuda.empty_cache()
        if not args.no_merge:
            sweep_merge(args, device, writer, meta)
        log("")
        log(f"best Triton configuration per shape (192/128 {args.dtype}):")
        for name, (tflops, config) in best.items():
            ratio = f"  {tflops / fa3[name]:.2f}x bf16 fa3 ({fa3[name]:.0f})" if name in fa3 else ""
            log(f"  {name:<18} {tflops:7.1f} TFLOP/s  {config}{ratio}")
            writer.writerow(
                {
                    **meta,
                    "kind": "best",
                    "shape": name,
                    "config": str(config),
                    "tflops": f"{tflops:.1f}",
                    "ratio_vs_fa3": f"{tflops / fa3[name]:.3f}" if name in fa3 else "",
                }
            )
        # One entry per path and table: the configuration with the best geometric mean over that path's
        # shapes. Gluon configurations go only into the large-batch table (every tuning shape is a large
        # batch), the others into the table that serves every batch.
        fp8 = args.dtype == "float8_e4m3fn"
        for causal in (True, False):
            names = [label(s) for s in shapes if (s.suite == "causal") == causal]
            if not names:
                continue
            large = "SM90_GLUON_FP8_ATTENTION" if fp8 else "SM90_LARGE_BATCH_ATTENTION"
            tables = (("SM90_ATTENTION", False), (large, True))
            for table, gluon in tables:
                # An fp8 entry of the tl.dot table is keyed on the dtype too, which wins over the dtype-free bf16 one
                # (configs.py); the Gluon kernel's fp8 table holds fp8 entries only.
                typed = fp8 and not gluon
                key = f"({P.DQK}, {P.DV}, {causal}, torch.float8_e4m3fn)" if typed else f"({P.DQK}, {P.DV}, {causal})"
                scored = [
                    (math.exp(sum(math.log(r[n]) for n in names) / len(names)), c)
                    for c, r in results.items()
                    if c.gluon == gluon and all(n in r for n in names)
                ]
                if scored:
                    score, config = max(scored, key=lambda t: t[0])
                    log(f"  -> {table}[{key}] = {config!r}  # geomean {score:.1f} TFLOP/s ({CONFIG_ENV_VAR}={config})")
    R.write_json(args.out.with_name(args.out.name.removesuffix(".csv") + ".env.json"), env)
    log(f"wrote {args.out} in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
