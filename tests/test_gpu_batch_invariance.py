"""The batch-invariant mode per CUDA backend (``pytest -m gpu``): with ``mla_ops.batch_invariant()`` a sequence's
``out`` and ``lse`` are bitwise the same alone and in batches of other sequences, small and large (on SM90 a large
batch is where TRITON would otherwise switch to its large-batch kernel); a backend that does not guarantee it is
refused in the mode. A backend whose library is missing here is skipped with the reason. The CPU part (the
setting, the routing, REFERENCE) is tests/test_batch_invariance.py."""

from __future__ import annotations

import pytest
import torch
from utils import cu_seqlens_of, make_qkv

import mla_ops
from mla_ops import DeviceCapability, MLADimensions, PrefillBackendEnum, SelectorConfig
from mla_ops.kernels.attention import TMA_MIN_KEY_ROWS
from mla_ops.selector import validate_backend

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
H, DQK, DV = 16, 192, 128
CONFIG = SelectorConfig(torch.bfloat16, MLADimensions(128, 64, 128))
#: The sequence checked, and what is batched with it: nothing, a few short sequences, and enough long ones that
#: the batch's key rows times heads pass TMA_MIN_KEY_ROWS (TRITON's large-batch switch on SM90).
TARGET, TARGET_CONTEXT = 300, 700
NEIGHBOURS = [[], [5, 1, 64], [2048] * (TMA_MIN_KEY_ROWS // (H * 2048) + 1)]
CUDA_BACKENDS = [m for m in PrefillBackendEnum if m is not PrefillBackendEnum.REFERENCE]


def _available(member: PrefillBackendEnum) -> None:
    capability = DeviceCapability.of(torch.device(DEVICE))
    _, reasons = validate_backend(member, capability, CONFIG)
    if reasons:
        pytest.skip(f"{member.name} is not valid here: {'; '.join(reasons)}")


def _batch(neighbours: list[int], first: bool, gen: torch.Generator, target: tuple[torch.Tensor, ...]):
    """The target's tensors (q, k, v, k_chunk, v_chunk) batched with random ``neighbours`` before or after it."""
    others = [make_qkv(n, H, DQK, DV, torch.bfloat16, DEVICE, strided_v=True, generator=gen) for n in neighbours]
    context = [make_qkv(2 * n, H, DQK, DV, torch.bfloat16, DEVICE, strided_v=True, generator=gen) for n in neighbours]
    pieces = [(*o, c[1], c[2]) for o, c in zip(others, context)]
    ordered = [target, *pieces] if first else [*pieces, target]
    lengths = [p[0].shape[0] for p in ordered]
    contexts = [p[3].shape[0] for p in ordered]
    start = 0 if first else sum(lengths[:-1])
    tensors = [torch.cat([p[i] for p in ordered]) for i in range(5)]
    return tensors, lengths, contexts, slice(start, start + TARGET)


def _both_paths(tensors, lengths, contexts):
    q, k, v, kc, vc = tensors
    cu, cu_k = cu_seqlens_of(lengths, DEVICE), cu_seqlens_of(contexts, DEVICE)
    new = mla_ops.prefill(q, k, v, cu, max(lengths))
    chunk = mla_ops.prefill_context_chunk(q, kc, vc, cu, cu_k, max(lengths), max(contexts))
    return new, chunk


@pytest.mark.parametrize("member", CUDA_BACKENDS, ids=lambda m: m.name)
def test_each_backend_is_batch_invariant_or_refused(member: PrefillBackendEnum) -> None:
    _available(member)
    gen = torch.Generator().manual_seed(0)
    q, k, v = make_qkv(TARGET, H, DQK, DV, torch.bfloat16, DEVICE, strided_v=True, generator=gen)
    _, kc, vc = make_qkv(TARGET_CONTEXT, H, DQK, DV, torch.bfloat16, DEVICE, strided_v=True, generator=gen)
    target = (q, k, v, kc, vc)
    with mla_ops.batch_invariant(), mla_ops.prefill_backend(member):
        if not member.backend().batch_invariant:
            with pytest.raises(ValueError, match="does not guarantee batch-invariant results"):
                _both_paths(*_batch([], True, gen, target)[:3])
            return
        alone = _both_paths(*_batch([], True, gen, target)[:3])
        for neighbours in NEIGHBOURS[1:]:
            for first in (True, False):
                tensors, lengths, contexts, rows = _batch(neighbours, first, gen, target)
                for (out, lse), (want_out, want_lse) in zip(_both_paths(tensors, lengths, contexts), alone):
                    assert torch.equal(out[rows], want_out), (member.name, neighbours[:3], first)
                    assert torch.equal(lse[:, rows], want_lse), (member.name, neighbours[:3], first)


def test_the_automatic_choice_is_batch_invariant() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v = make_qkv(TARGET, H, DQK, DV, torch.bfloat16, DEVICE, strided_v=True, generator=gen)
    _, kc, vc = make_qkv(TARGET_CONTEXT, H, DQK, DV, torch.bfloat16, DEVICE, strided_v=True, generator=gen)
    target = (q, k, v, kc, vc)
    with mla_ops.batch_invariant():
        try:
            chosen = mla_ops.selector.route(torch.device(DEVICE), torch.bfloat16, DQK, DV)
        except ValueError as exc:
            pytest.skip(f"no batch-invariant backend is valid here: {exc}")
        assert chosen.batch_invariant
        alone = _both_paths(*_batch([], True, gen, target)[:3])
        tensors, lengths, contexts, rows = _batch(NEIGHBOURS[-1], False, gen, target)
        for (out, lse), (want_out, want_lse) in zip(_both_paths(tensors, lengths, contexts), alone):
            assert torch.equal(out[rows], want_out) and torch.equal(lse[:, rows], want_lse), chosen.name
