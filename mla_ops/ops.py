"""Registration of the ``mla`` custom ops.

The schemas (:data:`SCHEMAS`, :data:`FP8_SCHEMAS`, :data:`FUSED_SCHEMA`, :data:`CHECK_MERGE_SCHEMA`), the Python
kernels of CPU and CUDA (check, route, run the backend on the inputs' device), the fakes' registration, and the
internal twins: ``*_in_graph`` for CUDA-graph trees, ``_*_python`` (:data:`PYTHON_TWINS`) for the native library's
C++ kernels. Declared with ``Library.define`` and ``impl``, forward-only. Design: docs/design/ops.md.
"""

from __future__ import annotations

import re

import torch

from . import meta, native
from .backends.base import Fp8Scales, MergeCall, VarlenCall
from .meta.checks import (
    check_attention_inputs,
    check_chunk_values,
    check_fp8_scale_values,
    check_fp8_scales,
    check_merge_inputs,
    checked_attention_sizes,
)
from .runtime.capture import current_cuda_device, on_device
from .runtime.graph_trees import IN_GRAPH_TWINS, check_graph_trees
from .runtime.merge_dispatch import merge_kernel
from .selector import route_call, route_checked, route_fused

NAMESPACE = "mla"

SCHEMAS = {
    "prefill": (
        "prefill(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, SymInt max_seqlen, float softmax_scale)"
        " -> (Tensor out, Tensor lse)"
    ),
    "prefill_context_chunk": (
        "prefill_context_chunk(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k,"
        " SymInt max_seqlen_q, SymInt max_seqlen_k, float softmax_scale) -> (Tensor out, Tensor lse)"
    ),
    "merge_attn_states": (
        "merge_attn_states(Tensor prefix_out, Tensor prefix_lse, Tensor suffix_out, Tensor suffix_lse)"
        " -> (Tensor out, Tensor lse)"
    ),
}

#: The fp8 ops: the attention ops with float8_e4m3fn ``q``/``k``/``v``, the descale factor of each (float32 ``[]``,
#: ``[1]`` or ``[H]``) and the output's dtype (bfloat16 or float16).
FP8_SCHEMAS = {
    "prefill_fp8": (
        "prefill_fp8(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, SymInt max_seqlen, Tensor q_descale,"
        " Tensor k_descale, Tensor v_descale, float softmax_scale, ScalarType out_dtype) -> (Tensor out, Tensor lse)"
    ),
    "prefill_context_chunk_fp8": (
        "prefill_context_chunk_fp8(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k,"
        " SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor q_descale, Tensor k_descale, Tensor v_descale,"
        " float softmax_scale, ScalarType out_dtype) -> (Tensor out, Tensor lse)"
    ),
}

#: The internal op that runs a layer's new tokens, one context chunk and their merge in one call.
FUSED_SCHEMA = (
    "prefill_with_chunk(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, SymInt max_seqlen, Tensor k_chunk,"
    " Tensor v_chunk, Tensor cu_seqlens_k, SymInt max_seqlen_k, float softmax_scale) -> (Tensor out, Tensor lse)"
)

#: The internal op with which the native merge raises the merge op's input errors (see mla_ops.native).
CHECK_MERGE_SCHEMA = (
    "_check_merge_inputs(Tensor prefix_out, Tensor prefix_lse, Tensor suffix_out, Tensor suffix_lse) -> ()"
)

#: The internal op of each attention op (and of the fused op) that runs its Python kernel, whatever is
#: registered for the op's CUDA key: the native library's C++ kernel (mla_ops.native) calls it for every call
#: it does not launch itself.
PYTHON_TWINS = {
    "prefill": "_prefill_python",
    "prefill_context_chunk": "_prefill_context_chunk_python",
    "prefill_with_chunk": "_prefill_with_chunk_python",
}

_TWINNED_SCHEMAS = {**SCHEMAS, "prefill_with_chunk": FUSED_SCHEMA}

_lib = torch.library.Library(NAMESPACE, "DEF")
for _schema in (*SCHEMAS.values(), *FP8_SCHEMAS.values(), FUSED_SCHEMA, CHECK_MERGE_SCHEMA):
    _lib.define(_schema)
for _twins in (IN_GRAPH_TWINS, PYTHON_TWINS):
    for _name, _twin in _twins.items():
        _lib.define(_twin + _TWINNED_SCHEMAS[_name].removeprefix(_name))


# --- CPU and CUDA: the selected backend -----------------------------------------------------------


def _attention_kernels(in_graph: bool, remember: bool):
    """The kernels of ``prefill`` and ``prefill_context_chunk``, selecting with ``in_graph``; with ``remember``,
    a CUDA call that ran a backend whose launches the native library can repeat hands it the launch
    (:func:`mla_ops.native.remember_attention`), after the input check accepted the inputs."""

    def run(op: int, name: str, call: VarlenCall):
        # The inputs are checked once per op call, with the op's name in every message; the route reads the
        # sizes the check read.
        sizes = checked_attention_sizes(*call)
        if sizes is None:
            check_attention_inputs(name, call[:8], call.causal)
            # The full check accepted what the one expression did not: the route reads the sizes itself.
            backend, device = route_call(call, in_graph), call.q.device
        else:
            backend, device = route_checked(call, sizes, in_graph), sizes[0]
        if device.type != "cuda" or device.index == current_cuda_device():  # on_device's no-switch case, inline
            result = backend.attention(call)
            # Only where the device is current: the C++ kernel hands other calls back (see remember_attention).
            if remember and backend.launches_natively and device.type == "cuda":
                native.remember_attention(op, call)
            return result
        with on_device(device):
            return backend.attention(call)

    def prefill(q, k, v, cu_seqlens, max_seqlen, softmax_scale):
        call = VarlenCall(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale, True)
        return run(native.PREFILL, "mla.prefill", call)

    def prefill_context_chunk(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale):
        call = VarlenCall(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, False)
        return run(native.PREFILL_CONTEXT_CHUNK, "mla.prefill_context_chunk", call)

    return prefill, prefill_context_chunk


def _run_fp8(name: str, call: VarlenCall, q_descale, k_descale, v_descale, out_dtype):
    """The kernel of the fp8 ops: check ``call`` and the scales, then run the backend the call routes to (only
    backends whose ``dtypes`` list fp8 can be chosen for its dtype)."""
    sizes = checked_attention_sizes(*call, fp8=True)
    if sizes is None:
        check_attention_inputs(name, call[:8], call.causal, fp8=True)
    q = call.q
    descales = (q_descale, k_descale, v_descale)
    check_fp8_scales(name, q, descales, out_dtype)
    if q.device.type == "cpu":
        check_fp8_scale_values(name, descales)
    # One factor per head for the kernels: a per-tensor factor becomes a stride-0 view, no copy.
    heads = q.shape[1]
    scales = Fp8Scales(*(d.reshape(-1).expand(heads) for d in descales), out_dtype)
    backend = route_call(call) if sizes is None else route_checked(call, sizes)
    v = call.v
    if v.stride()[2] != 1 and v.numel() and not backend.takes_key_major_values:
        call = call._replace(v=v.contiguous())  # key-major values, for a backend that loads a key's channels
    with on_device(q.device):
        return backend.attention_fp8(call, scales)


def _prefill_fp8(q, k, v, cu_seqlens, max_seqlen, q_descale, k_descale, v_descale, softmax_scale, out_dtype):
    call = VarlenCall(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale, True)
    return _run_fp8("mla.prefill_fp8", call, q_descale, k_descale, v_descale, out_dtype)


def _prefill_context_chunk_fp8(q, k, v, cu_q, cu_k, max_q, max_k, q_descale, k_descale, v_descale, scale, out_dtype):
    call = VarlenCall(q, k, v, cu_q, cu_k, max_q, max_k, scale, False)
    return _run_fp8("mla.prefill_context_chunk_fp8", call, q_descale, k_descale, v_descale, out_dtype)


def _prefill_with_chunk(q, k, v, cu_seqlens, max_seqlen, k_chunk, v_chunk, cu_seqlens_k, max_seqlen_k, softmax_scale):
    # Each part is checked as its own op checks it, with that op's messages; then that the chunk's values
    # are as wide as the new tokens', which the merge of the two ops' outputs would check.
    new = VarlenCall(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale, True)
    chunk = VarlenCall(q, k_chunk, v_chunk, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k, softmax_scale, False)
    sizes_new, sizes_chunk = checked_attention_sizes(*new), checked_attention_sizes(*chunk)
    if sizes_new is None:
        check_attention_inputs("mla.prefill", new[:8], True)
    if sizes_chunk is None:
        check_attention_inputs("mla.prefill_context_chunk", chunk[:8], False)
    dv = v.shape[2]
    if v_chunk.shape[2] != dv:
        check_chunk_values(v, v_chunk)
    device = q.device
    # The route reads the sizes the checks read where both parts passed in one expression (else it reads them).
    sizes = None if sizes_new is None or sizes_chunk is None else (sizes_new, sizes_chunk)
    backend = route_fused(new, chunk, sizes)
    # Neither part's result leaves this op: each may keep its library's base-2 LSE for the merge to read.
    with on_device(device):
        out, lse, base2 = backend.attention_for_merge(new)
        out_c, lse_c, base2_c = backend.attention_for_merge(chunk)
    # Each part's launch is handed over as its op's kernel hands it (see _attention_kernels): the C++ kernel
    # launches a call whose two parts are remembered, and merges them as below. Only a part that its own op
    # routes to this backend too, since the C++ kernel of that op launches every call of a remembered layout.
    # (Only natural-log LSEs: the C++ kernel's merge reads no base-2 one.)
    if (
        backend.launches_natively
        and not (base2 or base2_c)
        and device.type == "cuda"
        and device.index == current_cuda_device()
    ):
        alone = (route_call(new), route_call(chunk)) if sizes is None else (
            route_checked(new, sizes_new), route_checked(chunk, sizes_chunk)
        )  # fmt: skip
        if alone[0] is backend:
            native.remember_attention(native.PREFILL, new)
        if alone[1] is backend:
            native.remember_attention(native.PREFILL_CONTEXT_CHUNK, chunk)
    return merge_kernel(device)(MergeCall(out_c, lse_c, out, lse, base2_c, base2))


_prefill, _prefill_context_chunk = _attention_kernels(in_graph=False, remember=True)
_prefill_in_graph, _prefill_context_chunk_in_graph = _attention_kernels(in_graph=True, remember=False)


def _merge(prefix_out, prefix_lse, suffix_out, suffix_lse):
    # The merge function checks the inputs with the op's check, and the Triton kernel only once per layout of
    # them (shapes, strides, dtypes, devices, grad recording: all the check reads), since it builds that
    # layout for its launch anyway. No device switch here: each merge function runs on its tensors' device
    # whichever is current.
    try:
        device = prefix_out.device
    except AttributeError:  # None for a Tensor argument (a raw call): the check names the argument
        check_merge_inputs(prefix_out, prefix_lse, suffix_out, suffix_lse)
        raise
    return merge_kernel(device)(MergeCall(prefix_out, prefix_lse, suffix_out, suffix_lse), check=check_merge_inputs)


#: The public ops' eager kernels by op name, as registered for CPU and CUDA: what a call runs after the
#: dispatcher. ``benchmarks/bench_layers.py --attribute`` calls them directly to time the dispatcher apart.
EAGER_KERNELS = {"prefill": _prefill, "prefill_context_chunk": _prefill_context_chunk, "merge_attn_states": _merge}


# --- fake: shapes from mla_ops.meta, plus the one check only compile time can make -----------------


def _prefill_fake(q, k, v, cu_seqlens, max_seqlen, softmax_scale):
    check_graph_trees("mla::prefill", q, v)
    return meta.prefill_fake(q, k, v, cu_seqlens, max_seqlen, softmax_scale)


def _prefill_context_chunk_fake(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale):
    check_graph_trees("mla::prefill_context_chunk", q, v)
    return meta.prefill_context_chunk_fake(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale)


def _prefill_with_chunk_fake(q, k, v, cu, max_q, k_chunk, v_chunk, cu_k, max_k, softmax_scale):
    check_graph_trees("mla::prefill_with_chunk", q, v)
    return meta.prefill_with_chunk_fake(q, k, v, cu, max_q, k_chunk, v_chunk, cu_k, max_k, softmax_scale)


def _register(op: str, kernel, fake, cuda_key: str = "CUDA") -> None:
    _lib.impl(op, kernel, "CPU")
    _lib.impl(op, kernel, cuda_key)
    torch.library.register_fake(f"{NAMESPACE}::{op}", fake, lib=_lib)


# Each op with a C++ kernel in the native library: its Python kernel for every backend key, leaving CUDA free,
# and the same kernel for CPU and CUDA under its twin, which the C++ kernel calls.
for _name, _kernel, _fake in (
    ("prefill", _prefill, _prefill_fake),
    ("prefill_context_chunk", _prefill_context_chunk, _prefill_context_chunk_fake),
    ("prefill_with_chunk", _prefill_with_chunk, _prefill_with_chunk_fake),
):
    _register(_name, _kernel, _fake, cuda_key="CompositeExplicitAutograd")
    _register(PYTHON_TWINS[_name], _kernel, _fake)
# The fp8 ops have no C++ kernel and no CUDA-graph-tree twin: no backend that plans on the host takes fp8.
_register("prefill_fp8", _prefill_fp8, meta.prefill_fp8_fake)
_register("prefill_context_chunk_fp8", _prefill_context_chunk_fp8, meta.prefill_context_chunk_fp8_fake)
_register("merge_attn_states", _merge, meta.merge_attn_states_fake, cuda_key="CompositeExplicitAutograd")
_register("_check_merge_inputs", check_merge_inputs, check_merge_inputs, cuda_key="CompositeExplicitAutograd")
# The twins' fakes need no graph-tree check: their kernels never select a backend that plans on the host.
_register(IN_GRAPH_TWINS["prefill"], _prefill_in_graph, meta.prefill_fake)
_register(IN_GRAPH_TWINS["prefill_context_chunk"], _prefill_context_chunk_in_graph, meta.prefill_context_chunk_fake)


# --- raw calls: the dispatcher's own argument errors, made to name what to pass -----------------------

# torch's argument parser refuses an int beyond int64 for a SymInt with "Expected a value of type 'int' for
# argument 'max_seqlen' but instead found type 'int'", before any kernel of ours runs.
_INT_ARGUMENT_ERROR = re.compile(r"Expected a value of type '(?:int|SymInt)' for argument '(\w+)'")


def _argument_error(packet: torch._ops.OpOverloadPacket, exc: RuntimeError, args: tuple, kwargs: dict) -> Exception:
    """The error to raise for the dispatcher's ``exc`` from ``packet(*args, **kwargs)``: a ``ValueError`` naming
    the argument, what was passed and what to pass where ``exc`` refused an int out of range, else ``exc``."""
    match = _INT_ARGUMENT_ERROR.search(str(exc))
    if match is None:
        return exc
    name = match.group(1)
    schema = packet.default._schema
    names = [a.name for a in schema.arguments]
    value = kwargs.get(name, args[names.index(name)] if name in names and names.index(name) < len(args) else None)
    if isinstance(value, bool) or not isinstance(value, int):
        return exc
    return ValueError(
        f"{NAMESPACE}.{schema.name.split('::')[-1]}: {name} must be an int in [0, 2**31 - 1] "
        f"(an upper bound of the longest sequence), got {value}"
    )


class _OpPacket(torch._ops.OpOverloadPacket):
    """``torch.ops.mla.<op>``, calling the op as torch does, with one clearer error: an int argument beyond
    int64 (e.g. ``max_seqlen=2**63``) is refused by torch's argument parser, before the op's kernel and its
    checks, with a message that says the argument's type is wrong (``expected 'int' ... found 'int'``)."""

    def __call__(self, /, *args, **kwargs):
        try:  # free until it catches (Python 3.11+)
            return self._op(*args, **kwargs)
        except RuntimeError as exc:
            error = _argument_error(self, exc, args, kwargs)
            if error is exc:
                raise
            raise error from None


# The ops have no TorchBind arguments, which is all OpOverloadPacket.__call__ looks for besides calling _op.
for _name in (*SCHEMAS, *FP8_SCHEMAS, "prefill_with_chunk"):
    getattr(torch.ops.mla, _name).__class__ = _OpPacket
