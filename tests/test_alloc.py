"""``mla_ops.runtime.alloc.empty``: what ``torch.empty`` gives, from a zero-stride template (see the module)."""

from __future__ import annotations

import itertools

import pytest
import torch

from mla_ops.runtime import alloc

SHAPES_3D = list(itertools.product([0, 1, 2, 17], [0, 1, 3, 16], [1, 2, 128]))
SHAPES_2D = list(itertools.product([0, 1, 2, 16], [0, 1, 3, 17]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_same_tensor_as_torch_empty(dtype):
    for shape in SHAPES_3D + SHAPES_2D:
        for _ in range(2):  # the call that makes the template and one that reuses it
            got, want = alloc.empty(shape, dtype, torch.device("cpu")), torch.empty(shape, dtype=dtype)
            assert (got.shape, got.stride(), got.dtype, got.device) == (want.shape, want.stride(), dtype, want.device)
            assert got.is_contiguous() and not got.requires_grad


def test_each_call_gets_its_own_memory():
    a, b = (alloc.empty((4, 2, 8), torch.float16, torch.device("cpu")) for _ in range(2))
    assert a.data_ptr() != b.data_ptr() and a.untyped_storage().nbytes() == 4 * 2 * 8 * 2


def test_inference_tensors_exactly_under_inference_mode():
    shape, cpu = (5, 3), torch.device("cpu")
    with torch.inference_mode():
        inside = alloc.empty(shape, torch.float32, cpu)  # makes the template inside inference mode
    outside = alloc.empty(shape, torch.float32, cpu)
    assert inside.is_inference() and not outside.is_inference()
    outside.add_(1)  # an in-place write outside inference mode works on what it returns there


@pytest.fixture
def no_templates():
    """An empty template table, cleared again afterwards (templates are a cache: any state of it is valid)."""
    alloc.TEMPLATES.clear()
    yield alloc.TEMPLATES
    alloc.TEMPLATES.clear()


def test_the_template_table_is_bounded(no_templates, monkeypatch):
    monkeypatch.setattr(alloc, "MAX_TEMPLATES", 3)
    for n in range(2, 9):
        alloc.empty((n, 4), torch.float32, torch.device("cpu"))
        assert len(no_templates) <= 3


def test_no_template_is_made_during_graph_capture(no_templates, monkeypatch):
    monkeypatch.setattr(alloc, "is_capturing", lambda: True)
    out = alloc.empty((6, 4), torch.float32, torch.device("cpu"))
    assert out.shape == (6, 4) and no_templates == {}
