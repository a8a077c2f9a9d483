"""How the attention kernels number their programs: packed query-block slots, head groups for L2, and
the extra programs that fill the padding rows' LSE. Shared by :mod:`mla_ops.kernels.attention_kernel` and
:mod:`mla_ops.kernels.attention_sm90`, whose kernels decode the numbering in the same way (program to head and
slot: :func:`mla_ops.kernels.attention_kernel.head_and_slot`, which both call).
Design: docs/design/triton-kernels.md (The ``tl.dot`` kernel).
"""

from __future__ import annotations

from typing import NamedTuple

#: L2 bytes one group of heads may fill with K/V; H100/H200 have 50 MiB of L2, shared with Q/out
#: traffic and split in two partitions, so about half of it is a safe working set.
L2_BUDGET_BYTES = 24 * 1024 * 1024

#: Extra programs that write lse = -inf into the padding rows past cu_seqlens_q[-1], at most.
MAX_PAD_PROGRAMS = 64


class ProgramLayout(NamedTuple):
    """``grid = (num_heads * num_slots + num_pad_programs,)``."""

    num_slots: int
    heads_per_group: int
    num_pad_programs: int

    def grid(self, num_heads: int) -> tuple[int]:
        return (num_heads * self.num_slots + self.num_pad_programs,)


def program_layout(
    num_tokens: int, num_heads: int, num_seqs: int, max_seqlen_q: int, max_seqlen_k: int, key_row_bytes: int,
    block_m: int,
) -> ProgramLayout:  # fmt: skip
    """The programs of one launch over ``num_tokens`` packed query rows of ``num_seqs`` sequences.

    Sequence ``b``'s blocks of ``block_m`` rows live in slots from ``cu_seqlens_q[b] // block_m + b`` on,
    so ``num_tokens // block_m + num_seqs`` slots per head cover any batch (``max_seqlen_q`` only says
    whether there is any query). Heads are grouped so that a group's K/V (``key_row_bytes`` per key row
    and head, up to ``max_seqlen_k`` rows) fits :data:`L2_BUDGET_BYTES`.
    """
    num_slots = num_tokens // block_m + num_seqs if num_seqs > 0 and max_seqlen_q > 0 else 0
    kv_bytes = max(int(max_seqlen_k), 1) * key_row_bytes
    heads_per_group = max(1, min(num_heads, L2_BUDGET_BYTES // kv_bytes))
    num_pad_programs = min(MAX_PAD_PROGRAMS, -(-num_tokens // 256))
    return ProgramLayout(num_slots, heads_per_group, num_pad_programs)
