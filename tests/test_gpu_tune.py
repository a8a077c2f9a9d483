"""``python -m mla_ops tune``'s timer on a CUDA GPU (``pytest -m gpu``): the device time it reports is the time of the
kernels alone, whatever the host spends issuing them, and each timed call starts with L2 flushed.

The measuring loop itself runs against stand-in timers on CPU (tests/test_tune.py).
"""

from __future__ import annotations

import time

import pytest
import torch

from mla_ops.cli.tune import TuneShape, cuda_timer, sleep_rate

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
SHAPE = TuneShape(True, 16, (16,))


def _busy(us: float) -> None:
    """Spend ``us`` microseconds of host time (a spin: sleeping would give the time back to other threads)."""
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def test_the_device_time_is_the_kernels_alone_behind_a_slow_host() -> None:
    # A call that spends 300 µs on the host and then queues 50 µs of GPU work: the device time must be the 50 µs (the
    # sleep before the timed calls hides their issue), the host cost the 300.
    cycles = int(sleep_rate(DEVICE) * 0.05)
    timer = cuda_timer(DEVICE)

    def call() -> None:
        _busy(300)
        torch.cuda._sleep(cycles)

    host_us, device_us = timer(call, 20.0, SHAPE)
    assert 40 <= device_us <= 65, f"device {device_us:.1f} µs for a 50 µs kernel"
    assert host_us >= 280, f"host {host_us:.1f} µs for a 300 µs host cost"


def test_each_timed_call_finds_l2_flushed() -> None:
    # Summing 16 MiB, which fits in any SM90 GPU's L2: back to back it reads L2, after the timer's flush it reads HBM.
    # The flushed time must exceed the hot one (events around a loop of calls run back to back).
    x = torch.ones(8 << 20, dtype=torch.bfloat16, device=DEVICE)
    out = torch.empty((), dtype=torch.float32, device=DEVICE)

    def call() -> None:
        torch.sum(x, 0, dtype=torch.float32, out=out)  # (a full sum has no out= overload)

    _, flushed_us = cuda_timer(DEVICE)(call, 20.0, SHAPE)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(10):
        call()
    # Queued behind a GPU sleep longer than their issue, so that the events time the device, not the host's pace.
    torch.cuda._sleep(int(sleep_rate(DEVICE) * 20))
    begin.record()
    for _ in range(200):
        call()
    end.record()
    torch.cuda.synchronize(DEVICE)
    hot_us = begin.elapsed_time(end) * 1e3 / 200
    assert flushed_us > 1.15 * hot_us, f"flushed {flushed_us:.1f} µs, back to back {hot_us:.1f} µs"
