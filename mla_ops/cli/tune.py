"""``python -m mla_ops tune``: measure this machine's backend cost table.

For each shape of a grid (bench_prefill.py's shapes and small, host-bound ones, at the heads asked for), each
valid backend runs the op under an override, in rounds: in each round every backend in turn (the order reversed
every other round) makes a warm-up call (FlashInfer and FlashAttention-4 compile on first use), then one loop of
calls timed on the host (the host cost) and calls behind a GPU sleep, each timed with CUDA events after an L2 flush
(the device time, with the host's issue hidden, as the benchmarks time it). Where the two fastest backends of a
shape are within :data:`NEAR_TIE` of each other after the rounds asked for, more rounds are measured, up to twice
as many and one. Each shape's size class gets the backends' median device and host times, each backend the median
of its host times too (:class:`mla_ops.cost_table.CostTable`); the table is written atomically to
``$MLA_OPS_CACHE_DIR/tables/sm<NN>.json`` (else ``$XDG_CACHE_HOME/mla_ops/tables/...``, else
``~/.cache/mla_ops/tables/...``) or ``--output``. The measuring loop takes its device, capability and timer
from a :class:`Machine`, so that tests run it against stand-ins on CPU.
Design: docs/design/backends.md (Size classes, tune).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import math
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch

from .. import cost_table
from ..backends.registry import PrefillBackendEnum
from ..cost_table import CostTable, SizeClass
from ..selector import clear_cache, prefill_backend, validate_backend
from ..specs import DEEPSEEK_V3, DeviceCapability, MLADimensions, SelectorConfig
from .info import check_settings, parse_device, parse_dims

#: ``timer(fn, rep_ms, shape) -> (host_us, device_us)``: one round of ``fn``'s host cost and device time per call,
#: measured over about ``rep_ms`` milliseconds of calls after a warm-up call; ``shape`` (a :class:`TuneShape`) is the
#: call's, for a timer that models a GPU rather than timing one (tests).
Timer = Callable[[Callable[[], object], float, "TuneShape"], tuple[float, float]]


@dataclass(frozen=True)
class TuneShape:
    """One measured call: ``causal`` (new tokens) or a chunk, ``heads``, the new tokens per sequence ``q_lens``
    and, for a chunk, the context per sequence ``k_lens``."""

    causal: bool
    heads: int
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...] = ()

    @property
    def keys(self) -> tuple[int, ...]:
        return self.q_lens if self.causal else self.k_lens

    def size_class(self) -> SizeClass:
        """The class of this call (as the ops compute it from the tensors)."""
        return SizeClass.of(
            self.causal, sum(self.q_lens), sum(self.keys), self.heads, len(self.q_lens), max(self.q_lens),
            max(self.keys),
        )  # fmt: skip

    def label(self) -> str:
        def runs(lengths: tuple[int, ...]) -> str:
            return f"{len(lengths)}x{lengths[0]}" if len(set(lengths)) == 1 else "+".join(map(str, lengths))

        text = f"H{self.heads} {runs(self.q_lens)}"
        return text if self.causal else f"{text} over {runs(self.k_lens)}"


#: New-token batches as (sequences, length): host-bound ones, bench_prefill.py's 16384-token sweep (32 x 512 to
#: 1 x 16384), in between, and one 32768-token prompt.
_CAUSAL = ((1, 16), (1, 64), (4, 64), (8, 128), (1, 256), (16, 256), (1, 1024), (4, 1024), (1, 4096), (4, 4096),
           (2, 8192), (1, 16384), (32, 512), (16, 1024), (8, 2048), (1, 32768))  # fmt: skip
#: bench_prefill.py's mixed batch.
_MIXED = (512, 1024, 2048, 3000, 700)
#: Context chunks as (sequences, new tokens in all, context in all): small ones, and bench_prefill.py's 1024 new
#: tokens over 8k to 32k in 1 and 4 sequences and over 128k in one.
_CHUNK = ((1, 16, 256), (1, 64, 1024), (8, 64, 512), (1, 256, 4096), (1, 1024, 8192), (4, 1024, 8192),
          (1, 1024, 16384), (4, 1024, 16384), (1, 1024, 32768), (4, 1024, 32768), (1, 1024, 131072))  # fmt: skip
#: --quick: a few of each, at the first heads only.
_QUICK_CAUSAL = ((1, 64), (1, 1024), (4, 4096))
_QUICK_CHUNK = ((1, 64, 1024), (1, 1024, 8192))


def default_shapes(heads: Sequence[int], quick: bool = False) -> list[TuneShape]:
    """The grid: for each of ``heads``, the new-token and chunk batches above; one shape per size class."""
    shapes = []
    for h in heads[:1] if quick else heads:
        for seqs, length in _QUICK_CAUSAL if quick else _CAUSAL:
            shapes.append(TuneShape(True, h, (length,) * seqs))
        if not quick:
            shapes.append(TuneShape(True, h, _MIXED))
        for seqs, new, context in _QUICK_CHUNK if quick else _CHUNK:
            shapes.append(TuneShape(False, h, (new // seqs,) * seqs, (context // seqs,) * seqs))
    unique: dict[SizeClass, TuneShape] = {}
    for shape in shapes:
        unique.setdefault(shape.size_class(), shape)
    return list(unique.values())


def _inputs(shape: TuneShape, config: SelectorConfig, device: torch.device) -> Callable[[], object]:
    """The op's call on random inputs of ``shape``, laid out as an MLA layer makes them: ``v`` the last ``Dv``
    channels of ``kv_b_proj``'s ``[Tk, H, qk_nope_head_dim + Dv]`` output (``config``'s dimensions), a strided
    view."""
    dqk, dv = config.head_dim_qk, config.head_dim_v
    gen = torch.Generator(device=device).manual_seed(0)
    tq, tk, h = sum(shape.q_lens), sum(shape.keys), shape.heads

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=device, dtype=config.dtype)

    def offsets(lengths: tuple[int, ...]) -> torch.Tensor:
        return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)

    q, k = randn(tq, h, dqk), randn(tk, h, dqk)
    # A view of kv_b_proj's output, as in the layer and the benchmark: the value rows' stride is a speed, since
    # the kernels load them with it (not the [Tk, H, Dqk + Dv] it was, whose stride no model makes).
    nope = config.mla_dimensions.qk_nope_head_dim
    v = randn(tk, h, nope + dv)[..., nope:]
    cu_q = offsets(shape.q_lens)
    scale = dqk**-0.5
    if shape.causal:
        return lambda: torch.ops.mla.prefill(q, k, v, cu_q, max(shape.q_lens), scale)
    cu_k = offsets(shape.k_lens)
    return lambda: torch.ops.mla.prefill_context_chunk(q, k, v, cu_q, cu_k, max(shape.q_lens), max(shape.k_lens), scale)


#: Bytes zeroed before each call timed on the device: more than any GPU's L2 (the H200's is 50 MiB), as
#: benchmarks/bench_prefill.py does (and triton.testing.do_bench), so each call starts with its inputs out of L2.
FLUSH_BYTES = 256 << 20

#: Calls timed one by one on the device per measurement, at most. Each adds a flush, two events and its kernels to
#: the launch queue, which holds about a thousand entries before issuing blocks (and the GPU sleep below must
#: outlast the issue of them all).
MAX_DEVICE_CALLS = 64


def cuda_timer(device: torch.device) -> Timer:
    """A :data:`Timer` on ``device``: after a warm-up call (the first compiles and plans) and one call timed to size
    the loops, the host cost is the wall time per call of a loop of calls (before it synchronises), and the device
    time the median CUDA-event time of calls issued one by one behind a GPU sleep long enough to hide the host's
    issue, L2 flushed before each (:data:`FLUSH_BYTES`), as the benchmarks time them: a layer's attention reads its
    keys and values after other kernels have filled L2, and back-to-back calls of one shape would find part of them
    there."""
    cycles_per_ms = sleep_rate(device)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=device)
    # The fill kernel's first launch loads its module (CUDA's lazy loading): tens of milliseconds of host time that,
    # inside the first timed loop, would outlast the GPU sleep and leave each call timed at the host's pace.
    flush.zero_()
    torch.cuda.synchronize(device)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(MAX_DEVICE_CALLS)
    ]

    def timer(fn: Callable[[], object], rep_ms: float, shape: TuneShape) -> tuple[float, float]:
        fn()
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        one_ms = max((time.perf_counter() - start) * 1e3, 1e-3)
        reps = max(3, min(1000, int(rep_ms / one_ms)))
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        host_ms = (time.perf_counter() - start) * 1e3
        torch.cuda.synchronize(device)
        timed = events[: min(reps, MAX_DEVICE_CALLS)]
        # The sleep outlasts the issue of the timed calls with their flushes and events (about 20 µs each), so each
        # call starts as soon as its flush ends, whatever its host cost.
        issue_ms = len(timed) * (host_ms / reps + 0.02)
        torch.cuda._sleep(int(cycles_per_ms * (2 * issue_ms + 1)))
        for begin, end in timed:
            flush.zero_()
            begin.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        device_ms = statistics.median(begin.elapsed_time(end) for begin, end in timed)
        return host_ms * 1e3 / reps, device_ms * 1e3

    return timer


def sleep_rate(device: torch.device) -> float:
    """GPU clock cycles per millisecond of ``torch.cuda._sleep`` on ``device``."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    torch.cuda._sleep(1000)
    begin.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize(device)
    return cycles / max(begin.elapsed_time(end), 1e-3)


@dataclass
class Machine:
    """What tune measures on: ``device`` (the tensors' device), its ``capability`` and GPU ``name``, and
    ``timer``. :func:`cuda_machine` describes a CUDA device; tests build one around CPU stand-ins."""

    device: torch.device
    capability: DeviceCapability
    name: str
    timer: Timer


def cuda_machine(device: torch.device) -> Machine:
    """The :class:`Machine` of CUDA ``device``, timed by :func:`cuda_timer`."""
    capability = DeviceCapability.of(device)
    assert capability is not None
    return Machine(device, capability, torch.cuda.get_device_name(device), cuda_timer(device))


class Progress:
    """A progress bar with the time left, on ``stream``: redrawn in place on a terminal, else a line per tenth."""

    def __init__(self, total: int, stream: TextIO, estimate_s: float) -> None:
        self.total, self.stream, self.estimate_s = total, stream, estimate_s
        self.start = time.perf_counter()
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.shown_tenths = -1

    def update(self, done: int, what: str) -> None:
        elapsed = time.perf_counter() - self.start
        left = elapsed / done * (self.total - done) if done else self.estimate_s
        width = 30
        filled = width * done // max(self.total, 1)
        line = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} {_duration(elapsed)} elapsed, "
        line += f"about {_duration(left)} left  {what}"
        if self.tty:
            self.stream.write(f"\r\033[K{line}")
            if done == self.total:
                self.stream.write("\n")
        elif done * 10 // max(self.total, 1) != self.shown_tenths or done == self.total:
            self.shown_tenths = done * 10 // max(self.total, 1)
            self.stream.write(line + "\n")
        self.stream.flush()


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


#: Seconds one round of one backend takes beyond its two loops of calls (warm-up, sleep, synchronisation), roughly.
_OVERHEAD_S = 0.02
#: Rounds per backend and shape unless ``--rounds`` says otherwise.
DEFAULT_ROUNDS = 3
#: Two backends whose predicted times (the larger of host and device time, medians over the rounds) differ by less
#: than this fraction of the faster one's are a near-tie: their shape gets more rounds, up to ``2 * rounds + 1``.
NEAR_TIE = 0.05


def _medians(samples: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """A backend's ``(host_us, device_us)`` on a shape: the medians of its rounds', which the table keeps."""
    return statistics.median(h for h, _ in samples), statistics.median(d for _, d in samples)


def _predicted(samples: Sequence[tuple[float, float]]) -> float:
    """A backend's predicted time from its rounds' ``(host_us, device_us)``, as the table predicts a measured class:
    the larger of the median host and the median device time."""
    return max(_medians(samples))


def near_tie(samples: dict[str, list[tuple[float, float]]]) -> bool:
    """Whether the two fastest backends of ``samples`` (rounds of ``(host_us, device_us)`` per backend) are within
    :data:`NEAR_TIE` of each other."""
    times = sorted(_predicted(s) for s in samples.values())
    return len(times) > 1 and times[1] - times[0] < NEAR_TIE * times[0]


def measure_shape(
    machine: Machine,
    fn: Callable[[], object],
    shape: TuneShape,
    members: Sequence[PrefillBackendEnum],
    rep_ms: float,
    rounds: int,
) -> dict[str, list[tuple[float, float]]]:
    """``members``' rounds of ``(host_us, device_us)`` on one shape: ``rounds`` rounds, and more while the two
    fastest are a :func:`near_tie`, up to ``2 * rounds + 1``. In each round every backend is timed in turn, in an
    order reversed every other round, so that a drift of the GPU's clocks or temperature over the shape's rounds
    weighs on every backend alike."""
    samples: dict[str, list[tuple[float, float]]] = {member.name: [] for member in members}
    done = 0
    while done < rounds or (done < 2 * rounds + 1 and near_tie(samples)):
        for member in members if done % 2 == 0 else reversed(members):
            with prefill_backend(member), torch.no_grad():
                samples[member.name].append(machine.timer(fn, rep_ms, shape))
        done += 1
    return samples


def measure(
    machine: Machine,
    shapes: Sequence[TuneShape],
    configs: Sequence[SelectorConfig],
    members: Sequence[PrefillBackendEnum],
    rep_ms: float,
    command: str,
    progress: TextIO | None = None,
    rounds: int = DEFAULT_ROUNDS,
) -> CostTable:
    """Measure every valid backend of ``members`` on every shape and configuration, in ``rounds`` rounds (more
    for a near-tie: :func:`measure_shape`); returns the table.

    A backend is measured through the op under an override (``prefill_backend``), so its time includes the
    op's dispatch and checks as a user's call does. Backends that are not valid for a configuration here are
    left out of its entries, with the reason printed. The plan and a progress bar go to ``progress`` (stderr).
    """
    progress = progress or sys.stderr
    jobs: list[tuple[SelectorConfig, PrefillBackendEnum]] = []
    for config in configs:
        for member in members:
            _, reasons = validate_backend(member, machine.capability, config)
            label = f"{member.name} {str(config.dtype).removeprefix('torch.')} {tuple(config.mla_dimensions)}"
            if reasons:
                progress.write(f"tune: {label}: not measured ({'; '.join(reasons)})\n")
            else:
                jobs.append((config, member))
    if not jobs:
        raise ValueError("no backend is valid here for the configurations asked for; nothing to measure")
    total = len(jobs) * len(shapes)
    estimate = total * rounds * (2 * rep_ms / 1e3 + _OVERHEAD_S)
    progress.write(
        f"tune: {len(shapes)} shapes x {len(jobs)} backend configurations = {total} measurements of {rounds} rounds "
        f"(more for near-ties), about "
        f"{_duration(estimate)}, plus the libraries' first-use compiles (FlashInfer's can take minutes on a bare "
        "machine: `python -m mla_ops warmup` first)\n"
    )
    bar = Progress(total, progress, estimate)
    hosts: dict[str, list[float]] = {}
    device_us: dict[cost_table.ConfigKey, dict[SizeClass, dict[str, float]]] = {}
    class_hosts: dict[cost_table.ConfigKey, dict[SizeClass, dict[str, list[float]]]] = {}
    done = 0
    bar.update(done, "")
    # Shape by shape, the backends of a configuration in interleaved rounds on the same inputs: the backends
    # compared on one class are timed within seconds of each other, in one thermal and clock state (a GPU under
    # minutes of load runs slower than a rested one, and backend by backend the last would be timed on the hottest).
    by_config: dict[SelectorConfig, list[PrefillBackendEnum]] = {}
    for config, member in jobs:
        by_config.setdefault(config, []).append(member)
    for config, config_members in by_config.items():
        key = (str(config.dtype).removeprefix("torch."), config.head_dim_qk, config.head_dim_v)
        for shape in shapes:
            fn = _inputs(shape, config, machine.device)
            size = shape.size_class()
            samples = measure_shape(machine, fn, shape, config_members, rep_ms, rounds)
            for name, rounds_of in samples.items():
                host, device = _medians(rounds_of)
                hosts.setdefault(name, []).append(host)
                device_us.setdefault(key, {}).setdefault(size, {})[name] = device
                class_hosts.setdefault(key, {}).setdefault(size, {}).setdefault(name, []).append(host)
            done += len(config_members)
            extra = f" ({len(next(iter(samples.values())))} rounds: near-tie)" if near_tie(samples) else ""
            bar.update(done, f"{shape.label()}{extra}")
            del fn
    host_us = {name: cost_table.measured_host_cost(samples) for name, samples in hosts.items()}
    class_host_us = {
        key: {size: {name: cost_table.measured_host_cost(s) for name, s in by.items()} for size, by in sizes.items()}
        for key, sizes in class_hosts.items()
    }
    created = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return CostTable(
        machine.capability, machine.name, cost_table.library_versions(), command, host_us, device_us,
        created=created, class_host_us=class_host_us,
    )  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dtype", action="append", choices=["bfloat16", "float16"], help="dtype (repeatable; default bfloat16)"
    )
    parser.add_argument(
        "--dims",
        action="append",
        help=f"MLA dims qk_nope,qk_rope,v (repeatable; default {','.join(map(str, DEEPSEEK_V3))})",
    )
    parser.add_argument(
        "--heads", type=int, action="append", help="query heads per device (repeatable; default 16 and 128)"
    )
    parser.add_argument(
        "--backend",
        action="append",
        choices=[b.name for b in PrefillBackendEnum if b is not PrefillBackendEnum.REFERENCE],
        help="measure only these backends (repeatable; default: every backend valid here)",
    )
    parser.add_argument("--quick", action="store_true", help="a few shapes at the first heads only (a minute)")
    parser.add_argument(
        "--rep-ms", type=float, default=20.0, help="milliseconds of calls per round of a measurement (default 20)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=DEFAULT_ROUNDS,
        help="interleaved rounds per backend and shape; a near-tie gets up to twice as many and one "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--output", default=None, help="where to write the table (default: the user cache, which the selector reads)"
    )
    parser.add_argument("--device", default="cuda", help="CUDA device to measure (default %(default)s)")


def main(args: argparse.Namespace, machine: Machine | None = None) -> int:
    """Run ``tune`` with parsed ``args``; ``machine`` (tests) replaces the CUDA device and its timer."""
    dtypes = [getattr(torch, d) for d in (args.dtype or ["bfloat16"])]
    dims_list: list[MLADimensions] = [parse_dims(d) for d in (args.dims or [",".join(map(str, DEEPSEEK_V3))])]
    heads = args.heads or [16, 128]
    if any(h < 1 for h in heads):
        raise ValueError(f"--heads must be at least 1, got {min(heads)}")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    if not (args.rep_ms > 0 and math.isfinite(args.rep_ms)):
        raise ValueError(f"--rep-ms must be a positive number of milliseconds, got {args.rep_ms}")
    check_settings()
    if args.output and Path(args.output).is_dir():
        example = Path(args.output) / "sm90.json"
        raise ValueError(f"--output {args.output}: is a directory; name a file (e.g. {example})")
    if machine is None:
        parse_device(args.device, ("cuda",), present=False)  # the option's form, on every machine
        if not torch.cuda.is_available():
            raise ValueError("tune measures CUDA devices, and no CUDA device is visible; run it on the GPU to tune")
        machine = cuda_machine(parse_device(args.device, ("cuda",)))
    output = Path(args.output) if args.output else cost_table.user_table_path(machine.capability)
    if output is None:
        raise ValueError(f"{cost_table.native.CACHE_VARIABLE} is invalid; fix it or pass --output")
    members = [PrefillBackendEnum[name] for name in args.backend] if args.backend else [
        b for b in PrefillBackendEnum if b is not PrefillBackendEnum.REFERENCE
    ]  # fmt: skip
    configs = [SelectorConfig(dtype, dims) for dtype in dtypes for dims in dims_list]
    command = "python -m mla_ops tune " + " ".join(shlex.quote(a) for a in sys.argv[2:] if sys.argv[1:2] == ["tune"])
    print(f"tune: {machine.name} (compute capability {machine.capability}), writing {output}")
    shapes = default_shapes(heads, args.quick)
    table = measure(machine, shapes, configs, members, args.rep_ms, command.strip(), rounds=args.rounds)
    cost_table.write(table, output)
    clear_cache()  # this process routes by the new table from now on
    print(f"tune: wrote {output} ({sum(len(c) for c in table.device_us.values())} size classes)")
    for name, host in sorted(table.host_us.items()):
        print(f"  {name:<11} host {host:.1f} µs per call")
    return 0
