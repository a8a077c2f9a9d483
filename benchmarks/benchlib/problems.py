"""What the benchmarks run on: shapes, ragged offsets, and inputs laid out as an MLA layer produces them.

Two levels:

- **one call**: a :class:`Shape` (heads, new-token lengths, context lengths) and the :class:`Problem`
  built from it: ``q``/``k`` ``[T, H, Dqk]``, ``v`` ``[T, H, Dv]`` as the strided view of a
  ``[T, H, 128 + Dv]`` ``kv_b_proj`` output that MLA hands the kernels, int32 offsets, and for the merge
  two partial outputs with their LSEs;
- **a model**: :class:`MLAStack`, a stack of :class:`mla_ops.model.MLAAttention` layers, and
  :func:`serving_batches`, ragged batches of fixed token totals whose per-sequence split changes from
  batch to batch, each with one chunk of cached context.
"""

from __future__ import annotations

import fnmatch
import functools
import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from mla_ops.model import MLABatch, MLAConfig

#: DeepSeek-V3's MLA head dims: q/k heads are 128 no-position + 64 rotary channels, v heads 128.
DQK, DV = 192, 128
#: Channels of ``k_nope`` that precede ``v`` in each head of ``kv_b_proj``'s output.
KV_NOPE = DQK - 64


# --- devices --------------------------------------------------------------------------------------


def pick_device(requested: str | None) -> torch.device:
    """``requested``, else ``cuda`` when a GPU is present, else ``cpu``; exits with a message if CUDA
    was asked for and is absent."""
    import torch

    if requested:
        device = torch.device(requested)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise SystemExit(
                f"--device {requested}: torch.cuda.is_available() is False on this machine; use --device cpu"
            )
        return device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def setup_device(
    args: Any, gpu_defaults: dict[str, Any] | None = None, cpu_defaults: dict[str, Any] | None = None
) -> tuple[torch.device, torch.dtype]:
    """The device (``args.device``, see :func:`pick_device`) and dtype (``args.dtype``) of a run.

    Every attribute of ``args`` that is still ``None`` and has a default for the device's kind gets it:
    ``warmup_ms`` / ``rep_ms`` the timer's (smaller on CPU, where runs test the scripts), then those of
    ``gpu_defaults`` or ``cpu_defaults``.
    """
    import torch

    from .timing import CPU_REP_MS, CPU_WARMUP_MS, DEFAULT_REP_MS, DEFAULT_WARMUP_MS

    device = pick_device(getattr(args, "device", None))
    cuda = device.type == "cuda"
    defaults = {
        "warmup_ms": DEFAULT_WARMUP_MS if cuda else CPU_WARMUP_MS,
        "rep_ms": DEFAULT_REP_MS if cuda else CPU_REP_MS,
    }
    defaults.update((gpu_defaults if cuda else cpu_defaults) or {})
    for key, value in defaults.items():
        if getattr(args, key, value) is None:
            setattr(args, key, value)
    return device, getattr(torch, getattr(args, "dtype", "bfloat16"))


def require_cuda(script: str, needs: str) -> torch.device:
    """The current CUDA device; without one, print why ``script`` needs it (for ``needs``) and exit with
    status 2, having measured nothing."""
    import sys

    import torch

    if not torch.cuda.is_available():
        print(
            f"{script}: {needs} needs a CUDA device, and torch.cuda.is_available() is False on this machine; "
            "nothing was measured",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return torch.device("cuda", torch.cuda.current_device())


# --- offsets --------------------------------------------------------------------------------------


def offsets(lengths: Sequence[int], device: torch.device | str | None) -> torch.Tensor:
    """``cu_seqlens`` of a ragged batch: int32 ``[B+1]``, ``[0, l0, l0+l1, ...]``, on ``device``."""
    import torch

    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def split_lengths(total: int, parts: int, rng: random.Random, minimum: int = 1) -> list[int]:
    """``parts`` random lengths, each at least ``minimum``, that add up to ``total``.

    The cut points are uniform over the ``total - parts * minimum`` tokens left after the minimums, so
    batches mix long and short sequences as a serving scheduler's do.
    """
    spare = total - parts * minimum
    if parts < 1 or spare < 0:
        raise ValueError(f"cannot split {total} tokens into {parts} sequences of at least {minimum}")
    cuts = sorted(rng.randint(0, spare) for _ in range(parts - 1))
    return [minimum + b - a for a, b in zip([0, *cuts], [*cuts, spare])]


# --- shapes of one call ---------------------------------------------------------------------------


def _runs(lengths: Sequence[int]) -> str:
    if not lengths:
        return "0"
    if len(set(lengths)) == 1:
        return f"{len(lengths)}x{lengths[0]}"
    return "+".join(map(str, lengths))


@dataclass(frozen=True)
class Shape:
    """One benchmark problem.

    ``q_lens`` are the new tokens per sequence; ``k_lens`` the context chunk per sequence (chunk suite
    only); for the merge suite ``q_lens`` is ``(T,)``. ``series`` and ``x`` place it on a plot
    (``series == ""``: table only); ``tags`` select it (``ref``, ``quick``).
    """

    suite: str  # "causal", "chunk" or "merge"
    heads: int
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...] = ()
    series: str = ""
    x: int = 0
    tags: frozenset[str] = frozenset()

    @property
    def id(self) -> str:
        """A stable identifier, e.g. ``causal-h16-4x4096`` or ``chunk-h128-1x1024-ctx1x16384``."""
        lengths = f"t{self.q_lens[0]}" if self.suite == "merge" else _runs(self.q_lens)
        if self.suite == "chunk":
            lengths += f"-ctx{_runs(self.k_lens)}"
        return f"{self.suite}-h{self.heads}-{lengths}"

    @property
    def label(self) -> str:
        """A readable label for tables."""
        if self.suite == "merge":
            return f"T={self.q_lens[0]}, Dv={DV}"
        if self.suite == "chunk":
            return f"{_runs(self.q_lens)} new over {_runs(self.k_lens)} ctx"
        if len(set(self.q_lens)) > 1:
            return "mixed [" + ",".join(map(str, self.q_lens)) + "]"
        return _runs(self.q_lens)

    @property
    def short_label(self) -> str:
        """``4x4096`` for a single-length batch, ``mixed`` otherwise (causal); the label for chunks."""
        if self.suite == "causal" and len(set(self.q_lens)) > 1:
            return "mixed"
        return self.label

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


def _shape_set(
    heads: tuple[int, int],
    sweep: tuple[int, ...],
    sweep_tokens: int,
    reference: set[tuple[int, int]],
    mixed: tuple[int, ...],
    chunk_new: int,
    contexts: tuple[int, ...],
    quick_chunk: tuple[int, int],
    merge_tokens: int,
    long: tuple[Shape, ...] = (),
) -> list[Shape]:
    """bench_prefill's structure: causal length sweeps of ``sweep_tokens`` tokens per batch at both head
    counts, a mixed batch at the larger, chunks of ``chunk_new`` new tokens (1 and 4 sequences) over each
    total context, and the merge. ``reference`` (heads, length) pairs and the mixed batch are tagged
    ``ref`` and ``quick``; the ``quick_chunk`` (heads, context) chunk and the merges ``quick``. ``long`` shapes
    (tagged ``long``) come before the merges."""
    ref, quick = frozenset({"ref", "quick"}), frozenset({"quick"})
    shapes = []
    for h in heads:
        for s in sweep:
            tags = ref if (h, s) in reference else frozenset()
            shapes.append(Shape("causal", h, (s,) * (sweep_tokens // s), series="causal", x=s, tags=tags))
    shapes.append(Shape("causal", heads[-1], mixed, tags=ref))
    for h in heads:
        for ctx in contexts:
            tags = quick if (h, ctx) == quick_chunk else frozenset()
            shapes.append(Shape("chunk", h, (chunk_new,), (ctx,), series="chunk 1 seq", x=ctx, tags=tags))
            shapes.append(Shape("chunk", h, (chunk_new // 4,) * 4, (ctx // 4,) * 4, series="chunk 4 seqs", x=ctx))
    shapes += long
    shapes += [Shape("merge", h, (merge_tokens,), tags=quick) for h in heads]
    return shapes


def _long(heads: int, causal: tuple[int, ...], chunk: tuple[int, int]) -> tuple[Shape, ...]:
    """One sequence of each ``causal`` length and ``chunk = (new, context)``, tagged ``long``."""
    tags = frozenset({"long"})
    new, context = chunk
    causal_shapes = (Shape("causal", heads, (s,), tags=tags) for s in causal)
    return (*causal_shapes, Shape("chunk", heads, (new,), (context,), tags=tags))


def gpu_shapes() -> list[Shape]:
    """bench_prefill's GPU set: length sweeps of 16384 tokens at H=16 and 128, the reference shapes (4x4096
    at H=16, 2x8192 and a mixed batch at H=128), 1024 new tokens over 8k to 32k of context, long prompts at H=128
    (one sequence of 32k and of 128k tokens, 1024 new over 128k of context), the merge."""
    return _shape_set((16, 128), (512, 1024, 2048, 4096, 8192, 16384), 16384, {(16, 4096), (128, 8192)},
                      (512, 1024, 2048, 3000, 700), 1024, (8192, 16384, 32768), (128, 16384), 16384,
                      _long(128, (32768, 131072), (1024, 131072)))  # fmt: skip


def cpu_shapes() -> list[Shape]:
    """bench_prefill's CPU set: the same structure at tiny sizes (H=2 and 4, lengths 16..256), for CI."""
    return _shape_set((2, 4), (16, 32, 64), 128, {(2, 32), (4, 64)}, (16, 40, 64, 24), 16, (64, 128), (4, 64), 256,
                      _long(4, (256,), (16, 512)))  # fmt: skip


#: Context-chunk shapes of the Triton tuning sweep: 1024 new tokens over 8192 of context.
TUNING_CHUNK_SHAPES = (Shape("chunk", 16, (1024,), (8192,)), Shape("chunk", 128, (1024,), (8192,)))


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
                f"(causal, chunk, merge) or a tag (ref, quick, long). Ids: {', '.join(s.id for s in shapes)}"
            )
        chosen += [s for s in hits if s not in chosen]
    return [s for s in shapes if s in chosen]


# --- the inputs of one call -----------------------------------------------------------------------


@dataclass
class Problem:
    """The tensors of one shape on a device.

    Attention: ``q``/``k`` ``[T, H, Dqk]``, ``v`` ``[T, H, Dv]`` (a strided view, see :func:`make_problem`),
    int32 offsets with ``cu_k is cu_q`` on the causal path, and the ``max_seqlen`` bounds. Merge:
    ``merge = (out_a, lse_a, out_b, lse_b)``, outputs ``[T, H, Dv]`` and LSEs float32 ``[H, T]``.
    """

    shape: Shape
    device: torch.device
    dtype: torch.dtype
    scale: float
    q: Any = None
    k: Any = None
    v: Any = None
    cu_q: Any = None
    cu_k: Any = None
    max_q: int = 0
    max_k: int = 0
    q_lens: list[int] = field(default_factory=list)
    k_lens: list[int] = field(default_factory=list)
    merge: tuple[Any, ...] = ()

    @property
    def causal(self) -> bool:
        return self.shape.suite == "causal"

    @property
    def heads(self) -> int:
        return self.shape.heads

    def attention_args(self) -> tuple[Any, ...]:
        """``(q, k, v, cu_q, cu_k, max_q, max_k, scale)``: what every attention call takes, in order."""
        return self.q, self.k, self.v, self.cu_q, self.cu_k, self.max_q, self.max_k, self.scale


def make_problem(
    shape: Shape, device: torch.device, dtype: torch.dtype, seed: int = 0, padding_rows: int = 0
) -> Problem:
    """Random inputs for ``shape`` (standard normal, like the tests).

    ``v`` is laid out as MLA produces it: the last ``Dv`` channels of a ``[Tk, H, 128 + Dv]``
    ``kv_b_proj`` output, a strided view. Every method reads that same view; a method that needs
    another layout builds it outside its timed region. ``padding_rows`` appends rows past
    ``cu_q[-1]`` (and past ``cu_k[-1]``) that no sequence owns, as a CUDA graph's token budget leaves.
    """
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=device, dtype=dt)

    p = Problem(shape, device, dtype, 1.0 / math.sqrt(DQK))
    H = shape.heads
    if shape.suite == "merge":
        T = shape.q_lens[0]
        out_a, out_b = randn(T, H, DV), randn(T, H, DV)
        lse_a, lse_b = (randn(H, T, dt=torch.float32) * 2 + 5 for _ in range(2))
        p.merge = (out_a, lse_a, out_b, lse_b)
        return p
    k_lens = shape.k_lens or shape.q_lens
    tq, tk = sum(shape.q_lens) + padding_rows, sum(k_lens) + padding_rows
    kv = randn(tk, H, KV_NOPE + DV)
    p.q, p.k, p.v = randn(tq, H, DQK), randn(tk, H, DQK), kv[..., KV_NOPE:]
    p.cu_q = offsets(shape.q_lens, device)
    p.cu_k = p.cu_q if shape.suite == "causal" else offsets(k_lens, device)
    p.max_q, p.max_k = max(shape.q_lens), max(k_lens)
    p.q_lens, p.k_lens = list(shape.q_lens), list(k_lens)
    return p


# --- a model: stacks of MLA layers and serving batches ----------------------------------------------


def mla_config(hidden_size: int, num_heads: int) -> MLAConfig:
    """An MLA layer with DeepSeek-V3's head dims and latent rank, at the given width and head count."""
    from mla_ops.model import MLAConfig

    return MLAConfig(hidden_size=hidden_size, num_heads=num_heads)


@functools.cache
def _stack_class() -> type:
    from torch import nn

    from mla_ops.model import MLAAttention

    class MLAStack(nn.Module):
        """``depth`` MLA layers with residual connections, all reading the same ragged batch."""

        def __init__(self, config: MLAConfig, depth: int, device: torch.device, dtype: torch.dtype) -> None:
            super().__init__()
            self.layers = nn.ModuleList(MLAAttention(config, device=device, dtype=dtype) for _ in range(depth))

        def forward(self, hidden, positions, cu_seqlens, max_seqlen, context=()):
            for layer in self.layers:
                hidden = hidden + layer(hidden, positions, cu_seqlens, max_seqlen, context)
            return hidden

    return MLAStack


def mla_stack(config: MLAConfig, depth: int, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Any:
    """``MLAStack``: ``depth`` :class:`mla_ops.model.MLAAttention` layers with residual connections.

    ``forward(hidden [T, hidden_size], positions [T], cu_seqlens, max_seqlen, context=())`` returns
    ``[T, hidden_size]``; every layer reads the same offsets and context chunks.
    """
    import torch

    torch.manual_seed(seed)
    return _stack_class()(config, depth, device, dtype)


def stack_of(args: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """The :func:`mla_stack` that a script's ``--layers``, ``--heads``, ``--hidden`` and ``--seed`` describe
    (see :func:`benchlib.cli.add_stack`)."""
    return mla_stack(mla_config(args.hidden, args.heads), args.layers, device, dtype, args.seed)


def stack_description(args: Any) -> str:
    """:func:`stack_of`'s stack in words, for a results page: its layers, hidden size, heads and head dims."""
    return f"A stack of {args.layers} MLA layers (hidden {args.hidden}, H={args.heads}, (Dqk, Dv) = ({DQK}, {DV}))"


def stack_settings(args: Any) -> dict[str, int]:
    """``layers``, ``heads`` and ``hidden`` of :func:`stack_of`'s stack, for a run's environment record."""
    return {"layers": args.layers, "heads": args.heads, "hidden": args.hidden}


def batch_args(batch: MLABatch) -> tuple[Any, ...]:
    """``(hidden, positions, cu_seqlens, max_seqlen, context)``: the arguments of a layer or stack."""
    return batch.hidden, batch.positions, batch.cu_seqlens, batch.max_seqlen, batch.context


@dataclass(frozen=True)
class ServingSize:
    """A serving-sized batch: ``new_tokens`` over ``num_seqs`` sequences, with ``context_tokens`` of
    cached context in one chunk (0: no chunk)."""

    new_tokens: int
    num_seqs: int
    context_tokens: int

    @property
    def label(self) -> str:
        return f"{self.new_tokens} new / {self.num_seqs} seqs / {self.context_tokens} ctx"

    @classmethod
    def parse(cls, text: str, default_context: str = "same") -> ServingSize:
        """``"NEWxSEQS"`` or ``"NEWxSEQS+CTX"``; without ``+CTX`` the context is ``default_context``
        (``"same"``: as many tokens as the new ones, or a number). Raises ``ValueError`` on bad text."""
        head, _, ctx = text.strip().partition("+")
        new, _, seqs = head.partition("x")
        try:
            n, b = int(new), int(seqs)
            c = int(ctx) if ctx else (n if default_context == "same" else int(default_context))
        except ValueError:
            raise ValueError(
                f"cannot parse batch size {text!r}; write NEWxSEQS or NEWxSEQS+CTX, e.g. 2048x16+4096"
            ) from None
        if n < b or b < 1 or c < 0:
            raise ValueError(f"batch size {text!r}: need at least one new token per sequence and no negative context")
        return cls(n, b, c)


def parse_serving_size(text: str, option: str) -> ServingSize:
    """:meth:`ServingSize.parse` for the command-line ``option``: exits with a message naming it on bad text."""
    try:
        return ServingSize.parse(text)
    except ValueError as exc:
        raise SystemExit(f"{option}: {exc}") from None


def serving_batches(
    layer: Any,
    size: ServingSize,
    count: int,
    seed: int,
    context_fraction: float = 0.75,
    exact_bounds: bool = False,
) -> list[MLABatch]:
    """``count`` random batches of ``size`` for ``layer`` (an :class:`mla_ops.model.MLAAttention`).

    Every batch has the same token totals, and so the same tensor shapes, but its own split of them
    over the sequences; about ``context_fraction`` of the sequences have cached context (all of it in
    one chunk), the others none. ``max_seqlen`` and the chunk's ``max_seqlen_k`` are the totals: upper
    bounds that stay the same from batch to batch, as a captured graph needs (every backend accepts a
    bound); ``exact_bounds=True`` gives the batch's longest lengths instead, as an eager caller passes.
    Deterministic in ``seed``: two calls give the same lengths and data.
    """
    import torch

    from mla_ops.model import random_batch

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        new = split_lengths(size.new_tokens, size.num_seqs, rng)
        context = [0] * size.num_seqs
        if size.context_tokens:
            with_context = max(1, round(context_fraction * size.num_seqs))
            owners = sorted(rng.sample(range(size.num_seqs), with_context))
            for i, n in zip(owners, split_lengths(size.context_tokens, with_context, rng)):
                context[i] = n
        batch = random_batch(layer, new, context, chunk_size=max(max(context), 1), generator=gen)
        if exact_bounds:
            batches.append(batch)
            continue
        batch = replace(batch, max_seqlen=size.new_tokens)
        if batch.context:
            (chunk,) = batch.context
            batch.context = [chunk._replace(max_seqlen_k=size.context_tokens)]
        batches.append(batch)
    return batches
