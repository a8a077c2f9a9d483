"""The batch-invariant mode on CPU: its setting (``MLA_OPS_BATCH_INVARIANT``, ``mla_ops.batch_invariant()``,
``set_batch_invariant``), what it routes to on simulated GPUs, and REFERENCE's guarantee: a sequence's ``out`` and
``lse`` are bitwise the same alone and in any batch. tests/test_gpu_batch_invariance.py checks each CUDA backend."""

from __future__ import annotations

import json

import pytest
import standins
import torch
from utils import cu_seqlens_of, make_qkv

import mla_ops
from mla_ops import DeviceCapability, MLADimensions, SelectorConfig, cost_table
from mla_ops import selector as sel
from mla_ops.cost_table import SizeClass

SM90, SM80 = DeviceCapability(9, 0), DeviceCapability(8, 0)
CONFIG = SelectorConfig(torch.bfloat16, MLADimensions(128, 64, 128))
H, DQK, DV = 2, 192, 128


# --- the setting ------------------------------------------------------------------------------------------


def test_the_context_manager_turns_the_mode_on_and_restores_it() -> None:
    assert not mla_ops.invariance.STATE.active
    with mla_ops.batch_invariant():
        assert mla_ops.invariance.STATE.active
        with mla_ops.batch_invariant(False):
            assert not mla_ops.invariance.STATE.active
        assert mla_ops.invariance.STATE.active
    assert not mla_ops.invariance.STATE.active and mla_ops.invariance.STATE.forced is None


def test_the_environment_variable_is_validated(monkeypatch, all_installed) -> None:
    monkeypatch.setenv(mla_ops.invariance.ENV_VAR, "1")
    sel.clear_cache()
    assert sel.select_backend(SM90, CONFIG).name == "FLASH_ATTN"  # FLASHINFER does not guarantee it
    monkeypatch.setenv(mla_ops.invariance.ENV_VAR, "yes")
    sel.clear_cache()
    with pytest.raises(ValueError) as raised:
        sel.select_backend(SM90, CONFIG)
    assert str(raised.value) == "MLA_OPS_BATCH_INVARIANT must be 0 (off, the default) or 1 (on), got 'yes'"
    with mla_ops.batch_invariant(False):  # the Python API wins over the environment
        assert sel.select_backend(SM90, CONFIG).name == "FLASHINFER"
    with pytest.raises(TypeError, match="set_batch_invariant: on must be True, False or None, got str 'yes'"):
        mla_ops.set_batch_invariant("yes")


@pytest.mark.usefixtures("all_installed")
def test_the_mode_routes_one_invariant_backend_for_every_size(tmp_path) -> None:
    sizes = [SizeClass.of(True, 16, 16, 16, 1, 16, 16), SizeClass.of(True, 16384, 16384, 16, 4, 4096, 4096)]
    cost_table.LOCATIONS.user_dir = tmp_path
    (tmp_path / "sm90.json").write_text(json.dumps(standins.cost_table(sizes)))
    sel.clear_cache()
    assert {sel.select_backend(SM90, CONFIG, size=s).name for s in sizes} == {"TRITON", "FLASHINFER"}
    with mla_ops.batch_invariant():
        assert not isinstance(sel.routing_entry(SM90, CONFIG), sel.SizedRoute)
        assert {sel.select_backend(SM90, CONFIG, size=s).name for s in sizes} == {"FLASH_ATTN"}
        assert sel.select_backend(SM90, CONFIG, in_graph=True).name == "FLASH_ATTN"
        assert sel.select_backend(SM80, CONFIG).name == "FLASH_ATTN"
        assert sel.select_backend(None, CONFIG).name == "REFERENCE"
        with mla_ops.prefill_backend("TRITON"):
            assert sel.select_backend(SM90, CONFIG).name == "TRITON"
        with (
            mla_ops.prefill_backend("FLASHINFER"),
            pytest.raises(ValueError, match="FLASHINFER does not guarantee batch-invariant results, which the"),
        ):
            sel.select_backend(SM90, CONFIG)


def test_which_backends_guarantee_it() -> None:
    guaranteed = {m.name for m in mla_ops.PrefillBackendEnum if m.backend_class().batch_invariant}
    assert guaranteed == {"REFERENCE", "TRITON", "FLASH_ATTN"}


# --- REFERENCE: a sequence's bits do not depend on its batch -------------------------------------------------

LENGTHS = [37, 1, 0, 130, 64, 9]
CONTEXT = [50, 0, 12, 200, 1, 33]
#: Batches that each sequence is checked in: the whole batch, reversed, and with others around it.
BATCHES = [list(range(len(LENGTHS))), list(reversed(range(len(LENGTHS)))), [3, 0], [5, 3, 1]]


def _pieces(seed: int):
    gen = torch.Generator().manual_seed(seed)
    news = [make_qkv(n, H, DQK, DV, torch.bfloat16, generator=gen) for n in LENGTHS]
    chunks = [make_qkv(n, H, DQK, DV, torch.bfloat16, generator=gen)[1:] for n in CONTEXT]
    return news, chunks


def _run(news, chunks, members, padding: int, chunked: bool):
    """The op on the batch of sequences ``members`` (rows of each stacked in that order, ``padding`` rows after)."""
    q, k, v = (torch.cat([news[m][i] for m in members] + [news[0][i][:0].new_zeros(padding, H, news[0][i].shape[-1])])
               for i in range(3))  # fmt: skip
    cu = cu_seqlens_of([LENGTHS[m] for m in members])
    max_q = max([LENGTHS[m] for m in members] + [0])
    if not chunked:
        return torch.ops.mla.prefill(q, k, v, cu, max_q, DQK**-0.5)
    kc, vc = (torch.cat([chunks[m][i] for m in members]) for i in range(2))
    cu_k = cu_seqlens_of([CONTEXT[m] for m in members])
    return torch.ops.mla.prefill_context_chunk(
        q, kc, vc, cu, cu_k, max_q, max([CONTEXT[m] for m in members] + [0]), DQK**-0.5
    )


@pytest.mark.parametrize("chunked", [False, True], ids=["new-tokens", "context-chunk"])
def test_reference_is_batch_invariant(chunked) -> None:
    news, chunks = _pieces(seed=1)
    with mla_ops.batch_invariant():
        alone = {m: _run(news, chunks, [m], 0, chunked) for m in range(len(LENGTHS))}
        for batch in BATCHES:
            for padding in (0, 5):
                out, lse = _run(news, chunks, batch, padding, chunked)
                start = 0
                for m in batch:
                    rows = slice(start, start + LENGTHS[m])
                    assert torch.equal(out[rows], alone[m][0]), (batch, m)
                    assert torch.equal(lse[:, rows], alone[m][1]), (batch, m)
                    start += LENGTHS[m]


def test_reference_is_batch_invariant_through_a_layers_attention() -> None:
    # The fused op (new tokens, one chunk, their merge) and the merge are row-wise too.
    news, chunks = _pieces(seed=2)

    def layer(members):
        q, k, v = (torch.cat([news[m][i] for m in members]) for i in range(3))
        kc, vc = (torch.cat([chunks[m][i] for m in members]) for i in range(2))
        lengths, context = [LENGTHS[m] for m in members], [CONTEXT[m] for m in members]
        chunk = mla_ops.ContextChunk(kc, vc, cu_seqlens_of(context), max(context))
        return mla_ops.prefill_with_context(q, k, v, cu_seqlens_of(lengths), max(lengths), [chunk])

    with mla_ops.batch_invariant():
        for batch in BATCHES:
            out, lse = layer(batch)
            start = 0
            for m in batch:
                if LENGTHS[m]:
                    alone_out, alone_lse = layer([m])
                    assert torch.equal(out[start : start + LENGTHS[m]], alone_out)
                    assert torch.equal(lse[:, start : start + LENGTHS[m]], alone_lse)
                start += LENGTHS[m]
