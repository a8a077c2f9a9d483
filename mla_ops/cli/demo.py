"""``python -m mla_ops demo``: a DeepSeek-style MLA layer over ragged batches with cached context.

It runs the layer eagerly and under ``torch.compile(fullgraph=True)``, checks both against a float64
computation that does not use the package's kernels, and prints the errors and the times.
"""

from __future__ import annotations

import argparse
import copy
import functools
import math
import time
from collections.abc import Sequence

import torch

from ..api import ContextChunk
from ..model import MLAAttention, MLABatch, MLAConfig, pack_context, random_batch
from ..selector import ENV_VAR, current_override, route
from ..specs import DeviceCapability, SelectorConfig
from .info import check_settings, parse_device

# bf16 activations between the projections already cost ~0.4% relative error; an attention kernel
# that is wrong by even one masked row or a wrong LSE base lands far above this.
REL_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


def attention_fp64(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    chunks: Sequence[ContextChunk],
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each sequence's new tokens over ``[its context ; its new tokens]``, in float64.

    Written without the package's ops: per sequence it concatenates the context slices of every
    chunk and the new keys, applies one causal mask aligned to the end, and a softmax. Returns ``out``
    ``[T, H, Dv]`` and ``lse`` ``[H, T]``, both float64.
    """
    num_tokens, num_heads, _ = q.shape
    out = q.new_zeros(num_tokens, num_heads, v.shape[-1], dtype=torch.float64)
    lse = q.new_full((num_heads, num_tokens), -math.inf, dtype=torch.float64)
    bounds = cu_seqlens.tolist()
    chunk_bounds = [c.cu_seqlens_k.tolist() for c in chunks]
    for b in range(len(bounds) - 1):
        q0, q1 = bounds[b], bounds[b + 1]
        if q1 == q0:
            continue
        keys = [c.k[cb[b] : cb[b + 1]] for c, cb in zip(chunks, chunk_bounds)] + [k[q0:q1]]
        values = [c.v[cb[b] : cb[b + 1]] for c, cb in zip(chunks, chunk_bounds)] + [v[q0:q1]]
        kk = torch.cat(keys).double().transpose(0, 1)
        vv = torch.cat(values).double().transpose(0, 1)
        qq = q[q0:q1].double().transpose(0, 1)
        scores = qq @ kk.transpose(1, 2) * softmax_scale
        n_q, n_k = q1 - q0, kk.shape[1]
        visible = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(diagonal=n_k - n_q)
        scores = scores.masked_fill(~visible, -math.inf)
        lse[:, q0:q1] = torch.logsumexp(scores, dim=-1)
        out[q0:q1] = (torch.softmax(scores, dim=-1) @ vv).transpose(0, 1)
    return out, lse


def _batch_as(batch: MLABatch, dtype: torch.dtype) -> MLABatch:
    context = [c._replace(kv_c=c.kv_c.to(dtype), k_pe=c.k_pe.to(dtype)) for c in batch.context]
    return MLABatch(
        batch.hidden.to(dtype),
        batch.positions,
        batch.cu_seqlens,
        batch.max_seqlen,
        context,
        batch.new_lengths,
        batch.context_lengths,
    )


def _run(layer: torch.nn.Module, batch: MLABatch, context: list | None = None) -> torch.Tensor:
    context = batch.context if context is None else context
    return layer(batch.hidden, batch.positions, batch.cu_seqlens, batch.max_seqlen, context)


def _graphs_compiled() -> int:
    """How many distinct graphs Dynamo has compiled in this process."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _timed(fn, device: torch.device) -> tuple[torch.Tensor, float]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - start


def _rel_error(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = out.double() - ref
    return (diff.norm() / ref.norm()).item(), diff.abs().max().item()


def demo_batches(device: torch.device) -> list[tuple[list[int], list[int], int]]:
    """``(new_lengths, context_lengths, chunk_size)`` of the demo's batches on ``device``."""
    if device.type == "cuda":
        return [
            ([512, 1000, 17, 0, 2048], [4096, 0, 300, 1000, 0], 2048),
            ([3000, 1, 700], [0, 5000, 128], 2048),
            ([64, 64, 64, 64], [1024, 2048, 0, 512], 2048),
        ]
    return [
        ([37, 1, 0, 100, 64], [50, 0, 20, 130, 0], 64),
        ([5, 80, 33], [0, 200, 10], 64),
        ([16, 16], [70, 3], 64),
    ]


@torch.no_grad()
def run_demo(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.bfloat16, compile: bool = True
) -> int:
    """Run the demo; returns 0 when every result is within tolerance, else 1.

    The compiled layer receives each batch's context packed into one chunk
    (:func:`mla_ops.model.pack_context`), so every batch runs the graph compiled for the first.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = parse_device(str(device))
    check_settings()
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    config = MLAConfig(hidden_size=1024, num_heads=16)
    layer = MLAAttention(config, device=device, dtype=dtype)
    truth = copy.deepcopy(layer).double()
    truth.attention = attention_fp64
    compiled = torch.compile(layer, fullgraph=True, dynamic=True) if compile else None
    graphs_before = _graphs_compiled()

    selector_config = SelectorConfig(dtype, config.mla_dimensions)
    backend = route(device, dtype, config.qk_head_dim, config.v_head_dim)
    print(f"mla_ops demo: MLA layer H={config.num_heads}, dims {tuple(config.mla_dimensions)}, {dtype}, on {device}")
    print(f"backend: {backend.name} ({backend.describe(DeviceCapability.of(device), selector_config)})")
    forced = current_override()
    if device.type == "cpu" and forced is not None:
        print(
            f"  (the override {forced.name}, from {ENV_VAR} or set_prefill_backend, applies to CUDA devices; "
            "CPU tensors always run REFERENCE)"
        )
    if compiled is not None:
        print("  (the first compiled run's time includes compilation)")
    tolerance = REL_TOLERANCE[dtype]
    failures = 0
    for i, (new_lengths, context_lengths, chunk_size) in enumerate(demo_batches(device)):
        batch = random_batch(layer, new_lengths, context_lengths, chunk_size, generator=gen)
        ref = _run(truth, _batch_as(batch, torch.float64))
        runs = [("eager", layer)] + ([("compiled", compiled)] if compiled is not None else [])
        print(
            f"batch {i}: new tokens {new_lengths}, context {context_lengths} in {len(batch.context)} chunk(s) "
            f"of <= {chunk_size}"
        )
        packed = [pack_context(layer, batch.cu_seqlens, batch.context)]
        for name, module in runs:
            context = packed if module is compiled else None
            out, seconds = _timed(functools.partial(_run, module, batch, context), device)
            rel, worst = _rel_error(out, ref)
            ok = rel <= tolerance and not torch.isnan(out).any()
            failures += not ok
            print(
                f"  {name:8s} rel. error {rel:.2e} (max abs {worst:.2e}) vs float64, {seconds * 1e3:9.1f} ms  "
                f"{'ok' if ok else 'FAIL: above ' + format(tolerance, '.0e')}"
            )
    if compiled is not None:
        batches = len(demo_batches(device))
        graphs = _graphs_compiled() - graphs_before
        print(f"torch.compile(fullgraph=True, dynamic=True): {graphs} graph(s) for {batches} batches")
    print("demo passed" if failures == 0 else f"demo FAILED: {failures} result(s) out of tolerance")
    return 0 if failures == 0 else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="activation dtype")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile(fullgraph=True) runs")


def main(args: argparse.Namespace) -> int:
    return run_demo(args.device, getattr(torch, args.dtype), compile=not args.no_compile)
