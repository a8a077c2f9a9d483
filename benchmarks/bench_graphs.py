"""Eager against CUDA-graph replay for a stack of MLA layers on small batches.

Small prefill batches are launch-bound: a layer is a dozen kernels of a few microseconds each. This
measures how much replaying the whole stack from one captured graph saves, per backend.

    python benchmarks/bench_graphs.py [--layers 4] [--heads 16] [--lengths 128,128,128,128]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import sys
from pathlib import Path

import torch
from torch import nn

import mla_ops
from mla_ops.model import MLAAttention, MLAConfig, random_batch


class Stack(nn.Module):
    """``depth`` MLA layers with residual connections, all reading the same ragged batch."""

    def __init__(self, config: MLAConfig, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MLAAttention(config, device="cuda", dtype=torch.bfloat16) for _ in range(depth))

    def forward(self, hidden, positions, cu_seqlens, max_seqlen):
        for layer in self.layers:
            hidden = hidden + layer(hidden, positions, cu_seqlens, max_seqlen)
        return hidden


def _time_ms(fn, iters: int) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def measure(backend: str, depth: int, heads: int, lengths: list[int], iters: int) -> tuple[float, float, float]:
    """Median milliseconds per forward, eager and replayed, and the largest difference between them."""
    torch.manual_seed(0)
    stack = Stack(MLAConfig(hidden_size=2048, num_heads=heads), depth)
    batch = random_batch(stack.layers[0], lengths, generator=torch.Generator().manual_seed(0))
    args = (batch.hidden, batch.positions, batch.cu_seqlens, batch.max_seqlen)
    with mla_ops.prefill_backend(backend):
        mla_ops.plan_cuda_graph(batch.cu_seqlens)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            stack(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = stack(*args)
        eager_ms = _time_ms(lambda: stack(*args), iters)
        graph_ms = _time_ms(graph.replay, iters)
        graph.replay()
        diff = (replayed.float() - stack(*args).float()).abs().max().item()
    mla_ops.release_cuda_graph_buffers()
    return eager_ms, graph_ms, diff


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="layers in the stack (default %(default)s)")
    parser.add_argument("--heads", type=int, default=16, help="query heads (default %(default)s)")
    parser.add_argument("--lengths", default="128,128,128,128", help="new tokens per sequence (default %(default)s)")
    parser.add_argument("--iters", type=int, default=50, help="forwards per timing (default %(default)s)")
    parser.add_argument("--backends", default="TRITON,FLASH_ATTN,FLASHINFER", help="comma-separated backends")
    parser.add_argument("--out", type=Path, default=None, help="CSV file to write (default: print only)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_graphs: needs a CUDA device; none is visible", file=sys.stderr)
        return 2
    lengths = [int(x) for x in args.lengths.split(",")]
    device = torch.cuda.get_device_name()
    print(
        f"# {device}, torch {torch.__version__}, {datetime.date.today()}, {args.layers} layers, H={args.heads}, "
        f"lengths {lengths}"
    )
    rows = []
    for backend in args.backends.split(","):
        try:
            eager_ms, graph_ms, diff = measure(backend, args.layers, args.heads, lengths, args.iters)
        except (ValueError, RuntimeError) as exc:
            print(f"{backend:<11} skipped: {exc}")
            continue
        rows.append([backend, f"{eager_ms:.3f}", f"{graph_ms:.3f}", f"{eager_ms / graph_ms:.2f}", f"{diff:.2e}"])
        print(
            f"{backend:<11} eager {eager_ms:7.3f} ms  graph replay {graph_ms:7.3f} ms  "
            f"speed-up {eager_ms / graph_ms:5.2f}x  (max |replay - eager| {diff:.1e})",
            flush=True,
        )
    if args.out:
        with args.out.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow([f"# {device}", f"torch {torch.__version__}", str(datetime.date.today())])
            writer.writerow(["backend", "eager_ms", "graph_ms", "speedup", "max_abs_diff"])
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
