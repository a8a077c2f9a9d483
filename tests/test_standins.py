"""The stand-ins of tests/standins.py against the real libraries they model, wherever those are installed.

A stand-in that accepted a parameter the real function does not have would let a backend pass on CPU and
fail on a GPU, so each stand-in's parameter names must be a subset of the real one's, and the
parameters a stand-in requires (the ones the backends pass by position) must come first in the real
signature, in the same order. Where the real library is not installed, the test is skipped and says
which one.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest
import standins
import torch

_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _import_real(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        pytest.skip(f"{module} is not installed here ({type(exc).__name__}: {exc}), so there is nothing to compare")
    except Exception as exc:  # a broken install (a missing CUDA library, say) is as good as absent here
        pytest.skip(f"{module} cannot be imported here ({type(exc).__name__}: {exc})")


def _attribute(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def signature_problems(standin: inspect.Signature, real: inspect.Signature) -> list[str]:
    """Why ``standin`` is not a faithful subset of ``real`` (empty when it is)."""
    problems = []
    real_params = real.parameters
    for name, p in standin.parameters.items():
        r = real_params.get(name)
        if r is None:
            if p.kind not in _VARIADIC or not any(q.kind == p.kind for q in real_params.values()):
                problems.append(f"the real function has no parameter {name!r}")
        elif p.kind is inspect.Parameter.KEYWORD_ONLY and r.kind is inspect.Parameter.POSITIONAL_ONLY:
            problems.append(f"{name!r} is positional-only in the real function")
    required = [n for n, p in standin.parameters.items() if p.default is p.empty and p.kind not in _VARIADIC]
    leading = [n for n, p in real_params.items() if p.kind not in _VARIADIC][: len(required)]
    if required != leading:
        problems.append(
            f"the stand-in's required parameters {required} are not the real function's first ones {leading}"
        )
    return problems


def _real_function(module: str, dotted: str) -> Any:
    real = _import_real(module)
    try:
        return _attribute(real, dotted)
    except AttributeError:
        # flash-attn-4 installs flash_attn/cute/ only, which makes `flash_attn` an importable namespace
        # package without FlashAttention-2's functions: FlashAttention-2 itself is not installed then.
        if getattr(real, "__file__", None) is None:
            pytest.skip(f"{module} is only a namespace package here (no {dotted}), so there is nothing to compare")
        raise


@pytest.mark.parametrize("case", standins.modelled(), ids=lambda m: m.name)
def test_standin_parameters_are_a_subset_of_the_real_ones(case: standins.Modelled) -> None:
    real = _real_function(case.module, case.attribute)
    problems = signature_problems(inspect.signature(case.standin), inspect.signature(real))
    assert not problems, f"{case.name} stand-in vs {case.module}.{case.attribute}: " + "; ".join(problems)


def test_bundled_op_standin_matches_the_schema() -> None:
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if op is None:
        pytest.skip(f"torch {torch.__version__} has no aten::_flash_attention_forward")
    arguments = op.default._schema.arguments
    positional = [a.name for a in arguments if not a.kwarg_only]
    keyword = {a.name for a in arguments if a.kwarg_only}
    params = inspect.signature(standins.bundled_op()).parameters.values()
    standin_positional = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    standin_keyword = {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert standin_positional == positional, "the backend passes these positionally, in the schema's order"
    assert standin_keyword <= keyword, f"not in the schema: {sorted(standin_keyword - keyword)}"


# --- the check itself must be able to fail ----------------------------------------------------------------


def _real(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, *, causal=False):
    pass


def test_signature_check_catches_what_it_should() -> None:
    real = inspect.signature(_real)

    def unknown_keyword(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, return_lse=False):
        pass

    def reordered(q, k, v, cu_seqlens_k, cu_seqlens_q, max_seqlen_q, max_seqlen_k):
        pass

    def faithful(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False, softmax_scale=None):
        pass

    def splat(q, k, v, *args, causal=False):
        pass

    assert signature_problems(inspect.signature(unknown_keyword), real) == [
        "the real function has no parameter 'return_lse'"
    ]
    assert "are not the real function's first ones" in signature_problems(inspect.signature(reordered), real)[0]
    assert signature_problems(inspect.signature(faithful), real) == []
    assert signature_problems(inspect.signature(splat), real) == ["the real function has no parameter 'args'"]
