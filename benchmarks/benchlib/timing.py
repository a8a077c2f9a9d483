"""The benchmarks' one timer, and the alternating-rounds helper for ratio measurements.

:func:`measure` times a callable the way ``triton.testing.do_bench`` does on CUDA: one untimed call,
an estimate from five calls, warm-up calls worth ``warmup_ms``, then samples worth ``rep_ms``, each
bracketed by CUDA events and preceded by zeroing a buffer larger than L2 (so that every sample starts
with a cold cache); the median is the figure. On CPU the samples are ``time.perf_counter`` intervals.
Options cover the other uses: several back-to-back calls per sample (host cost of tiny calls, graph
replays), a synchronisation before each sample (a step's latency, host issue time included), and a
fixed number of samples (a list of distinct batches, one per sample).

:func:`alternating` measures several callables in rounds, taking turns within each round, and
:func:`difference_of_rounds` turns two of them into the median of their per-round differences. :func:`interleaved`
takes turns sample by sample instead, and :func:`interleaved_ratio` (the op/raw ratio of every script)
takes the median ratio of neighbouring samples in each round. A ratio of two
single measurements taken at different moments carries the drift of the GPU's clocks and temperature
between those moments (several percent on long kernels); within one round both sides see the same
machine, and the median over rounds discards the rounds that drift hit. :func:`settled_ratio` compares two
functions that draw different power: under a power cap, samples in turns would run both at the clock of their mix,
so it times each in phases long enough for the clock to settle to what that function draws alone.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: Defaults of :func:`measure` on CUDA (``triton.testing.do_bench``'s); the scripts use smaller ones on CPU.
DEFAULT_WARMUP_MS = 25.0
DEFAULT_REP_MS = 100.0
#: Smaller budgets for CPU runs, which test the scripts rather than measure.
CPU_WARMUP_MS = 2.0
CPU_REP_MS = 10.0
#: Rounds of :func:`alternating` for an op/raw ratio, shared by every script that reports one.
DEFAULT_ROUNDS = 7
#: :func:`settled_ratio`'s untimed run before each phase and each phase's timed budget on CUDA: an H100 at its
#: 700 W cap moved its SM clock to what one attention kernel draws within about a second of back-to-back calls.
SETTLE_MS = 1000.0
PHASE_MS = 1000.0
#: Bytes zeroed before each CUDA sample: larger than any GPU's L2 (the H200's is 50 MiB), as do_bench does.
FLUSH_BYTES = 256 << 20

_flush_buffers: dict[Any, torch.Tensor] = {}


@dataclass(frozen=True)
class Timing:
    """The samples of one :func:`measure` call, in milliseconds per call of the function."""

    samples_ms: tuple[float, ...]

    @property
    def median_ms(self) -> float:
        """The median sample: the figure every script reports."""
        return statistics.median(self.samples_ms)

    @property
    def min_ms(self) -> float:
        return min(self.samples_ms)

    @property
    def max_ms(self) -> float:
        return max(self.samples_ms)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _flush_buffer(device: torch.device) -> torch.Tensor:
    import torch

    buffer = _flush_buffers.get(device)
    if buffer is None:
        buffer = _flush_buffers[device] = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=device)
    return buffer


def describe(device: torch.device) -> str:
    """What :func:`measure` measures with on ``device``, for the environment record."""
    if device.type == "cuda":
        return (
            "CUDA events around each sample, L2 flushed before each, after warm-up (as triton.testing.do_bench); "
            "median of the samples"
        )
    return "time.perf_counter around each sample, after warm-up; median of the samples"


def _clamp(value: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, value)))


def measure(
    fn: Callable[[], Any],
    device: torch.device,
    *,
    warmup_ms: float = DEFAULT_WARMUP_MS,
    rep_ms: float = DEFAULT_REP_MS,
    samples: int | None = None,
    warmup_calls: int | None = None,
    calls_per_sample: int = 1,
    flush_l2: bool = True,
    sync_each: bool = False,
    min_samples: int = 5,
    max_samples: int = 1000,
) -> Timing:
    """Time ``fn``; returns the samples in milliseconds per call.

    Args:
        fn: what is timed; its result is discarded.
        device: where ``fn`` runs: CUDA events on ``cuda``, ``time.perf_counter`` otherwise.
        warmup_ms, rep_ms: time budgets for the warm-up calls and for the samples, converted to counts
            from an estimate over five calls (as do_bench does), or over one where that one call takes
            ``rep_ms``. Ignored where ``warmup_calls`` / ``samples`` give the counts.
        samples: take exactly this many samples, with no estimate and no untimed first call (for a
            ``fn`` that consumes one distinct input per call). Warm-up is then ``warmup_calls`` or 0.
        warmup_calls: untimed calls before the samples.
        calls_per_sample: back-to-back calls per sample; a sample's time is divided by it.
        flush_l2: on CUDA, zero a buffer larger than L2 before each sample (outside its events).
        sync_each: synchronise the device before each sample, so that a sample also contains the
            host's time to issue the work (a step's latency) instead of only the device's time.
        min_samples, max_samples: bounds of the sample count derived from ``rep_ms``.
    """
    prepare, run = _preparer(device, flush_l2, sync_each), _repeated(fn, calls_per_sample)
    if samples is None:
        fn()
        synchronize(device)
        estimate = _estimate_ms(prepare, run, device, rep_ms) / calls_per_sample
        n_warmup = warmup_calls if warmup_calls is not None else _clamp(warmup_ms / max(estimate, 1e-6), 1, 1000)
        n_samples = _clamp(rep_ms / max(estimate * calls_per_sample, 1e-6), min_samples, max_samples)
    else:
        n_warmup, n_samples = warmup_calls or 0, samples
    for _ in range(n_warmup):
        fn()
    with gc_paused():
        times = _samples(prepare, run, device, n_samples)
    return Timing(tuple(t / calls_per_sample for t in times))


def _preparer(device: torch.device, flush_l2: bool, sync_each: bool) -> Callable[[], None]:
    """What precedes each sample: a synchronisation (``sync_each``) and, on CUDA, an L2 flush (``flush_l2``)."""
    flush = _flush_buffer(device) if device.type == "cuda" and flush_l2 else None

    def prepare() -> None:
        if sync_each:
            synchronize(device)
        if flush is not None:
            flush.zero_()

    return prepare


def _repeated(fn: Callable[[], Any], calls: int) -> Callable[[], None]:
    """One sample's work: ``calls`` back-to-back calls of ``fn``."""

    def run() -> None:
        for _ in range(calls):
            fn()

    return run


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """As timeit does, the garbage collector paused while samples are taken: a collection that earlier
    allocations trigger would otherwise land in whichever function's sample runs next, which on
    microsecond host-bound calls is larger than the cost being measured."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _estimate_ms(prepare: Callable[[], None], run: Callable[[], None], device: torch.device, budget_ms: float) -> float:
    """Mean time of one sample, with what precedes each: of one sample where it takes at least ``budget_ms`` (the
    counts derived from the estimate are then at their lower bounds: five more calls of a second-long kernel would
    buy nothing), else of five more (do_bench's estimate)."""
    one = _mean_ms(prepare, run, device, 1)
    return one if one >= budget_ms else _mean_ms(prepare, run, device, 5)


def _mean_ms(prepare: Callable[[], None], run: Callable[[], None], device: torch.device, n: int) -> float:
    """Mean time of ``n`` samples run back to back, with what precedes each."""
    import torch

    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(n):
            prepare()
            run()
        return (time.perf_counter() - start) * 1e3 / n
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(n):
        prepare()
        run()
    end.record()
    torch.cuda.synchronize(device)
    return begin.elapsed_time(end) / n


def _samples(prepare: Callable[[], None], run: Callable[[], None], device: torch.device, n: int) -> list[float]:
    import torch

    if device.type != "cuda":
        out = []
        for _ in range(n):
            prepare()
            start = time.perf_counter()
            run()
            out.append((time.perf_counter() - start) * 1e3)
        return out
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        prepare()
        starts[i].record()
        run()
        ends[i].record()
    torch.cuda.synchronize(device)
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def host_issue(fn: Callable[[], Any], device: torch.device, calls: int, rounds: int) -> list[float]:
    """Host time of issuing ``fn``, in ms per call, in each of ``rounds`` rounds: ``time.perf_counter`` around
    ``calls`` back-to-back calls, the device synchronised before each round (and after it, untimed).

    Unlike :func:`measure`, nothing waits for the device within a round, so for a call whose kernels run
    longer than the host takes to issue them the figure is still the host's: the launches queue up. Keep
    ``calls`` well below the launch queue's depth (about a thousand kernels), past which issuing blocks.
    """
    if calls < 1 or rounds < 1:
        raise ValueError(f"calls and rounds must be at least 1, got {calls} and {rounds}")
    out = []
    with gc_paused():
        for _ in range(3):  # warm-up
            fn()
        for _ in range(rounds):
            synchronize(device)
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            out.append((time.perf_counter() - start) * 1e3 / calls)
        synchronize(device)
    return out


def alternating(
    fns: Mapping[str, Callable[[], Any]],
    device: torch.device,
    rounds: int = DEFAULT_ROUNDS,
    per_fn: Mapping[str, Mapping[str, Any]] | None = None,
    reverse_odd_rounds: bool = False,
    **measure_kwargs: Any,
) -> dict[str, list[float]]:
    """Each function's median time (ms per call) in each of ``rounds`` rounds; within a round the
    functions take turns in the order given, each measured for its whole budget before the next (for
    ratios of neighbouring samples, see :func:`interleaved`).

    ``reverse_odd_rounds``: odd rounds take the functions in the reverse order, so that over the rounds
    each function runs as often before as after each other one (a drift of the host within a round then
    favours neither side of a per-round difference).
    ``measure_kwargs`` go to :func:`measure` for every function, ``per_fn[name]`` on top for one.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    per_fn = per_fn or {}
    medians: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for round_index in range(rounds):
        order = names[::-1] if reverse_odd_rounds and round_index % 2 else names
        for name in order:
            timing = measure(fns[name], device, **{**measure_kwargs, **per_fn.get(name, {})})
            medians[name].append(timing.median_ms)
    return medians


@dataclass(frozen=True)
class RoundsRatio:
    """``numerator / denominator`` measured in alternating rounds."""

    median: float  # median over rounds of the per-round ratio: the figure reported
    low: float  # smallest and largest per-round ratio: the spread the median was taken over
    high: float
    rounds: int
    numerator_ms: float  # median over rounds of each side's time
    denominator_ms: float

    @classmethod
    def of(cls, ratios: Sequence[float], numerators: Sequence[float], denominators: Sequence[float]) -> RoundsRatio:
        """From each round's ratio and each side's time in it."""
        return cls(
            median=statistics.median(ratios),
            low=min(ratios),
            high=max(ratios),
            rounds=len(ratios),
            numerator_ms=statistics.median(numerators),
            denominator_ms=statistics.median(denominators),
        )


@dataclass(frozen=True)
class RoundsDifference:
    """``minuend - subtrahend`` measured in alternating rounds, in the series' unit."""

    median: float  # median over rounds of the per-round difference: the figure reported
    low: float  # first and third quartile of the per-round differences: how far the rounds agree
    high: float
    rounds: int


def difference_of_rounds(minuend: Sequence[float], subtrahend: Sequence[float]) -> RoundsDifference:
    """The median and quartiles of the per-round differences of two :func:`alternating` series of equal
    length (or of two :func:`interleaved` ones: sample by sample). Where both sides drift together from
    round to round (a shared host's load), the per-round difference cancels the drift that a difference of
    the two medians keeps."""
    if len(minuend) != len(subtrahend) or not minuend:
        raise ValueError("difference_of_rounds needs two non-empty series of the same length")
    differences = sorted(a - b for a, b in zip(minuend, subtrahend))
    if len(differences) == 1:
        low = high = differences[0]
    else:
        low, _, high = statistics.quantiles(differences, n=4, method="inclusive")
    return RoundsDifference(statistics.median(differences), low, high, len(differences))


def interleaved(
    fns: Mapping[str, Callable[[], Any]],
    device: torch.device,
    *,
    warmup_ms: float = DEFAULT_WARMUP_MS,
    rep_ms: float = DEFAULT_REP_MS,
    calls_per_sample: int = 1,
    flush_l2: bool = True,
    sync_each: bool = False,
    min_samples: int = 5,
    max_samples: int = 1000,
    contexts: Mapping[str, Callable[[], contextlib.AbstractContextManager]] | None = None,
) -> dict[str, list[float]]:
    """Samples of several functions taken in turns sample by sample, in milliseconds per call.

    Sample ``i`` of every function is taken before sample ``i + 1`` of any, in the order of ``fns`` for
    even ``i`` and in the reverse order for odd ``i``. So the ``i``-th samples of two functions lie
    microseconds to milliseconds apart and see the same GPU clocks and temperature (a ratio of such
    neighbours does not carry the drift that separates two measurements of 100 ms each,
    :func:`alternating`), and each function runs first as often as last (running right after another
    function, with its caches cold, costs the first one more). The number of samples is even. Each
    sample is timed as :func:`measure` times one (``flush_l2``, ``sync_each``, ``calls_per_sample``
    alike); ``rep_ms`` is the budget of one function's samples, from an estimate over five samples of
    the slowest one (one where that one takes ``rep_ms``), and each function first gets warm-up calls worth
    ``warmup_ms``.

    ``contexts[name]``: makes a context manager entered around each of that function's samples (e.g. a backend
    forced for it alone). Entering and leaving one may cost the host milliseconds (forcing a backend clears the
    routing caches, and the next call routes afresh), which must not land in a sample: on CUDA each turn of the
    functions is then issued behind a GPU sleep longer than the host took to issue the turn before, so that its
    samples time the device's work alone.
    """
    enter = {name: (contexts or {}).get(name, contextlib.nullcontext) for name in fns}
    prepare = _preparer(device, flush_l2, sync_each)
    runs = {name: _repeated(fn, calls_per_sample) for name, fn in fns.items()}
    estimates = {}
    for name, run in runs.items():
        with enter[name]():
            run()
            synchronize(device)
            estimates[name] = _estimate_ms(prepare, run, device, rep_ms) / calls_per_sample
    slowest = max(estimates.values())
    n_samples = _clamp(rep_ms / max(slowest * calls_per_sample, 1e-6), min_samples, max_samples)
    n_samples += n_samples % 2  # as many samples in each order
    for name, fn in fns.items():
        with enter[name]():
            for _ in range(_clamp(warmup_ms / max(estimates[name], 1e-6), 1, 1000)):
                fn()
    with gc_paused():
        times = _interleaved_samples(prepare, runs, device, n_samples, enter, hide_host=bool(contexts))
    return {name: [t / calls_per_sample for t in series] for name, series in times.items()}


def _interleaved_samples(
    prepare: Callable[[], None],
    runs: Mapping[str, Callable[[], None]],
    device: torch.device,
    n: int,
    enter: Mapping[str, Callable[[], contextlib.AbstractContextManager]],
    hide_host: bool,
) -> dict[str, list[float]]:
    """``n`` samples of each of ``runs`` in turns, each inside ``enter[name]()``; with ``hide_host``, on CUDA, each
    turn behind a GPU sleep (see :func:`interleaved`)."""
    import torch

    forward, backward = list(runs.items()), list(reversed(runs.items()))
    if device.type != "cuda":
        out: dict[str, list[float]] = {name: [] for name in runs}
        for i in range(n):
            for name, run in forward if i % 2 == 0 else backward:
                with enter[name]():
                    prepare()
                    start = time.perf_counter()
                    run()
                    out[name].append((time.perf_counter() - start) * 1e3)
        return out
    events = {name: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
              for name in runs}  # fmt: skip
    if hide_host:
        from mla_ops.cli.tune import sleep_rate

        cycles_per_ms = sleep_rate(device)
    turn_ms = 5.0  # the host time of issuing the last turn, which the next one's sleep must outlast
    for i in range(n):
        if hide_host:
            torch.cuda._sleep(int(cycles_per_ms * (2 * turn_ms + 0.5)))
        start = time.perf_counter()
        for name, run in forward if i % 2 == 0 else backward:
            begin, end = events[name][i]
            with enter[name]():
                prepare()
                begin.record()
                run()
                end.record()
        turn_ms = (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize(device)
    return {name: [b.elapsed_time(e) for b, e in pairs] for name, pairs in events.items()}


def interleaved_ratio(
    numerator: Callable[[], Any],
    denominator: Callable[[], Any],
    device: torch.device,
    rounds: int = DEFAULT_ROUNDS,
    **interleaved_kwargs: Any,
) -> RoundsRatio:
    """``numerator`` time / ``denominator`` time: per round, the median over pairs of neighbouring
    samples in both orders (:func:`interleaved`: samples ``2j`` and ``2j + 1``) of the ratio of the two
    functions' sums over the pair, in which each ran once first and once last; over ``rounds`` rounds,
    the median of those and their range."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    ratios, numerators, denominators = [], [], []
    for _ in range(rounds):
        series = interleaved({"denominator": denominator, "numerator": numerator}, device, **interleaved_kwargs)
        num, den = series["numerator"], series["denominator"]
        pairs = range(0, len(num) - 1, 2)
        ratios.append(statistics.median((num[j] + num[j + 1]) / (den[j] + den[j + 1]) for j in pairs))
        numerators.append(statistics.median(series["numerator"]))
        denominators.append(statistics.median(series["denominator"]))
    return RoundsRatio.of(ratios, numerators, denominators)


def settled_ratio(
    numerator: Callable[[], Any],
    denominator: Callable[[], Any],
    device: torch.device,
    rounds: int = DEFAULT_ROUNDS,
    *,
    settle_ms: float = SETTLE_MS,
    phase_ms: float = PHASE_MS,
    contexts: Mapping[str, Callable[[], contextlib.AbstractContextManager]] | None = None,
    monitor: Callable[[str], contextlib.AbstractContextManager] | None = None,
    **measure_kwargs: Any,
) -> RoundsRatio:
    """``numerator`` time / ``denominator`` time in rounds of settled phases: in each round each function runs
    back to back for ``settle_ms`` untimed, then is timed by :func:`measure` for ``phase_ms`` (its samples'
    median); odd rounds take the two in the reverse order. Per round the ratio of the two medians; over the
    rounds their median and range.

    For two functions that draw different power. A GPU at its power cap moves its clock to the power drawn within
    about a second: samples taken in turns (:func:`interleaved_ratio`) run both at the clock of their mix, so the
    one that draws less is timed at a lower clock than it runs at on its own, as in a serving loop; a phase after
    ``settle_ms`` of the function alone is timed at its own clock.

    ``contexts[name]`` (``"numerator"``, ``"denominator"``): a context manager entered around that function's
    whole phase, settling included (e.g. a backend forced for it). ``monitor(name)``: a context manager entered
    around each timed phase alone (e.g. a sampler of the GPU's clock). ``measure_kwargs`` go to :func:`measure`.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    fns = {"numerator": numerator, "denominator": denominator}
    contexts = contexts or {}
    ratios, medians = [], {name: [] for name in fns}
    for round_index in range(rounds):
        order = list(fns)[::-1] if round_index % 2 else list(fns)
        for name in order:
            with contexts.get(name, contextlib.nullcontext)():
                _run_for(fns[name], device, settle_ms)
                with monitor(name) if monitor is not None else contextlib.nullcontext():
                    timing = measure(fns[name], device, warmup_calls=0, rep_ms=phase_ms, **measure_kwargs)
            medians[name].append(timing.median_ms)
        ratios.append(medians["numerator"][-1] / medians["denominator"][-1])
    return RoundsRatio.of(ratios, medians["numerator"], medians["denominator"])


def _run_for(fn: Callable[[], Any], device: torch.device, budget_ms: float) -> None:
    """Call ``fn`` back to back, untimed, until ``budget_ms`` of wall-clock time has passed (at least once), each
    call waited for, so that the time passed is the device's and no backlog outlasts the budget."""
    start = time.perf_counter()
    fn()
    synchronize(device)
    while (time.perf_counter() - start) * 1e3 < budget_ms:
        fn()
        synchronize(device)
