"""A DeepSeek-style MLA attention layer built on the ``mla`` ops.

This is the prefill half of multi-head latent attention as DeepSeek-V2/V3/R1 run it:

- queries come from ``q_proj`` (or the low-rank ``q_a_proj`` -> norm -> ``q_b_proj`` pair);
- keys and values are compressed by ``kv_a_proj_with_mqa`` into a latent ``kv_c`` (which a KV cache
  stores, normalised) plus one shared rotary key ``k_pe``;
- ``kv_b_proj`` expands the latent into per-head ``k_nope`` and ``v``; ``v`` stays a strided view of
  that projection, and ``k_pe`` is broadcast over the heads;
- cached context is expanded the same way, chunk by chunk, and merged through the log-sum-exp.

The module is usable eagerly, under ``torch.compile(fullgraph=True)`` and inside CUDA graphs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from .api import MIN_PACKED_ROWS, ContextChunk, _chunk_list, _length, check_packing, pack_rows, prefill_with_context
from .specs import MLADimensions


@dataclass(frozen=True)
class MLAConfig:
    """Shapes of an MLA layer. The defaults are DeepSeek-V3's head dims with a small hidden size."""

    hidden_size: int = 1024
    num_heads: int = 16
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        # Each field as a layer needs it, so that a bad config fails here, naming the field, rather than in a
        # reshape or a negative dimension inside the first forward.
        counts = ("hidden_size", "num_heads", "kv_lora_rank", "v_head_dim", "q_lora_rank")
        for name in (*counts, "qk_nope_head_dim", "qk_rope_head_dim"):
            value = getattr(self, name)
            if name == "q_lora_rank" and value is None:
                continue
            least = 1 if name in counts else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                what = "a positive int" if least else "an int >= 0"
                also = " or None (queries from one q_proj)" if name == "q_lora_rank" else ""
                raise ValueError(f"MLAConfig: {name} must be {what}{also}, got {value!r:.40}")
        if self.qk_nope_head_dim + self.qk_rope_head_dim == 0:
            raise ValueError("MLAConfig: qk_nope_head_dim + qk_rope_head_dim must be positive, got 0 + 0")
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"MLAConfig: qk_rope_head_dim must be even (the rotary embedding rotates channel pairs), "
                f"got {self.qk_rope_head_dim}"
            )
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"MLAConfig: {name} must be a positive finite float, got {value!r:.40}")

    @classmethod
    def deepseek_v3(cls, num_heads: int = 128) -> MLAConfig:
        """DeepSeek-V3/R1's layer; ``num_heads`` is 128 for the full model, 16 per GPU under TP=8."""
        return cls(hidden_size=7168, num_heads=num_heads, q_lora_rank=1536, kv_lora_rank=512)

    @property
    def mla_dimensions(self) -> MLADimensions:
        return MLADimensions(self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class LatentChunk(NamedTuple):
    """One chunk of cached context, as a latent KV cache stores it.

    ``kv_c`` ``[Tk, kv_lora_rank]`` (normalised latent) and ``k_pe`` ``[Tk, qk_rope_head_dim]`` (rotated
    rotary key), packed per sequence as ``cu_seqlens_k`` (int32 ``[B+1]``) says.
    """

    kv_c: torch.Tensor
    k_pe: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_k: int


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in fp32."""

    def __init__(self, dim: int, eps: float, **factory: object) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, **factory))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX-style rotary embedding of ``x`` ``[T, ..., D]`` at integer ``positions`` ``[T]``."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (dim // 2,)
    cos, sin = angles.cos().view(shape), angles.sin().view(shape)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


AttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class MLAAttention(nn.Module):
    """DeepSeek-style MLA attention for prefill over a ragged batch, with optional cached context.

    ``attention`` computes ``(out, lse)`` from ``(q, k, v, cu_seqlens, max_seqlen, chunks,
    softmax_scale)``; it defaults to :func:`mla_ops.prefill_with_context` and can be swapped, e.g.
    for a float64 ground truth.
    """

    def __init__(
        self,
        config: MLAConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        attention: AttentionFn = prefill_with_context,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.config = c = config
        h = c.num_heads
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(c.hidden_size, h * c.qk_head_dim, bias=False, **factory)
        else:
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False, **factory)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, **factory)
            self.q_b_proj = nn.Linear(c.q_lora_rank, h * c.qk_head_dim, bias=False, **factory)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=False, **factory)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps, **factory)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim), bias=False, **factory)
        self.o_proj = nn.Linear(h * c.v_head_dim, c.hidden_size, bias=False, **factory)
        self.softmax_scale = 1.0 / math.sqrt(c.qk_head_dim)
        self.attention = attention
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Random weights of the magnitude trained models have (plain init would give huge logits)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)

    def compress(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What a latent KV cache stores for these tokens: ``kv_c`` ``[T, kv_lora_rank]``, ``k_pe`` ``[T, rope]``."""
        c = self.config
        kv = self.kv_a_proj_with_mqa(hidden)
        kv_c, k_pe = kv.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        return self.kv_a_layernorm(kv_c), apply_rotary(k_pe, positions, c.rope_theta)

    def expand(self, kv_c: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys ``[T, H, Dqk]`` and values ``[T, H, Dv]`` (a strided view) from the latent."""
        c = self.config
        kv = self.kv_b_proj(kv_c).view(-1, c.num_heads, c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, c.num_heads, -1)], dim=-1)
        return k, v

    def queries(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotated queries ``[T, H, Dqk]``."""
        c = self.config
        if c.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(-1, c.num_heads, c.qk_head_dim)
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        return torch.cat([q_nope, apply_rotary(q_pe, positions, c.rope_theta)], dim=-1)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        context: Sequence[LatentChunk] = (),
    ) -> torch.Tensor:
        """Attention output ``[T, hidden_size]`` for new tokens ``hidden`` ``[T, hidden_size]``.

        Args:
            hidden: the new tokens of every sequence, packed as ``cu_seqlens`` says.
            positions: int64 ``[T]`` position of each token in its sequence (context included).
            cu_seqlens: int32 ``[B+1]``; max_seqlen: an upper bound of the longest sequence.
            context: cached context of the same sequences, in chunks.
        """
        c = self.config
        q = self.queries(hidden, positions)
        k, v = self.expand(*self.compress(hidden, positions))
        chunks = [ContextChunk(*self.expand(ch.kv_c, ch.k_pe), ch.cu_seqlens_k, ch.max_seqlen_k) for ch in context]
        out, _ = self.attention(q, k, v, cu_seqlens, max_seqlen, chunks, self.softmax_scale)
        return self.o_proj(out.reshape(-1, c.num_heads * c.v_head_dim))


def _as_latent_chunk(index: int, chunk: object, like: tuple[torch.Tensor, torch.Tensor]) -> LatentChunk:
    """``chunk`` as a :class:`LatentChunk`, its tensors' widths checked against the layer's (``like``)."""
    where = f"pack_context: context[{index}]"
    if not isinstance(chunk, (tuple, list)) or len(chunk) != 4:
        got = f"{len(chunk)} items" if isinstance(chunk, (tuple, list)) else type(chunk).__name__
        raise TypeError(f"{where} must be a LatentChunk (kv_c, k_pe, cu_seqlens_k, max_seqlen_k), got {got}")
    kv_c, k_pe, cu_seqlens_k, max_seqlen_k = chunk
    for name, t, model in (("kv_c", kv_c, like[0]), ("k_pe", k_pe, like[1])):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2 or t.shape[1] != model.shape[1]:
            raise ValueError(
                f"{where}: {name} must be [Tk, {model.shape[1]}] for this layer, got shape {tuple(t.shape)}"
            )
    return LatentChunk(kv_c, k_pe, cu_seqlens_k, _length(where, "max_seqlen_k", max_seqlen_k))


def pack_context(layer: MLAAttention, cu_seqlens: torch.Tensor, context: Sequence[LatentChunk]) -> LatentChunk:
    """Every chunk of cached context as one, in the latent cache's form.

    The latent counterpart of :func:`mla_ops.pack_chunks` (see there): call it outside a compiled
    layer and pass ``[pack_context(...)]``, and any number of chunks runs the same graph, with one
    context attention and one merge per layer.
    """
    c, weight = layer.config, layer.o_proj.weight
    like = (weight.new_empty((0, c.kv_lora_rank)), weight.new_empty((0, c.qk_rope_head_dim)))
    context = _chunk_list("pack_context", context, "context", "LatentChunk items")
    context = [_as_latent_chunk(i, chunk, like) for i, chunk in enumerate(context)]
    latent = [(("kv_c", ch.kv_c, like[0]), ("k_pe", ch.k_pe, like[1])) for ch in context]
    check_packing("pack_context", cu_seqlens, latent, context, "context")
    kv_c, k_pe, offsets = pack_rows(
        [(ch.kv_c, ch.k_pe) for ch in context], like, [ch.cu_seqlens_k for ch in context], cu_seqlens
    )
    return LatentChunk(kv_c, k_pe, offsets, max(sum(int(ch.max_seqlen_k) for ch in context), MIN_PACKED_ROWS))


@dataclass
class MLABatch:
    """Inputs of :meth:`MLAAttention.forward` for one ragged batch with cached context."""

    hidden: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    context: list[LatentChunk]
    new_lengths: list[int]
    context_lengths: list[int]


def _offsets(lengths: Sequence[int], device: torch.device | str | None) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


@torch.no_grad()
def random_batch(
    layer: MLAAttention,
    new_lengths: Sequence[int],
    context_lengths: Sequence[int] = (),
    chunk_size: int = 256,
    generator: torch.Generator | None = None,
) -> MLABatch:
    """A random ragged batch for ``layer``: new tokens, and cached context split into chunks.

    Sequence ``b`` has ``context_lengths[b]`` cached tokens (0 if omitted) followed by
    ``new_lengths[b]`` new ones. The context is produced by ``layer.compress`` on random hidden
    states, as a prefix cache would hold it, and cut into chunks of at most ``chunk_size`` tokens per
    sequence; a sequence whose context is used up has an empty slice in the later chunks.
    """
    weight = layer.o_proj.weight
    device, dtype = weight.device, weight.dtype
    hidden_size = layer.config.hidden_size
    context_lengths = list(context_lengths) or [0] * len(new_lengths)
    if len(context_lengths) != len(new_lengths):
        raise ValueError("random_batch: give one context length per sequence")

    def randn(n: int) -> torch.Tensor:
        return torch.randn(n, hidden_size, generator=generator).to(device=device, dtype=dtype)

    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(context_lengths, new_lengths)] or [torch.zeros(0)])
    hidden = randn(sum(new_lengths))
    ctx_positions = torch.cat([torch.arange(c) for c in context_lengths] or [torch.zeros(0)])
    kv_c, k_pe = layer.compress(randn(sum(context_lengths)), ctx_positions.to(device=device, dtype=torch.int64))
    ctx_starts = _offsets(context_lengths, None).tolist()
    chunks: list[LatentChunk] = []
    num_chunks = max([math.ceil(c / chunk_size) for c in context_lengths], default=0)
    for i in range(num_chunks):
        rows, lengths = [], []
        for b, c in enumerate(context_lengths):
            lo, hi = min(c, i * chunk_size), min(c, (i + 1) * chunk_size)
            rows.append(torch.arange(ctx_starts[b] + lo, ctx_starts[b] + hi))
            lengths.append(hi - lo)
        index = torch.cat(rows).to(device)
        chunks.append(LatentChunk(kv_c[index], k_pe[index], _offsets(lengths, device), max(lengths)))
    return MLABatch(
        hidden=hidden,
        positions=positions.to(device=device, dtype=torch.int64),
        cu_seqlens=_offsets(new_lengths, device),
        max_seqlen=max(new_lengths, default=0),
        context=chunks,
        new_lengths=list(new_lengths),
        context_lengths=context_lengths,
    )
