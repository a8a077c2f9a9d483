"""What the benchmarks time, and the check each result passes before it is timed.

A :class:`Method` turns a :class:`~benchlib.problems.Problem` into a :class:`Prepared` call. Four kinds:

- ``op``: the public ops (``mla_ops.prefill``, ``mla_ops.prefill_context_chunk``,
  ``mla_ops.merge_attn_states``) under ``mla_ops.prefill_backend(NAME)``;
- ``fp8``: the fp8 ops on the problem's inputs quantised by ``mla_ops.quantize_fp8``, untimed or (``+quant``)
  inside the timed call (:class:`Fp8OpMethod`);
- ``direct``: package code without the op layer: a backend's ``attention`` method, the Triton kernel
  function, the merge function the op dispatches to;
- ``baseline``: a library's own call: FlashInfer's planned wrapper, FlashAttention-4/3/2 and PyTorch's
  bundled FlashAttention-2, SDPA, FlexAttention, ``flashinfer.merge_state``, eager PyTorch.

Each op's *raw call* (:func:`raw_method_for`) is the library call its backend makes, handed the same
tensors: the FlashInfer wrapper for FLASHINFER, the FlashAttention implementation FLASH_ATTN runs here,
the Triton kernel function for TRITON. :func:`overhead_ratio` measures an op against it in alternating
rounds; every script that reports that ratio calls it. :class:`RawLayerAttention` assembles the same
raw calls into an MLA layer's attention, for model-level comparisons.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from . import timing
from .problems import DQK, DV, Problem, Shape, make_problem, offsets
from .report import short_error

if TYPE_CHECKING:
    import torch

#: Largest row-relative output error accepted as correct, in multiples of the dtype's machine epsilon
#: (bf16: 0.031, fp16: 0.0039). A correct bf16 kernel shows about 0.004, a wrong mask 0.3 or more.
OUT_TOL_EPS = 4.0
#: Largest LSE error accepted, in natural-log units; a wrong base or layout is off by far more.
LSE_TOL = 1e-2
#: The fp8 rows' tolerances against the fp32 reference on the *unquantised* inputs: a sanity bound that a broken
#: kernel exceeds (a lost descale factor is off by far more), not the accuracy contract, which the tests check
#: against the dequantised inputs (tests/fp8_contract.py). Quantising q, k and v to e4m3 alone cost up to 0.14
#: row-relative and 0.09 in the LSE on the CPU shapes' N(0, 1) inputs; a lost factor or probability shift is off
#: by 1 or more.
FP8_OUT_TOL = 0.3
FP8_LSE_TOL = 0.25
#: FlashInfer's float workspace per device (its recommended size, and the backend's default).
FLASHINFER_WORKSPACE_BYTES = 128 << 20

Result = tuple["torch.Tensor", "torch.Tensor | None"]


@dataclass
class Prepared:
    """A method made ready for one problem.

    ``fn`` is what is timed. ``extract`` turns its result into ``(out [T, H, Dv], lse [H, T] or None)``
    for the check. ``context`` makes a context manager that must be active while ``fn`` runs (a fresh
    one each time: a measurement may enter it more than once).
    """

    fn: Callable[[], Any]
    extract: Callable[[Any], Result]
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    note: str = ""


def _pair(result: Any) -> Result:
    return result[0], result[1]


def _out_only(result: Any) -> Result:
    return result[0], None


class Method:
    """Something timed on every shape of its suites."""

    name: str = ""
    kind: str = "baseline"  # "op", "direct" or "baseline"
    suites: tuple[str, ...] = ("causal", "chunk")
    implementation: str = ""
    raw: str | None = None  # for ops: the name of the method that is this op's own raw call
    #: ``(output, LSE)`` tolerances of its check; ``None``: the bf16/fp16 ones (:data:`OUT_TOL_EPS`, :data:`LSE_TOL`).
    tolerance: tuple[float, float] | None = None

    def unavailable(self, device: torch.device) -> str | None:
        """Why this method cannot run on ``device`` at all, or ``None``."""
        return None

    def prepare(self, p: Problem) -> Prepared:
        """The call on ``p``'s tensors; any setup it needs (plans, padding) happens here, untimed."""
        raise NotImplementedError


def _needs_cuda(device: torch.device, what: str) -> str | None:
    return None if device.type == "cuda" else f"{what} runs on CUDA devices only"


def _import_problem(module: str) -> str | None:
    """Why ``module`` does not import, or ``None`` (a broken install raises more than ImportError)."""
    import importlib

    try:
        importlib.import_module(module)
    except Exception as exc:
        return f"{module} is not importable ({short_error(exc)})"
    return None


# --- the ops and the package's own code -------------------------------------------------------------


class OpMethod(Method):
    """A backend through ``mla_ops.prefill`` / ``mla_ops.prefill_context_chunk`` under ``prefill_backend``."""

    kind = "op"

    def __init__(self, name: str, implementation: str, raw: str | None = None) -> None:
        self.name, self.implementation, self.raw = name, implementation, raw

    #: The backend forced around each call (``prefill_backend``'s argument; ``None``: no override).
    @property
    def forced(self) -> str | None:
        return self.name

    def prepare(self, p: Problem) -> Prepared:
        import mla_ops

        q, k, v, cu_q, cu_k, max_q, max_k, scale = p.attention_args()
        if p.causal:
            fn = lambda: mla_ops.prefill(q, k, v, cu_q, max_q, scale)
        else:
            fn = lambda: mla_ops.prefill_context_chunk(q, k, v, cu_q, cu_k, max_q, max_k, scale)
        return Prepared(fn, _pair, lambda: mla_ops.prefill_backend(self.forced))


class AutoOpMethod(OpMethod):
    """The op with no override: what a user's call runs, the backend chosen per call (by size class where a cost
    table ranks the backends; ``python -m mla_ops info`` shows the table)."""

    def __init__(self) -> None:
        super().__init__("auto", "mla_ops.prefill / prefill_context_chunk with automatic selection (no override)")

    @property
    def forced(self) -> str | None:
        return None

    @staticmethod
    def routed(p: Problem) -> str:
        """The backend the ops route ``p``'s call to outside CUDA graphs (what this method runs), by the
        selector's per-call rule (``mla_ops.selector.route_call``), for the report to set beside the fastest."""
        from mla_ops.backends.base import VarlenCall
        from mla_ops.selector import route_call

        return route_call(VarlenCall(*p.attention_args(), p.causal)).name


class Fp8OpMethod(Method):
    """A backend through ``mla_ops.prefill_fp8`` / ``mla_ops.prefill_context_chunk_fp8`` under ``prefill_backend``,
    on the problem's ``q``, ``k``, ``v`` quantised per head by ``mla_ops.quantize_fp8``: before timing, or with
    ``quantize`` inside every timed call (the ``+quant`` row: what an engine without an fp8 cache pays). A call of one
    sequence quantises ``v`` key-major (``key_major=True``) for a backend that takes it
    (``takes_key_major_values``: TRITON, whose Hopper kernel then reads it without a transposed copy), as the README
    advises; other calls and backends get token-major ``v``."""

    kind = "fp8"
    tolerance = (FP8_OUT_TOL, FP8_LSE_TOL)

    def __init__(self, backend: str, quantize: bool) -> None:
        self.backend, self.quantize = backend, quantize
        self.name = f"{backend} fp8" + ("+quant" if quantize else "")
        fp8_op = "mla_ops.prefill_fp8 / prefill_context_chunk_fp8"
        self.implementation = f"mla_ops.quantize_fp8 of q, k and v, then {fp8_op}" if quantize else fp8_op

    def prepare(self, p: Problem) -> Prepared:
        import mla_ops

        q, k, v, cu_q, cu_k, max_q, max_k, scale = p.attention_args()

        def attend(q8, k8, v8, dq, dk, dv):
            if p.causal:
                return mla_ops.prefill_fp8(q8, k8, v8, cu_q, max_q, dq, dk, dv, scale)
            return mla_ops.prefill_context_chunk_fp8(q8, k8, v8, cu_q, cu_k, max_q, max_k, dq, dk, dv, scale)

        backend = mla_ops.PrefillBackendEnum.from_name(self.backend).backend()
        key_major = cu_q.shape[0] == 2 and backend.takes_key_major_values
        if self.quantize:
            fn = lambda: attend(*quantised_inputs(q, k, v, key_major))
        else:
            inputs = quantised_inputs(q, k, v, key_major)
            fn = lambda: attend(*inputs)
        return Prepared(fn, _pair, lambda: mla_ops.prefill_backend(self.backend))


def quantised_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_major: bool = False
) -> tuple[torch.Tensor, ...]:
    """``(q8, k8, v8, q_descale, k_descale, v_descale)``: the three quantised per head by ``mla_ops.quantize_fp8``,
    ``v`` key-major where ``key_major``."""
    import mla_ops

    (q8, dq), (k8, dk) = (mla_ops.quantize_fp8(x) for x in (q, k))
    v8, dv = mla_ops.quantize_fp8(v, key_major=key_major)
    return q8, k8, v8, dq, dk, dv


def fp8_backends(names: Sequence[str], device: torch.device) -> list[str]:
    """Those of the backends ``names`` that take fp8 inputs on ``device`` (REFERENCE only on CPU, as the ops run)."""
    import mla_ops
    from mla_ops.specs import FP8_DTYPE

    capability = mla_ops.DeviceCapability.of(device)
    valid = []
    for name in names:
        member = mla_ops.PrefillBackendEnum.from_name(name)
        _, reasons = mla_ops.selector.validate_backend(member, capability, mla_ops.SelectorConfig(FP8_DTYPE))
        if not reasons and (device.type == "cuda" or name == "REFERENCE"):
            valid.append(name)
    return valid


class DirectMethod(Method):
    """A backend's ``attention`` method called directly: no dispatcher, input checks or routing."""

    kind = "direct"

    def __init__(self, name: str, backend: Any) -> None:
        self.name, self.backend = f"{name.lower()}_direct", backend
        self.implementation = f"{type(backend).__name__}.attention called directly"

    def prepare(self, p: Problem) -> Prepared:
        from mla_ops.backends.base import VarlenCall

        call, attention = VarlenCall(*p.attention_args(), p.causal), self.backend.attention
        return Prepared(lambda: attention(call), _pair)


class TritonRaw(Method):
    """TRITON's raw call: the kernel function ``mla_ops.kernels.attention.attention_triton``, with its
    tuned launch configuration or ``config`` (an ``AttentionConfig``, for tuning sweeps). With ``fp8``, on the
    problem's inputs quantised per head by ``mla_ops.quantize_fp8`` before timing, checked with the fp8 rows'
    tolerances."""

    name = "triton_raw"
    kind = "direct"
    implementation = "mla_ops.kernels.attention.attention_triton called directly"

    def __init__(self, config: Any = None, fp8: bool = False) -> None:
        self.config, self.fp8 = config, fp8
        if fp8:
            self.tolerance = (FP8_OUT_TOL, FP8_LSE_TOL)
            self.name = "triton_raw fp8"
        if config is not None:
            self.name = f"{self.name}[{config}]"

    def unavailable(self, device: torch.device) -> str | None:
        return _needs_cuda(device, "the Triton kernel (outside the interpreter)") or _import_problem("triton")

    def call(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal) -> Any:
        """``attention_triton`` on these arguments: ``(out [T, H, Dv], lse [H, T])``."""
        from mla_ops.backends.base import VarlenCall
        from mla_ops.kernels.attention import attention_triton

        return attention_triton(VarlenCall(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal), config=self.config)

    def prepare(self, p: Problem) -> Prepared:
        args, causal = p.attention_args(), p.causal
        if not self.fp8:
            return Prepared(lambda: self.call(*args, causal), _pair)
        from mla_ops.backends.base import Fp8Scales, VarlenCall
        from mla_ops.kernels.attention import attention_triton

        q8, k8, v8, *descales = quantised_inputs(*args[:3])
        scales = Fp8Scales(*descales, p.dtype)
        call = VarlenCall(q8, k8, v8, *args[3:], causal)
        return Prepared(lambda: attention_triton(call, config=self.config, scales=scales), _pair)


class ReferenceRaw(Method):
    """REFERENCE's raw call: ``mla_ops.backends.reference.attention_reference`` (fp32 math)."""

    name = "reference_raw"
    kind = "direct"
    implementation = "mla_ops.backends.reference.attention_reference called directly"

    def call(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal) -> Any:
        """``attention_reference`` on these arguments: ``(out [T, H, Dv], lse [H, T])``."""
        from mla_ops.backends.reference import attention_reference

        return attention_reference(q, k, v, cu_q, cu_k, scale, causal=causal)

    def prepare(self, p: Problem) -> Prepared:
        args, causal = p.attention_args(), p.causal
        return Prepared(lambda: self.call(*args, causal), _pair)


# --- FlashInfer ---------------------------------------------------------------------------------------

_workspaces: dict[Any, torch.Tensor] = {}


def flashinfer_kernel(device: torch.device, requested: str = "auto") -> str:
    """FlashInfer's ``backend=`` for the raw baseline: ``requested``, or for ``"auto"`` the kernel the
    FLASHINFER backend runs eagerly on this device for (192, 128) heads (fa3 on SM90)."""
    if requested != "auto":
        return requested
    import mla_ops
    from mla_ops.backends.flashinfer import choose_kernel

    return choose_kernel(mla_ops.DeviceCapability.of(device), DQK, DV)


def flashinfer_wrapper(
    device: torch.device,
    kernel: str,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    heads: int,
    dtype: torch.dtype,
    scale: float,
    causal: bool,
    *,
    cuda_graph: bool = False,
    head_dims: tuple[int, int] = (DQK, DV),
) -> Any:
    """A ``flashinfer.BatchPrefillWithRaggedKVCacheWrapper`` planned for one batch: the benchmarks' raw
    FlashInfer call is its ``run(q, k, v, return_lse=True)``.

    It shares one float workspace per device (:data:`FLASHINFER_WORKSPACE_BYTES`) with every other
    wrapper made here, as the backend's wrappers share theirs. ``cuda_graph=True`` builds it with
    ``use_cuda_graph`` and static indptr buffers, so that ``run`` can be captured.
    """
    import flashinfer
    import torch

    ws = _workspaces.get(device)
    if ws is None:
        ws = _workspaces[device] = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    if cuda_graph:
        w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True, qo_indptr_buf=cu_q.clone(), kv_indptr_buf=cu_k.clone(), backend=kernel
        )
        cu_q, cu_k = cu_q.cpu(), cu_k.cpu()
    else:
        w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=kernel)
    dqk, dv = head_dims
    w.plan(
        cu_q,
        cu_k,
        heads,
        heads,
        dqk,
        head_dim_vo=dv,
        causal=causal,
        sm_scale=scale,
        q_data_type=dtype,
        kv_data_type=dtype,
    )
    return w


class FlashInferRaw(Method):
    """FLASHINFER's raw call: a ``BatchPrefillWithRaggedKVCacheWrapper`` planned once outside the timed
    region; ``run(q, k, v, return_lse=True)`` is timed. Its LSE is base 2, ``[T, H]``.

    ``natural_lse=True`` times ``run(q, k, v, return_lse=True, lse_base="ln", lse_layout="HN")`` instead
    (FlashInfer 0.7.2 and newer): the library's own call for the outputs the op returns, a natural-log
    ``[H, T]`` LSE, which costs FlashInfer one more allocation and the transpose-and-scale launch.
    """

    name = "flashinfer_raw"

    def __init__(self, kernel: str, natural_lse: bool = False) -> None:
        self.kernel = kernel
        self.natural_lse = natural_lse
        self.implementation = f"flashinfer.BatchPrefillWithRaggedKVCacheWrapper(backend={kernel!r}).run" + (
            '(..., lse_base="ln", lse_layout="HN")' if natural_lse else ""
        )

    def unavailable(self, device: torch.device) -> str | None:
        return _needs_cuda(device, "FlashInfer") or _import_problem("flashinfer")

    def plan(self, p: Problem) -> Any:
        """The wrapper planned for ``p``'s batch."""
        return flashinfer_wrapper(p.device, self.kernel, p.cu_q, p.cu_k, p.heads, p.dtype, p.scale, p.causal)

    def prepare(self, p: Problem) -> Prepared:
        w, q, k, v = self.plan(p), p.q, p.k, p.v
        if not self.natural_lse:
            return Prepared(lambda: w.run(q, k, v, return_lse=True), _out_only)
        if "lse_base" not in _parameters(w.run):
            raise RuntimeError("this FlashInfer's run() has no lse_base/lse_layout (added in 0.7.2)")
        return Prepared(lambda: w.run(q, k, v, return_lse=True, lse_base="ln", lse_layout="HN"), _out_only)

    def warm(self, device: torch.device, dtype: torch.dtype) -> None:
        """JIT-compile (or load) the kernels, both paths, on a tiny batch."""
        for shape in (Shape("causal", 16, (64, 64)), Shape("chunk", 16, (64, 64), (32, 96))):
            self.prepare(make_problem(shape, device, dtype)).fn()


# --- FlashAttention ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _FlashImpl:
    module: str  # what must import
    method: str  # the method's name in results
    label: str
    pads_v: bool  # needs Dv == Dqk: v is widened to Dqk and the output sliced back
    min_major: int
    max_major: int


#: The FlashAttention implementations the FLASH_ATTN backend may run, by the names of its chain.
FLASH_IMPLS = {
    "flash_attn.cute": _FlashImpl(
        "flash_attn.cute", "fa4_raw", "flash_attn.cute.flash_attn_varlen_func (FlashAttention-4)", False, 9, 11
    ),
    "flash_attn_interface": _FlashImpl(
        "flash_attn_interface", "fa3_raw", "flash_attn_interface.flash_attn_varlen_func (FlashAttention-3)", False, 9, 9
    ),
    "flash_attn": _FlashImpl(
        "flash_attn", "flash_attn_raw", "flash_attn.flash_attn_varlen_func (FlashAttention-2)", True, 8, 99
    ),
    "torch.ops.aten._flash_attention_forward": _FlashImpl(
        "torch",
        "fa2_varlen_raw",
        "torch.ops.aten._flash_attention_forward (bundled FlashAttention-2 varlen)",
        True,
        8,
        99,
    ),
}


class FlashAttnRaw(Method):
    """A FlashAttention implementation's varlen forward called directly, with ``return_lse``.

    ``impl`` is a name of the FLASH_ATTN backend's chain (:data:`FLASH_IMPLS`). FlashAttention-4 and -3
    take ``Dv != Dqk`` and the strided ``v`` as they are. The FlashAttention-2 kernels need
    ``Dv == Dqk``: ``v`` is widened the way the backend widens it (a wider window over ``v``'s own
    storage, here the ``k_nope`` channels before it; no copy), outside the timed region, and the output's
    ``Dv`` columns are read back as a view.
    """

    def __init__(self, impl: str) -> None:
        self.impl = FLASH_IMPLS[impl]
        self.name = self.impl.method
        self.implementation = self.impl.label + (
            ", v widened to Dqk as FLASH_ATTN widens it, output sliced to Dv" if self.impl.pads_v else ""
        )
        self._function: Callable[..., Any] | None = None

    def unavailable(self, device: torch.device) -> str | None:
        import torch

        if device.type != "cuda":
            return f"{self.impl.label} runs on CUDA devices only"
        major = torch.cuda.get_device_capability(device)[0]
        if not self.impl.min_major <= major <= self.impl.max_major:
            return f"{self.impl.label} does not serve compute capability {major}.x"
        try:
            self.function()
        except Exception as exc:
            return f"{self.impl.module} is not usable ({short_error(exc)})"
        return None

    def function(self) -> Callable[..., Any]:
        """The library function (imported on first use)."""
        if self._function is None:
            import importlib

            import torch

            if self.impl.module == "torch":
                self._function = torch.ops.aten._flash_attention_forward
            else:
                self._function = importlib.import_module(self.impl.module).flash_attn_varlen_func
        return self._function

    def widen(self, v: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``(v as the kernel takes it, first output column of v)``."""
        if not self.impl.pads_v:
            return v, 0
        from mla_ops.backends.flash_attn import widen_v

        wide, first, _ = widen_v(v, DQK)
        return wide, first

    def call(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal) -> tuple[Any, Any]:
        """The library call on an already widened ``v``: ``(out [T, H, Dqk or Dv], lse [H, T] natural log)``."""
        fn, method = self.function(), self.impl.method
        if method == "fa4_raw":
            return fn(
                q,
                k,
                v,
                cu_seqlens_q=cu_q,
                cu_seqlens_k=cu_k,
                max_seqlen_q=max_q,
                max_seqlen_k=max_k,
                softmax_scale=scale,
                causal=causal,
                return_lse=True,
            )
        if method == "fa2_varlen_raw":
            result = fn(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale)
            return result[0], result[1]
        # FA2 always takes return_attn_probs; FA3 has it (or return_softmax_lse) only in newer trees,
        # and older ones return (out, lse) unasked.
        flags = {name: True for name in ("return_attn_probs", "return_softmax_lse") if name in _parameters(fn)}
        result = fn(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=causal, **flags)
        return result[0], result[1]

    def prepare(self, p: Problem) -> Prepared:
        q, k, _, cu_q, cu_k, max_q, max_k, scale = p.attention_args()
        v, first = self.widen(p.v)
        causal, call = p.causal, self.call
        fn = lambda: call(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal)
        return Prepared(fn, lambda r: (r[0][..., first : first + DV], None))


def _parameters(fn: Callable[..., Any]) -> Sequence[str]:
    import inspect

    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def flash_attn_impl(backend: Any, device: torch.device) -> str | None:
    """The name of the implementation the FLASH_ATTN ``backend`` runs on ``device`` for (192, 128)."""
    import mla_ops

    adapter, _ = backend.choose(mla_ops.DeviceCapability.of(device), DQK, DV)
    return None if adapter is None else adapter.kind.name


def raw_method_for(name: str, backend: Any, device: torch.device, fi_kernel: str) -> Method | None:
    """The raw library call the backend ``name`` (instance ``backend``) makes on ``device``, or ``None``."""
    if name == "FLASHINFER":
        return FlashInferRaw(fi_kernel)
    if name == "FLASH_ATTN":
        impl = flash_attn_impl(backend, device)
        return FlashAttnRaw(impl) if impl is not None else None
    if name == "TRITON":
        return TritonRaw()
    if name == "REFERENCE":
        return ReferenceRaw()
    return None


def backends_to_time(
    backends: list[dict[str, Any]], device: torch.device, requested: Sequence[str] | None = None
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The rows of :func:`benchlib.report.backend_table` whose ops can be timed on ``device``, and for
    every other one why not.

    ``requested``: backend names (any case) from ``--backends``; ``None`` means every valid one. On CPU
    the ops always run REFERENCE, whatever is selected, so only REFERENCE is timed there; on CUDA
    REFERENCE (host-synchronising fp32 math) is timed only when requested. Exits with a message naming
    the choices for an unknown name.
    """
    known = [row["name"] for row in backends]
    wanted = [name.strip().upper() for name in requested] if requested else known
    unknown = [name for name in wanted if name not in known]
    if unknown:
        raise SystemExit(f"--backends: unknown backend(s) {unknown}; choose from {', '.join(known)}")
    rows, skipped = [], {}
    for row in backends:
        name = row["name"]
        if name not in wanted:
            continue
        if not row["valid"]:
            skipped[name] = "not valid here: " + "; ".join(row["reasons"])
        elif device.type == "cpu" and name != "REFERENCE":
            skipped[name] = "the ops' CPU dispatch key always runs REFERENCE, so it cannot be timed on CPU"
        elif device.type == "cuda" and name == "REFERENCE" and not requested:
            skipped[name] = (
                "host-synchronising fp32 math, orders of magnitude slower; used as the correctness reference "
                "(pass --backends REFERENCE to time it)"
            )
        else:
            rows.append(row)
    return rows, skipped


# --- other baselines -----------------------------------------------------------------------------------


class SdpaBaseline(Method):
    """``torch.nn.functional.scaled_dot_product_attention``: the memory-efficient kernel on CUDA.

    Batches whose sequences all have one length run as one ``[B, H, S, D]`` call on strided views;
    ragged batches run one call per sequence.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.name = "sdpa_efficient" if self.cuda else "sdpa_cpu"
        self.implementation = (
            "F.scaled_dot_product_attention under sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION)"
            if self.cuda
            else "F.scaled_dot_product_attention, PyTorch's default CPU kernel choice"
        )

    def unavailable(self, device: torch.device) -> str | None:
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
        except ImportError as exc:
            return f"torch.nn.attention.sdpa_kernel is missing ({exc})"
        return None

    def prepare(self, p: Problem) -> Prepared:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        H, causal, scale = p.heads, p.causal, p.scale
        context = (lambda: sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION)) if self.cuda else contextlib.nullcontext
        if len(set(p.q_lens)) == 1 and len(set(p.k_lens)) == 1:
            B, sq, sk = len(p.q_lens), p.q_lens[0], p.k_lens[0]
            q = p.q.view(B, sq, H, DQK).transpose(1, 2)
            k = p.k.view(B, sk, H, DQK).transpose(1, 2)
            v = p.v.view(B, sk, H, DV).transpose(1, 2)
            fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
            extract = lambda o: (o.transpose(1, 2).reshape(-1, H, DV), None)
            return Prepared(fn, extract, context, note="one batched [B,H,S,D] call")
        bq = [0, *itertools.accumulate(p.q_lens)]
        bk = [0, *itertools.accumulate(p.k_lens)]
        views = [
            tuple(t[b[i] : b[i + 1]].transpose(0, 1).unsqueeze(0) for t, b in ((p.q, bq), (p.k, bk), (p.v, bk)))
            for i in range(len(p.q_lens))
        ]
        fn = lambda: [F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale) for q, k, v in views]
        extract = lambda outs: (torch.cat([o[0].transpose(0, 1) for o in outs]), None)
        return Prepared(fn, extract, context, note="one call per sequence (ragged batch)")


class FlexBaseline(Method):
    """FlexAttention, ``torch.compile(flex_attention)`` once, with a document (ragged) block mask."""

    name = "flex_attention"
    implementation = "torch.compile(flex_attention) with a document mask from create_block_mask"
    FALLBACK_OPTIONS: ClassVar[dict[str, int]] = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}

    def __init__(self) -> None:
        self._compiled = None

    def unavailable(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return (
                "measured on CUDA only (on CPU each shape needs a C++ compile, and CPU is not where MLA prefill runs)"
            )
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
        except ImportError as exc:
            return f"torch.nn.attention.flex_attention is missing ({exc})"
        return None

    def prepare(self, p: Problem) -> Prepared:
        import torch
        import torch._dynamo
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if self._compiled is None:
            # Each new shape recompiles; the default limit (8) would silently fall back to eager
            # FlexAttention, which materialises the whole score matrix.
            for knob in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit"):
                if hasattr(torch._dynamo.config, knob):
                    setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), 256))
            self._compiled = torch.compile(flex_attention, dynamic=False)
        dev = p.device
        doc_q, doc_k = (
            torch.repeat_interleave(torch.arange(len(lens), device=dev), torch.tensor(lens, device=dev))
            for lens in (p.q_lens, p.k_lens)
        )
        if p.causal:
            mask_mod = lambda b, h, qi, ki: (doc_q[qi] == doc_q[ki]) & (qi >= ki)
        else:
            mask_mod = lambda b, h, qi, ki: doc_q[qi] == doc_k[ki]
        block_mask = create_block_mask(mask_mod, None, None, doc_q.numel(), doc_k.numel(), device=dev)
        # FlexAttention's layout is [B, H, S, D]; the copies are made outside the timed region.
        q, k, v = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (p.q, p.k, p.v))
        compiled = self._compiled
        note = "[1,H,T,D] inputs, document block mask"
        # The default tile configuration may not fit every GPU's shared memory at Dqk=192; a smaller
        # one is tried before giving up. The first call compiles, outside the timed region.
        first_error = None
        for options in (None, self.FALLBACK_OPTIONS):
            kwargs: dict[str, Any] = {"block_mask": block_mask, "scale": p.scale}
            if options is not None:
                kwargs["kernel_options"] = options
            fn = lambda kwargs=kwargs: compiled(q, k, v, **kwargs)
            try:
                fn()
            except Exception as exc:
                first_error = first_error or exc
                continue
            if options is not None:
                note += f"; kernel_options {options} (default failed: {short_error(first_error, 80)})"
            return Prepared(fn, lambda o: (o[0].transpose(0, 1), None), note=note)
        assert first_error is not None
        raise first_error


# --- the merge -------------------------------------------------------------------------------------


def _merge_fn_name(fn: Callable[..., Any]) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


class MergeOp(Method):
    """``mla_ops.merge_attn_states`` through its op."""

    name = "mla.merge_attn_states"
    kind = "op"
    suites = ("merge",)

    def __init__(self, device: torch.device) -> None:
        from mla_ops.runtime.merge_dispatch import merge_kernel

        self.implementation = _merge_fn_name(merge_kernel(device))
        if device.type == "cuda":
            self.raw = MergeDirect.name
        else:
            self.implementation += " (CPU dispatch key)"

    def prepare(self, p: Problem) -> Prepared:
        import mla_ops

        args = p.merge
        return Prepared(lambda: mla_ops.merge_attn_states(*args), _pair)


class MergeDirect(Method):
    """The merge function the op dispatches to on CUDA, called without the op."""

    name = "merge_kernel_direct"
    kind = "direct"
    suites = ("merge",)

    def unavailable(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return "on CPU the op runs the reference math (timed as torch_eager_merge)"
        from mla_ops.runtime.merge_dispatch import merge_kernel

        self.implementation = _merge_fn_name(merge_kernel(device)) + " called directly"
        return None

    def prepare(self, p: Problem) -> Prepared:
        from mla_ops.backends.base import MergeCall
        from mla_ops.runtime.merge_dispatch import merge_kernel

        fn, call = merge_kernel(p.device), MergeCall(*p.merge)
        return Prepared(lambda: fn(call), _pair)


class FlashInferMerge(Method):
    """``flashinfer.merge_state``; it takes base-2 LSEs ``[T, H]``, converted outside the timed region."""

    name = "flashinfer_merge_state"
    suites = ("merge",)
    implementation = "flashinfer.merge_state (LSE base 2, [T, H])"

    def __init__(self, log: Callable[[str], None] = print) -> None:
        self.log, self._announced = log, False

    def unavailable(self, device: torch.device) -> str | None:
        return _needs_cuda(device, "FlashInfer") or _import_problem("flashinfer")

    def prepare(self, p: Problem) -> Prepared:
        import flashinfer

        a, lse_a, b, lse_b = p.merge
        s_a, s_b = (lse.t().contiguous() * math.log2(math.e) for lse in (lse_a, lse_b))
        if not self._announced:
            self.log("flashinfer.merge_state: JIT-compiling on first use (once)...")
            self._announced = True
        return Prepared(lambda: flashinfer.merge_state(a, s_a, b, s_b), _out_only)


class TorchEagerMerge(Method):
    """The merge written in eager PyTorch (the package's fp32 reference math)."""

    name = "torch_eager_merge"
    suites = ("merge",)
    implementation = "mla_ops.backends.reference.merge_attn_states_reference (eager PyTorch, fp32)"

    def prepare(self, p: Problem) -> Prepared:
        from mla_ops.backends.base import MergeCall
        from mla_ops.backends.reference import merge_attn_states_reference

        call = MergeCall(*p.merge)
        return Prepared(lambda: merge_attn_states_reference(call), _pair)


# --- checking and timing ------------------------------------------------------------------------------


#: A shape of more query rows than this is checked on a sample of them (:func:`reference_outputs`): the reference
#: materialises a few query rows' fp32 scores over every key at a time (4 rows over the keys of one 131072-token
#: sequence at H=128), step after step for every row.
SAMPLED_CHECK_ROWS = 16384
#: Query rows at the start and at the end of each sequence that a sampled check compares: the first see the fewest
#: keys (causal), the last the most.
SAMPLE_EDGE_ROWS = 1024


def reference_outputs(p: Problem, sample: bool | None = None) -> tuple[torch.Tensor, ...]:
    """fp32 ground truth ``(out [T, H, Dv] float32, lse [H, T])`` from the package's reference math; with ``sample``
    (by default: a shape of more than :data:`SAMPLED_CHECK_ROWS` query rows), ``(out, lse, rows)`` of the
    :data:`SAMPLE_EDGE_ROWS` first and last query rows of each sequence only, ``rows`` their indices (int64 on the
    device): :func:`check_and_time` compares those rows."""
    import torch

    from mla_ops.backends.base import MergeCall
    from mla_ops.backends.reference import attention_reference, merge_attn_states_reference

    if p.shape.suite == "merge":
        a, lse_a, b, lse_b = p.merge
        return merge_attn_states_reference(MergeCall(a.float(), lse_a, b.float(), lse_b))
    if sample is None:
        sample = sum(p.q_lens) > SAMPLED_CHECK_ROWS
    if not sample:
        return attention_reference(p.q.float(), p.k.float(), p.v.float(), p.cu_q, p.cu_k, p.scale, causal=p.causal)
    # Each sequence gives two: its first rows over the keys they see (causal: as many keys as rows, since the
    # causal path's keys are its queries; a chunk: all of its keys), and its last rows over all of its keys. The
    # reference aligns a causal mask bottom-right, so both see what they see in the whole sequence.
    rows, keys, q_lens, k_lens = [], [], [], []
    q0 = k0 = 0
    for len_q, len_k in zip(p.q_lens, p.k_lens):
        first = min(SAMPLE_EDGE_ROWS, len_q)
        last = min(SAMPLE_EDGE_ROWS, len_q - first)
        for start, count, seen in ((q0, first, first if p.causal else len_k), (q0 + len_q - last, last, len_k)):
            rows.append(torch.arange(start, start + count, device=p.device))
            keys.append(torch.arange(k0, k0 + seen, device=p.device))
            q_lens.append(count)
            k_lens.append(seen)
        q0, k0 = q0 + len_q, k0 + len_k
    index, key_index = torch.cat(rows), torch.cat(keys)
    cu_q, cu_k = (offsets(lens, p.device) for lens in (q_lens, k_lens))
    q, k, v = p.q[index].float(), p.k[key_index].float(), p.v[key_index].float()
    return (*attention_reference(q, k, v, cu_q, cu_k, p.scale, causal=p.causal), index)


def compare(
    out: torch.Tensor,
    lse: torch.Tensor | None,
    ref_out: torch.Tensor,
    ref_lse: torch.Tensor,
    rows: int | None = None,
) -> tuple[float, float | None]:
    """``(rel_err, lse_err)``: the largest per-row ``max|out-ref| / max|ref|`` and the largest LSE error,
    over the first ``rows`` rows (default: all; rows past the batch's tokens are padding, unspecified).

    A per-row scale keeps long rows, whose outputs average many values and are small, as visible as
    short ones. NaN anywhere gives ``inf``.
    """
    import torch

    n = ref_out.shape[0] if rows is None else rows
    ref_out, ref_lse = ref_out[:n], ref_lse[:, :n]
    lse = None if lse is None else lse[:, :n]
    o = out[:n].float()
    if o.shape != ref_out.shape:
        raise ValueError(f"output has shape {tuple(out.shape)}, expected {tuple(ref_out.shape)}")
    if torch.isnan(o).any():
        rel = math.inf
    else:
        scale = ref_out.abs().amax(-1).clamp_min(1e-6)
        rel = ((o - ref_out).abs().amax(-1) / scale).max().item() if o.numel() else 0.0
    if lse is None:
        return rel, None
    if lse.shape != ref_lse.shape:
        raise ValueError(f"lse has shape {tuple(lse.shape)}, expected [H, T] = {tuple(ref_lse.shape)}")
    got = lse.float()
    finite = torch.isfinite(ref_lse)
    if torch.isnan(got).any() or not torch.equal(torch.isfinite(got), finite):
        return rel, math.inf
    lse_err = (got[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    return rel, lse_err


@dataclass
class Checked:
    """A method's result on one problem: ``status`` is ``ok``, ``WRONG`` (timed, but over tolerance) or
    ``error`` (``note`` says why); ``prepared`` stays for a later ratio measurement."""

    status: str = "ok"
    time_ms: float | None = None
    host_ms: float | None = None
    rel_err: float | None = None
    lse_err: float | None = None
    note: str = ""
    prepared: Prepared | None = field(default=None, repr=False)


#: Calls that take longer than this (ms) get no host measurement: no backend's host cost comes near it.
HOST_PACE_MAX_MS = 2.0


def check_and_time(
    method: Method,
    p: Problem,
    reference: tuple[torch.Tensor, ...],
    timed: bool = True,
    **timing_kwargs: Any,
) -> Checked:
    """Run ``method`` on ``p`` once, check it against ``reference``, then (if ``timed``) time it with
    :func:`timing.measure`, and a call of under :data:`HOST_PACE_MAX_MS` also with :func:`timing.host_issue`
    (``host_ms``): each of :func:`timing.measure`'s samples follows an L2 flush, behind which the host issues
    the call, so a host-bound call's sample hides up to the flush's duration of its host time.

    Never raises: a method that fails is an ``error`` result with the message.
    """
    import torch

    out_tol, lse_tol = method.tolerance or (OUT_TOL_EPS * torch.finfo(p.dtype).eps, LSE_TOL)
    result = Checked()
    try:
        prepared = method.prepare(p)
        result.note = prepared.note
        with prepared.context():
            out, lse = prepared.extract(prepared.fn())
            rows = sum(p.q_lens) if p.shape.suite != "merge" else None
            ref_out, ref_lse, *sampled = reference
            if sampled:  # a sample of the rows (reference_outputs)
                out, lse, rows = out[sampled[0]], None if lse is None else lse[:, sampled[0]], None
            result.rel_err, result.lse_err = compare(out, lse, ref_out, ref_lse, rows=rows)
            del out, lse
            if not result.rel_err <= out_tol or (result.lse_err is not None and not result.lse_err <= lse_tol):
                result.status = "WRONG"
            if timed:
                result.time_ms = timing.measure(prepared.fn, p.device, **timing_kwargs).median_ms
                if result.time_ms < HOST_PACE_MAX_MS:
                    result.host_ms = host_time(prepared.fn, p.device, result.time_ms)
        result.prepared = prepared
    except Exception as exc:
        result.status, result.note, result.time_ms = "error", short_error(exc), None
        if p.device.type == "cuda":  # after an out-of-memory error, return what the failed call held
            torch.cuda.empty_cache()
            clear_launch_error(p.device)
    return result


def host_time(fn: Callable[[], Any], device: torch.device, time_ms: float) -> float:
    """The median of three rounds of :func:`timing.host_issue` of ``fn``, a call of about ``time_ms``: rounds of
    about 10 ms of the device's time, 3 to 100 calls (at a few kernels per call, well within the launch queue)."""
    calls = max(3, min(100, int(10.0 / max(time_ms, 1e-3))))
    return statistics.median(timing.host_issue(fn, device, calls, rounds=3))


def clear_launch_error(device: torch.device) -> None:
    """Consume a kernel-launch error that a failed library call left behind on ``device``.

    A library that reports a failed launch (FlashInfer's ``merge_state`` at H=128, T=16384 on the H200:
    "invalid argument") but does not reset CUDA's last error hands it to the next PyTorch launch, which
    then raises although it is fine: in one run the next benchmark's L2 flush did, and the whole run
    stopped. One throwaway launch takes the stale error; a second failure would be a real one.
    """
    import torch

    try:
        torch.zeros(1, device=device)
    except RuntimeError:
        torch.zeros(1, device=device)


def overhead_ratio(
    op: Prepared, raw: Prepared, device: torch.device, rounds: int = timing.DEFAULT_ROUNDS, **timing_kwargs: Any
) -> timing.RoundsRatio:
    """Raw call time / op time: per round the median ratio of neighbouring samples of the two, taken in
    turns sample by sample (:func:`benchlib.timing.interleaved_ratio`), and the median over ``rounds``.

    Both run on the same tensors (the same problem), with the op's backend selected throughout. Above
    1: the op is faster than its raw call; the op layer's cost shows as the distance below 1.
    """
    with op.context(), raw.context():
        return timing.interleaved_ratio(raw.fn, op.fn, device, rounds, **timing_kwargs)


#: Samples per function and round of :func:`rounds_ratio` at most: each turn of the two sits behind a GPU sleep
#: longer than the host's issue of a turn, which forcing a backend and lifting it makes milliseconds long.
ROUNDS_RATIO_MAX_SAMPLES = 40


def rounds_ratio(
    ours: Prepared, theirs: Prepared, device: torch.device, rounds: int = timing.DEFAULT_ROUNDS, **timing_kwargs: Any
) -> timing.RoundsRatio:
    """``theirs``'s time / ``ours``'s (above 1: ours is faster), each inside its own context (e.g. ``auto`` and a
    backend forced): per round, the median ratio of neighbouring samples of the two taken in turns sample by
    sample (:func:`benchlib.timing.interleaved_ratio`), each sample in its function's context; the median over
    ``rounds`` and their range. Used for auto against the fastest forced op and for an op against the fastest raw
    baseline, whose single measurements, minutes apart in a long run, differ by their noise too; neighbouring
    samples milliseconds apart share the GPU's clocks and temperature. Entering a context costs the host
    milliseconds (forcing a backend clears the routing caches), which the GPU sleep before each turn hides from
    the samples (:func:`benchlib.timing.interleaved`)."""
    timing_kwargs.setdefault("max_samples", ROUNDS_RATIO_MAX_SAMPLES)
    return timing.interleaved_ratio(
        theirs.fn, ours.fn, device, rounds, contexts={"numerator": theirs.context, "denominator": ours.context},
        **timing_kwargs,
    )  # fmt: skip


def settled_rounds_ratio(
    ours: Prepared,
    theirs: Prepared,
    device: torch.device,
    rounds: int = timing.DEFAULT_ROUNDS,
    monitor: Callable[[str], contextlib.AbstractContextManager] | None = None,
    **timing_kwargs: Any,
) -> timing.RoundsRatio:
    """``theirs``'s time / ``ours``'s (above 1: ours is faster), each inside its own context, in rounds of phases
    long enough for the GPU's clock to settle to what each draws (:func:`benchlib.timing.settled_ratio`; ``monitor``
    is its, with ``"numerator"`` for theirs and ``"denominator"`` for ours). Used for an fp8 op against the fastest
    bf16 op: at a power cap the fp8 kernel draws less per FLOP and runs at a higher clock, which samples of both
    taken in turns (:func:`rounds_ratio`) would share between them."""
    return timing.settled_ratio(
        theirs.fn, ours.fn, device, rounds, contexts={"numerator": theirs.context, "denominator": ours.context},
        monitor=monitor, **timing_kwargs,
    )  # fmt: skip


# --- raw calls in an MLA layer ------------------------------------------------------------------------


class RawLayerAttention:
    """An :class:`mla_ops.model.MLAAttention` attention function made of a backend's raw library calls.

    It computes what :func:`mla_ops.prefill_with_context` computes (the new tokens' causal call, each
    context chunk's call, the merge) without the op layer: FLASHINFER's wrappers planned once per batch
    by :meth:`plan` and merged with ``flashinfer.merge_state`` (base-2 LSEs); FlashAttention's, Triton's
    or the reference's calls merged by the function the merge op dispatches to. ``out`` may be a view
    (the FlashAttention-2 kernels' ``Dv`` columns); the layer's ``reshape`` copies it, as the op does.
    """

    def __init__(self, raw: Method, device: torch.device) -> None:
        from mla_ops.backends.base import MergeCall
        from mla_ops.runtime.merge_dispatch import merge_kernel

        self.raw, self.device = raw, device
        if isinstance(raw, FlashInferRaw):
            import flashinfer

            self.merge = flashinfer.merge_state
        else:
            kernel = merge_kernel(device)
            self.merge = lambda *parts: kernel(MergeCall(*parts))
        self._wrappers: dict[tuple[int, int], Any] = {}

    def plan(
        self,
        cu_seqlens: torch.Tensor,
        chunk_offsets: Sequence[torch.Tensor],
        heads: int,
        dtype: torch.dtype,
        scale: float,
    ) -> None:
        """Plan FlashInfer's wrappers for a batch (new tokens and every chunk); nothing for other backends."""
        if not isinstance(self.raw, FlashInferRaw):
            return
        self._wrappers = {
            (cu_seqlens.data_ptr(), cu_k.data_ptr()): flashinfer_wrapper(
                self.device, self.raw.kernel, cu_seqlens, cu_k, heads, dtype, scale, cu_k is cu_seqlens
            )
            for cu_k in (cu_seqlens, *chunk_offsets)
        }

    def _call(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal) -> tuple[Any, Any]:
        raw = self.raw
        if isinstance(raw, FlashInferRaw):
            return self._wrappers[(cu_q.data_ptr(), cu_k.data_ptr())].run(q, k, v, return_lse=True)
        if isinstance(raw, FlashAttnRaw):
            v, first = raw.widen(v)
            out, lse = raw.call(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal)
            return out[..., first : first + DV], lse
        return raw.call(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal)

    def __call__(self, q, k, v, cu_seqlens, max_seqlen, chunks, softmax_scale) -> tuple[Any, Any]:
        out, lse = self._call(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale, True)
        for k_c, v_c, cu_k, max_k in chunks:
            out_c, lse_c = self._call(q, k_c, v_c, cu_seqlens, cu_k, max_seqlen, max_k, softmax_scale, False)
            out, lse = self.merge(out_c, lse_c, out, lse)
        return out, lse


# --- CUDA graphs -----------------------------------------------------------------------------------


def capture_cuda_graph(fn: Callable[[], Any], device: torch.device, warmup_calls: int = 3) -> tuple[Any, Any]:
    """``(graph, output)``: ``fn`` warmed up on a side stream (as PyTorch's CUDA-graph notes recommend,
    so that lazy initialisation and JIT compiles happen outside capture), then captured once."""
    import torch

    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmup_calls):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = fn()
    return graph, output


def recorded_graphs(device: torch.device) -> int:
    """How many CUDA graphs torch.compile's CUDA-graph tree manager of ``device`` (its current device when
    ``device`` has no index) has recorded; 0 before it has one. Reads Inductor's private tree manager, so
    an error here means that API changed."""
    import torch
    from torch._inductor.cudagraph_trees import get_manager

    index = torch.cuda.current_device() if device.index is None else device.index
    manager = get_manager(index, create_if_none_exists=False)
    if manager is None:
        return 0
    nodes = [node for roots in manager.roots.values() for node in roots]
    count = 0
    while nodes:
        node = nodes.pop()
        count += 1
        nodes.extend(child for children in node.children.values() for child in children)
    return count


def _print_now(line: str) -> None:
    print(line, flush=True)


def start_stack(
    args: Any, backends: list[dict[str, Any]], env: dict[str, Any], device: torch.device, dtype: torch.dtype, what: str
) -> tuple[list[dict[str, Any]], dict[str, str], Any]:
    """``(timed, not_measured, stack)`` of a run over :func:`benchlib.problems.stack_of`'s stack: the rows of
    ``--backends`` to time (:func:`backends_to_time`), warmed up for the stack's heads, and the stack; prints
    the device, the stack (``what`` adds to its description) and the backends."""
    from .problems import stack_of

    timed, not_measured = backends_to_time(backends, device, args.backends)
    print(
        f"device: {env['gpu']} ({device}); {args.layers} layers, H={args.heads}, hidden {args.hidden}{what}; "
        f"backends: {', '.join(r['name'] for r in timed) or 'none'}",
        flush=True,
    )
    warm_backends(timed, device, dtype, [args.heads], record=env)
    return timed, not_measured, stack_of(args, device, dtype)


def warm_backends(
    rows: Sequence[dict[str, Any]],
    device: torch.device,
    dtype: torch.dtype,
    heads: Sequence[int],
    log: Callable[[str], None] | None = None,
    record: dict[str, Any] | None = None,
) -> dict[str, float]:
    """Let each backend of ``rows`` build its just-in-time kernels (its ``warmup``) before anything is
    timed, announcing each; returns the seconds each took, also kept as ``record["warmup_s"]`` in a run's
    environment ``record`` when any backend warmed up. A failure is reported, not raised: the
    measurements of that backend will show the error."""
    import time

    import mla_ops

    log = log or _print_now
    seconds: dict[str, float] = {}
    if device.type != "cuda":
        return seconds
    config = mla_ops.SelectorConfig(dtype, mla_ops.MLADimensions.from_head_dims(DQK, DV))
    for row in rows:
        if row.get("backend") is None:
            continue
        log(f"{row['name']}: warming up (may JIT-compile; FlashInfer's fa3 takes about 80 s on a fresh machine)...")
        start = time.perf_counter()
        try:
            for h in sorted(set(heads)):
                row["backend"].warmup(device, config, h)
            seconds[row["name"]] = round(time.perf_counter() - start, 1)
        except Exception as exc:
            log(f"{row['name']}: warm-up failed ({short_error(exc)}); its measurements will show the error")
    if seconds and record is not None:
        record["warmup_s"] = seconds
    return seconds


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in fp32: how far one computation of a tensor is from another."""
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
