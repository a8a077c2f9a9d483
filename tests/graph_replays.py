"""A layer captured once in a CUDA graph over a token budget, and replayed with other batches written into
the same static buffers: the buffers, the batches, and the capture and replay steps.

Shared by ``tests/test_gpu_e2e.py`` (one GPU) and ``tests/tp_worker.py`` (a tensor-parallel layer, one rank
per GPU); ``"cuda"`` is the current device, which each rank sets to its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

import mla_ops
from mla_ops.model import LatentChunk, MLAAttention, MLABatch, random_batch

BUDGET, MAX_SEQS, CHUNK_BUDGET = 8192, 16, 4096
REPLAYS = [
    ([1000, 17, 1, 0, 0, 0], [0, 300, 5, 0, 0, 0]),
    ([4097, 127], [2000, 0]),
    ([5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 0], [100] * 16),
    ([0] * 15 + [8000], [0] * 15 + [4000]),
    ([2048, 0, 2048, 0, 1024], [1024, 0, 0, 3000, 0]),
]


class StaticBatch:
    """Static buffers a captured graph reads: a token budget, a sequence budget and one context chunk."""

    def __init__(self, layer: MLAAttention) -> None:
        c, dev, dt = layer.config, "cuda", torch.bfloat16
        self.hidden = torch.zeros(BUDGET, c.hidden_size, device=dev, dtype=dt)
        self.positions = torch.zeros(BUDGET, device=dev, dtype=torch.int64)
        self.cu_seqlens = torch.zeros(MAX_SEQS + 1, device=dev, dtype=torch.int32)
        self.kv_c = torch.zeros(CHUNK_BUDGET, c.kv_lora_rank, device=dev, dtype=dt)
        self.k_pe = torch.zeros(CHUNK_BUDGET, c.qk_rope_head_dim, device=dev, dtype=dt)
        self.cu_seqlens_k = torch.zeros(MAX_SEQS + 1, device=dev, dtype=torch.int32)

    def load(self, batch: MLABatch) -> None:
        """Copy a batch in; unused sequences become zero-length padding at the end."""
        t, tk = batch.hidden.shape[0], batch.context[0].kv_c.shape[0] if batch.context else 0
        pad = MAX_SEQS + 1 - batch.cu_seqlens.shape[0]
        self.hidden[:t] = batch.hidden
        self.positions[:t] = batch.positions
        self.cu_seqlens.copy_(torch.cat([batch.cu_seqlens, batch.cu_seqlens[-1:].expand(pad)]))
        if batch.context:
            chunk = batch.context[0]
            self.kv_c[:tk] = chunk.kv_c
            self.k_pe[:tk] = chunk.k_pe
            self.cu_seqlens_k.copy_(torch.cat([chunk.cu_seqlens_k, chunk.cu_seqlens_k[-1:].expand(pad)]))
        else:
            self.cu_seqlens_k.zero_()

    def args(self):
        chunk = LatentChunk(self.kv_c, self.k_pe, self.cu_seqlens_k, CHUNK_BUDGET)
        return self.hidden, self.positions, self.cu_seqlens, BUDGET, [chunk]


def replay_batch(layer: MLAAttention, lengths, context, seed: int) -> MLABatch:
    """A batch of ``layer``'s with one context chunk, as every replay of the captured layer reads one."""
    batch = random_batch(
        layer, lengths, context, chunk_size=CHUNK_BUDGET, generator=torch.Generator().manual_seed(seed)
    )
    if not batch.context:  # keep one (empty) chunk so every replay has the captured structure
        empty = torch.zeros(len(lengths) + 1, dtype=torch.int32, device="cuda")
        batch.context = [LatentChunk(batch.hidden.new_zeros(0, 512), batch.hidden.new_zeros(0, 64), empty, 0)]
    return batch


def capture(
    layer: Callable[..., torch.Tensor], static: StaticBatch, first: MLABatch
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``(graph, output buffer)``: ``first`` loaded and planned, ``layer`` warmed up eagerly on a side
    stream (JIT compiles, graph plans and, under tensor parallelism, the NCCL communicator happen there),
    then one forward over ``static``'s buffers captured."""
    static.load(first)
    mla_ops.plan_cuda_graph(static.cu_seqlens, [static.cu_seqlens_k])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(*static.args())
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(*static.args())
    return graph, out


def replays(
    graph: torch.cuda.CUDAGraph, static: StaticBatch, layer: MLAAttention
) -> Iterator[tuple[int, MLABatch, int]]:
    """Each of :data:`REPLAYS` made for ``layer``, written into ``static``, planned and replayed:
    ``(seed, batch, rows)``, with the graph's output valid on its first ``rows`` (the new tokens)."""
    for seed, (lengths, context) in enumerate(REPLAYS):
        batch = replay_batch(layer, lengths, context, seed)
        static.load(batch)
        mla_ops.plan_cuda_graph(static.cu_seqlens, [static.cu_seqlens_k])
        graph.replay()
        yield seed, batch, sum(lengths)
