"""FLASHINFER: MLA prefill through ``flashinfer.BatchPrefillWithRaggedKVCacheWrapper``.

:class:`FlashInferBackend` plans once per batch (keyed on the offsets tensors' identity and version) and
reuses the plan for every layer, replays the planned kernel call (:mod:`.flashinfer_replay`), converts the
LSE to the package's convention, and keeps the CUDA-graph wrappers :func:`mla_ops.plan_cuda_graph` plans.
All its state (workspaces, plans, wrappers) lives on the instance, per device. Eager bf16 calls on SM100
that FlashInfer's trtllm-gen DeepSeek kernel serves run it (:mod:`.flashinfer_trtllm`; not run on hardware
by this project).
Design: docs/design/flashinfer.md.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import os
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ..meta.checks import check_cu_seqlens_values, check_offsets_start_and_order
from ..runtime.alloc import empty
from ..runtime.capture import is_capturing, on_device, version_of
from ..specs import DeviceCapability, SelectorConfig
from .base import PrefillBackend, VarlenCall, dtype_name
from .flashinfer_replay import RecordedRun, record_run
from .flashinfer_trtllm import TRTLLM_KERNEL, TrtllmRaggedWrapper, TrtllmWorkspaces, trtllm_function, trtllm_serves

logger = logging.getLogger("mla_ops")

#: ``ln(2)``: FlashInfer's LSE is ``log2(sum(exp(s)))``; times ``ln 2`` it is the natural-log LSE.
LN2 = math.log(2.0)
_FP32 = torch.float32

INSTALL_HINT = "pip install 'mla_ops[flashinfer]'"

#: ``(Dqk, Dv)`` pairs FlashInfer builds ragged prefill kernels for. FA3 accepts exactly these
#: (``flashinfer.utils.is_fa3_prefill_head_dim_supported``); FA2 is instantiated and tested for the
#: same set (``aot.py`` builds ``(64, 64)``, ``(128, 128)``, ``(256, 256)``; FlashInfer's DeepSeek
#: tests build ``(192, 128)`` for both fa2 and fa3).
SUPPORTED_HEAD_DIMS: frozenset[tuple[int, int]] = frozenset({(64, 64), (128, 128), (256, 256), (192, 128)})

#: ``(Dqk, Dv)`` pairs of the SM100 CUTLASS kernel (``DISPATCH_head_dim`` in ``fmha_cutlass_sm100.cu``).
CUTLASS_HEAD_DIMS: frozenset[tuple[int, int]] = frozenset({(192, 128), (128, 128), (64, 64)})

# The CUTLASS planner writes one work item per (256-row query tile, head) into buffers of this fixed
# capacity without a bounds check (``fmha_varlen_plan`` in flashinfer/prefill.py); larger batches
# go to FA2 instead.
CUTLASS_MAX_WORK_ITEMS = 131072
_CUTLASS_QO_TILE = 256

#: Size of the float workspace shared by all wrappers on a device (FlashInfer recommends 128 MiB).
#: ``MLA_OPS_FLASHINFER_WORKSPACE_MB`` overrides it; FA2 in CUDA-graph mode always splits the KV
#: loop and may need more at large ``H * T``.
WORKSPACE_BYTES = 128 << 20
WORKSPACE_ENV = "MLA_OPS_FLASHINFER_WORKSPACE_MB"

#: Batches whose plans stay cached (each batch keeps one plan per layer configuration and chunk).
MAX_CACHED_BATCHES = 4
#: Idle wrappers kept for reuse per (device, kernel); each holds 8 MiB of device and 8 MiB of
#: pinned host memory for its schedule.
MAX_POOLED_WRAPPERS = 16


# --- the library --------------------------------------------------------------------------------


def api_problem(module: Any) -> str | None:
    """Why ``module`` (an imported ``flashinfer``) lacks what this backend calls, or ``None``."""
    version = getattr(module, "__version__", "(unknown version)")
    cls = getattr(module, "BatchPrefillWithRaggedKVCacheWrapper", None)
    if cls is None:
        return f"flashinfer {version} has no BatchPrefillWithRaggedKVCacheWrapper; {INSTALL_HINT}"
    try:
        init_params = inspect.signature(cls.__init__).parameters
        plan_params = inspect.signature(cls.plan).parameters
    except (TypeError, ValueError):  # signatures hidden by a C extension: trust the version pin
        return None
    missing = [name for name in ("backend", "use_cuda_graph") if name not in init_params]
    missing += [name for name in ("head_dim_vo", "o_data_type") if name not in plan_params]
    if missing:
        return (
            f"flashinfer {version} is too old: BatchPrefillWithRaggedKVCacheWrapper lacks {', '.join(missing)}; "
            f"upgrade it ({INSTALL_HINT})"
        )
    return None


def _import_flashinfer() -> tuple[Any, str | None]:
    """``(module, None)``, or ``(None, why it cannot be used)``."""
    try:
        module = importlib.import_module("flashinfer")
    except ModuleNotFoundError as exc:
        if exc.name == "flashinfer":
            return None, f"flashinfer is not installed ({INSTALL_HINT})"
        return None, f"flashinfer failed to import: {type(exc).__name__}: {exc}"
    except Exception as exc:  # a broken install raises anything (OSError for a missing libcudart)
        return None, f"flashinfer failed to import: {type(exc).__name__}: {exc}"
    problem = api_problem(module)
    return (None, problem) if problem else (module, None)


def workspace_bytes_from_env() -> int:
    """The workspace size per device: ``MLA_OPS_FLASHINFER_WORKSPACE_MB`` MiB, else :data:`WORKSPACE_BYTES`."""
    text = os.environ.get(WORKSPACE_ENV, "").strip()
    if not text:
        return WORKSPACE_BYTES
    try:
        megabytes = int(text)
    except ValueError:
        megabytes = 0
    if megabytes <= 0:
        raise ValueError(f"{WORKSPACE_ENV} must be a positive number of MiB, got {text!r}")
    return megabytes << 20


# --- kernel choice ------------------------------------------------------------------------------

#: How ``info`` labels the trtllm-gen path: no Blackwell GPU has run it here.
_TRTLLM_UNTESTED = "not run on hardware by this project"


def _toolkit_at_least(major: int, minor: int) -> bool:
    # FlashInfer gates fa3 on CUDA 12.3 and cutlass on 12.8 (is_sm90a_supported / is_sm100a_supported).
    # A CPU build of torch has no CUDA version; the capability is then simulated and the gate is moot.
    version = torch.version.cuda
    if not version:
        return True
    parts = version.split(".")
    return (int(parts[0]), int(parts[1]) if len(parts) > 1 else 0) >= (major, minor)


def choose_kernel(
    capability: DeviceCapability | None, head_dim_qk: int, head_dim_vo: int, *, cuda_graph: bool = False
) -> str:
    """FlashInfer's ``backend=`` for a device (``None``: CPU) and head dims.

    ``"fa3"`` on SM90; ``"cutlass"`` on SM100 for :data:`CUTLASS_HEAD_DIMS` outside CUDA graphs
    (its wrapper cannot be re-planned in graph mode); ``"fa2"`` otherwise.
    """
    if capability is None:
        return "fa2"
    dims = (head_dim_qk, head_dim_vo)
    if capability.major == 9 and dims in SUPPORTED_HEAD_DIMS and _toolkit_at_least(12, 3):
        return "fa3"
    if capability.major == 10 and dims in CUTLASS_HEAD_DIMS and not cuda_graph and _toolkit_at_least(12, 8):
        return "cutlass"
    return "fa2"


def cutlass_work_items(qo_indptr_host: torch.Tensor, num_heads: int) -> int:
    """Work items the CUTLASS planner emits: one per 256-row query tile per head."""
    lengths = qo_indptr_host[1:] - qo_indptr_host[:-1]
    return int(((lengths + _CUTLASS_QO_TILE - 1) // _CUTLASS_QO_TILE).sum()) * num_heads


# --- LSE and tensors ------------------------------------------------------------------------------


def lse_base2_to_natural(
    lse: torch.Tensor, out: torch.Tensor | None = None, *, posinf_means_empty: bool = False
) -> torch.Tensor:
    """Convert FlashInfer's LSE (base 2, ``[T, H]``) to the package's (natural log, ``[H, T]``).

    Args:
        lse: float32 ``[T, H]``, ``log2`` of each row's sum of ``exp`` of the scaled scores.
        out: optional float32 ``[H, T]`` destination (any strides); allocated contiguous if absent.
        posinf_means_empty: also map ``+inf`` (how some kernels mark a row with no keys) to
            ``-inf``. FlashInfer's fa2, fa3 and cutlass kernels write ``-inf`` for such rows (fa3:
            ``store_zero`` in ``hopper/epilogue.cuh``; fa2: ``m = -inf, d = 1`` give
            ``log2(d) + m = -inf``, and its split-KV merge writes ``-inf`` for zero chunks; cutlass:
            the SM100 epilogue), so the backend leaves this off and the conversion stays one fused
            elementwise kernel.

    Returns:
        float32 ``[H, T]``, natural log; ``-inf`` stays ``-inf`` (never NaN).
    """
    if out is None:
        out = torch.empty((lse.shape[1], lse.shape[0]), dtype=torch.float32, device=lse.device)
    torch.mul(lse.t(), LN2, out=out)
    if posinf_means_empty:
        out.masked_fill_(torch.isposinf(out), -math.inf)
    return out


def _lse_to_natural(lse: torch.Tensor, out: torch.Tensor) -> None:
    """What :func:`lse_base2_to_natural` writes into ``out``, for the per-call path: on CUDA, with Triton
    installed, one launch of :func:`mla_ops.kernels.lse.lse_base2_to_natural_triton` (a few µs less host
    time than ``torch.mul``'s, the same bits); elsewhere ``torch.mul``."""
    global _cuda_lse_to_natural
    if lse.is_cuda:
        convert = _cuda_lse_to_natural
        if convert is None:
            try:
                from ..kernels.lse import lse_base2_to_natural_triton as convert
            except ImportError:
                convert = _torch_lse_to_natural
            _cuda_lse_to_natural = convert
        convert(lse, out)
    else:
        _torch_lse_to_natural(lse, out)


def _torch_lse_to_natural(lse: torch.Tensor, out: torch.Tensor) -> None:
    torch.mul(lse.t(), LN2, out=out)


_cuda_lse_to_natural = None  # the CUDA conversion, chosen on first use


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` (3-D), or a contiguous copy when its base or strides break the kernels' 16-byte loads."""
    token_stride, head_stride, _ = t.stride()
    itemsize = t.element_size()
    if t.data_ptr() % 16 == 0 and (token_stride * itemsize) % 16 == 0 and (head_stride * itemsize) % 16 == 0:
        return t
    return t.contiguous()


def _all_aligned(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`_aligned` would return all three of one dtype as they are, in one expression (it
    runs on every call): 16 is a power of two, so it divides each of several numbers exactly when it
    divides their bitwise OR."""
    (qt, qh, _), (kt, kh, _), (vt, vh, _) = q.stride(), k.stride(), v.stride()
    return (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16 == 0 and (
        (qt | qh | kt | kh | vt | vh) * q.element_size()
    ) % 16 == 0


def _empty_outputs(q: torch.Tensor, head_dim_vo: int) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_heads, _ = q.shape
    device = q.device
    return empty((num_tokens, num_heads, head_dim_vo), q.dtype, device), empty((num_heads, num_tokens), _FP32, device)


def _offsets_key(t: torch.Tensor) -> tuple[torch.device, int, int | None, int]:
    return (t.device, t.data_ptr(), version_of(t), t.numel())


def _hot_key(cu_q: torch.Tensor, cu_k: torch.Tensor | None, cfg: tuple) -> tuple:
    """The flat key of the hot-plan table: both offsets tensors' address, version and length, and the
    layer configuration. Device pointers are unique within a process (unified addressing), so the
    device itself need not be part of it; a tensor without a version counter gives ``None`` there,
    a key that is never stored. ``cfg`` is a :class:`_LayerConfig` where a plan is stored and the plain
    tuple of its fields where one is looked up (cheaper to build): the two hash and compare equal."""
    if cu_k is None:
        return (cu_q.data_ptr(), version_of(cu_q), cu_q.numel(), cfg)
    return (cu_q.data_ptr(), version_of(cu_q), cu_q.numel(), cu_k.data_ptr(), version_of(cu_k), cu_k.numel(), cfg)


def _run(
    wrapper: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse_out: torch.Tensor,
    plan: _EagerPlan | None = None,
) -> None:
    """Run a planned wrapper; ``q`` must hold exactly the planned ``qo_indptr[-1]`` rows.

    ``out`` is ``[n, H, Dv]`` contiguous and ``lse_out`` a float32 ``[H, n]`` view to fill. ``plan``: the
    eager plan ``wrapper`` carries out, whose first call records the wrapper's kernel call and whose later
    calls replay it (:mod:`.flashinfer_replay`); without one, ``wrapper.run()`` serves every call.
    """
    # One fused transpose-and-scale from FlashInfer's own LSE buffer. FlashInfer >= 0.7.2's
    # run(lse_base="ln", lse_layout="HN") does the same two steps internally and rejects the strided
    # [H, n] view that a padded batch needs.
    _lse_to_natural(_run_base2(wrapper, q, k, v, out, plan), lse_out)


def _run_base2(
    wrapper: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, plan: _EagerPlan | None
) -> torch.Tensor:
    """:func:`_run` without the LSE conversion: returns FlashInfer's own LSE, float32 ``[n, H]``, base 2."""
    # The kernels index the LSE as a contiguous [n, H] array, so it gets its own buffer.
    num_rows, num_heads, _ = q.shape
    lse = empty((num_rows, num_heads), _FP32, q.device)
    if not _all_aligned(q, k, v):
        q, k, v = _aligned(q), _aligned(k), _aligned(v)
    replay = None if plan is None else plan.replay
    if replay is not None:
        replay(q, k, v, out, lse)
    elif plan is not None and not plan.recorded:
        plan.replay, plan.recorded = record_run(wrapper, q, k, v, out, lse), True
    else:  # no eager plan, or one whose kernel call was recorded and found not to be replayable
        wrapper.run(q, k, v, out=out, lse=lse, return_lse=True)
    return lse


class _LayerConfig(NamedTuple):
    """What a plan depends on besides the offsets (a tuple: it is built and hashed on every call)."""

    num_heads: int
    head_dim_qk: int
    head_dim_vo: int
    dtype: torch.dtype
    softmax_scale: float
    causal: bool


class _Call(NamedTuple):
    """One validated call's inputs, as the eager and graph paths pass them on: ``cu_k`` is None on the
    causal path (the new tokens over themselves, one offsets tensor)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor | None
    max_seqlen_q: int
    max_seqlen_k: int
    cfg: _LayerConfig


# --- eager plans ----------------------------------------------------------------------------------


@dataclass
class _EagerPlan:
    wrapper: Any  # None when nothing is computed: no query rows, or a chunk with no keys at all
    kernel: str
    num_rows: int
    host_offsets: torch.Tensor  # [1 or 2, B+1]: what was planned, compared again for unversioned offsets
    offsets_k: torch.Tensor | None  # strong reference: keeps the address of a keyed chunk tensor taken
    replay: RecordedRun | None = None  # the wrapper's kernel call for this plan, once recorded and trusted
    recorded: bool = False  # whether the first call recorded it (None then means: run() serves the plan)


@dataclass
class _BatchPlans:
    offsets_q: torch.Tensor  # strong reference: keeps the address of the keyed tensor taken
    plans: dict[tuple[_LayerConfig, tuple | None], _EagerPlan] = field(default_factory=dict)


def _read_offsets(cu_q: torch.Tensor, cu_k: torch.Tensor | None) -> torch.Tensor:
    # One device-to-host copy (one sync) for both offset arrays. The sync also drains the stream, so
    # no earlier plan's pinned-to-device copy is still pending when a pooled wrapper is re-planned.
    # copy=True: the plan keeps this as a record of what it planned, which must not alias offsets
    # that already live on the host (and may be rewritten in place).
    both = cu_q.unsqueeze(0) if cu_k is None else torch.stack((cu_q, cu_k))
    return both.to("cpu", copy=True)


# --- CUDA-graph plans -------------------------------------------------------------------------------


@dataclass
class _GraphBuffer:
    """A static offsets buffer registered by :func:`mla_ops.plan_cuda_graph`."""

    offsets: torch.Tensor  # the device buffer itself
    version: int | None  # its version counter when registered
    generation: int  # which plan_cuda_graph call registered it
    host: torch.Tensor | None = None  # its values, read on the host when a wrapper is planned from it


@dataclass
class _GraphWrapper:
    wrapper: Any
    kernel: str
    cfg: _LayerConfig
    offsets_q: torch.Tensor  # the registered static buffers this wrapper is planned from
    offsets_k: torch.Tensor
    num_rows: int  # the token budget T; qo_indptr always ends there
    num_kv_rows: int
    generation: tuple[int, int] = (-1, -1)


def _capture_error(problem: str) -> RuntimeError:
    return RuntimeError(
        f"FLASHINFER cannot run inside CUDA graph capture: {problem}. FlashInfer plans on the host, which "
        "capture forbids. Before capturing, call mla_ops.plan_cuda_graph(cu_seqlens, cu_seqlens_k=[...]) with "
        "the graph's static offset buffers (the new tokens' cu_seqlens and each context chunk's cu_seqlens_k), "
        "then make one eager warm-up call of the model with those buffers and the same shapes, then capture; "
        "call mla_ops.plan_cuda_graph again after writing new offsets, before each replay. Under torch.compile's "
        "CUDA-graph trees (mode='reduce-overhead'), call mla_ops.prefill / mla_ops.prefill_context_chunk instead "
        "of torch.ops.mla.*, with automatic selection: they run a backend that reads the offsets on the device there"
    )


def _check_unchanged(name: str, cu: torch.Tensor, entry: _GraphBuffer) -> None:
    version = version_of(cu)
    if version is not None and version != entry.version:
        raise RuntimeError(
            f"{name} was written after mla_ops.plan_cuda_graph(...) planned it; call mla_ops.plan_cuda_graph "
            "again after writing new offsets into the graph's buffers (and before each replay)"
        )


# --- the backend ------------------------------------------------------------------------------------


class FlashInferBackend(PrefillBackend):
    """MLA prefill with FlashInfer's ragged-KV batch prefill wrapper (fa3 / cutlass / fa2 kernels).

    Args:
        library: the ``flashinfer`` module to call; by default it is imported on first use.
        workspace_bytes: the float workspace per device; by default :func:`workspace_bytes_from_env`.
        capability: the compute capability to choose kernels for, instead of the tensors' device's
            (tests simulate GPUs with it).
    """

    name = "FLASHINFER"
    plans_on_host = True

    def __init__(
        self,
        library: Any = None,
        *,
        workspace_bytes: int | None = None,
        capability: DeviceCapability | None = None,
    ) -> None:
        self._library = library
        self._library_problem = api_problem(library) if library is not None else None
        self._imported = library is not None
        self._workspace_bytes = workspace_bytes
        self._forced_capability = capability
        self._workspaces: dict[torch.device, torch.Tensor] = {}
        self._capabilities: dict[torch.device, DeviceCapability | None] = {}
        self._built_modules: set[tuple[str, torch.dtype, int, int]] = set()
        self._batches: OrderedDict[tuple, _BatchPlans] = OrderedDict()
        # The plans of versioned offsets by one flat key (see attention()); a subset of _batches' plans,
        # emptied whenever one of those is dropped, with the key of the batch each belongs to.
        self._hot: dict[tuple, tuple[_EagerPlan, tuple]] = {}
        self._pool: dict[tuple[torch.device, str], list[Any]] = {}
        self._buffers: dict[int, _GraphBuffer] = {}
        self._generation = 0
        self._graph_wrappers: dict[tuple, _GraphWrapper] = {}
        self._warned_unversioned = False
        # FlashInfer's trtllm-gen DeepSeek kernel (SM100, eager calls): probed once the library is imported.
        self._trtllm: Any = None
        self._trtllm_problem: str | None = None
        self._trtllm_probed = False
        self._trtllm_workspaces: TrtllmWorkspaces | None = None
        #: How many times this backend has called a wrapper's ``plan()``.
        self.plan_count = 0

    # --- library --------------------------------------------------------------------------------

    def _flashinfer(self) -> Any:
        """The library module; raises ``RuntimeError`` saying why it cannot be used."""
        if not self._imported:
            self._library, self._library_problem = _import_flashinfer()
            self._imported = True
        if self._library is None or self._library_problem is not None:
            raise RuntimeError(f"FLASHINFER MLA prefill backend is unavailable: {self._library_problem}")
        return self._library

    def version(self) -> str | None:
        """The FlashInfer version in use, or ``None`` when it cannot be used."""
        try:
            return str(getattr(self._flashinfer(), "__version__", "unknown"))
        except RuntimeError:
            return None

    def trtllm(self) -> Any:
        """``flashinfer.prefill.trtllm_ragged_attention_deepseek``, or ``None`` where the installed FlashInfer
        lacks it (or cannot be used; :meth:`trtllm_problem` says why)."""
        if not self._trtllm_probed:
            try:
                library = self._flashinfer()
            except RuntimeError:
                return None
            self._trtllm, self._trtllm_problem = trtllm_function(library)
            self._trtllm_probed = True
        return self._trtllm

    def trtllm_problem(self) -> str | None:
        """Why :meth:`trtllm` is ``None`` (``None`` when it is not)."""
        if self.trtllm() is not None:
            return None
        return self._trtllm_problem or self._library_problem

    def eager_kernel(
        self, capability: DeviceCapability | None, head_dim_qk: int, head_dim_vo: int, dtype: torch.dtype
    ) -> str:
        """The kernel an eager call of ``(dtype, Dqk, Dv)`` runs on ``capability``: ``"trtllm-gen"`` where that
        kernel serves it (:func:`.flashinfer_trtllm.trtllm_serves`) and the installed FlashInfer has it, else
        the ragged wrapper's :func:`choose_kernel`."""
        if trtllm_serves(capability, head_dim_qk, head_dim_vo, dtype) and self.trtllm() is not None:
            return TRTLLM_KERNEL
        return choose_kernel(capability, head_dim_qk, head_dim_vo)

    def library_reasons(self, capability: DeviceCapability | None, config: SelectorConfig) -> list[str]:
        try:
            self._flashinfer()
        except RuntimeError:
            return [str(self._library_problem)]
        return []

    def head_dim_reasons(self, head_dim_qk: int, head_dim_v: int, capability: DeviceCapability | None) -> list[str]:
        pair = (head_dim_qk, head_dim_v)
        if pair in SUPPORTED_HEAD_DIMS:
            return []
        return [
            f"head dims (Dqk, Dv) = {pair} have no FlashInfer ragged prefill kernel: fa2/fa3 are built for "
            "Dqk == Dv in (64, 128, 256) and for DeepSeek's (192, 128)"
        ]

    def describe(self, capability: DeviceCapability | None, config: SelectorConfig) -> str:
        version = self.version()
        if version is None:
            return f"unavailable: {self._library_problem}"
        head = f"flashinfer {version} BatchPrefillWithRaggedKVCacheWrapper"
        if capability is None:
            text = f"{head}; backend fa3 on SM90, cutlass on SM100 (heads {sorted(CUTLASS_HEAD_DIMS)}), else fa2; "
            if self.trtllm() is None:
                return text + f"trtllm-gen unavailable: {self.trtllm_problem()}"
            return text + f"eager bf16 calls on SM100 run trtllm_ragged_attention_deepseek ({_TRTLLM_UNTESTED})"
        dqk, dv = config.head_dim_qk, config.head_dim_v
        eager = self.eager_kernel(capability, dqk, dv, config.dtype)
        graph = choose_kernel(capability, dqk, dv, cuda_graph=True)
        where = f"SM{capability.major}{capability.minor}"
        if eager == TRTLLM_KERNEL:
            return (
                f"flashinfer {version} prefill.trtllm_ragged_attention_deepseek (trtllm-gen) on {where}, "
                f"{_TRTLLM_UNTESTED}; BatchPrefillWithRaggedKVCacheWrapper backend {graph} in CUDA graphs"
            )
        text = f"{head}, backend {eager} on {where}"
        text += f" ({graph} in CUDA graphs)" if graph != eager else ""
        if trtllm_serves(capability, dqk, dv, config.dtype):
            text += f"; trtllm-gen unavailable: {self.trtllm_problem()}"
        return text

    # --- device state -----------------------------------------------------------------------------

    def _capability(self, device: torch.device) -> DeviceCapability | None:
        if self._forced_capability is not None:
            return self._forced_capability
        cap = self._capabilities.get(device)
        if cap is None and device not in self._capabilities:
            cap = self._capabilities[device] = DeviceCapability.of(device)
        return cap

    def workspace_bytes(self) -> int:
        """The size of the float workspace each device gets."""
        if self._workspace_bytes is None:
            self._workspace_bytes = workspace_bytes_from_env()
        return self._workspace_bytes

    def _workspace(self, device: torch.device) -> torch.Tensor:
        buffer = self._workspaces.get(device)
        if buffer is None:
            buffer = self._workspaces[device] = torch.empty(self.workspace_bytes(), dtype=torch.uint8, device=device)
        return buffer

    def _new_wrapper(self, device: torch.device, kernel: str, **graph_buffers: Any) -> Any:
        fi = self._flashinfer()
        if kernel == TRTLLM_KERNEL:  # eager calls only: choose_kernel never picks it for CUDA graphs
            if self._trtllm_workspaces is None:
                self._trtllm_workspaces = TrtllmWorkspaces(self.workspace_bytes())
            return TrtllmRaggedWrapper(self.trtllm(), self._trtllm_workspaces, device)
        if graph_buffers:
            return fi.BatchPrefillWithRaggedKVCacheWrapper(
                self._workspace(device), "NHD", use_cuda_graph=True, backend=kernel, **graph_buffers
            )
        return fi.BatchPrefillWithRaggedKVCacheWrapper(self._workspace(device), "NHD", backend=kernel)

    def _plan(
        self,
        wrapper: Any,
        kernel: str,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        cfg: _LayerConfig,
        warn_build: bool = True,
    ) -> None:
        """``wrapper.plan`` with host offsets; warns before the first just-in-time build of a module."""
        module_key = (kernel, cfg.dtype, cfg.head_dim_qk, cfg.head_dim_vo)
        first = module_key not in self._built_modules
        if first and warn_build:
            logger.warning(
                "FlashInfer loads or builds its %s prefill kernel for %s, Dqk=%d, Dv=%d on first use; a build "
                "from scratch can take minutes. `python -m mla_ops warmup` builds the kernels ahead of time.",
                kernel,
                dtype_name(cfg.dtype),
                cfg.head_dim_qk,
                cfg.head_dim_vo,
            )
        start = time.perf_counter()
        device = wrapper.device
        # The planner sizes its schedule by the current device's SM count.
        with on_device(device):
            try:
                wrapper.plan(
                    qo_indptr,
                    kv_indptr,
                    cfg.num_heads,
                    cfg.num_heads,
                    cfg.head_dim_qk,
                    head_dim_vo=cfg.head_dim_vo,
                    causal=cfg.causal,
                    sm_scale=cfg.softmax_scale,
                    q_data_type=cfg.dtype,
                    kv_data_type=cfg.dtype,
                    o_data_type=cfg.dtype,
                )
            except RuntimeError as exc:
                if "workspace" in str(exc).lower():
                    raise RuntimeError(
                        f"FlashInfer's plan ran out of workspace ({self.workspace_bytes() >> 20} MiB per device): "
                        f"{exc}. Set {WORKSPACE_ENV} to a larger size, in MiB, before the first call"
                    ) from exc
                raise
        self.plan_count += 1
        if first:
            self._built_modules.add(module_key)
            logger.info("FlashInfer %s prefill kernel ready after %.1f s", kernel, time.perf_counter() - start)

    # --- eager calls ------------------------------------------------------------------------------

    def _acquire_wrapper(self, device: torch.device, kernel: str) -> Any:
        pool = self._pool.get((device, kernel))
        return pool.pop() if pool else self._new_wrapper(device, kernel)

    def _recycle(self, plan: _EagerPlan) -> None:
        if plan.wrapper is not None:
            pool = self._pool.setdefault((plan.wrapper.device, plan.kernel), [])
            if len(pool) < MAX_POOLED_WRAPPERS:
                pool.append(plan.wrapper)

    def _make_eager_plan(self, call: _Call, host: torch.Tensor) -> _EagerPlan:
        q, k, _, _, cu_k, max_seqlen_q, max_seqlen_k, cfg = call
        host_q = host[0]
        host_k = host_q if cu_k is None else host[1]
        if cu_k is None:
            check_cu_seqlens_values("mla.prefill", host_q, q.shape[0], max_seqlen_q, "cu_seqlens")
        else:
            check_cu_seqlens_values("mla.prefill_context_chunk", host_q, q.shape[0], max_seqlen_q, "cu_seqlens_q")
            check_cu_seqlens_values("mla.prefill_context_chunk", host_k, k.shape[0], max_seqlen_k, "cu_seqlens_k")
        num_rows = int(host_q[-1])
        if num_rows == 0 or int(host_k[-1]) == 0:
            return _EagerPlan(None, "", num_rows, host, cu_k)
        kernel = self.eager_kernel(self._capability(q.device), cfg.head_dim_qk, cfg.head_dim_vo, cfg.dtype)
        if kernel == "cutlass" and cutlass_work_items(host_q, cfg.num_heads) > CUTLASS_MAX_WORK_ITEMS:
            kernel = "fa2"
        wrapper = self._acquire_wrapper(q.device, kernel)
        self._plan(wrapper, kernel, host_q, host_k, cfg)
        return _EagerPlan(wrapper, kernel, num_rows, host, cu_k)

    def _eager_plan_for(self, call: _Call) -> _EagerPlan:
        cu_q, cu_k, cfg = call.cu_q, call.cu_k, call.cfg
        batch_key = _offsets_key(cu_q)
        plan_key = (cfg, None if cu_k is None else _offsets_key(cu_k))
        group = self._batches.get(batch_key)
        plan = None
        if group is not None:
            self._batches.move_to_end(batch_key)
            plan = group.plans.get(plan_key)
        unversioned = batch_key[2] is None or (plan_key[1] is not None and plan_key[1][2] is None)
        if plan is not None and not unversioned:
            return plan
        host = _read_offsets(cu_q, cu_k)
        if plan is not None:
            if torch.equal(host, plan.host_offsets):
                return plan
            del group.plans[plan_key]  # before its wrapper can be handed out again
            self._hot.clear()
            self._recycle(plan)
        if unversioned and not self._warned_unversioned:
            self._warned_unversioned = True
            logger.warning(
                "FLASHINFER: cu_seqlens was created under torch.inference_mode() and has no version counter, so "
                "in-place rewrites cannot be detected cheaply; the offsets are read on the host (a device sync) "
                "at every call. Allocate offsets tensors outside inference mode to plan once per batch."
            )
        plan = self._make_eager_plan(call, host)
        if group is None:
            group = self._batches[batch_key] = _BatchPlans(cu_q)
            while len(self._batches) > MAX_CACHED_BATCHES:
                _, evicted = self._batches.popitem(last=False)
                self._hot.clear()
                for old in evicted.plans.values():
                    self._recycle(old)
        group.plans[plan_key] = plan
        if not unversioned:
            self._hot[_hot_key(cu_q, cu_k, cfg)] = (plan, batch_key)
        return plan

    def _run_eager(self, call: _Call) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self._eager_plan_for(call)
        q, k, v, _, cu_k, _, _, cfg = call
        out, lse = _empty_outputs(q, cfg.head_dim_vo)
        num_tokens, n = q.shape[0], plan.num_rows
        if n < num_tokens or plan.wrapper is None:
            # Padding rows (and rows without keys) are unspecified by contract; zero and -inf keep NaN
            # garbage out of anything downstream. Costs two small fills, and only for padded batches.
            start = n if plan.wrapper is not None else 0
            out[start:].zero_()
            lse[:, start:].fill_(-math.inf)
        if plan.wrapper is None:
            return out, lse
        if n < num_tokens:
            q = q[:n]
            if cu_k is None:
                k, v = k[:n], v[:n]
            _run(plan.wrapper, q, k, v, out[:n], lse[:, :n], plan)
        else:
            _run(plan.wrapper, q, k, v, out, lse, plan)
        return out, lse

    # --- CUDA graphs ------------------------------------------------------------------------------

    def plan_cuda_graph(self, cu_seqlens: torch.Tensor, cu_seqlens_k: Sequence[torch.Tensor]) -> None:
        """Register the graph's offsets buffers, and re-plan every graph wrapper that reads one of them
        with the offsets they now hold (a host read, only where such wrappers exist)."""
        self._generation += 1
        for cu in (cu_seqlens, *cu_seqlens_k):
            self._buffers[cu.data_ptr()] = _GraphBuffer(cu, version_of(cu), self._generation)
        planned = {cu.data_ptr() for cu in (cu_seqlens, *cu_seqlens_k)}
        for gw in self._graph_wrappers.values():
            if gw.offsets_q.data_ptr() not in planned and gw.offsets_k.data_ptr() not in planned:
                continue
            entry_q, entry_k = self._registered(gw.offsets_q), self._registered(gw.offsets_k)
            if entry_q is not None and entry_k is not None:
                self._plan_graph_wrapper(gw, entry_q, entry_k)

    def release_cuda_graph_state(self) -> None:
        self._buffers.clear()
        self._graph_wrappers.clear()

    def _registered(self, cu: torch.Tensor) -> _GraphBuffer | None:
        entry = self._buffers.get(cu.data_ptr())
        if entry is None or entry.offsets.device != cu.device or entry.offsets.numel() != cu.numel():
            return None
        return entry

    @staticmethod
    def _host(name: str, entry: _GraphBuffer) -> torch.Tensor:
        if entry.host is None:
            entry.host = entry.offsets.cpu()
            check_offsets_start_and_order("plan_cuda_graph", name, entry.host)
        return entry.host

    def _plan_graph_wrapper(self, gw: _GraphWrapper, entry_q: _GraphBuffer, entry_k: _GraphBuffer) -> None:
        host_q = self._host("cu_seqlens", entry_q)
        host_k = self._host("cu_seqlens_k", entry_k)
        if int(host_q[-1]) > gw.num_rows:
            raise ValueError(
                f"cu_seqlens ends at {int(host_q[-1])} but the graph's token budget (q.shape[0] at warm-up) is "
                f"{gw.num_rows}; keep cu_seqlens[-1] <= {gw.num_rows}"
            )
        if int(host_k[-1]) > gw.num_kv_rows:
            raise ValueError(
                f"cu_seqlens_k ends at {int(host_k[-1])} but the chunk buffers hold {gw.num_kv_rows} tokens; "
                f"keep cu_seqlens_k[-1] <= {gw.num_kv_rows}"
            )
        if gw.offsets_q.is_cuda:  # let any pending copy out of the wrapper's pinned buffer finish first
            torch.cuda.current_stream(gw.offsets_q.device).synchronize()
        # One extra sequence owns the rows [cu_seqlens[-1], T) with no keys: FlashInfer's run() needs
        # qo_indptr[-1] == q.shape[0], and the fa2/fa3 kernels write 0 and an LSE of -inf for such rows.
        budget = torch.tensor([gw.num_rows], dtype=torch.int32)
        qo_indptr = torch.cat((host_q, budget))
        kv_indptr = torch.cat((host_k, host_k[-1:]))
        self._plan(gw.wrapper, gw.kernel, qo_indptr, kv_indptr, gw.cfg)
        gw.generation = (entry_q.generation, entry_k.generation)

    def _new_graph_wrapper(
        self, q: torch.Tensor, k: torch.Tensor, entry_q: _GraphBuffer, entry_k: _GraphBuffer, cfg: _LayerConfig
    ) -> _GraphWrapper:
        device = q.device
        kernel = choose_kernel(self._capability(device), cfg.head_dim_qk, cfg.head_dim_vo, cuda_graph=True)
        batch = entry_q.offsets.numel() + 1  # B sequences + the padding sequence, plus one
        wrapper = self._new_wrapper(
            device,
            kernel,
            qo_indptr_buf=torch.zeros(batch, dtype=torch.int32, device=device),
            kv_indptr_buf=torch.zeros(batch, dtype=torch.int32, device=device),
        )
        return _GraphWrapper(wrapper, kernel, cfg, entry_q.offsets, entry_k.offsets, q.shape[0], k.shape[0])

    def _run_graph(
        self, call: _Call, entry_q: _GraphBuffer, entry_k: _GraphBuffer, capturing: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, cu_q, cu_k, _, _, cfg = call
        _check_unchanged("cu_seqlens" if cu_k is None else "cu_seqlens_q", cu_q, entry_q)
        if cu_k is not None:
            _check_unchanged("cu_seqlens_k", cu_k, entry_k)
        key = (q.device, entry_q.offsets.data_ptr(), entry_k.offsets.data_ptr(), q.shape[0], k.shape[0], cfg)
        gw = self._graph_wrappers.get(key)
        generation = (entry_q.generation, entry_k.generation)
        if capturing:
            if gw is None or gw.generation != generation:
                raise _capture_error(
                    f"no FlashInfer graph wrapper is planned for this call (H={cfg.num_heads}, "
                    f"Dqk={cfg.head_dim_qk}, Dv={cfg.head_dim_vo}, {dtype_name(cfg.dtype)}, causal={cfg.causal}, "
                    f"token budget {q.shape[0]}); the eager warm-up call after mla_ops.plan_cuda_graph creates it"
                )
        elif gw is None:
            gw = self._new_graph_wrapper(q, k, entry_q, entry_k, cfg)
            self._plan_graph_wrapper(gw, entry_q, entry_k)
            self._graph_wrappers[key] = gw
        elif gw.generation != generation:
            self._plan_graph_wrapper(gw, entry_q, entry_k)
        out, lse = _empty_outputs(q, cfg.head_dim_vo)
        _run(gw.wrapper, q, k, v, out, lse)
        return out, lse

    # --- execution --------------------------------------------------------------------------------

    def _hot_plan(
        self, q: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor | None, softmax_scale: float,
        causal: bool,
    ) -> _EagerPlan | None:  # fmt: skip
        """The plan of the common eager call, or ``None``: a batch planned before (for an earlier layer)
        with offsets that were not written since, no graph buffers registered, no capture. One flat
        lookup, no record built; anything else (a miss, a padded batch, an empty one) takes
        :meth:`_attention_unplanned`."""
        if self._buffers or is_capturing():
            return None
        num_tokens, num_heads, head_dim_qk = q.shape
        cfg = (num_heads, head_dim_qk, v.shape[2], q.dtype, float(softmax_scale), causal)
        hot = self._hot.get(_hot_key(cu_q, cu_k, cfg))
        if hot is None:
            return None
        plan, batch_key = hot
        if plan.num_rows != num_tokens or plan.wrapper is None:
            return None
        self._batches.move_to_end(batch_key)
        return plan

    def attention(self, call: VarlenCall) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal = call
        cu_k = None if causal else cu_seqlens_k  # causal: the new tokens over themselves, one offsets tensor
        plan = self._hot_plan(q, v, cu_seqlens_q, cu_k, softmax_scale, causal)
        if plan is not None:
            out, lse = _empty_outputs(q, v.shape[2])
            _run(plan.wrapper, q, k, v, out, lse, plan)
            return out, lse
        return self._attention_unplanned(q, k, v, cu_seqlens_q, cu_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal)

    def _attention_unplanned(self, q, k, v, cu_seqlens_q, cu_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
        """:meth:`attention` past the hot plan: a first call of a batch, a padded or empty one, graphs."""
        num_tokens, num_heads, head_dim_qk = q.shape
        cfg = _LayerConfig(num_heads, head_dim_qk, v.shape[-1], q.dtype, float(softmax_scale), causal)
        if num_tokens == 0:
            return _empty_outputs(q, cfg.head_dim_vo)
        call = _Call(q, k, v, cu_seqlens_q, cu_k, max_seqlen_q, max_seqlen_k, cfg)
        capturing = is_capturing()
        entry_q = self._registered(cu_seqlens_q)
        if entry_q is not None:
            entry_k = entry_q if cu_k is None else self._registered(cu_k)
            if entry_k is not None:
                return self._run_graph(call, entry_q, entry_k, capturing)
            if capturing:
                raise _capture_error("this context chunk's cu_seqlens_k is not registered for CUDA graphs")
        elif capturing:
            name = "cu_seqlens" if cu_k is None else "cu_seqlens_q"
            raise _capture_error(f"{name} is not registered for CUDA graphs")
        return self._run_eager(call)

    def attention_for_merge(self, call: VarlenCall) -> tuple[torch.Tensor, torch.Tensor, bool]:
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal = call
        # The common eager call hands FlashInfer's base-2 [T, H] LSE over as an [H, T] view: the merge
        # converts it as it reads it, so the transpose-and-scale kernel of attention() is not launched.
        cu_k = None if causal else cu_seqlens_k
        plan = self._hot_plan(q, v, cu_seqlens_q, cu_k, softmax_scale, causal)
        if plan is None:
            out, lse = self._attention_unplanned(
                q, k, v, cu_seqlens_q, cu_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal
            )
            return out, lse, False
        out = empty((q.shape[0], q.shape[1], v.shape[2]), q.dtype, q.device)
        return out, _run_base2(plan.wrapper, q, k, v, out, plan).t(), True

    # --- warm-up ----------------------------------------------------------------------------------

    def warmup(self, device: torch.device, config: SelectorConfig, num_heads: int) -> None:
        """Load or build FlashInfer's kernels for ``config`` (causal and not) with tiny inputs.

        Builds the kernel used eagerly and, where it differs, the one used in CUDA graphs. Logs
        progress on the ``mla_ops`` logger.
        """
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # tensors name their index: share their workspace
            device = torch.device("cuda", torch.cuda.current_device())
        cap = self._capability(device)
        reasons = self.reasons(cap, config)
        if reasons:
            raise ValueError(f"FLASHINFER cannot serve {config!r} on {device}: {reasons}")
        dqk, dv = config.head_dim_qk, config.head_dim_v
        eager = self.eager_kernel(cap, dqk, dv, config.dtype)
        kernels = dict.fromkeys((eager, choose_kernel(cap, dqk, dv, cuda_graph=True)))
        lengths = torch.tensor([0, 3, 8], dtype=torch.int32)
        gen = torch.Generator().manual_seed(0)
        q, k = (torch.randn(8, num_heads, dqk, generator=gen).to(device, config.dtype) for _ in range(2))
        v = torch.randn(8, num_heads, dv, generator=gen).to(device, config.dtype)
        for kernel in kernels:
            wrapper = self._new_wrapper(device, kernel)
            for causal in (True, False):
                logger.info(
                    "warming up FlashInfer %s (%s, Dqk=%d, Dv=%d, causal=%s)", kernel, config.dtype, dqk, dv, causal
                )
                start = time.perf_counter()
                cfg = _LayerConfig(num_heads, dqk, dv, config.dtype, 1.0 / math.sqrt(dqk), causal)
                self._plan(wrapper, kernel, lengths, lengths, cfg, warn_build=False)
                out, lse = _empty_outputs(q, dv)
                with on_device(device):  # as the ops run attention(): on the tensors' device
                    _run(wrapper, q, k, v, out, lse)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                logger.info("FlashInfer %s ready (causal=%s) in %.1f s", kernel, causal, time.perf_counter() - start)
