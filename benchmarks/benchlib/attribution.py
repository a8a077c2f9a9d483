"""Where an eager MLA layer's op cost goes: its attention called through successively thinner forms.

Each form computes the same attention of a layer (the new tokens' causal call, each context chunk's
call, the merges), with less of the package around the backend's work:

- ``api``: :func:`mla_ops.prefill_with_context`, as the layers call it (eagerly, for one chunk, one call
  of the internal op ``mla.prefill_with_chunk``);
- ``fused``: that op's default overload called directly (with more than one chunk, the ``ops`` form);
- ``ops``: the three ops' default overloads, ``torch.ops.mla.*.default``, called directly;
- ``dispatch``: ops of the same schemas in a namespace of this module, whose kernels call the backend at
  once: the dispatcher's cost for those schemas, and nothing of the package's kernels;
- ``kernels``: the ops' eager kernels (:data:`mla_ops.ops.EAGER_KERNELS`) called as Python functions:
  validation, routing and the device guard around the backend, without the dispatcher;
- ``backend``: the selected backend's ``attention`` and the merge function
  (:func:`mla_ops.runtime.merge_dispatch.merge_kernel`), as the three ops call them (the fused op calls
  ``attention_for_merge``, which may skip an LSE conversion: that saving is part of "three op calls for one");
- ``raw``: the backend's library calls (:class:`benchlib.methods.RawLayerAttention`).

:func:`attribute` runs one stack per form (the same weights) in turns, sample by sample, and times the host:
a sample is one forward from an idle device, and what it records is the host time spent inside the layers'
attention calls. The eager layers are host-bound on small batches, so that time is what each form costs
a forward. :data:`PARTS` are the differences of neighbouring samples, which split the op cost
(``api`` - ``raw``) into the API wrappers, the dispatcher, validation and routing, and the backend's own
wrapping of its library, and say what three op calls cost more than the fused one. The parts are medians
of separate differences: their sum is close to, not equal to, the median of ``api`` - ``raw``.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from mla_ops.backends.base import MergeCall, VarlenCall

from . import timing
from .methods import relative_difference

#: The forms timed, thickest first, with what each one calls.
FORMS = {
    "api": "mla_ops.prefill_with_context",
    "fused": "torch.ops.mla.prefill_with_chunk.default called directly",
    "ops": "the three torch.ops.mla.*.default called directly",
    "dispatch": "ops of the same schemas whose kernels call the backend at once",
    "kernels": "the ops' eager kernels called as Python functions",
    "backend": "the backend's attention() and the merge function",
    "raw": "the backend's library calls",
}
#: The parts of the op cost: ``name: (form, minus form)``.
PARTS = {
    "API wrappers": ("api", "fused"),
    "three op calls for one": ("ops", "fused"),
    "dispatcher": ("dispatch", "backend"),
    "validation and routing": ("kernels", "backend"),
    "backend wrapping": ("backend", "raw"),
}

#: The whole op cost, as the parts are: ``(form, minus form)``, and its result key.
TOTAL = ("api", "raw")
TOTAL_KEY = "op_cost_host_us"
#: The same difference for the host time of the forwards *outside* the attention calls.
REST_KEY = "rest_of_forward_us"

#: The ops a layer's attention calls, in the order :func:`_chained` takes them.
_OP_NAMES = ("prefill", "prefill_context_chunk", "merge_attn_states")

#: The namespace of the dispatcher-only ops.
NAMESPACE = "mla_bench_dispatch"

_library: Any = None
#: What the dispatcher-only ops' kernels call: ``{"backend": PrefillBackend, "merge": merge function}``.
_targets: dict[str, Any] = {}


def _dispatch_ops() -> tuple[Any, Any, Any]:
    """The dispatcher-only ops (defined on first use): the ``mla`` schemas, kernels that call ``_targets``."""
    global _library
    import torch

    from mla_ops.ops import SCHEMAS

    if _library is None:
        library = torch.library.Library(NAMESPACE, "DEF")
        for schema in SCHEMAS.values():
            library.define(schema)

        def prefill(q, k, v, cu, max_q, scale):
            return _targets["backend"].attention(VarlenCall(q, k, v, cu, cu, max_q, max_q, scale, True))

        def chunk(q, k, v, cu_q, cu_k, max_q, max_k, scale):
            return _targets["backend"].attention(VarlenCall(q, k, v, cu_q, cu_k, max_q, max_k, scale, False))

        def merge(prefix_out, prefix_lse, suffix_out, suffix_lse):
            return _targets["merge"](MergeCall(prefix_out, prefix_lse, suffix_out, suffix_lse))

        for name, kernel in zip(_OP_NAMES, (prefill, chunk, merge)):
            library.impl(name, kernel, "CPU")
            library.impl(name, kernel, "CUDA")
        _library = library
    ns = getattr(torch.ops, NAMESPACE)
    return tuple(getattr(ns, name).default for name in _OP_NAMES)


def _chained(prefill: Callable, chunk: Callable, merge: Callable) -> Callable:
    """A layer's attention function made of three callables with the ops' signatures."""

    def attention(q, k, v, cu_seqlens, max_seqlen, chunks, softmax_scale):
        out, lse = prefill(q, k, v, cu_seqlens, max_seqlen, softmax_scale)
        for k_c, v_c, cu_k, max_k in chunks:
            out_c, lse_c = chunk(q, k_c, v_c, cu_seqlens, cu_k, max_seqlen, max_k, softmax_scale)
            out, lse = merge(out_c, lse_c, out, lse)
        return out, lse

    return attention


def backend_attention(backend: Any, device: Any, for_merge: bool = False) -> Callable:
    """The ``backend`` form: a layer's attention from ``backend.attention`` (causal, then each chunk) and the
    merge function of ``device``, with no op around them. ``for_merge``: call ``backend.attention_for_merge``
    instead and hand the merge each part's LSE as it comes (base 2 where flagged), as the fused op does."""
    from mla_ops.runtime.merge_dispatch import merge_kernel

    merge = merge_kernel(device)
    if not for_merge:

        def causal(q, k, v, cu, max_q, scale):
            return backend.attention(VarlenCall(q, k, v, cu, cu, max_q, max_q, scale, True))

        def chunk(q, k, v, cu_q, cu_k, max_q, max_k, scale):
            return backend.attention(VarlenCall(q, k, v, cu_q, cu_k, max_q, max_k, scale, False))

        def merge_op(prefix_out, prefix_lse, suffix_out, suffix_lse):
            return merge(MergeCall(prefix_out, prefix_lse, suffix_out, suffix_lse))

        return _chained(causal, chunk, merge_op)

    def attention(q, k, v, cu_seqlens, max_seqlen, chunks, softmax_scale):
        out, lse, base2 = backend.attention_for_merge(
            VarlenCall(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale, True)
        )
        for k_c, v_c, cu_k, max_k in chunks:
            out_c, lse_c, base2_c = backend.attention_for_merge(
                VarlenCall(q, k_c, v_c, cu_seqlens, cu_k, max_seqlen, max_k, softmax_scale, False)
            )
            out, lse = merge(MergeCall(out_c, lse_c, out, lse, base2_c, base2))
            base2 = False
        return out, lse

    return attention


def attention_forms(backend: Any, device: Any, raw_attention: Callable) -> dict[str, Callable]:
    """Every form of :data:`FORMS` as a layer attention function, for ``backend`` (the instance the ops
    route to on ``device``, under ``mla_ops.prefill_backend``) and its ``raw_attention``.

    Only eager: the ``kernels`` and ``dispatch`` forms call the backend without the ops' compile-time path.
    """
    import torch

    import mla_ops
    from mla_ops.ops import EAGER_KERNELS
    from mla_ops.runtime.merge_dispatch import merge_kernel

    _targets["backend"], _targets["merge"] = backend, merge_kernel(device)
    ops = torch.ops.mla
    three = _chained(ops.prefill.default, ops.prefill_context_chunk.default, ops.merge_attn_states.default)
    fused_op = ops.prefill_with_chunk.default

    def fused(q, k, v, cu_seqlens, max_seqlen, chunks, softmax_scale):
        if len(chunks) != 1:
            return three(q, k, v, cu_seqlens, max_seqlen, chunks, softmax_scale)
        ((k_c, v_c, cu_k, max_k),) = chunks
        return fused_op(q, k, v, cu_seqlens, max_seqlen, k_c, v_c, cu_k, max_k, softmax_scale)

    return {
        "api": mla_ops.prefill_with_context,
        "fused": fused,
        "ops": three,
        "dispatch": _chained(*_dispatch_ops()),
        "kernels": _chained(*(EAGER_KERNELS[name] for name in _OP_NAMES)),
        "backend": backend_attention(backend, device),
        "raw": raw_attention,
    }


class _Timed:
    """An attention function that adds the host time of its calls to :attr:`seconds`."""

    def __init__(self, fn: Callable) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args: Any) -> Any:
        start = time.perf_counter()
        result = self.fn(*args)
        self.seconds += time.perf_counter() - start
        return result


def attribute(
    stack: Any, args: Sequence[Any], forms: dict[str, Callable], device: Any, samples: int, warmup: int = 5
) -> dict[str, Any]:
    """Host time per layer of each form's attention calls, and the :data:`PARTS` of the op cost.

    ``stack`` (an :func:`mla_ops.model.MLAAttention` stack with ``.layers``) is copied once per form with that
    form's attention; ``args`` are its forward's arguments. ``samples`` forwards of each form, in turns (the
    order reversed every other turn), after ``warmup`` forwards each; the garbage collector is paused.

    Returns ``{"<form>_us": median µs per layer, "<form>_forward_us": the whole forward's host time per layer,
    "<part>_us": median of the differences of neighbouring samples}`` with part names in snake case
    (:func:`part_key`), :data:`TOTAL_KEY` (the same for ``api`` - ``raw``), :data:`REST_KEY` (``api`` - ``raw``
    of the host time outside the attention calls), ``"samples"``, and
    ``"forms_rel_diff"``: the largest ``||out - out_api|| / ||out_api||`` of the stacks' outputs (the forms
    compute the same layers, so it is rounding at most).
    """
    stacks, timers = {}, {}
    for name, fn in forms.items():
        timers[name] = _Timed(fn)
        stacks[name] = copy.deepcopy(stack)
        for layer in stacks[name].layers:
            layer.attention = timers[name]
    layers = len(stack.layers)
    outputs = {}
    for name, forward in stacks.items():
        for _ in range(max(warmup, 1)):
            outputs[name] = forward(*args)
    first = next(iter(outputs.values()))
    worst = max(relative_difference(out, first) for out in outputs.values())
    timing.synchronize(device)
    attention: dict[str, list[float]] = {name: [] for name in forms}
    forward_us: dict[str, list[float]] = {name: [] for name in forms}
    with timing.gc_paused():
        for turn in range(samples):
            for name in list(forms) if turn % 2 == 0 else list(reversed(forms)):
                timers[name].seconds = 0.0
                timing.synchronize(device)
                start = time.perf_counter()
                stacks[name](*args)
                forward_us[name].append((time.perf_counter() - start) * 1e6 / layers)
                timing.synchronize(device)
                attention[name].append(timers[name].seconds * 1e6 / layers)
    result: dict[str, Any] = {"samples": samples, "forms_rel_diff": worst}
    for name in forms:
        result[f"{name}_us"] = statistics.median(attention[name])
        result[f"{name}_forward_us"] = statistics.median(forward_us[name])
    for key, (form, minus) in [(part_key(part), pair) for part, pair in PARTS.items()] + [(TOTAL_KEY, TOTAL)]:
        result[key] = statistics.median(a - b for a, b in zip(attention[form], attention[minus]))
    # The layers' other calls, outside attention: the same code in every form, so a difference here is
    # what a form's attention does to the rest of the forward (caches, allocator state).
    form, minus = TOTAL
    rest = [
        (fa - aa) - (fb - ab)
        for fa, aa, fb, ab in zip(forward_us[form], attention[form], forward_us[minus], attention[minus])
    ]
    result[REST_KEY] = statistics.median(rest)
    return result


def part_key(part: str) -> str:
    """The result key of a part of :data:`PARTS`: ``"API wrappers"`` -> ``"api_wrappers_us"``."""
    return part.lower().replace(" ", "_") + "_us"
