#!/usr/bin/env python
"""Benchmark MLA prefill: every backend through the public ops, against raw library baselines.

Measures TFLOP/s of the causal new-tokens path (``mla_ops.prefill``) and of the context-chunk path
(``mla_ops.prefill_context_chunk``), and GB/s of ``mla_ops.merge_attn_states``, for every backend that
is valid on this machine and, in the same run, for raw baselines: FlashInfer called directly,
FlashAttention-4 (``flash_attn.cute``) called directly, PyTorch's bundled FlashAttention-2 varlen
kernel, PyTorch SDPA (memory-efficient kernel) and FlexAttention with a document mask. Each output is
checked once against the fp32 reference before timing; each op is then measured against its own raw
call, samples taken in turns in several rounds, which gives its overhead ratio. The ``auto`` row is the op with
no override, routed per call as a user's call is (by size class where a cost table ranks the backends), with
its throughput over the fastest forced backend's (*auto / best op*). Each backend with fp8 kernels here adds two
rows: its fp8 op on inputs quantised beforehand (``NAME fp8``) and with the quantisation of ``q``, ``k`` and ``v``
inside the timed call (``NAME fp8+quant``), each with its throughput over the best bf16 op's
(*/ best bf16 op*, FLOPs counted alike), and the report gives the causal length from which fp8 pays;
``--versus-best-op`` measures that ratio again in rounds of phases in which each runs at its own settled clock.

Writes ``prefill.csv``, ``prefill.md``, ``prefill.png`` and ``prefill.env.json`` into
``benchmarks/results/<gpu-slug>/`` (or ``--out``). Without a GPU it times the REFERENCE backend on tiny
shapes, which keeps the script testable anywhere. See ``benchmarks/README.md`` for the columns.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The shared modules live next to this script, which is not part of a package.
from benchlib import cli, clocks, timing
from benchlib import methods as M
from benchlib import problems as P
from benchlib import report as R

if TYPE_CHECKING:
    import torch

#: ``--baselines`` keys and what each adds (a timed op's own raw call is timed whatever these say).
BASELINE_KEYS = {
    "flashinfer": "flashinfer_raw and flashinfer_merge_state",
    "fa4": "fa4_raw: flash_attn.cute.flash_attn_varlen_func (FlashAttention-4)",
    "fa3": "fa3_raw: flash_attn_interface.flash_attn_varlen_func (FlashAttention-3)",
    "fa2": "fa2_varlen_raw (PyTorch's bundled FlashAttention-2) and flash_attn_raw (flash_attn package)",
    "sdpa": "sdpa_efficient (sdpa_cpu on CPU)",
    "flex": "flex_attention",
    "torch": "torch_eager_merge",
}

CSV_FIELDS = R.PREFILL_FIELDS


def build_methods(
    args: argparse.Namespace, device: torch.device, backends: list[dict[str, Any]], fi_kernel: str
) -> tuple[list[M.Method], dict[str, str]]:
    """The methods to time, in order, and for each one left out, why."""
    timed, not_measured = M.backends_to_time(backends, device, args.backends)
    ops: list[M.Method] = []
    own_raw: list[M.Method] = []
    for row in timed:
        raw = M.raw_method_for(row["name"], row["backend"], device, fi_kernel)
        ops.append(M.OpMethod(row["name"], row["implementation"], raw.name if raw is not None else None))
        if raw is not None:
            own_raw.append(raw)

    keys = [] if args.baselines == ["none"] else (args.baselines or list(BASELINE_KEYS))
    bad = [k for k in keys if k not in BASELINE_KEYS]
    if bad:
        raise SystemExit(f"--baselines: unknown {bad}; choose from {', '.join(BASELINE_KEYS)} or 'none'")
    candidates: dict[str, list[M.Method]] = {
        "flashinfer": [M.FlashInferRaw(fi_kernel)],
        "fa4": [M.FlashAttnRaw("flash_attn.cute")],
        "fa3": [M.FlashAttnRaw("flash_attn_interface")],
        "fa2": [M.FlashAttnRaw("torch.ops.aten._flash_attention_forward"), M.FlashAttnRaw("flash_attn")],
        "sdpa": [M.SdpaBaseline(device)],
        "flex": [M.FlexBaseline()],
        "torch": [M.TorchEagerMerge()],
    }
    # The op with no override, against the best forced backend ("auto / best op"): what size-aware routing gets.
    fp8 = [] if args.no_fp8 else M.fp8_backends([row["name"] for row in timed], device)
    fp8_ops = [M.Fp8OpMethod(name, quantize) for name in fp8 for quantize in (False, True)]
    methods = [*ops, M.AutoOpMethod(), *fp8_ops, *own_raw, M.MergeOp(device), M.MergeDirect()]
    methods += [m for key in keys for m in candidates[key]]
    if "flashinfer" in keys:
        # Last: a failed launch inside flashinfer.merge_state leaves a CUDA error that the next
        # method's first launch would report as its own.
        methods.append(M.FlashInferMerge())
    kept, names = [], set()
    for method in methods:
        if method.name in names:  # an op's own raw call that a baseline key names too
            continue
        names.add(method.name)
        why = method.unavailable(device)
        if why is None:
            kept.append(method)
        else:
            not_measured[method.name] = why
    return kept, not_measured


def run_shape(
    shape: P.Shape,
    methods: list[M.Method],
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    progress: R.Progress,
) -> list[dict[str, Any]]:
    """Check and time every method of the shape's suite, then each op against its own raw call."""
    import torch

    methods = [m for m in methods if shape.suite in m.suites]
    names = {m.name for m in methods}
    in_ratio = {m.name for m in methods if m.raw in names} | {m.raw for m in methods if m.raw in names}
    in_ratio |= {m.name for m in methods if m.kind == "op"}  # auto is measured against the fastest forced op
    in_ratio |= set(args.versus_best_op) & names  # and these fp8 methods against the fastest bf16 op
    # With --versus-best-raw the fastest correct baseline so far keeps its buffers too (as add_best_baseline picks
    # it: the least time_ms of an ok row), and hands them back once a faster one comes.
    fastest: str | None = None
    try:
        problem = P.make_problem(shape, device, dtype, args.seed)
        reference = M.reference_outputs(problem)
        setup_error = None
    except Exception as exc:  # e.g. out of memory on a smaller GPU: record it and go on to the next shape
        problem = reference = None
        setup_error = f"inputs or reference failed: {R.short_error(exc)}"
        progress.write(f"  {shape.id}: {setup_error}")
    work = shape.flops() if shape.suite != "merge" else shape.merge_bytes(torch.finfo(dtype).bits // 8)
    rows, checked = [], {}
    for method in methods:
        progress.step(f"{shape.id} {method.name}")
        row: dict[str, Any] = {
            "suite": shape.suite,
            "shape": shape.id,
            "label": shape.label,
            "heads": shape.heads,
            "num_seqs": len(shape.q_lens),
            "total_q": sum(shape.q_lens),
            "total_k": sum(shape.k_lens or shape.q_lens),
            "series": shape.series,
            "x": shape.x,
            "method": method.name,
            "kind": method.kind,
            "implementation": method.implementation,
            "raw_method": method.raw,
        }
        rows.append(row)
        if setup_error is not None:
            row["status"], row["note"] = "error", setup_error
            continue
        result = M.check_and_time(method, problem, reference, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
        keep = method.name in in_ratio
        ok_baseline = args.versus_best_raw and method.kind == "baseline" and result.status == "ok" and result.time_ms
        if ok_baseline and (fastest is None or result.time_ms < checked[fastest].time_ms):
            if fastest is not None and fastest not in in_ratio:
                checked[fastest].prepared = None
            fastest, keep = method.name, True
        if not keep:
            result.prepared = None  # hand its buffers back now
        checked[method.name] = result
        row.update(status=result.status, time_ms=result.time_ms, rel_err=result.rel_err, lse_err=result.lse_err)
        if isinstance(method, M.AutoOpMethod):
            row["auto_route"] = method.routed(problem)
        if result.time_ms is not None:
            row.update(host_ms=result.host_ms, pace_ms=max(result.time_ms, result.host_ms or 0.0))
        row["note"] = result.note
        if result.time_ms is not None:
            per_second = work / (result.time_ms * 1e-3)
            if shape.suite == "merge":
                row["gbps"] = per_second / 1e9
            else:
                row["tflops"] = per_second / 1e12
        progress.write(_result_line(row))
    for row in rows:
        op, raw = checked.get(row["method"]), checked.get(row.get("raw_method") or "")
        if row["kind"] != "op" or row.get("raw_method") not in names:
            continue
        progress.step(
            f"{shape.id} {row['method']} vs {row['raw_method']}, {args.ratio_rounds} rounds of samples in turns"
        )
        if op is None or raw is None or op.status != "ok" or raw.status != "ok":
            progress.write(f"  {shape.id}: no overhead ratio for {row['method']}: it or its raw call is not ok")
            continue
        ratio = M.overhead_ratio(
            op.prepared, raw.prepared, device, args.ratio_rounds, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms
        )
        _record_ratio(row, "ratio_raw", ratio, f"{row['method']:<22} {row['raw_method']} / op", progress)
    R.add_best_baseline(rows)
    R.add_auto_ratio(rows)
    R.add_fp8_ratio(rows)
    _rounds_ratios(rows, checked, args, device, progress)
    checked.clear()
    problem = reference = None
    if device.type == "cuda":  # hand the shape's gigabytes back before the next one allocates
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def _rounds_ratios(
    rows: list[dict[str, Any]],
    checked: dict[str, M.Checked],
    args: argparse.Namespace,
    device: torch.device,
    progress: R.Progress,
) -> None:
    """The ratios measured in rounds, each with its rounds' range: ``ratio_auto_best_rounds`` in the ``auto`` row
    (the fastest forced op's time over auto's) and ``ratio_best_rounds`` in the rows of ``--versus-best-raw``'s
    methods (the fastest raw baseline's time over the method's), from samples of both taken in turns
    (:func:`benchlib.methods.rounds_ratio`); ``ratio_best_bf16_rounds`` in the rows of ``--versus-best-op``'s fp8
    methods (the fastest bf16 op's time over the method's), from settled phases of each
    (:func:`benchlib.methods.settled_rounds_ratio`), with the median SM clock of each side's phases
    (``sm_clock_mhz``, ``best_sm_clock_mhz``) and the share of their samples under a power or thermal cap
    (``capped``). ``ratio_auto_best``, ``ratio_best`` and ``ratio_best_bf16`` compare single measurements, taken
    seconds to minutes apart, which differ by their noise too."""
    pairs = [(r, r["best_op"], "ratio_auto_best") for r in rows if r["method"] == "auto" and r.get("best_op")]
    pairs += [(r, r.get("best_baseline"), "ratio_best") for r in rows if r["method"] in args.versus_best_raw]
    pairs += [(r, r.get("best_op"), "ratio_best_bf16") for r in rows if r["method"] in args.versus_best_op]
    for row, theirs, key in pairs:
        settled = key == "ratio_best_bf16"
        how = "settled phases" if settled else "samples in turns"
        progress.step(f"{row['shape']} {row['method']} vs {theirs}, {args.ratio_rounds} rounds of {how}")
        ours, best = checked.get(row["method"]), checked.get(theirs or "")
        if ours is None or best is None or ours.prepared is None or best.prepared is None:
            progress.write(f"  {row['shape']}: no {key} in rounds for {row['method']}: it or {theirs} is not ok")
            continue
        label = f"{row['method']} / {theirs}"
        if settled:
            _settled_ratio(row, ours.prepared, best.prepared, label, args, device, progress)
            continue
        ratio = M.rounds_ratio(
            ours.prepared, best.prepared, device, args.ratio_rounds, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms
        )
        _record_ratio(row, key, ratio, label, progress, median_key=f"{key}_rounds")


def _settled_ratio(
    row: dict[str, Any],
    ours: M.Prepared,
    best: M.Prepared,
    label: str,
    args: argparse.Namespace,
    device: torch.device,
    progress: R.Progress,
) -> None:
    """``ratio_best_bf16_rounds`` of an fp8 ``row`` against the fastest bf16 op ``best`` in settled phases, with the
    SM clock sampled through each timed phase (:class:`benchlib.clocks.ClockSampler`): ``sm_clock_mhz`` (the fp8
    method's phases), ``best_sm_clock_mhz`` (the op's) and ``capped`` (the share of both sides' samples under a
    power or thermal cap), left empty where nothing was sampled."""
    samplers: dict[str, list[clocks.ClockSampler]] = {"numerator": [], "denominator": []}

    def monitor(name: str) -> clocks.ClockSampler:
        samplers[name].append(clocks.ClockSampler(device))
        return samplers[name][-1]

    ratio = M.settled_rounds_ratio(
        ours, best, device, args.ratio_rounds, monitor=monitor, settle_ms=args.settle_ms, phase_ms=args.phase_ms
    )
    _record_ratio(row, "ratio_best_bf16", ratio, label, progress, median_key="ratio_best_bf16_rounds")
    mine, theirs, both = (
        clocks.ClockSummary.of(sample for sampler in group for sample in sampler.samples)
        for group in (samplers["denominator"], samplers["numerator"], samplers["denominator"] + samplers["numerator"])
    )  # fmt: skip
    if mine is not None and theirs is not None and both is not None:
        row.update(sm_clock_mhz=mine.sm_mhz, best_sm_clock_mhz=theirs.sm_mhz, capped=both.capped)
        progress.write(f"  {'':<30} SM clock {mine.describe()}; the bf16 op's {theirs.describe()}")


def _record_ratio(
    row: dict[str, Any], key: str, ratio: Any, label: str, progress: R.Progress, median_key: str | None = None
) -> None:
    """A ratio measured in rounds into ``row`` (``median_key``, default ``key``; ``key_min``, ``key_max``: its
    rounds' range), and its line."""
    row.update({median_key or key: ratio.median, f"{key}_min": ratio.low, f"{key}_max": ratio.high})
    progress.write(f"  {row['shape']:<30} {label}: {ratio.median:.3f} (rounds {ratio.low:.3f}..{ratio.high:.3f})")


def ratio_steps(
    shape: P.Shape, methods: list[M.Method], versus_best_raw: Sequence[str] = (), versus_best_op: Sequence[str] = ()
) -> int:
    """How many ratio measurements a shape gets (one progress step each): each op against its raw call, auto
    against the fastest forced op, each of ``versus_best_raw`` against the fastest raw baseline and each of
    ``versus_best_op`` against the fastest bf16 op."""
    names = {m.name for m in methods if shape.suite in m.suites}
    raws = sum(1 for m in methods if shape.suite in m.suites and m.kind == "op" and m.raw in names)
    auto = "auto" in names and any(m.kind == "op" and m.name != "auto" for m in methods if m.name in names)
    return raws + auto + len(names & set(versus_best_raw)) + len(names & set(versus_best_op))


def _result_line(row: dict[str, Any]) -> str:
    if row["suite"] == "merge":
        speed = f"{R.fmt_rate(row.get('gbps')):>8} GB/s"
    else:
        speed = f"{R.fmt_rate(row.get('tflops')):>8} TFLOP/s"
    err = f"err {R.fmt(row.get('rel_err'), '.1e')} lse {R.fmt(row.get('lse_err'), '.1e')}"
    tail = f"  ({row['note']})" if row["status"] == "error" else ""
    time_ms = R.fmt(row.get("time_ms"), "9.4f")
    return f"  {row['shape']:<30} {row['method']:<22} {time_ms} ms {speed}  {err}  {row['status']}{tail}"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser(
        "Benchmark MLA prefill (Dqk=192, Dv=128): every valid mla_ops backend through the public ops, and raw "
        "FlashInfer / FlashAttention-4 / bundled FlashAttention-2 / SDPA / FlexAttention baselines, in TFLOP/s "
        "(merge in GB/s), with each op's overhead against its own raw call. Writes prefill.csv, prefill.md, "
        "prefill.png and prefill.env.json. Without a GPU it times the REFERENCE backend on tiny shapes."
    )
    cli.add_out_dir(parser)
    parser.add_argument(
        "--quick", action="store_true", help="reduced set: the 3 reference shapes, one chunk shape and the merge"
    )
    cli.add_backends(parser, help="mla_ops backends to time (default: every backend valid here; REFERENCE only on CPU)")
    parser.add_argument(
        "--baselines",
        nargs="+",
        metavar="KEY",
        help="raw baselines to time, from "
        + "; ".join(f"{k} ({v})" for k, v in BASELINE_KEYS.items())
        + "; or 'none' (default: all). A timed op's own raw call is always timed",
    )
    parser.add_argument(
        "--shapes",
        nargs="+",
        metavar="PATTERN",
        default=[],
        help="shape ids (shell wildcards), suites (causal, chunk, merge) or tags (ref, quick, long); see --list",
    )
    parser.add_argument("--list", action="store_true", help="print the shapes and methods that would run, then exit")
    parser.add_argument("--no-fp8", action="store_true", help="leave out the fp8 rows (NAME fp8, NAME fp8+quant)")
    parser.add_argument(
        "--flashinfer-backend",
        default="auto",
        help="kernel of the raw FlashInfer baseline: auto (the one FLASHINFER runs: fa3 on SM90), fa2, fa3, ...",
    )
    cli.add_timer(parser)
    parser.add_argument(
        "--ratio-rounds",
        type=int,
        help="rounds of each op against its own raw call, samples taken in turns "
        f"(default: {timing.DEFAULT_ROUNDS} on GPU, 3 on CPU)",
    )
    parser.add_argument(
        "--versus-best-raw",
        nargs="+",
        metavar="METHOD",
        default=[],
        help="methods (e.g. TRITON triton_raw) to measure against the shape's fastest raw baseline in --ratio-rounds "
        "rounds of samples of both in turns as well (ratio_best_rounds): 'best raw' compares single measurements, "
        "which differ by several percent on their own",
    )
    parser.add_argument(
        "--versus-best-op",
        nargs="+",
        metavar="METHOD",
        default=[],
        help="fp8 methods (e.g. 'TRITON fp8') to measure against the shape's fastest bf16 op in --ratio-rounds rounds "
        "of settled phases as well (ratio_best_bf16_rounds, with the SM clock of each side's phases): each runs "
        "alone for --settle-ms, then is timed for --phase-ms, so that at a power cap each is timed at its own clock",
    )
    parser.add_argument(
        "--settle-ms",
        type=float,
        help=f"untimed run before each phase of --versus-best-op (default: {timing.SETTLE_MS:g} on GPU, "
        f"{timing.CPU_WARMUP_MS:g} on CPU)",
    )
    parser.add_argument(
        "--phase-ms",
        type=float,
        help=f"timed budget of each phase of --versus-best-op (default: {timing.PHASE_MS:g} on GPU, "
        f"{timing.CPU_REP_MS:g} on CPU)",
    )
    cli.add_device(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar or counter")
    parser.add_argument(
        "--append",
        action="store_true",
        help="merge into the prefill.csv already in the output folder: its rows of the shapes measured now are "
        "replaced, the others kept (to split a long run into several commands)",
    )
    parser.add_argument(
        "--from-csv",
        type=Path,
        metavar="CSV",
        help="re-render prefill.md and prefill.png from an existing prefill.csv (and its "
        "prefill.env.json) without measuring, e.g. on a machine with matplotlib",
    )
    args = parser.parse_args(argv)
    if args.ratio_rounds is not None and args.ratio_rounds < 1:
        parser.error("--ratio-rounds must be at least 1")
    for name in ("settle_ms", "phase_ms"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must not be negative")
    return args


def replot(csv_path: Path, out_dir: Path | None) -> int:
    """``--from-csv``: rebuild the Markdown and the plot from saved results."""
    if not csv_path.is_file():
        raise SystemExit(f"--from-csv: {csv_path} does not exist")
    out_dir = out_dir or csv_path.parent
    for note in R.write_prefill_report(R.load_prefill_rows(csv_path), R.read_env(csv_path), out_dir):
        print(note)
    md, png = (out_dir / f"{R.PREFILL_STEM}{ext}" for ext in (".md", ".png"))
    print(f"wrote {md}" + (f" and {png.name}" if png.exists() else ""))
    return 0


def warm_up(
    methods: list[M.Method],
    backends: list[dict[str, Any]],
    shapes: list[P.Shape],
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, float]:
    """Build the just-in-time kernels before timing, announcing each; returns the seconds each took."""
    seconds: dict[str, float] = {}
    for method in (m for m in methods if isinstance(m, M.FlashInferRaw)):
        print(
            f"{method.name}: JIT-compiling FlashInfer {method.kernel!r} prefill kernels for {dtype}, (Dqk, Dv) = "
            f"({P.DQK}, {P.DV}) (once; about 80 s for fa3 on a fresh machine)...",
            flush=True,
        )
        start = time.perf_counter()
        try:
            method.warm(device, dtype)
            seconds[method.name] = round(time.perf_counter() - start, 1)
            print(f"{method.name}: ready after {seconds[method.name]:.1f} s")
        except Exception as exc:
            print(f"{method.name}: compile failed ({R.short_error(exc)}); its rows will show the error")
    if any(m.name == "fa4_raw" for m in methods):
        print("fa4_raw: FlashAttention-4 compiles each kernel variant on its first call (2-5 s each), untimed")
    timed = {m.name for m in methods if isinstance(m, M.OpMethod)}
    heads = [s.heads for s in shapes if s.suite != "merge"]
    rows = [row for row in backends if row["name"] in timed]
    return {**seconds, **M.warm_backends(rows, device, dtype, heads)}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_csv is not None:
        return replot(args.from_csv, args.out)

    device, dtype = P.setup_device(
        args,
        {"ratio_rounds": timing.DEFAULT_ROUNDS, "settle_ms": timing.SETTLE_MS, "phase_ms": timing.PHASE_MS},
        {"ratio_rounds": 3, "settle_ms": timing.CPU_WARMUP_MS, "phase_ms": timing.CPU_REP_MS},
    )
    cuda = device.type == "cuda"
    all_shapes = P.gpu_shapes() if cuda else P.cpu_shapes()
    shapes = P.select_shapes(all_shapes, args.shapes, args.quick)
    out_dir = args.out or R.default_out_dir(device)

    started = time.perf_counter()
    backends, env = R.start_run("bench_prefill.py", argv, device, dtype)
    fi_kernel = M.flashinfer_kernel(device, args.flashinfer_backend)
    methods, not_measured = build_methods(args, device, backends, fi_kernel)
    env.update(
        warmup_ms=args.warmup_ms,
        rep_ms=args.rep_ms,
        ratio_rounds=args.ratio_rounds,
        **({"settle_ms": args.settle_ms, "phase_ms": args.phase_ms} if args.versus_best_op else {}),
        correctness=f"row-relative output error <= {M.OUT_TOL_EPS:g} eps({args.dtype}), |lse error| <= {M.LSE_TOL:g}",
        not_measured=not_measured,
    )

    unknown = sorted(set(args.versus_best_raw) - {m.name for m in methods})
    if unknown:
        raise SystemExit(
            f"bench_prefill.py: --versus-best-raw: {', '.join(unknown)} not timed in this run; "
            f"the methods timed: {', '.join(m.name for m in methods)}"
        )
    fp8_methods = [m.name for m in methods if m.kind == "fp8"]
    unknown = sorted(set(args.versus_best_op) - set(fp8_methods))
    if unknown:
        raise SystemExit(
            f"bench_prefill.py: --versus-best-op: {', '.join(unknown)} not an fp8 method timed in this run; "
            f"the fp8 methods timed: {', '.join(fp8_methods) or 'none (--no-fp8, or no backend takes fp8 here)'}"
        )
    print(f"device: {env['gpu']} ({device}), dtype {args.dtype}, (Dqk, Dv) = ({P.DQK}, {P.DV})")
    print("timing: " + ", ".join(m.name for m in methods))
    for name, why in not_measured.items():
        print(f"not measured: {name}: {why}")
    count = sum(1 for s in shapes for m in methods if s.suite in m.suites)
    count += sum(ratio_steps(s, methods, args.versus_best_raw, args.versus_best_op) for s in shapes)
    if args.list:
        for s in shapes:
            print(f"  {s.id:<32} {s.label}")
        print(f"{len(shapes)} shapes, {count} measurements")
        return 0
    warmed = warm_up(methods, backends, shapes, device, dtype)
    if warmed:
        env["warmup_s"] = warmed

    # What --append merges into, read before the first checkpoint below replaces the files.
    previous_rows: list[dict[str, Any]] = []
    previous_csv, previous_env = out_dir / f"{R.PREFILL_STEM}.csv", out_dir / f"{R.PREFILL_STEM}.env.json"
    if args.append and previous_csv.is_file():
        previous_rows = R.load_prefill_rows(previous_csv)
        if previous_env.is_file():
            old = json.loads(previous_env.read_text())
            env["appended_to"] = [*old.get("appended_to", []), f"{old.get('date')}: {old.get('command')}"]
    all_ids = [s.id for s in all_shapes]

    def merged(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return R.merge_rows(previous_rows, rows, all_ids) if previous_rows else rows

    progress = R.Progress(count, "bench_prefill", enabled=not args.no_progress)
    progress.write(
        f"each shape's rows go to {previous_csv} as it completes; if the run stops early, "
        f"`--from-csv {previous_csv}` renders the report of what it measured\n"
    )
    measure_start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for method in methods:
        if isinstance(method, M.FlashInferMerge):
            method.log = progress.write
    for done, shape in enumerate(shapes, 1):
        with clocks.ClockSampler(device) as sampler:
            rows += run_shape(shape, methods, args, device, dtype, progress)
        load = clocks.ClockSummary.of(clocks.busy(sampler.samples))
        if load is not None:  # the regime the shape's figures come from: at a power cap the clock follows the power
            env.setdefault("sm_clock_under_load", {})[shape.id] = load.describe()
        # A checkpoint: a run cut short (a time limit, Ctrl-C) keeps every shape it finished.
        env["shapes_measured"] = f"{done} of {len(shapes)}"
        R.write_checkpoint(merged(rows), env, out_dir)
    progress.close()
    env["measure_s"] = round(time.perf_counter() - measure_start, 1)
    env["elapsed_s"] = round(time.perf_counter() - started, 1)
    rows = merged(rows)

    notes = R.write_prefill_outputs(rows, env, out_dir)
    summary = R.overhead_summary(rows)
    if summary:
        print(
            "op overhead (raw call time / op time, median over rounds of neighbouring-sample ratios; target >= 0.97):\n"
            + summary.replace("**", "")
        )
    summary = R.auto_summary(rows)
    if summary:
        print("auto against the fastest forced op:\n" + summary)
    crossover = R.fp8_crossover(rows)
    if crossover:
        print("fp8 against the best bf16 op (causal sweep):\n" + crossover.replace("**", ""))
    settled = R.fp8_rounds(rows)
    if settled:
        print("fp8 against the best bf16 op, each in phases at its own settled clock:\n" + settled.replace("**", ""))
    wrong = sorted({f"{r['method']} on {r['shape']}" for r in rows if r["status"] == "WRONG"})
    if wrong:
        print("WRONG results (exceed the tolerance): " + ", ".join(wrong))
    for note in notes:
        print("note: " + note)
    written = ", ".join(p.name for p in sorted(out_dir.glob(f"{R.PREFILL_STEM}.*")))
    print(f"wrote {written} to {out_dir}: {env['elapsed_s']:.0f} s in all, {env['measure_s']:.0f} s measuring")
    return 0


if __name__ == "__main__":
    sys.exit(main())
