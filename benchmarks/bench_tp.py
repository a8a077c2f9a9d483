"""One DeepSeek-V3 MLA layer (128 heads) on 1 GPU and split over 2 with tensor parallelism.

For prefills of 8k and 32k new tokens after one chunk of cached context, it reports the time per
layer on 1 GPU and on ``P`` GPUs (``mla_ops.parallel.TensorParallelMLAAttention``, one process per GPU
under torchrun, NCCL), the speedup and scaling efficiency ``t1 / (P * tP)``, and where a layer's time
goes: the attention ops, the projections, and the all-reduce of the output. The all-reduce is timed
with CUDA events of its own, inside the layer (where it also waits for the slower rank) and alone.

    python benchmarks/bench_tp.py                        # 1 and 2 GPUs, 8k and 32k new tokens
    python benchmarks/bench_tp.py --gpus 1 2 4 --tokens 8192 --context 16384 --backend TRITON

Each GPU count runs in its own ``torchrun --standalone`` job, started by this script. With fewer
GPUs than a count asks for, that count is skipped with a message (and the script exits 0 after what
it could measure); without a GPU it exits with a message. Results go to
``benchmarks/results/<gpu>/tp.csv``, ``tp.md`` and ``tp.env.json`` unless ``--out`` is given. Timing: CUDA events
around every phase of every iteration, after warm-up iterations; each figure is a median, and for
``P`` GPUs the slowest rank's.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import mla_ops
from mla_ops.model import MLAAttention, MLABatch, MLAConfig, random_batch
from mla_ops.parallel import TensorParallelMLAAttention
from mla_ops.selector import route

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The shared modules live next to this script, which is not part of a package.
from benchlib import report as R
from benchlib import timing

#: NVLink multicast stays off in every rank (a program that uses it can take a shared host's GPUs down).
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "PYTHONUNBUFFERED": "1"}

FIELDS = [
    "gpus",
    "tokens",
    "context",
    "sequences",
    "heads_per_gpu",
    "backend",
    "layer_ms",
    "attention_ms",
    "projections_ms",
    "allreduce_ms",
    "allreduce_alone_ms",
    "allreduce_busbw_gbs",
    "attention_tflops",
    "speedup",
    "scaling_efficiency",
]


# --- one rank's measurements ------------------------------------------------------------------------


class _TimedAttention:
    """Wraps a layer's ``attention`` callable; records a CUDA event pair around each call."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = self.fn(*args, **kwargs)
        end.record()
        self.events.append((start, end))
        return result


def _batch(layer: MLAAttention, tokens: int, context: int, sequences: int) -> MLABatch:
    """``tokens`` new tokens after ``context`` cached ones, split evenly over ``sequences``; the
    context is one chunk (chunk size = the longest sequence's context)."""
    new = [tokens // sequences + (i < tokens % sequences) for i in range(sequences)]
    ctx = [context // sequences + (i < context % sequences) for i in range(sequences)]
    return random_batch(layer, new, ctx, chunk_size=max(max(ctx), 1), generator=torch.Generator().manual_seed(1))


def attention_flops(batch: MLABatch, heads: int, dqk: int, dv: int) -> float:
    """``2 * H * (Dqk + Dv) * pairs``: causal pairs over the new tokens plus new x context pairs."""
    pairs = sum(n * (n + 1) // 2 + n * c for n, c in zip(batch.new_lengths, batch.context_lengths))
    return 2.0 * heads * (dqk + dv) * pairs


@torch.no_grad()
def time_layer(layer: MLAAttention, batch: MLABatch, warmup: int, iters: int) -> dict[str, float]:
    """Median milliseconds of the layer and of its phases over ``iters`` iterations after ``warmup``.

    A :class:`TensorParallelMLAAttention` runs as ``partial_forward`` then ``all_reduce`` (what its
    forward does) with an event between the two, so the all-reduce gets its own interval.
    """
    args = (batch.hidden, batch.positions, batch.cu_seqlens, batch.max_seqlen, batch.context)
    parallel = isinstance(layer, TensorParallelMLAAttention)
    compute = layer.partial_forward if parallel else layer.forward
    timed = layer.attention = _TimedAttention(layer.attention)
    try:
        for _ in range(warmup):
            out = compute(*args)
            if parallel:
                layer.all_reduce(out)
        torch.cuda.synchronize()
        timed.events.clear()
        marks = []
        for _ in range(iters):
            events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            events[0].record()
            out = compute(*args)
            events[1].record()
            if parallel:
                layer.all_reduce(out)
            events[2].record()
            marks.append(events)
        torch.cuda.synchronize()
    finally:
        layer.attention = timed.fn
    layer_ms = [a.elapsed_time(c) for a, _, c in marks]
    compute_ms = [a.elapsed_time(b) for a, b, _ in marks]
    attention_ms = [s.elapsed_time(e) for s, e in timed.events]
    return {
        "layer_ms": statistics.median(layer_ms),
        "attention_ms": statistics.median(attention_ms),
        "projections_ms": statistics.median(c - a for c, a in zip(compute_ms, attention_ms)),
        "allreduce_ms": statistics.median(t - c for t, c in zip(layer_ms, compute_ms)) if parallel else None,
    }


@torch.no_grad()
def time_allreduce(shape: tuple[int, int], dtype: torch.dtype, device: torch.device, warmup: int, iters: int):
    """Median milliseconds of an all-reduce of ``shape`` alone, and NCCL's bus bandwidth in GB/s."""
    x = torch.randn(shape, dtype=dtype, device=device)
    # Each call between CUDA events, after `warmup` untimed ones; no L2 flush, as inside the layer.
    ms = timing.measure(
        lambda: dist.all_reduce(x), device, samples=iters, warmup_calls=warmup, flush_l2=False
    ).median_ms
    world = dist.get_world_size()
    busbw = 2 * (world - 1) / world * x.numel() * x.element_size() / (ms * 1e-3) / 1e9
    return ms, busbw


def run_rank(args: argparse.Namespace) -> None:
    """One rank of a torchrun job: measure every shape, gather the ranks' figures on rank 0."""
    local_rank, world = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    dtype = getattr(torch, args.dtype)
    config = MLAConfig.deepseek_v3(num_heads=args.heads)
    torch.manual_seed(0)
    dense = MLAAttention(config, device=device, dtype=dtype)
    layer = TensorParallelMLAAttention.from_dense(dense) if world > 1 else dense
    del dense
    torch.cuda.empty_cache()
    heads = layer.config.num_heads
    rows = []
    with mla_ops.prefill_backend(args.backend) if args.backend else contextlib.nullcontext():
        backend = route(device, dtype, config.qk_head_dim, config.v_head_dim).name
        for tokens in args.tokens:
            batch = _batch(layer, tokens, args.context, args.sequences)
            row: dict[str, Any] = {
                "gpus": world,
                "tokens": tokens,
                "context": args.context,
                "sequences": args.sequences,
                "heads_per_gpu": heads,
                "backend": backend,
            }
            row.update(time_layer(layer, batch, args.warmup, args.iters))
            flops = attention_flops(batch, heads, config.qk_head_dim, config.v_head_dim)
            row["attention_tflops"] = flops / (row["attention_ms"] * 1e-3) / 1e12
            if world > 1:
                shape = (tokens, config.hidden_size)
                row["allreduce_alone_ms"], row["allreduce_busbw_gbs"] = time_allreduce(
                    shape, dtype, device, args.warmup, args.iters
                )
            rows.append(row)
            if local_rank == 0:
                print(f"  {world} GPU(s), {tokens} tokens: {row['layer_ms']:.3f} ms per layer", flush=True)
            del batch
            torch.cuda.empty_cache()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rows)
    if dist.get_rank() == 0 and args.result_file:
        Path(args.result_file).write_text(json.dumps({"ranks": gathered, "env": environment(device)}))
    # Only after success: a failed rank exits without it and torchrun stops the others.
    dist.destroy_process_group()


# --- the driver: one torchrun job per GPU count, then the report -------------------------------------


def slowest_rank(ranks: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per shape, each timing as the largest over the ranks (the slowest rank sets the layer's pace)."""
    rows = []
    for per_rank in zip(*ranks):
        row = dict(per_rank[0])
        for key in ("layer_ms", "attention_ms", "projections_ms", "allreduce_ms", "allreduce_alone_ms"):
            if row.get(key) is not None:
                row[key] = max(r[key] for r in per_rank)
        if "allreduce_busbw_gbs" in row:
            row["allreduce_busbw_gbs"] = min(r["allreduce_busbw_gbs"] for r in per_rank)
        row["attention_tflops"] = min(r["attention_tflops"] for r in per_rank)
        rows.append(row)
    return rows


def add_scaling(rows: list[dict[str, Any]]) -> None:
    """Speedup ``t1 / tP`` and efficiency ``t1 / (P * tP)`` against the 1-GPU row of the same shape."""
    single = {(r["tokens"], r["context"], r["sequences"]): r["layer_ms"] for r in rows if r["gpus"] == 1}
    for r in rows:
        t1 = single.get((r["tokens"], r["context"], r["sequences"]))
        if t1 is not None:
            r["speedup"] = t1 / r["layer_ms"]
            r["scaling_efficiency"] = t1 / (r["gpus"] * r["layer_ms"])


def environment(device: torch.device) -> dict[str, str]:
    nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(device),
        "gpus_visible": str(torch.cuda.device_count()),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
        "mla_ops": mla_ops.__version__,
        "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "(unset)"),
    }


def render_markdown(
    rows: list[dict[str, Any]],
    env: dict[str, str],
    args: argparse.Namespace,
    command: str,
    skipped: Sequence[str] = (),
) -> str:
    """The report: environment, then one table row per GPU count and shape, then what was not measured."""
    config = MLAConfig.deepseek_v3(num_heads=args.heads)
    lines = [
        f"# Tensor-parallel MLA layer: {env['gpu']}, DeepSeek-V3 (H={config.num_heads}), {args.dtype}",
        "",
        f"Command: `{command}`",
        "",
        "## Environment",
        "",
        *(f"- **{k}**: {v}" for k, v in env.items()),
        f"- **layer**: hidden {config.hidden_size}, q_lora_rank {config.q_lora_rank}, kv_lora_rank "
        f"{config.kv_lora_rank}, (Dqk, Dv) = ({config.qk_head_dim}, {config.v_head_dim})",
        f"- **timing**: CUDA events, {args.warmup} warm-up and {args.iters} timed iterations, medians; "
        "for several GPUs the slowest rank",
        "",
        "## Results",
        "",
        "`layer` is one forward: `attention` (the mla ops: new tokens, the context chunk and the merge) plus "
        "`projections` (everything else of the local layer) plus `all-reduce` (of the `[T, hidden]` output, "
        "timed inside the layer, so it includes waiting for the slower rank). `all-reduce alone` times the "
        "same all-reduce on its own, with NCCL's bus bandwidth. Efficiency is `t1 / (P * tP)`.",
        "",
        "| GPUs | new tokens | context | heads/GPU | backend | layer ms | attention ms | projections ms "
        "| all-reduce ms | all-reduce alone ms | bus GB/s | attention TFLOP/s | speedup | efficiency |",
        "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: (r["tokens"], r["gpus"])):
        lines.append(
            f"| {r['gpus']} | {r['tokens']} | {r['context']} | {r['heads_per_gpu']} | {r['backend']} "
            f"| {R.fmt(r['layer_ms'], '.3f')} | {R.fmt(r['attention_ms'], '.3f')} "
            f"| {R.fmt(r['projections_ms'], '.3f')} | {R.fmt(r.get('allreduce_ms'), '.3f')} "
            f"| {R.fmt(r.get('allreduce_alone_ms'), '.3f')} | {R.fmt(r.get('allreduce_busbw_gbs'), '.0f')} "
            f"| {R.fmt(r['attention_tflops'], '.0f')} | {R.fmt(r.get('speedup'), '.2f')} "
            f"| {R.fmt(r.get('scaling_efficiency'), '.0%')} |"
        )
    if skipped:
        lines += ["", f"Not measured: {'; '.join(skipped)}."]
    return "\n".join(lines) + "\n"


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for r in sorted(rows, key=lambda r: (r["tokens"], r["gpus"])):
            writer.writerow({k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in r.items() if k in FIELDS})


def run_job(gpus: int, args: argparse.Namespace, result_file: Path) -> None:
    """``gpus`` ranks of this script under ``torchrun --standalone``; raises ``SystemExit`` if one fails."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}"]
    command += [__file__, *_forwarded(args), "--result-file", str(result_file)]
    # No timeout here: torchrun owns its ranks and stops them on Ctrl-C or when one fails.
    status = subprocess.run(command, env={**os.environ, **CHILD_ENV}, check=False).returncode
    if status != 0:
        raise SystemExit(f"bench_tp: the {gpus}-GPU job failed (torchrun exited with {status}); see its output above")


def _forwarded(args: argparse.Namespace) -> list[str]:
    out = ["--tokens", *map(str, args.tokens), "--context", str(args.context), "--sequences", str(args.sequences)]
    out += ["--heads", str(args.heads), "--dtype", args.dtype, "--warmup", str(args.warmup)]
    out += ["--iters", str(args.iters)]
    return out + (["--backend", args.backend] if args.backend else [])


def drive(args: argparse.Namespace, argv: Sequence[str]) -> None:
    if not torch.cuda.is_available():
        raise SystemExit(
            "bench_tp: no CUDA GPU is visible (torch.cuda.is_available() is False); this benchmark times an MLA "
            "layer on 1 and several GPUs. Run it on a machine with NVIDIA GPUs."
        )
    # Counting GPUs creates no CUDA context here: this process leaves every GPU's memory to the ranks.
    visible = torch.cuda.device_count()
    counts = [g for g in args.gpus if g <= visible]
    skipped = [f"{g} GPUs (only {visible} visible)" for g in args.gpus if g > visible]
    for note in skipped:
        print(f"bench_tp: not measured: {note}", flush=True)
    rows: list[dict[str, Any]] = []
    env: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for gpus in counts:
            print(f"bench_tp: {gpus} GPU(s)", flush=True)
            result_file = Path(tmp) / f"gpus{gpus}.json"
            run_job(gpus, args, result_file)
            result = json.loads(result_file.read_text())
            rows += slowest_rank(result["ranks"])
            env = result["env"]
    add_scaling(rows)
    out_dir = Path(args.out) if args.out else R.RESULTS_DIR / R.gpu_name_slug(env["gpu"])
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(out_dir / "tp.csv", rows)
    command = R.command_line("bench_tp.py", argv)
    report = render_markdown(rows, env, args, command, skipped)
    (out_dir / "tp.md").write_text(report)
    R.write_json(out_dir / "tp.env.json", {**env, "command": command, "not_measured": skipped})
    print(report)
    print(f"bench_tp: wrote tp.csv, tp.md and tp.env.json to {out_dir}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2], help="GPU counts (default: 1 2)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768], help="new tokens per prefill")
    parser.add_argument("--context", type=int, default=8192, help="cached tokens, one chunk (default %(default)s)")
    parser.add_argument("--sequences", type=int, default=1, help="sequences sharing the tokens (default 1)")
    parser.add_argument("--heads", type=int, default=128, help="heads of the unsplit layer (default 128)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--backend", help="force a backend (default: automatic selection)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up iterations per shape (default 3)")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per shape (default 10)")
    parser.add_argument("--out", help="output folder (default benchmarks/results/<gpu>/)")
    parser.add_argument("--result-file", help=argparse.SUPPRESS)  # set for the ranks of a torchrun job
    args = parser.parse_args(argv)
    if 1 not in args.gpus:
        parser.error("--gpus must include 1: scaling is measured against one GPU")
    if min(args.gpus) < 1 or args.sequences < 1 or min(args.tokens) < args.sequences or args.context < 0:
        parser.error("--gpus, --sequences and --tokens must be positive (at least one token per sequence)")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if "LOCAL_RANK" in os.environ:  # a rank of a torchrun job
        run_rank(args)
    else:
        drive(args, argv)


if __name__ == "__main__":
    main()
