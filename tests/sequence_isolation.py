"""Sequence isolation in ragged batches: poison a sequence's neighbours, then check that it never sees them."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from utils import assert_attention_close, cu_seqlens_of


def poison_sequences(k: torch.Tensor, v: torch.Tensor, cu_k: torch.Tensor, sequences: Sequence[int]) -> None:
    """Fill the keys and values of ``sequences`` with NaN, +inf and -inf; sequence ``len(cu_k) - 1``
    stands for the rows past ``cu_k[-1]`` (a token budget's padding)."""
    poison = torch.tensor([math.nan, math.inf, -math.inf], dtype=k.dtype, device=k.device)
    for b in sequences:
        end = int(cu_k[b + 1]) if b + 1 < len(cu_k) else k.shape[0]
        rows = torch.arange(int(cu_k[b]), end, device=k.device)
        k[rows] = poison[rows % 3, None, None]
        v[rows] = poison[(rows + 1) % 3, None, None]


def assert_sequences_close(out, lse, q, k, v, cu_q, cu_k, scale, causal, sequences: Sequence[int]) -> None:
    """Each of ``sequences`` is finite and matches the reference computed from its own rows only (what
    a neighbour poisoned with :func:`poison_sequences` must not change)."""
    for b in sequences:
        qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        assert out[qs:qe].isfinite().all() and not lse[:, qs:qe].isnan().any(), f"sequence {b} sees its neighbours"
        one_q, one_k = cu_seqlens_of([qe - qs], q.device), cu_seqlens_of([ke - ks], q.device)
        assert_attention_close(
            out[qs:qe], lse[:, qs:qe].contiguous(), q[qs:qe], k[ks:ke], v[ks:ke], one_q, one_k, scale, causal
        )
