#!/usr/bin/env python
"""Benchmark MLA prefill: every backend through the public ops, against raw library baselines.

Measures TFLOP/s of the causal new-tokens path (``mla_ops.prefill``) and of the context-chunk path
(``mla_ops.prefill_context_chunk``), and GB/s of ``mla_ops.merge_attn_states``, for every backend that
is valid on this machine and, in the same run, for raw baselines: FlashInfer called directly, PyTorch
SDPA (memory-efficient kernel), FlexAttention with a document mask, and PyTorch's bundled
FlashAttention-2 varlen kernel. Each output is checked once against the fp32 reference before timing.

Writes ``results.csv``, ``results.md``, ``results.png`` and ``results.env.json`` into
``benchmarks/results/<gpu-slug>/`` (or ``--out``). Without a GPU it times the REFERENCE backend on tiny
shapes, which keeps the script testable anywhere. See ``benchmarks/README.md`` for the columns.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import gc
import itertools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The helpers live next to this script, which is not part of a package.
import _common as C

if TYPE_CHECKING:
    import torch

DQK, DV = 192, 128  # DeepSeek-V3's MLA head dims: 128 + 64 for q/k, 128 for v

CSV_FIELDS = [
    "suite",
    "shape",
    "label",
    "heads",
    "num_seqs",
    "total_q",
    "total_k",
    "series",
    "x",
    "method",
    "kind",
    "implementation",
    "status",
    "time_ms",
    "tflops",
    "gbps",
    "rel_err",
    "lse_err",
    "raw_method",
    "ratio_raw",
    "best_baseline",
    "ratio_best",
    "note",
]

# Largest row-relative output error and LSE error accepted as correct; see README ("Correctness").
OUT_TOL_EPS = 4.0  # multiples of the dtype's machine epsilon (bf16: 0.031, fp16: 0.0039)
LSE_TOL = 1e-2  # natural-log units; a wrong base or layout is off by far more


# --- shapes ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """One benchmark problem.

    ``q_lens`` are the new tokens per sequence; ``k_lens`` the context chunk per sequence (chunk suite
    only); for the merge suite ``q_lens`` is ``(T,)``. ``series`` and ``x`` place it on the plot
    (``series == ""``: table only).
    """

    suite: str
    heads: int
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...] = ()
    series: str = ""
    x: int = 0
    tags: frozenset[str] = frozenset()

    @property
    def id(self) -> str:
        if self.suite == "merge":
            return f"merge-h{self.heads}-t{self.q_lens[0]}"
        if self.suite == "chunk":
            return f"chunk-h{self.heads}-{_runs(self.q_lens)}-ctx{_runs(self.k_lens)}"
        return f"causal-h{self.heads}-{_runs(self.q_lens)}"

    @property
    def label(self) -> str:
        if self.suite == "merge":
            return f"T={self.q_lens[0]}, Dv={DV}"
        if self.suite == "chunk":
            return f"{_runs(self.q_lens)} new over {_runs(self.k_lens)} ctx"
        if len(set(self.q_lens)) > 1:
            return "mixed [" + ",".join(map(str, self.q_lens)) + "]"
        return _runs(self.q_lens)

    def flops(self) -> int:
        """``2*H*(Dqk+Dv)*pairs``; pairs is ``s*(s+1)/2`` per causal sequence and ``sq*sk`` per chunk."""
        if self.suite == "causal":
            pairs = sum(s * (s + 1) // 2 for s in self.q_lens)
        else:
            pairs = sum(sq * sk for sq, sk in zip(self.q_lens, self.k_lens))
        return 2 * self.heads * (DQK + DV) * pairs

    def merge_bytes(self, elem_size: int) -> int:
        """Bytes a merge moves: read two outputs and two LSEs, write one output and one LSE."""
        rows = self.q_lens[0] * self.heads
        return 3 * rows * DV * elem_size + 3 * rows * 4


def _runs(lengths: Sequence[int]) -> str:
    if not lengths:
        return "0"
    if len(set(lengths)) == 1:
        return f"{len(lengths)}x{lengths[0]}"
    return "+".join(map(str, lengths))


def gpu_shapes() -> list[Shape]:
    """The GPU set: length sweeps at H=16 and 128, the reference shapes, chunks and the merge."""
    shapes = []
    reference = {(16, 4096), (128, 8192)}  # 4x4096 at H=16 and 2x8192 at H=128
    for heads in (16, 128):
        for s in (512, 1024, 2048, 4096, 8192, 16384):
            tags = frozenset({"ref", "quick"}) if (heads, s) in reference else frozenset()
            shapes.append(Shape("causal", heads, (s,) * (16384 // s), series="causal", x=s, tags=tags))
    shapes.append(Shape("causal", 128, (512, 1024, 2048, 3000, 700), tags=frozenset({"ref", "quick"})))
    for heads in (16, 128):
        for ctx in (8192, 16384, 32768):
            quick = frozenset({"quick"}) if (heads, ctx) == (128, 16384) else frozenset()
            shapes.append(Shape("chunk", heads, (1024,), (ctx,), series="chunk 1 seq", x=ctx, tags=quick))
            shapes.append(Shape("chunk", heads, (256,) * 4, (ctx // 4,) * 4, series="chunk 4 seqs", x=ctx))
    for heads in (16, 128):
        shapes.append(Shape("merge", heads, (16384,), tags=frozenset({"quick"})))
    return shapes


def cpu_shapes() -> list[Shape]:
    """The CPU set: the same structure at tiny sizes (H=2 and 4, lengths 16..64), for CI."""
    shapes = []
    for heads in (2, 4):
        for s in (16, 32, 64):
            tags = frozenset({"ref", "quick"}) if (heads, s) in {(2, 32), (4, 64)} else frozenset()
            shapes.append(Shape("causal", heads, (s,) * (128 // s), series="causal", x=s, tags=tags))
    shapes.append(Shape("causal", 4, (16, 40, 64, 24), tags=frozenset({"ref", "quick"})))
    for heads in (2, 4):
        for ctx in (64, 128):
            quick = frozenset({"quick"}) if (heads, ctx) == (4, 64) else frozenset()
            shapes.append(Shape("chunk", heads, (16,), (ctx,), series="chunk 1 seq", x=ctx, tags=quick))
            shapes.append(Shape("chunk", heads, (4,) * 4, (ctx // 4,) * 4, series="chunk 4 seqs", x=ctx))
    for heads in (2, 4):
        shapes.append(Shape("merge", heads, (256,), tags=frozenset({"quick"})))
    return shapes


def select_shapes(shapes: list[Shape], patterns: Sequence[str], quick: bool) -> list[Shape]:
    """Filter by ``--quick`` and ``--shapes`` (ids with shell wildcards, suite names, or tags)."""
    if quick:
        shapes = [s for s in shapes if "quick" in s.tags]
    if not patterns:
        return shapes
    chosen = []
    for pattern in patterns:
        hits = [s for s in shapes if fnmatch.fnmatch(s.id, pattern) or s.suite == pattern or pattern in s.tags]
        if not hits:
            raise SystemExit(
                f"--shapes {pattern!r} matches no shape here; choose ids (wildcards allowed), a suite "
                f"(causal, chunk, merge) or a tag (ref, quick). Ids: {', '.join(s.id for s in shapes)}"
            )
        chosen += [s for s in hits if s not in chosen]
    return [s for s in shapes if s in chosen]


# --- problems and methods -------------------------------------------------------------------------


@dataclass
class Problem:
    """The tensors of one shape on the device. Attention: q/k ``[T, H, Dqk]``, v ``[T, H, Dv]``, int32
    offsets; ``cu_k is cu_q`` for the causal path. Merge: two ``[T, H, Dv]`` outputs and ``[H, T]`` LSEs."""

    shape: Shape
    device: torch.device
    dtype: torch.dtype
    scale: float
    tensors: dict[str, Any] = field(default_factory=dict)

    @property
    def causal(self) -> bool:
        return self.shape.suite == "causal"


def make_problem(shape: Shape, device: torch.device, dtype: torch.dtype, seed: int) -> Problem:
    """Random inputs for ``shape`` (standard normal, like the tests)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=device, dtype=dt)

    def offsets(lengths: Sequence[int]) -> torch.Tensor:
        return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)

    p = Problem(shape, device, dtype, 1.0 / math.sqrt(DQK))
    H = shape.heads
    if shape.suite == "merge":
        T = shape.q_lens[0]
        p.tensors.update(
            out_a=randn(T, H, DV),
            out_b=randn(T, H, DV),
            lse_a=randn(H, T, dt=torch.float32) * 2 + 5,
            lse_b=randn(H, T, dt=torch.float32) * 2 + 5,
        )
        return p
    tq = sum(shape.q_lens)
    k_lens = shape.k_lens or shape.q_lens
    tk = sum(k_lens)
    cu_q = offsets(shape.q_lens)
    # v is laid out as MLA produces it: the second half of kv_b_proj's [Tk, H, 128 + Dv] output, a
    # strided view. Every method reads the same view; the raw FA2 baseline pads it outside the timing.
    kv = randn(tk, H, DQK - 64 + DV)
    p.tensors.update(
        q=randn(tq, H, DQK),
        k=randn(tk, H, DQK),
        v=kv[..., DQK - 64 :],
        cu_q=cu_q,
        cu_k=cu_q if shape.suite == "causal" else offsets(k_lens),
        max_q=max(shape.q_lens),
        max_k=max(k_lens),
        q_lens=list(shape.q_lens),
        k_lens=list(k_lens),
    )
    return p


@dataclass
class Prepared:
    """A method made ready for one problem: ``fn`` is what is timed; ``extract`` turns its result into
    ``(out [T, H, Dv], lse [H, T] or None)`` for the check; ``context`` is active while it runs."""

    fn: Callable[[], Any]
    extract: Callable[[Any], tuple[torch.Tensor, torch.Tensor | None]]
    context: contextlib.AbstractContextManager = field(default_factory=contextlib.nullcontext)
    note: str = ""


class Method:
    """Something timed on every shape of its suites."""

    name: str = ""
    kind: str = "baseline"  # "op" (public op), "direct" (package code without op dispatch) or "baseline"
    suites: tuple[str, ...] = ("causal", "chunk")
    implementation: str = ""
    raw: str | None = None  # for ops: the method that is this op's own raw call

    def unavailable(self, device: torch.device) -> str | None:
        """Why this method cannot run on ``device`` at all, or ``None``."""
        return None

    def prepare(self, p: Problem) -> Prepared:
        raise NotImplementedError


_LOG: Callable[[str], None] = print


def _identity(result: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    return result[0], result[1]


class OpMethod(Method):
    """A backend through ``mla_ops.prefill`` / ``mla_ops.prefill_context_chunk`` under ``prefill_backend``."""

    kind = "op"
    _raw_of: ClassVar[dict[str, str]] = {
        "FLASHINFER": "flashinfer_raw",
        "FLASH_ATTN": "fa2_varlen_raw",
        "TRITON": "triton_direct",
    }

    def __init__(self, name: str, implementation: str) -> None:
        self.name, self.implementation, self.raw = name, implementation, self._raw_of.get(name)

    def prepare(self, p: Problem) -> Prepared:
        import mla_ops

        t = p.tensors
        if p.causal:
            fn = lambda: mla_ops.prefill(t["q"], t["k"], t["v"], t["cu_q"], t["max_q"], p.scale)
        else:
            fn = lambda: mla_ops.prefill_context_chunk(
                t["q"], t["k"], t["v"], t["cu_q"], t["cu_k"], t["max_q"], t["max_k"], p.scale
            )
        return Prepared(fn, _identity, mla_ops.prefill_backend(self.name))


class BackendDirect(Method):
    """A backend's classmethods called directly: no op dispatch, input checks or routing."""

    kind = "direct"

    def __init__(self, name: str, cls: type) -> None:
        self.name, self.cls = f"{name.lower()}_direct", cls
        self.implementation = f"{cls.__name__}.prefill / .prefill_context_chunk called directly"

    def prepare(self, p: Problem) -> Prepared:
        t, cls = p.tensors, self.cls
        if p.causal:
            fn = lambda: cls.prefill(t["q"], t["k"], t["v"], t["cu_q"], t["max_q"], p.scale)
        else:
            fn = lambda: cls.prefill_context_chunk(
                t["q"], t["k"], t["v"], t["cu_q"], t["cu_k"], t["max_q"], t["max_k"], p.scale
            )
        return Prepared(fn, _identity)


def _flashinfer_unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "FlashInfer runs on CUDA devices only"
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # a broken install (e.g. a missing CUDA toolkit) raises more than ImportError
        return f"flashinfer is not importable ({C.short_error(exc)})"
    return None


class FlashInferRaw(Method):
    """(a) ``flashinfer.BatchPrefillWithRaggedKVCacheWrapper``, planned once outside the timed region."""

    name = "flashinfer_raw"
    _workspace: dict[torch.device, torch.Tensor] = {}  # noqa: RUF012  (one 128 MiB buffer per device)

    def __init__(self, fi_backend: str) -> None:
        self.fi_backend = fi_backend
        self.implementation = f"flashinfer.BatchPrefillWithRaggedKVCacheWrapper(backend={fi_backend!r}).run"

    def unavailable(self, device: torch.device) -> str | None:
        return _flashinfer_unavailable(device)

    def wrapper(self, p: Problem, causal: bool, cu_q: torch.Tensor, cu_k: torch.Tensor) -> Any:
        import flashinfer
        import torch

        ws = self._workspace.get(p.device)
        if ws is None:
            ws = self._workspace[p.device] = torch.empty(128 * 2**20, dtype=torch.uint8, device=p.device)
        w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=self.fi_backend)
        heads = p.shape.heads
        w.plan(
            cu_q,
            cu_k,
            heads,
            heads,
            DQK,
            head_dim_vo=DV,
            causal=causal,
            sm_scale=p.scale,
            q_data_type=p.dtype,
            kv_data_type=p.dtype,
        )
        return w

    def prepare(self, p: Problem) -> Prepared:
        t = p.tensors
        w = self.wrapper(p, p.causal, t["cu_q"], t["cu_k"])
        return Prepared(lambda: w.run(t["q"], t["k"], t["v"], return_lse=True), lambda r: (r[0], None))

    def compile(self, device: torch.device, dtype: torch.dtype) -> None:
        """JIT-compile the kernels (once per process and machine) on a tiny batch."""
        shape = Shape("causal", 16, (64, 64))
        p = make_problem(shape, device, dtype, seed=0)
        self.prepare(p).fn()


class SdpaBaseline(Method):
    """(b) ``torch.nn.functional.scaled_dot_product_attention``: the memory-efficient kernel on CUDA.

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

        t, H = p.tensors, p.shape.heads
        q_lens, k_lens = t["q_lens"], t["k_lens"]
        context = sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION) if self.cuda else contextlib.nullcontext()
        if len(set(q_lens)) == 1 and len(set(k_lens)) == 1:
            B, sq, sk = len(q_lens), q_lens[0], k_lens[0]
            q = t["q"].view(B, sq, H, DQK).transpose(1, 2)
            k = t["k"].view(B, sk, H, DQK).transpose(1, 2)
            v = t["v"].view(B, sk, H, DV).transpose(1, 2)
            fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=p.causal, scale=p.scale)
            extract = lambda o: (o.transpose(1, 2).reshape(-1, H, DV), None)
            return Prepared(fn, extract, context, note="one batched [B,H,S,D] call")
        bq = [0, *itertools.accumulate(q_lens)]
        bk = [0, *itertools.accumulate(k_lens)]
        views = [
            (
                t["q"][bq[i] : bq[i + 1]].transpose(0, 1).unsqueeze(0),
                t["k"][bk[i] : bk[i + 1]].transpose(0, 1).unsqueeze(0),
                t["v"][bk[i] : bk[i + 1]].transpose(0, 1).unsqueeze(0),
            )
            for i in range(len(q_lens))
        ]
        fn = lambda: [F.scaled_dot_product_attention(q, k, v, is_causal=p.causal, scale=p.scale) for q, k, v in views]
        extract = lambda outs: (torch.cat([o[0].transpose(0, 1) for o in outs]), None)
        return Prepared(fn, extract, context, note="one call per sequence (ragged batch)")


class FlexBaseline(Method):
    """(c) FlexAttention, ``torch.compile(flex_attention)`` once, with a document (ragged) block mask."""

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
        t, dev = p.tensors, p.device
        doc_q, doc_k = (
            torch.repeat_interleave(torch.arange(len(lens), device=dev), torch.tensor(lens, device=dev))
            for lens in (t["q_lens"], t["k_lens"])
        )
        if p.causal:
            mask_mod = lambda b, h, qi, ki: (doc_q[qi] == doc_q[ki]) & (qi >= ki)
        else:
            mask_mod = lambda b, h, qi, ki: doc_q[qi] == doc_k[ki]
        block_mask = create_block_mask(mask_mod, None, None, doc_q.numel(), doc_k.numel(), device=dev)
        # FlexAttention's layout is [B, H, S, D]; the copies are made outside the timed region.
        q, k, v = (t[n].transpose(0, 1).unsqueeze(0).contiguous() for n in ("q", "k", "v"))
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
                note += f"; kernel_options {options} (default failed: {C.short_error(first_error, 80)})"
            return Prepared(fn, lambda o: (o[0].transpose(0, 1), None), note=note)
        assert first_error is not None
        raise first_error


class FlashAttn2Raw(Method):
    """(d) ``torch.ops.aten._flash_attention_forward`` (PyTorch's bundled FA2, varlen), v padded to Dqk."""

    name = "fa2_varlen_raw"
    implementation = "torch.ops.aten._flash_attention_forward (bundled FlashAttention-2 varlen), v zero-padded to Dqk"

    def unavailable(self, device: torch.device) -> str | None:
        import torch

        if device.type != "cuda":
            return "PyTorch's bundled FlashAttention-2 kernel runs on CUDA only"
        if not hasattr(torch.ops.aten, "_flash_attention_forward"):
            return "torch.ops.aten._flash_attention_forward is missing from this torch build"
        if torch.cuda.get_device_capability(device) < (8, 0):
            return "FlashAttention-2 needs compute capability 8.0 or newer"
        return None

    def prepare(self, p: Problem) -> Prepared:
        import torch
        import torch.nn.functional as F

        t = p.tensors
        v_pad = F.pad(t["v"], (0, DQK - DV))  # padding is the FLASH_ATTN backend's cost, not the kernel's
        fa = torch.ops.aten._flash_attention_forward
        fn = lambda: fa(
            t["q"], t["k"], v_pad, t["cu_q"], t["cu_k"], t["max_q"], t["max_k"], 0.0, p.causal, False, scale=p.scale
        )
        return Prepared(fn, lambda r: (r[0][..., :DV], None))


# --- merge methods --------------------------------------------------------------------------------


def _merge_args(p: Problem) -> tuple[torch.Tensor, ...]:
    t = p.tensors
    return t["out_a"], t["lse_a"], t["out_b"], t["lse_b"]


class MergeOp(Method):
    """``mla_ops.merge_attn_states`` through its op."""

    name = "mla.merge_attn_states"
    kind = "op"
    suites = ("merge",)

    def __init__(self, device: torch.device) -> None:
        from mla_ops.ops import merge_kernel

        if device.type == "cuda":
            fn = merge_kernel()
            self.implementation = f"{fn.__module__}.{fn.__qualname__}"
            self.raw = "merge_kernel_direct"
        else:
            self.implementation = "mla_ops.backends.reference.merge_attn_states_reference (CPU dispatch key)"

    def prepare(self, p: Problem) -> Prepared:
        import mla_ops

        args = _merge_args(p)
        return Prepared(lambda: mla_ops.merge_attn_states(*args), _identity)


class MergeDirect(Method):
    """The CUDA merge function the op dispatches to, called without the op."""

    name = "merge_kernel_direct"
    kind = "direct"
    suites = ("merge",)

    def unavailable(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return "on CPU the op runs the reference math (timed as torch_eager_merge)"
        from mla_ops.ops import merge_kernel

        fn = merge_kernel()
        self.implementation = f"{fn.__module__}.{fn.__qualname__} called directly"
        return None

    def prepare(self, p: Problem) -> Prepared:
        from mla_ops.ops import merge_kernel

        fn, args = merge_kernel(), _merge_args(p)
        return Prepared(lambda: fn(*args), _identity)


class FlashInferMerge(Method):
    """``flashinfer.merge_state``; it takes base-2 LSEs ``[T, H]``, converted outside the timed region."""

    name = "flashinfer_merge_state"
    suites = ("merge",)
    implementation = "flashinfer.merge_state (LSE base 2, [T, H])"
    _compiled = False

    def unavailable(self, device: torch.device) -> str | None:
        return _flashinfer_unavailable(device)

    def prepare(self, p: Problem) -> Prepared:
        import flashinfer

        a, lse_a, b, lse_b = _merge_args(p)
        s_a, s_b = (lse.t().contiguous() * math.log2(math.e) for lse in (lse_a, lse_b))
        if not FlashInferMerge._compiled:
            _LOG("flashinfer.merge_state: JIT-compiling on first use (once)...")
            FlashInferMerge._compiled = True
        return Prepared(lambda: flashinfer.merge_state(a, s_a, b, s_b), lambda r: (r[0], None))


class TorchEagerMerge(Method):
    """The merge written in eager PyTorch (the package's fp32 reference math)."""

    name = "torch_eager_merge"
    suites = ("merge",)
    implementation = "mla_ops.backends.reference.merge_attn_states_reference (eager PyTorch, fp32)"

    def prepare(self, p: Problem) -> Prepared:
        from mla_ops.backends.reference import merge_attn_states_reference

        args = _merge_args(p)
        return Prepared(lambda: merge_attn_states_reference(*args), _identity)


# --- building the method list ---------------------------------------------------------------------

BASELINE_KEYS = ("flashinfer", "sdpa", "flex", "fa2", "torch")


def build_methods(
    args: argparse.Namespace, device: torch.device, backends: list[dict[str, Any]]
) -> tuple[list[Method], dict[str, str], dict[str, FlashInferRaw]]:
    """The methods to time and, for each one left out, why."""
    import torch

    not_measured: dict[str, str] = {}
    methods: list[Method] = []
    by_name = {row["name"]: row for row in backends}
    if args.backends:
        wanted = []
        for name in args.backends:
            key = name.strip().upper()
            if key not in by_name:
                raise SystemExit(f"--backends: unknown backend {name!r}; choose from {', '.join(by_name)}")
            wanted.append(key)
    else:
        wanted = list(by_name)
    for name in wanted:
        row = by_name[name]
        if not row["valid"]:
            not_measured[name] = "not valid here: " + "; ".join(row["reasons"])
        elif device.type == "cpu" and name != "REFERENCE":
            not_measured[name] = "the ops' CPU dispatch key always runs REFERENCE, so it cannot be timed on CPU"
        elif device.type == "cuda" and name == "REFERENCE" and not args.backends:
            not_measured[name] = (
                "host-synchronising fp32 math, orders of magnitude slower; used as the correctness reference "
                "(pass --backends REFERENCE to time it)"
            )
        else:
            methods.append(OpMethod(name, row["implementation"]))
            if name == "TRITON":
                methods.append(BackendDirect(name, row["class"]))
    methods.append(MergeOp(device))
    methods.append(MergeDirect())

    if args.baselines == ["none"]:
        keys: list[str] = []
    else:
        keys = args.baselines or list(BASELINE_KEYS)
        bad = [k for k in keys if k not in BASELINE_KEYS]
        if bad:
            raise SystemExit(f"--baselines: unknown {bad}; choose from {', '.join(BASELINE_KEYS)} or 'none'")
    fi_backend = args.flashinfer_backend
    if fi_backend == "auto":
        fi_backend = "fa3" if device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0) else "fa2"
    fi_raw = FlashInferRaw(fi_backend)
    candidates = {
        "flashinfer": [fi_raw],
        "sdpa": [SdpaBaseline(device)],
        "flex": [FlexBaseline()],
        "fa2": [FlashAttn2Raw()],
        "torch": [TorchEagerMerge()],
    }
    for key in keys:
        methods.extend(candidates[key])
    if "flashinfer" in keys:
        # Last: a failed launch inside flashinfer.merge_state leaves a CUDA error that the next
        # method's first launch would report as its own.
        methods.append(FlashInferMerge())

    kept = []
    for method in methods:
        why = method.unavailable(device)
        if why is None:
            kept.append(method)
        else:
            not_measured[method.name] = why
    compile_first = {m.name: m for m in kept if isinstance(m, FlashInferRaw)}
    return kept, not_measured, compile_first


# --- running --------------------------------------------------------------------------------------


def reference_outputs(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ground truth ``(out [T, H, Dv] float32, lse [H, T])`` from the package's reference math."""
    from mla_ops.backends.reference import attention_reference, merge_attn_states_reference

    if p.shape.suite == "merge":
        a, lse_a, b, lse_b = _merge_args(p)
        out, lse = merge_attn_states_reference(a.float(), lse_a, b.float(), lse_b)
        return out, lse
    t = p.tensors
    q, k, v = (t[n].float() for n in ("q", "k", "v"))
    return attention_reference(q, k, v, t["cu_q"], t["cu_k"], p.scale, causal=p.causal)


def compare(
    out: torch.Tensor, lse: torch.Tensor | None, ref_out: torch.Tensor, ref_lse: torch.Tensor
) -> tuple[float, float | None]:
    """``(rel_err, lse_err)``: the largest per-row ``max|out-ref| / max|ref|`` and the largest LSE error.

    A per-row scale keeps long rows, whose outputs average many values and are small, as visible as
    short ones. NaN anywhere gives ``inf``.
    """
    import torch

    n = ref_out.shape[0]
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


def run_shape(
    shape: Shape,
    methods: list[Method],
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    progress: C.Progress,
) -> list[dict[str, Any]]:
    """Check and time every method on one shape; returns one CSV row per method."""
    import torch

    try:
        p = make_problem(shape, device, dtype, args.seed)
        ref_out, ref_lse = reference_outputs(p)
    except Exception as exc:  # e.g. out of memory on a smaller GPU: record it and go on to the next shape
        setup_error = f"inputs or reference failed: {C.short_error(exc)}"
        progress.write(f"  {shape.id}: {setup_error}")
        p = None
    else:
        setup_error = None
    out_tol = OUT_TOL_EPS * torch.finfo(dtype).eps
    work = shape.flops() if shape.suite != "merge" else shape.merge_bytes(torch.finfo(dtype).bits // 8)
    rows = []
    for method in methods:
        if shape.suite not in method.suites:
            continue
        progress.step(f"{shape.id} {method.name}")
        row: dict[str, Any] = {
            "suite": shape.suite,
            "shape": shape.id,
            "label": shape.label,
            "heads": shape.heads,
            "num_seqs": len(shape.q_lens),
            "total_q": sum(shape.q_lens),
            "total_k": sum(shape.k_lens or shape.q_lens),
            "series": shape.series,
            "x": shape.x,
            "method": method.name,
            "kind": method.kind,
            "implementation": method.implementation,
            "status": "ok",
            "raw_method": method.raw,
        }
        if setup_error is not None:
            row["status"], row["note"] = "error", setup_error
            rows.append(row)
            continue
        prepared = None
        try:
            prepared = method.prepare(p)
            row["note"] = prepared.note
            with prepared.context:
                result = prepared.fn()
                out, lse = prepared.extract(result)
                rel, lse_err = compare(out, lse, ref_out, ref_lse)
                del result, out, lse
                row["rel_err"], row["lse_err"] = rel, lse_err
                if not rel <= out_tol or (lse_err is not None and not lse_err <= LSE_TOL):
                    row["status"] = "WRONG"
                ms = C.time_ms(prepared.fn, device, args.warmup_ms, args.rep_ms)
            row["time_ms"] = ms
            if shape.suite == "merge":
                row["gbps"] = work / (ms * 1e-3) / 1e9
            else:
                row["tflops"] = work / (ms * 1e-3) / 1e12
        except Exception as exc:
            row["status"], row["note"] = "error", C.short_error(exc)
            if device.type == "cuda":  # after an out-of-memory error, return what the failed call held
                torch.cuda.empty_cache()
        finally:
            prepared = None
        progress.write(_result_line(row))
        rows.append(row)
    add_ratios(rows)
    p = ref_out = ref_lse = None
    if device.type == "cuda":  # hand the shape's gigabytes back before the next one allocates
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def _result_line(row: dict[str, Any]) -> str:
    if row["suite"] == "merge":
        speed = f"{C.fmt_rate(row.get('gbps')):>8} GB/s"
    else:
        speed = f"{C.fmt_rate(row.get('tflops')):>8} TFLOP/s"
    err = f"err {C.fmt(row.get('rel_err'), '.1e')} lse {C.fmt(row.get('lse_err'), '.1e')}"
    tail = f"  ({row['note']})" if row["status"] == "error" else ""
    time_ms = C.fmt(row.get("time_ms"), "9.4f")
    return f"  {row['shape']:<30} {row['method']:<22} {time_ms} ms {speed}  {err}  {row['status']}{tail}"


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Fill ``ratio_raw`` (raw time / op time) and ``ratio_best`` (best baseline time / time) in place."""
    times = {r["method"]: r["time_ms"] for r in rows if r["status"] == "ok" and r.get("time_ms")}
    baselines = {r["method"]: r["time_ms"] for r in rows if r["kind"] == "baseline" and r["method"] in times}
    best = min(baselines, key=baselines.get) if baselines else None
    for r in rows:
        r["best_baseline"] = best
        if r["method"] not in times:
            continue
        if r.get("raw_method") in times:
            r["ratio_raw"] = times[r["raw_method"]] / times[r["method"]]
        if best is not None:
            r["ratio_best"] = baselines[best] / times[r["method"]]


# --- report ---------------------------------------------------------------------------------------

SUITE_TITLES = {
    "causal": "Causal new-tokens path (`mla_ops.prefill`), TFLOP/s",
    "chunk": "Context-chunk path (`mla_ops.prefill_context_chunk`), TFLOP/s",
    "merge": "Merge (`mla_ops.merge_attn_states`), GB/s",
}


def _ordered(values: list[str]) -> list[str]:
    return list(dict.fromkeys(values))


def render_markdown(rows: list[dict[str, Any]], env: dict[str, Any]) -> str:
    """The results as Markdown: header, one speed table and one ratio table per suite, checks, summary."""
    title = f"# MLA prefill benchmark: {env.get('gpu')}, {env.get('dtype')}, (Dqk, Dv) = ({DQK}, {DV})"
    env_list = C.env_markdown({k: v for k, v in env.items() if k != "command"})
    parts = [title, "", f"Command: `{env.get('command', '')}`", "", "## Environment", "", env_list, ""]
    summary = overhead_summary(rows)
    if summary:
        parts += ["## Op overhead (op throughput / its own raw call; target >= 0.97)", "", summary, ""]
    for suite in ("causal", "chunk", "merge"):
        srows = [r for r in rows if r["suite"] == suite]
        if not srows:
            continue
        metric = "gbps" if suite == "merge" else "tflops"
        methods = _ordered([r["method"] for r in srows])
        shapes = _ordered([r["shape"] for r in srows])
        cell = {(r["shape"], r["method"]): r for r in srows}
        table = []
        for shape_id in shapes:
            first = next(r for r in srows if r["shape"] == shape_id)
            line = [f"H={first['heads']}", first["label"]]
            for m in methods:
                r = cell.get((shape_id, m))
                line.append(_speed_cell(r, metric))
            table.append(line)
        parts += [f"## {SUITE_TITLES[suite]}", "", C.markdown_table(["H", "shape", *methods], table), ""]
        kinds = {r["method"]: r["kind"] for r in srows}
        raw_of = {r["method"]: r["raw_method"] for r in srows if r.get("raw_method")}
        columns = []  # (header, method, row key)
        for m in (m for m in methods if kinds[m] in ("op", "direct")):
            if m in raw_of:
                columns.append((f"{m} / {raw_of[m]}", m, "ratio_raw"))
            columns.append((f"{m} / best raw", m, "ratio_best"))
        if columns:
            table = []
            for shape_id in shapes:
                first = next(r for r in srows if r["shape"] == shape_id)
                line = [f"H={first['heads']}", first["label"], first.get("best_baseline") or "—"]
                line += [C.fmt(cell.get((shape_id, m), {}).get(key), ".2f") for _, m, key in columns]
                table.append(line)
            headers = ["H", "shape", "best raw baseline", *(h for h, _, _ in columns)]
            parts += [f"Ratios ({suite}): time of the named call / time of the method (above 1: the method is faster)"]
            parts += ["", C.markdown_table(headers, table), ""]
    parts += ["## Correctness (checked once per shape before timing, against fp32 reference math)", ""]
    parts += [correctness_table(rows), ""]
    parts += ["Columns and methods are described in `benchmarks/README.md`.", ""]
    return "\n".join(parts)


def _speed_cell(r: dict[str, Any] | None, metric: str) -> str:
    if r is None:
        return "—"
    if r["status"] == "ok":
        return C.fmt_rate(r.get(metric))
    if r["status"] == "WRONG":
        return f"WRONG ({C.fmt_rate(r.get(metric))})"
    return r["status"]


def overhead_summary(rows: list[dict[str, Any]]) -> str:
    """One line per op: min and median of its ratio to its own raw call over all shapes."""
    lines = []
    for m in _ordered([r["method"] for r in rows if r["kind"] == "op"]):
        ratios = [r["ratio_raw"] for r in rows if r["method"] == m and r.get("ratio_raw") is not None]
        raw = next((r["raw_method"] for r in rows if r["method"] == m and r.get("raw_method")), None)
        if ratios:
            lines.append(
                f"- **{m}** vs `{raw}`: min {min(ratios):.3f}, median {statistics.median(ratios):.3f} "
                f"over {len(ratios)} shapes"
            )
    return "\n".join(lines)


def correctness_table(rows: list[dict[str, Any]]) -> str:
    """Per method: worst output and LSE errors over the shapes, and how many shapes were WRONG or failed."""
    table = []
    for m in _ordered([r["method"] for r in rows]):
        mrows = [r for r in rows if r["method"] == m]
        rels = [r["rel_err"] for r in mrows if r.get("rel_err") is not None]
        lses = [r["lse_err"] for r in mrows if r.get("lse_err") is not None]
        counts = {s: sum(r["status"] == s for r in mrows) for s in ("ok", "WRONG", "error")}
        errors = _ordered([r["note"] for r in mrows if r["status"] == "error" and r.get("note")])
        table.append(
            [
                m,
                C.fmt(max(rels) if rels else None, ".1e"),
                C.fmt(max(lses) if lses else None, ".1e"),
                counts["ok"],
                counts["WRONG"],
                counts["error"],
                "; ".join(errors)[:300],
            ]
        )
    return C.markdown_table(["method", "max rel err (out)", "max lse err", "ok", "WRONG", "error", "errors"], table)


PLOT_XLABEL = {
    "causal": "sequence length s (batches of equal total tokens)",
    "chunk": "context tokens in the chunk (all sequences)",
}
PLOT_TITLE = {
    "causal": "causal new tokens",
    "chunk 1 seq": "context chunk, 1 sequence",
    "chunk 4 seqs": "context chunk, 4 sequences",
}


def render_plot(rows: list[dict[str, Any]], env: dict[str, Any], path: Path) -> str | None:
    """Plot TFLOP/s against length, one panel per (series, H), one line per method; ``None`` on success,
    else a note saying why no plot was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return (
            "matplotlib is not installed, so no results.png was written; install it (pip install matplotlib) "
            f"and rerun with --from-csv {path.with_suffix('.csv')}"
        )
    prows = [r for r in rows if r.get("series") and r["suite"] != "merge" and r.get("tflops") is not None]
    if not prows:
        return "no plottable rows (the length sweeps were not run), so no results.png was written"
    series = _ordered([r["series"] for r in prows])
    heads = sorted({r["heads"] for r in prows})
    methods = _ordered([r["method"] for r in prows])
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    # Tiny CPU problems run at GFLOP/s; plotting them in TFLOP/s would leave only zeros on the axis.
    unit, factor = ("TFLOP/s", 1.0) if max(r["tflops"] for r in prows) >= 1 else ("GFLOP/s", 1e3)
    fig, axes = plt.subplots(len(series), len(heads), figsize=(6.2 * len(heads), 4.2 * len(series)), squeeze=False)
    for i, s in enumerate(series):
        for j, h in enumerate(heads):
            ax = axes[i][j]
            for m in methods:
                pts = sorted(
                    (r["x"], r["tflops"] * factor, r["status"])
                    for r in prows
                    if r["series"] == s and r["heads"] == h and r["method"] == m
                )
                if not pts:
                    continue
                kind = next(r["kind"] for r in prows if r["method"] == m)
                ok = [(x, y) for x, y, st in pts if st == "ok"]
                bad = [(x, y) for x, y, st in pts if st != "ok"]
                style = "-" if kind in ("op", "direct") else "--"
                if ok:
                    ax.plot(*zip(*ok), style, marker="o", ms=4, color=colors[m], label=m)
                if bad:
                    ax.plot(*zip(*bad), "x", ms=9, mew=2, color=colors[m], label=f"{m} (WRONG)")
            xs = sorted({r["x"] for r in prows if r["series"] == s})
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs)
            ax.set_xticklabels([f"{x // 1024}k" if x >= 1024 and x % 1024 == 0 else str(x) for x in xs])
            ax.minorticks_off()
            ax.set_xlabel(PLOT_XLABEL["causal" if s == "causal" else "chunk"])
            ax.set_ylabel(unit)
            ax.set_ylim(bottom=0)
            ax.set_title(f"{PLOT_TITLE.get(s, s)}, H={h}")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7, loc="best")
    fig.suptitle(
        f"MLA prefill, {env.get('gpu')}, {env.get('dtype')}, (Dqk, Dv) = ({DQK}, {DV}); "
        f"{unit}, solid: mla_ops, dashed: raw baselines",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    _save_small_png(fig, path)
    plt.close(fig)
    return None


def _save_small_png(fig: Any, path: Path) -> None:
    """Save ``fig`` as a PNG with a 256-colour palette: a third of the bytes, and results stay small in git."""
    import io

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=72)
    try:
        from PIL import Image  # a dependency of matplotlib

        with Image.open(buffer) as image:
            image.convert("RGB").quantize(colors=256).save(path, optimize=True)
    except Exception:  # any Pillow trouble: keep the full-colour image
        path.write_bytes(buffer.getvalue())


def merge_rows(old: list[dict[str, Any]], new: list[dict[str, Any]], shapes: list[Shape]) -> list[dict[str, Any]]:
    """``old`` rows of shapes not in ``new``, plus ``new``, in the order of ``shapes``."""
    measured = {r["shape"] for r in new}
    order = {s.id: i for i, s in enumerate(shapes)}
    kept = [r for r in old if r["shape"] not in measured]
    return sorted(kept + new, key=lambda r: order.get(r["shape"], len(order)))


def write_outputs(rows: list[dict[str, Any]], env: dict[str, Any], out_dir: Path) -> list[str]:
    """Write CSV, env JSON, Markdown and PNG; returns notes to print (e.g. why there is no PNG)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    C.write_csv(out_dir / "results.csv", CSV_FIELDS, rows)
    C.write_json(out_dir / "results.env.json", env)
    # The report is rendered from the CSV as written, so a later --from-csv re-render gives the same
    # figures; rendering the unrounded rows could round a derived column differently in its last digit.
    return write_report(load_rows(out_dir / "results.csv"), env, out_dir)


def write_report(rows: list[dict[str, Any]], env: dict[str, Any], out_dir: Path) -> list[str]:
    """Write results.md and results.png from rows; returns notes."""
    notes = []
    note = render_plot(rows, env, out_dir / "results.png")
    markdown = render_markdown(rows, env)
    if note is None:
        markdown = markdown.replace("## Environment", "![TFLOP/s against length](results.png)\n\n## Environment", 1)
    else:
        notes.append(note)
        markdown += f"\nNo plot: {note}\n"
        (out_dir / "results.png").unlink(missing_ok=True)  # a plot left by an earlier run would not match
    (out_dir / "results.md").write_text(markdown)
    return notes


# --- main -----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(
            "Benchmark MLA prefill (Dqk=192, Dv=128): every valid mla_ops backend through the public ops, and "
            "raw FlashInfer / SDPA / FlexAttention / bundled FlashAttention-2 baselines, in TFLOP/s (merge in "
            "GB/s). Writes results.csv, results.md, results.png and results.env.json. Without a GPU it times "
            "the REFERENCE backend on tiny shapes."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--out", type=Path, help="output folder (default: benchmarks/results/<gpu-slug>/)")
    parser.add_argument(
        "--quick", action="store_true", help="reduced set: the 3 reference shapes, one chunk shape and the merge"
    )
    parser.add_argument(
        "--backends",
        nargs="+",
        metavar="NAME",
        help="mla_ops backends to time (default: every backend valid here; REFERENCE only on CPU)",
    )
    parser.add_argument(
        "--baselines",
        nargs="+",
        metavar="KEY",
        help=f"raw baselines to time, from {', '.join(BASELINE_KEYS)}, or 'none' (default: all)",
    )
    parser.add_argument(
        "--shapes",
        nargs="+",
        metavar="PATTERN",
        default=[],
        help="shape ids (shell wildcards), suites (causal, chunk, merge) or tags (ref, quick); see --list",
    )
    parser.add_argument("--list", action="store_true", help="print the shapes and methods that would run, then exit")
    parser.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda if available)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument(
        "--flashinfer-backend",
        default="auto",
        help="backend of the raw FlashInfer baseline: auto (fa3 on SM90, else fa2), fa2, fa3, ...",
    )
    parser.add_argument("--warmup-ms", type=float, help="warm-up time per measurement (default: 25 on GPU, 2 on CPU)")
    parser.add_argument(
        "--rep-ms", type=float, help="timed repetitions per measurement (default: 100 on GPU, 10 on CPU)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar or counter")
    parser.add_argument(
        "--append",
        action="store_true",
        help="merge into the results.csv already in the output folder: its rows of the shapes measured now are "
        "replaced, the others kept (to split a long run into several commands)",
    )
    parser.add_argument(
        "--from-csv",
        type=Path,
        metavar="CSV",
        help="re-render results.md and results.png from an existing results.csv (and its "
        "results.env.json) without measuring, e.g. on a machine with matplotlib",
    )
    return parser.parse_args(argv)


def load_rows(csv_path: Path) -> list[dict[str, Any]]:
    """Rows of a results.csv, with numbers parsed and text columns kept as text."""
    rows = C.read_csv(csv_path)
    for r in rows:
        for key in ("method", "series", "shape", "label", "raw_method", "best_baseline", "note"):
            if r.get(key) is not None:
                r[key] = str(r[key])
    return rows


def replot(csv_path: Path, out_dir: Path | None) -> int:
    """``--from-csv``: rebuild the Markdown and the plot from saved results."""
    if not csv_path.is_file():
        raise SystemExit(f"--from-csv: {csv_path} does not exist")
    env_path = csv_path.with_name(csv_path.stem + ".env.json")
    env = json.loads(env_path.read_text()) if env_path.is_file() else {"gpu": "unknown", "note": f"{env_path} missing"}
    rows = load_rows(csv_path)
    out_dir = out_dir or csv_path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    for note in write_report(rows, env, out_dir):
        print(note)
    print(f"wrote {out_dir / 'results.md'}" + ("" if not (out_dir / "results.png").exists() else " and results.png"))
    return 0


@contextlib.contextmanager
def _logging_to(progress: C.Progress) -> Iterator[None]:
    global _LOG
    previous, _LOG = _LOG, progress.write
    try:
        yield
    finally:
        _LOG = previous


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_csv is not None:
        return replot(args.from_csv, args.out)

    import torch

    import mla_ops

    device = C.pick_device(args.device)
    dtype = getattr(torch, args.dtype)
    if args.warmup_ms is None:
        args.warmup_ms = 25.0 if device.type == "cuda" else 2.0
    if args.rep_ms is None:
        args.rep_ms = 100.0 if device.type == "cuda" else 10.0
    all_shapes = gpu_shapes() if device.type == "cuda" else cpu_shapes()
    shapes = select_shapes(all_shapes, args.shapes, args.quick)
    out_dir = args.out or C.default_out_dir(device)

    started = time.perf_counter()
    backends = C.backend_table(device, dtype, DQK, DV)
    env = C.collect_env(device, dtype, DQK, DV, backends)
    methods, not_measured, fi_compile = build_methods(args, device, backends)
    env.update(
        command=" ".join(["python benchmarks/bench_prefill.py", *(sys.argv[1:] if argv is None else argv)]),
        timer=C.timer_description(device),
        warmup_ms=args.warmup_ms,
        rep_ms=args.rep_ms,
        correctness=f"row-relative output error <= {OUT_TOL_EPS:g} eps({args.dtype}), |lse error| <= {LSE_TOL:g}",
        not_measured=not_measured,
    )

    print(f"device: {env['gpu']} ({device}), dtype {args.dtype}, (Dqk, Dv) = ({DQK}, {DV})")
    print("timing: " + ", ".join(m.name for m in methods))
    for name, why in not_measured.items():
        print(f"not measured: {name}: {why}")
    count = sum(1 for s in shapes for m in methods if s.suite in m.suites)
    if args.list:
        for s in shapes:
            print(f"  {s.id:<32} {s.label}")
        print(f"{len(shapes)} shapes, {count} measurements")
        return 0

    compile_s: dict[str, float] = {}
    for name, method in fi_compile.items():
        print(
            f"{name}: JIT-compiling FlashInfer {method.fi_backend!r} prefill kernels for {args.dtype}, "
            f"(Dqk, Dv) = ({DQK}, {DV}) (once; about 80 s for fa3 on a fresh machine)...",
            flush=True,
        )
        t0 = time.perf_counter()
        try:
            method.compile(device, dtype)
            compile_s[name] = time.perf_counter() - t0
            print(f"{name}: ready after {compile_s[name]:.1f} s")
        except Exception as exc:
            print(f"{name}: compile failed ({C.short_error(exc)}); its rows will show the error")
    config = mla_ops.SelectorConfig(dtype, mla_ops.MLADimensions.from_head_dims(DQK, DV))
    for row in backends if device.type == "cuda" else []:
        if any(isinstance(m, OpMethod) and m.name == row["name"] for m in methods) and row["class"] is not None:
            print(f"{row['name']}: warming up (may JIT-compile)...", flush=True)
            t0 = time.perf_counter()
            try:
                for heads in sorted({s.heads for s in shapes if s.suite != "merge"}):
                    row["class"].warmup(device, config, heads)
                compile_s[row["name"]] = time.perf_counter() - t0
            except Exception as exc:
                print(f"{row['name']}: warm-up failed ({C.short_error(exc)}); its rows will show the error")
    if compile_s:
        env["warmup_s"] = {k: round(v, 1) for k, v in compile_s.items()}

    progress = C.Progress(count, "bench_prefill", enabled=not args.no_progress)
    measure_start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    sm_clocks: list[int] = []
    with _logging_to(progress):
        for shape in shapes:
            rows += run_shape(shape, methods, args, device, dtype, progress)
            if device.type == "cuda":
                clock = C.query_clocks(device)["sm_clock_mhz"]
                if clock.isdigit():
                    sm_clocks.append(int(clock))
    progress.close()
    if sm_clocks:
        median = statistics.median(sm_clocks)
        env["sm_clock_after_each_shape_mhz"] = f"min {min(sm_clocks)}, median {median:g}, max {max(sm_clocks)}"
    env["measure_s"] = round(time.perf_counter() - measure_start, 1)
    env["elapsed_s"] = round(time.perf_counter() - started, 1)
    if args.append and (out_dir / "results.csv").is_file():
        rows = merge_rows(load_rows(out_dir / "results.csv"), rows, all_shapes)
        previous = out_dir / "results.env.json"
        if previous.is_file():
            old = json.loads(previous.read_text())
            earlier = [*old.get("appended_to", []), f"{old.get('date')}: {old.get('command')}"]
            env["appended_to"] = earlier

    notes = write_outputs(rows, env, out_dir)
    summary = overhead_summary(rows)
    if summary:
        print("op overhead (op throughput / own raw call, target >= 0.97):\n" + summary.replace("**", ""))
    wrong = sorted({f"{r['method']} on {r['shape']}" for r in rows if r["status"] == "WRONG"})
    if wrong:
        print("WRONG results (exceed the tolerance): " + ", ".join(wrong))
    for note in notes:
        print("note: " + note)
    written = ", ".join(p.name for p in sorted(out_dir.glob("results.*")))
    print(f"wrote {written} to {out_dir}: {env['elapsed_s']:.0f} s in all, {env['measure_s']:.0f} s measuring")
    return 0


if __name__ == "__main__":
    sys.exit(main())
