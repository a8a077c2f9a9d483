"""Shared pytest configuration.

Without CUDA, Triton kernels run in Triton's interpreter; it is chosen when a kernel is decorated, so
the variable is set here, before any test module imports ``mla_ops.kernels``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import settings

# CI replays the same examples on every run, so a submission fails only for what it changed; local
# runs draw new examples each time and keep exploring. `.ci/run` sets MLA_OPS_HYPOTHESIS_PROFILE=ci.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("MLA_OPS_HYPOTHESIS_PROFILE", "default"))

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import standins  # noqa: E402

import mla_ops  # noqa: E402
from mla_ops import selector  # noqa: E402
from mla_ops.backends.flash_attn import FlashAttnBackend  # noqa: E402
from mla_ops.backends.flashinfer import FlashInferBackend  # noqa: E402

_NO_CUDA = "needs a CUDA device: torch.cuda.is_available() is False on this machine"
_GPU_COUNT = torch.cuda.device_count() if HAS_CUDA else 0
_FEW_GPUS = f"needs at least 2 CUDA devices: torch.cuda.device_count() is {_GPU_COUNT} on this machine"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skips = []
    if not HAS_CUDA:
        skips.append(("gpu", pytest.mark.skip(reason=_NO_CUDA)))
    if _GPU_COUNT < 2:
        skips.append(("multi_gpu", pytest.mark.skip(reason=_FEW_GPUS)))
    for item in items:
        for keyword, skip in skips:
            if keyword in item.keywords:
                item.add_marker(skip)
                break


@pytest.fixture(autouse=True)
def _isolated_selection(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory):
    """Every test starts with automatic selection and empty caches, and leaves them that way: no override, the
    batch-invariant mode off, and no cost table (neither this machine's nor the package's), so that the fixed
    order decides unless a test installs a table (tests/test_cost_table.py)."""
    from mla_ops import cost_table

    monkeypatch.delenv(mla_ops.selector.ENV_VAR, raising=False)
    monkeypatch.delenv(mla_ops.invariance.ENV_VAR, raising=False)
    locations = cost_table.LOCATIONS
    saved = (locations.user_dir, locations.committed_dir, set(locations.warned))
    locations.user_dir = locations.committed_dir = tmp_path_factory.getbasetemp() / "no-cost-tables"
    mla_ops.set_batch_invariant(None)
    mla_ops.set_prefill_backend(None)
    yield
    locations.user_dir, locations.committed_dir, locations.warned = saved
    mla_ops.set_batch_invariant(None)
    mla_ops.set_prefill_backend(None)


def _emptied(cache: Any) -> Iterator[Any]:
    """``cache`` (a :class:`mla_ops.kernels.launch.LaunchCache`) emptied for the test, then put back as it
    was, with whatever the test replaced on it."""
    saved = cache.state()
    cache.reset()
    yield cache
    cache.restore(saved)


@pytest.fixture
def attention_launches() -> Iterator[Any]:
    """The Triton attention's launch state (``mla_ops.kernels.attention.LAUNCHES``) with no known layout or
    configuration; the test may replace its tables, ``launcher`` or ``launch``."""
    attention = pytest.importorskip("mla_ops.kernels.attention", reason="the Triton kernels need triton installed")
    yield from _emptied(attention.LAUNCHES)


@pytest.fixture
def merge_launches() -> Iterator[Any]:
    """The Triton merge's launch state (``mla_ops.kernels.merge.LAUNCHES``) with no known layout; the test
    may replace its ``known``, launchers or ``launch``."""
    merge = pytest.importorskip("mla_ops.kernels.merge", reason="the Triton kernels need triton installed")
    yield from _emptied(merge.LAUNCHES)


@pytest.fixture
def all_installed() -> Iterator[None]:
    """Every library present (Triton for real, the others as stand-ins), so choices depend only on the rules."""
    pytest.importorskip("triton", reason="TRITON's library is part of 'every library installed'")
    flashinfer = FlashInferBackend(library=standins.flashinfer_module(), workspace_bytes=1 << 20)
    flash_attn = FlashAttnBackend(libraries=standins.flash_attn_libraries(*standins.FLASH_ATTN_NAMES))
    with selector.backend_installed(flashinfer), selector.backend_installed(flash_attn):
        yield
