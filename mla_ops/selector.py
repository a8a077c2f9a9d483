"""Device-capability selector for MLA prefill backends.

The priority lists per capability family, the override (``set_prefill_backend``, ``prefill_backend``,
``MLA_OPS_PREFILL_BACKEND``), the batch-invariant mode (``set_batch_invariant``, ``batch_invariant``,
``MLA_OPS_BATCH_INVARIANT``), cached selection (:func:`select_backend`) and per-call routing
(:func:`route_checked`, :func:`route_call`, :func:`route_fused`, :func:`route`, :func:`backend_for`), with
``in_graph`` for CUDA-graph trees. Where a cost table ranks the backends of a configuration
(:mod:`mla_ops.cost_table`), a call's route depends on its size class too (:class:`SizedRoute`).
:func:`backend_installed` swaps in another backend instance for tests. The capability is an argument
everywhere, so any GPU's rules can be computed on a machine without one.
Design: docs/design/backends.md (Selection, Size classes).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterable, Iterator

import torch

from . import cost_table, invariance, native
from .backends.base import PrefillBackend, VarlenCall
from .backends.flashinfer_trtllm import trtllm_serves
from .backends.registry import PrefillBackendEnum, replace_backend
from .meta.checks import AttentionSizes
from .specs import DeviceCapability, MLADimensions, SelectorConfig

logger = logging.getLogger("mla_ops")

#: Environment variable naming a backend to use instead of automatic selection (on CUDA devices).
ENV_VAR = "MLA_OPS_PREFILL_BACKEND"

B = PrefillBackendEnum

# Orders follow measurements where we have them; README's performance section cites the figures and a
# benchmark that disagrees changes the order. SM90: benchmarks/results/h200/results.md at commit 8fe6e83 (2026-12-01):
# FLASHINFER (fa3) was fastest on 14 of the 25 attention shapes and FLASH_ATTN through FlashAttention-4
# on the other 11; FLASH_ATTN through FlashAttention-4 beat TRITON on 21 of 25. Through a
# FlashAttention-2 that pads v (PyTorch's bundled kernel) FLASH_ATTN ran at about half TRITON's speed
# (the 2026-11-30 run), so on SM90 it then ranks after TRITON (see _ranked_here).
_SM90 = [B.FLASHINFER, B.FLASH_ATTN, B.TRITON]
# Not measured here: flash-attn's FA2 is the usual leader on Ampere/Ada, FlashInfer fa2 next.
_SM80 = [B.FLASH_ATTN, B.FLASHINFER, B.TRITON]
# SM100: not measured by this project (no Blackwell GPU); the orders follow the seed
# (_get_mla_prefill_backend_priorities: FLASH_ATTN, TRTLLM_RAGGED, FLASHINFER for (192, 128) heads;
# TRTLLM_RAGGED, FLASH_ATTN, FLASHINFER for the (192, 64, 256) configuration, i.e. (256, 256) heads) and
# the published figures that agree with it: vLLM made FlashAttention-4 its default MLA prefill on SM100,
# its B200 comparison gives an 8k prefill in 0.415 ms with FA4 against 0.555 ms with FlashInfer, and FA4
# reports 1441 TFLOP/s at (192, 128) on B200. The seed's TRTLLM_RAGGED is FlashInfer's
# trtllm_ragged_attention_deepseek, which this package runs as the FLASHINFER backend's SM100 kernel
# (backends/flashinfer_trtllm.py); the seed's TOKENSPEED_MLA is outside the package's libraries.
_SM100 = [B.FLASH_ATTN, B.FLASHINFER, B.TRITON]
# (256, 256) heads: FLASHINFER first where it runs the trtllm-gen kernel (bf16 only; _ranked_here demotes
# it where the installed FlashInfer lacks that kernel), FLASH_ATTN first otherwise.
_SM100_WIDE_HEADS = [B.FLASHINFER, B.FLASH_ATTN, B.TRITON]
_SM100_WIDE_HEADS_NO_TRTLLM = [B.FLASH_ATTN, B.FLASHINFER, B.TRITON]
_WIDE_HEAD_DIMS = (256, 256)

#: Where each family's order comes from, as ``info`` prints it.
_EVIDENCE_SM90 = (
    "measured by this project on an H200 (benchmarks/results/h200/results.md at commit 8fe6e83, 2026-12-01): "
    "FLASHINFER (fa3) fastest on 14 of 25 attention shapes, FLASH_ATTN (FlashAttention-4) on the other 11"
)
_EVIDENCE_SM80 = "not measured by this project: FlashAttention-2 is the usual leader on Ampere/Ada"
_EVIDENCE_SM100 = (
    "the seed's order (FLASH_ATTN, TRTLLM_RAGGED, FLASHINFER; TRTLLM_RAGGED's kernel, FlashInfer's "
    "trtllm_ragged_attention_deepseek, runs inside FLASHINFER here) and published data, not measured by this "
    "project (no Blackwell GPU has run any backend here): vLLM's SM100 default MLA prefill is FlashAttention-4, "
    "its B200 8k prefill 0.415 ms with FA4 vs 0.555 ms with FlashInfer; FA4 reports 1441 TFLOP/s at (192, 128) "
    "on B200"
)
_EVIDENCE_SM100_WIDE = (
    "the seed's order for its (192, 64, 256) configuration: TRTLLM_RAGGED, FLASH_ATTN, FLASHINFER. TRTLLM_RAGGED "
    "is FlashInfer's trtllm_ragged_attention_deepseek, which FLASHINFER runs here in bf16 only (FLASH_ATTN leads "
    "where it does not run). Not measured by this project (no Blackwell GPU has run any backend here)"
)

_FAMILIES = "SM80/SM86/SM89 (Ampere, Ada), SM90 (Hopper) and SM100 (Blackwell)"


def backend_priorities(capability: DeviceCapability | None, config: SelectorConfig) -> list[PrefillBackendEnum]:
    """The backends to try, best first, for a device (``None`` for CPU) and ``config``.

    Only ``(Dqk, Dv)`` of the dimensions matter. Returns an empty list for a CUDA capability outside
    the supported families; :func:`unsupported_platform_reason` says why.
    """
    if capability is None:
        return [B.REFERENCE]
    if capability.major == 10:
        if (config.head_dim_qk, config.head_dim_v) != _WIDE_HEAD_DIMS:
            return list(_SM100)
        trtllm = trtllm_serves(capability, config.head_dim_qk, config.head_dim_v, config.dtype)
        return list(_SM100_WIDE_HEADS if trtllm else _SM100_WIDE_HEADS_NO_TRTLLM)
    if capability == DeviceCapability(9, 0):
        return list(_SM90)
    if capability.major == 8:
        return list(_SM80)
    return []


def order_evidence(capability: DeviceCapability | None, config: SelectorConfig) -> str | None:
    """Where the priority order for ``capability`` and ``config`` comes from (``None``: CPU or no order)."""
    if capability is None:
        return None
    if capability.major == 10:
        wide = (config.head_dim_qk, config.head_dim_v) == _WIDE_HEAD_DIMS
        return _EVIDENCE_SM100_WIDE if wide else _EVIDENCE_SM100
    if capability == DeviceCapability(9, 0):
        return _EVIDENCE_SM90
    if capability.major == 8:
        return _EVIDENCE_SM80
    return None


def _ranked_here(
    priorities: list[PrefillBackendEnum], capability: DeviceCapability | None, config: SelectorConfig
) -> list[PrefillBackendEnum]:
    """``priorities`` as this machine's libraries rank them: on SM90, FLASH_ATTN moves after TRITON when
    the FlashAttention it would run here pads ``v`` (FlashAttention-2), which measured half TRITON's speed;
    on SM100, FLASHINFER leaves the first place to FLASH_ATTN for (256, 256) heads when the installed
    FlashInfer lacks the trtllm-gen kernel that earns it that place."""
    if capability is not None and capability.major == 10 and priorities[:2] == [B.FLASHINFER, B.FLASH_ATTN]:
        try:
            kernel = B.FLASHINFER.backend().eager_kernel(
                capability, config.head_dim_qk, config.head_dim_v, config.dtype
            )
        except Exception:  # a probe of the installed libraries reports, never raises; validation says why
            kernel = None
        if kernel != "trtllm-gen":
            return [B.FLASH_ATTN, B.FLASHINFER, *priorities[2:]]
        return priorities
    if capability is None or capability.major != 9 or B.FLASH_ATTN not in priorities or B.TRITON not in priorities:
        return priorities
    try:
        pads = B.FLASH_ATTN.backend().pads_v(capability, config)
    except Exception:  # a probe of the installed libraries reports, never raises; validation says why
        pads = False
    if not pads or priorities.index(B.FLASH_ATTN) > priorities.index(B.TRITON):
        return priorities
    ranked = [b for b in priorities if b is not B.FLASH_ATTN]
    ranked.insert(ranked.index(B.TRITON) + 1, B.FLASH_ATTN)
    return ranked


def unsupported_platform_reason(capability: DeviceCapability) -> str:
    """Why ``capability`` has no priority list, and what to do about it."""
    return (
        f"no MLA prefill backend priority list for compute capability {capability}; "
        f"automatic selection covers {_FAMILIES}. Set {ENV_VAR} to force a backend that is valid here"
    )


def validate_backend(
    member: PrefillBackendEnum, capability: DeviceCapability | None, config: SelectorConfig
) -> tuple[PrefillBackend | None, list[str]]:
    """Load ``member`` and validate it: ``(instance or None, reasons)``; empty reasons mean valid."""
    try:
        backend = member.backend()
    except ImportError as exc:
        return None, [f"ImportError: {exc}"]
    return backend, backend.reasons(capability, config)


# --- explicit override --------------------------------------------------------------------------

_override: PrefillBackendEnum | None = None


def _coerce(name: str | PrefillBackendEnum, where: str = "set_prefill_backend") -> PrefillBackendEnum:
    if isinstance(name, PrefillBackendEnum):
        return name
    if not isinstance(name, str):
        choices = ", ".join(repr(member.name) for member in PrefillBackendEnum)
        raise TypeError(
            f"{where}: name must be a backend name ({choices}), a PrefillBackendEnum member or None, "
            f"got {type(name).__name__} {name!r:.40}"
        )
    return PrefillBackendEnum.from_name(name)


def current_override() -> PrefillBackendEnum | None:
    """The backend forced by the Python API or, failing that, by ``MLA_OPS_PREFILL_BACKEND``.

    Raises ``ValueError`` naming the choices when the environment variable names no backend.
    """
    if _override is not None:
        return _override
    return env_override()


def env_override() -> PrefillBackendEnum | None:
    """The backend ``MLA_OPS_PREFILL_BACKEND`` names, or ``None`` where it is unset; raises ``ValueError``
    naming the variable and the choices where it names no backend."""
    name = os.environ.get(ENV_VAR, "").strip()
    if not name:
        return None
    try:
        return PrefillBackendEnum.from_name(name)
    except ValueError as exc:
        raise ValueError(f"{ENV_VAR}={name!r}: {exc}") from None


def set_prefill_backend(name: str | PrefillBackendEnum | None) -> None:
    """Force every later call on a CUDA device onto backend ``name`` (``None``: automatic selection).

    The backend is validated when an op first meets a configuration; if it is invalid there the op
    raises ``ValueError`` rather than falling back. CPU tensors run REFERENCE whatever is forced.
    """
    global _override
    _override = None if name is None else _coerce(name)
    clear_cache()


@contextlib.contextmanager
def prefill_backend(name: str | PrefillBackendEnum) -> Iterator[None]:
    """Context manager form of :func:`set_prefill_backend`; restores the previous setting on exit."""
    previous = _override
    if name is not None:
        _coerce(name, "prefill_backend")  # before the with block, so that the error names this function
    set_prefill_backend(name)
    try:
        yield
    finally:
        set_prefill_backend(previous)


@contextlib.contextmanager
def backend_installed(backend: PrefillBackend) -> Iterator[PrefillBackend]:
    """Make ``backend`` the process's instance of its registry entry for the ``with`` block.

    How tests run a backend around a stand-in library: ``backend_installed(FlashInferBackend(fake))``.
    """
    member = PrefillBackendEnum[backend.name]
    previous = replace_backend(member, backend)
    clear_cache()
    try:
        yield backend
    finally:
        replace_backend(member, previous)
        clear_cache()


# --- the batch-invariant mode --------------------------------------------------------------------------


def set_batch_invariant(on: bool | None) -> None:
    """Turn the batch-invariant mode on or off for every later call (``None``: ``MLA_OPS_BATCH_INVARIANT`` decides).

    In the mode each sequence's ``out`` and ``lse`` are bitwise the same whatever else is in its batch: routing
    ignores call sizes (one backend per device, dtype and head dims), only backends that guarantee it
    (``PrefillBackend.batch_invariant``) are chosen, and forcing another raises ``ValueError``.
    """
    if on is not None and not isinstance(on, bool):
        raise TypeError(f"set_batch_invariant: on must be True, False or None, got {type(on).__name__} {on!r:.40}")
    invariance.STATE.forced = on
    clear_cache()


@contextlib.contextmanager
def batch_invariant(on: bool = True) -> Iterator[None]:
    """Context manager form of :func:`set_batch_invariant`; restores the previous setting on exit."""
    previous = invariance.STATE.forced
    set_batch_invariant(on)
    try:
        yield
    finally:
        set_batch_invariant(previous)


# --- selection ----------------------------------------------------------------------------------


#: Why automatic selection inside CUDA-graph trees passes over a backend that plans on the host.
_IN_GRAPH_REASON = (
    "plans each batch on the host, which CUDA-graph trees (torch.compile mode='reduce-overhead') cannot do "
    "before their replays"
)

#: Why the batch-invariant mode passes over a backend.
_VARIANT_REASON = "does not guarantee batch-invariant results"


def _in_graph_override_error(name: str) -> ValueError:
    """The error for an override naming a host-planning backend, ``name``, inside CUDA-graph trees."""
    return ValueError(
        f"Selected MLA prefill backend {name} cannot run inside CUDA-graph trees: it {_IN_GRAPH_REASON}. "
        f"Clear the override (mla_ops.set_prefill_backend(None), {ENV_VAR} unset) and calls through "
        "mla_ops.prefill and mla_ops.prefill_context_chunk inside the graphs run the best backend that reads "
        f"the offsets on the device; or, to keep {name}, capture torch.cuda.CUDAGraph yourself and call "
        "mla_ops.plan_cuda_graph before capturing and before each replay"
    )


#: How many size classes (or pairs of them, for the fused op) a route remembers before it starts over.
_MAX_CLASSES = 4096


class SizedRoute:
    """The route of one configuration that a cost table ranks: a backend per size class, chosen once per class.

    ``fixed`` is the fixed order's choice (what :func:`route` and ``select_backend`` without ``size`` return);
    ``candidates`` the valid backends in that order; :meth:`for_sizes` the choice for given classes, the fused op's
    two parts summed, which :func:`route_call` looks up per call in ``chosen``.
    """

    def __init__(
        self, fixed: PrefillBackend, candidates: list[PrefillBackend], table: cost_table.CostTable, key: tuple
    ) -> None:
        self.fixed = fixed
        self.candidates = candidates
        self.table = table
        self.key = key
        self._names = [b.name for b in candidates]
        self._by_name = {b.name: b for b in candidates}
        #: The backend per size class met, by the class's fields (a plain tuple, as :func:`route_checked` builds
        #: it); the fused op's pairs of classes too.
        self.chosen: dict[tuple, PrefillBackend] = {}

    def _choose(self, sizes: tuple[tuple, ...]) -> PrefillBackend:
        """The backend with the least predicted time summed over ``sizes`` (the fixed choice where the table
        predicts no candidate): :class:`~mla_ops.cost_table.SizeClass` instances, or plain tuples of their fields,
        as the per-call routes build them (equal to the classes and hashed alike, so either keys ``chosen``)."""
        classes = tuple(size if type(size) is cost_table.SizeClass else cost_table.SizeClass(*size) for size in sizes)
        name = self.table.choose(self._names, self.key, classes)
        return self.fixed if name is None else self._by_name[name]

    def _remember(self, key: tuple, backend: PrefillBackend) -> PrefillBackend:
        if len(self.chosen) >= _MAX_CLASSES:
            self.chosen.clear()
        self.chosen[key] = backend
        return backend

    def for_sizes(self, sizes: tuple[tuple, ...]) -> PrefillBackend:
        """:meth:`_choose` for ``sizes`` (the fused op's two classes, or one; classes or their fields' plain
        tuples), cached under ``sizes``."""
        backend = self.chosen.get(sizes)
        return self._remember(sizes, self._choose(sizes)) if backend is None else backend

    def for_key(self, key: tuple) -> PrefillBackend:
        """The backend for one call whose :class:`~mla_ops.cost_table.SizeClass` has the fields ``key``, cached
        under ``key`` alone: the plain tuple that :func:`route_checked` builds and looks up in ``chosen``."""
        return self._remember(key, self._choose((key,)))

    def may_run(self) -> list[PrefillBackend]:
        """Every backend this route can choose: the fixed one and the candidates the table measured."""
        measured = self.table.measured(self.key)
        return [self.fixed, *(b for b in self.candidates if b.name in measured and b is not self.fixed)]


def select_backend(
    capability: DeviceCapability | None,
    config: SelectorConfig,
    *,
    in_graph: bool = False,
    size: cost_table.SizeClass | Iterable[cost_table.SizeClass] | None = None,
) -> PrefillBackend:
    """The backend to run ``config`` on a device of ``capability`` (``None`` for CPU).

    With ``in_graph=True``, the backend for a call inside torch.compile's CUDA-graph trees: automatic
    selection skips backends that plan on the host (``plans_on_host``). CPU always gets REFERENCE.
    ``size``: a call's :class:`~mla_ops.cost_table.SizeClass` (or the fused op's two), where the device's cost
    table ranks the backends; ``None``, or no table: the fixed order's choice.

    Raises ``ValueError`` if an explicit override is invalid or misspelt, or (``in_graph``) plans on the
    host, or (batch-invariant mode) does not guarantee invariance; if ``MLA_OPS_BATCH_INVARIANT`` is invalid;
    or if no backend is valid.
    """
    entry = _entry(capability, config, in_graph)
    if type(entry) is SizedRoute:
        if size is None:
            return entry.fixed
        sizes = (size,) if isinstance(size, cost_table.SizeClass) else tuple(size)
        return entry.for_sizes(sizes)
    return entry


def routing_entry(
    capability: DeviceCapability | None, config: SelectorConfig, in_graph: bool = False
) -> PrefillBackend | SizedRoute:
    """What the ops cache for ``config`` on ``capability``: a backend, or a :class:`SizedRoute` where a cost table
    ranks the candidates (not under an override, in the batch-invariant mode, on CPU or without a table)."""
    return _entry(capability, config, in_graph)


def _entry(capability: DeviceCapability | None, config: SelectorConfig, in_graph: bool) -> PrefillBackend | SizedRoute:
    override = current_override()
    invariant = invariance.resolve()
    if capability is not None and override is not None:
        backend, reasons = validate_backend(override, capability, config)
        if reasons:
            raise ValueError(
                f"Selected MLA prefill backend {override.name} is not valid for this configuration. Reason: {reasons}"
            )
        assert backend is not None
        if in_graph and backend.plans_on_host:
            raise _in_graph_override_error(override.name)
        if invariant and not backend.batch_invariant:
            raise ValueError(
                f"Selected MLA prefill backend {override.name} {_VARIANT_REASON}, which the batch-invariant mode "
                f"({invariance.ENV_VAR}=1 or mla_ops.batch_invariant()) asks for: select one that does "
                f"({', '.join(_invariant_names())}) or leave the mode"
            )
        logger.info("Using %s MLA prefill backend (explicit override).", override.name)
        return backend
    # CUDA-graph trees exist only on CUDA devices: CPU ignores in_graph, and caches one entry for both.
    return _auto_select(
        capability, config.dtype, config.head_dim_qk, config.head_dim_v, in_graph and capability is not None, invariant
    )


def _invariant_names() -> list[str]:
    names = []
    for member in PrefillBackendEnum:
        try:
            if member.backend_class().batch_invariant:
                names.append(member.name)
        except ImportError:
            continue
    return names


@functools.cache
def _auto_select(
    capability: DeviceCapability | None,
    dtype: torch.dtype,
    head_dim_qk: int,
    head_dim_v: int,
    in_graph: bool,
    invariant: bool,
) -> PrefillBackend | SizedRoute:
    config = SelectorConfig(dtype, MLADimensions.from_head_dims(head_dim_qk, head_dim_v))
    priorities = _ranked_here(backend_priorities(capability, config), capability, config)
    if not priorities:
        assert capability is not None
        raise ValueError(
            f"No valid MLA prefill backend found with {config!r}: {unsupported_platform_reason(capability)}."
        )
    # A table ranks the candidates only outside the batch-invariant mode (where a call's size must not change
    # its backend), and only where it measured this configuration; otherwise the first valid backend wins.
    table = None
    key = (str(dtype).removeprefix("torch."), head_dim_qk, head_dim_v)
    if capability is not None and not invariant:
        table = cost_table.table_for(capability)
        if table is not None and not table.covers(key):
            table = None
    candidates: list[PrefillBackend] = []
    all_reasons: dict[str, list[str]] = {}
    for member in priorities:
        backend, reasons = validate_backend(member, capability, config)
        if not reasons and in_graph and backend is not None and backend.plans_on_host:
            reasons = [f"{member.name} {_IN_GRAPH_REASON}"]
        if not reasons and invariant and backend is not None and not backend.batch_invariant:
            reasons = [f"{member.name} {_VARIANT_REASON}"]
        if reasons:
            all_reasons[member.name] = reasons
            continue
        assert backend is not None
        candidates.append(backend)
        if table is None:
            break  # the fixed order: the first valid backend wins, and the rest need no validation
    if not candidates:
        reasons_str = "{" + ", ".join(f"{name}: [{', '.join(r)}]" for name, r in all_reasons.items()) + "}"
        raise ValueError(f"No valid MLA prefill backend found with {config!r}. Reasons: {reasons_str}.")
    fixed = candidates[0]
    where = " inside CUDA-graph trees" if in_graph else ""
    if table is not None and len(table.measured(key) & {b.name for b in candidates}) > 0 and len(candidates) > 1:
        logger.info(
            "MLA prefill backend by size class among %s (cost table %s)%s.",
            ", ".join(b.name for b in candidates), table.source, where,
        )  # fmt: skip
        return SizedRoute(fixed, candidates, table, key)
    logger.info("Using %s MLA prefill backend%s.", fixed.name, where)
    return fixed


# --- per-call routing ---------------------------------------------------------------------------

_routes: dict[tuple[torch.device, torch.dtype, int, int, bool], PrefillBackend | SizedRoute] = {}


def backend_for(q: torch.Tensor, v: torch.Tensor, *, in_graph: bool = False) -> PrefillBackend:
    """The backend that runs an op whose inputs are ``q`` ``[T, H, Dqk]`` and ``v`` ``[T, H, Dv]`` where the
    call's size does not matter (the fixed order's choice where a cost table ranks the backends: see
    :func:`route_call`); ``in_graph``: for a call inside CUDA-graph trees (see :func:`select_backend`).

    A warm call is one dict lookup. The override and the environment variables are read when a
    configuration is first seen; :func:`clear_cache` makes the next call read them again.
    """
    backend = _routes.get((q.device, q.dtype, q.shape[-1], v.shape[-1], in_graph))
    if backend is None or type(backend) is SizedRoute:
        return route(q.device, q.dtype, q.shape[-1], v.shape[-1], in_graph=in_graph)
    return backend


def route(
    device: torch.device, dtype: torch.dtype, head_dim_qk: int, head_dim_v: int, in_graph: bool = False
) -> PrefillBackend:
    """The backend for tensors on ``device`` of ``dtype`` with these head dims, whatever a call's size (the
    fixed order's choice where a cost table ranks the backends); cached.

    ``in_graph``: for a call inside CUDA-graph trees (see :func:`select_backend`).
    """
    entry = _route_entry(device, dtype, head_dim_qk, head_dim_v, in_graph)
    return entry.fixed if type(entry) is SizedRoute else entry


def _route_entry(
    device: torch.device, dtype: torch.dtype, head_dim_qk: int, head_dim_v: int, in_graph: bool
) -> PrefillBackend | SizedRoute:
    key = (device, dtype, head_dim_qk, head_dim_v, in_graph)
    entry = _routes.get(key)
    if entry is None:
        config = SelectorConfig(dtype, MLADimensions.from_head_dims(head_dim_qk, head_dim_v))
        entry = _routes[key] = routing_entry(DeviceCapability.of(device), config, in_graph)
    return entry


def route_call(call: VarlenCall, in_graph: bool = False) -> PrefillBackend:
    """The backend the ops run for ``call`` (:class:`~mla_ops.backends.base.VarlenCall`, validated): the
    configuration's route, and where a cost table ranks the backends, the best for the call's size class.

    Reads only shapes and ints (no device sync). The ops call :func:`route_checked` with the sizes their input
    check read instead; this reads them itself.
    """
    return route_checked(call, _sizes_of(call), in_graph)


def route_checked(call: VarlenCall, sizes: AttentionSizes, in_graph: bool = False) -> PrefillBackend:
    """:func:`route_call` for a call whose sizes are known: ``sizes`` is what
    :func:`mla_ops.meta.checks.checked_attention_sizes` returned for ``call`` when it accepted it, so the ops read
    each size once, for the check and the route.

    A warm call costs a dict lookup per configuration, and where sizes matter one more per size class
    (benchmarks/bench_dispatch.py measures it).
    """
    device, dtype, (rows, heads, dqk), rows_k, dv, seqs_1 = sizes
    entry = _routes.get((device, dtype, dqk, dv, in_graph))
    if entry is None:
        entry = _route_entry(device, dtype, dqk, dv, in_graph)
    if type(entry) is not SizedRoute:
        return entry
    # _class_key(call, sizes), inline: this runs on every op call, where the function call costs a fifth of the rest.
    seqs = (seqs_1 - 1).bit_length()
    if call.causal:
        r, m = rows.bit_length(), call.max_seqlen_q.bit_length()
        key = (True, r, r, heads.bit_length(), seqs, m, m)
    else:
        key = (
            False, rows.bit_length(), rows_k.bit_length(), heads.bit_length(), seqs,
            call.max_seqlen_q.bit_length(), call.max_seqlen_k.bit_length(),
        )  # fmt: skip
    backend = entry.chosen.get(key)
    return entry.for_key(key) if backend is None else backend


def route_fused(
    new: VarlenCall, chunk: VarlenCall, sizes: tuple[AttentionSizes, AttentionSizes] | None = None
) -> PrefillBackend:
    """The one backend that runs both parts of the fused op (new tokens ``new``, context chunk ``chunk``): the
    least predicted time summed over the two parts' size classes. Where both parts alone route to one backend,
    this is that backend, so a part that the fused op hands to the native library routes there alone too.
    ``sizes``: each part's :func:`~mla_ops.meta.checks.checked_attention_sizes`, where the caller has them."""
    sizes_new, sizes_chunk = (_sizes_of(new), _sizes_of(chunk)) if sizes is None else sizes
    device, dtype, (_, _, dqk), _, dv, _ = sizes_new
    entry = _route_entry(device, dtype, dqk, dv, False)
    if type(entry) is not SizedRoute:
        return entry
    key = (_class_key(new, sizes_new), _class_key(chunk, sizes_chunk))
    backend = entry.chosen.get(key)
    return entry.for_sizes(key) if backend is None else backend


def _sizes_of(call: VarlenCall) -> AttentionSizes:
    """What :func:`~mla_ops.meta.checks.checked_attention_sizes` returns for ``call``, read without the check."""
    q = call.q
    return q.device, q.dtype, q.shape, call.k.shape[0], call.v.shape[2], call.cu_seqlens_q.shape[0]


def _class_key(call: VarlenCall, sizes: AttentionSizes) -> tuple:
    """The fields of ``call``'s :class:`~mla_ops.cost_table.SizeClass` as a plain tuple (equal to the class, and
    hashed alike), from its checked ``sizes``: inline, where ``SizeClass.of``'s constructor would cost more than
    the lookup it keys. New tokens: k has q's rows and max_seqlen_k is max_seqlen_q."""
    _, _, (rows, heads, _), rows_k, _, seqs_1 = sizes
    seqs = (seqs_1 - 1).bit_length()
    if call.causal:
        r, m = rows.bit_length(), call.max_seqlen_q.bit_length()
        return (True, r, r, heads.bit_length(), seqs, m, m)
    return (
        False, rows.bit_length(), rows_k.bit_length(), heads.bit_length(), seqs,
        call.max_seqlen_q.bit_length(), call.max_seqlen_k.bit_length(),
    )  # fmt: skip


def host_planner_for(q: torch.Tensor, v: torch.Tensor) -> PrefillBackend | None:
    """A backend that plans on the host which calls with ``q`` and ``v`` (``[T, H, Dqk]``, ``[T, H, Dv]``) may
    route to, at any size, outside CUDA-graph trees; ``None`` where none may (the graph trees' compile check)."""
    entry = _route_entry(q.device, q.dtype, q.shape[-1], v.shape[-1], False)
    backends = entry.may_run() if type(entry) is SizedRoute else [entry]
    return next((b for b in backends if b.plans_on_host), None)


def clear_cache() -> None:
    """Forget every cached selection, e.g. after changing ``MLA_OPS_PREFILL_BACKEND`` or a cost table, and
    every TRITON launch the native library repeats (they were remembered for the routing of their time)."""
    _routes.clear()
    _auto_select.cache_clear()
    cost_table.forget()
    try:
        invariance.resolve()
    except ValueError:  # an invalid MLA_OPS_BATCH_INVARIANT: the next routing raises it, with the ops' message
        invariance.STATE.active = False
    native.forget_attention()
