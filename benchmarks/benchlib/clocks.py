"""The GPU's SM clock, board power and clock-event reasons while a measurement runs, sampled by ``nvidia-smi``.

An H100 running one long attention kernel after another draws its 700 W cap, and its SM clock then follows the
power the kernel draws: a kernel that draws less per FLOP runs at a higher clock. :class:`ClockSampler` records
which regime a measurement ran in (the clock under load, and whether a power or thermal cap held it), so that
figures from different machines and runs can be read side by side.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

#: ``clocks_throttle_reasons.active`` bits of a cap that lowers the clock under load: the software power cap
#: (0x4), hardware slowdown (0x8), software and hardware thermal slowdown (0x20, 0x40), the power brake (0x80).
CAP_REASONS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
#: The ``clocks_throttle_reasons.active`` bit of an idle GPU: such samples are no measurement's.
IDLE_REASON = 0x1
#: The query: one CSV line per sample, no header or units.
QUERY = ["--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active", "--format=csv,noheader,nounits"]


class ClockSample(NamedTuple):
    """One ``nvidia-smi`` sample: SM clock (MHz), board power (W, ``None`` where not reported) and the active
    clock-event reasons (a bit mask, see :data:`CAP_REASONS`)."""

    sm_mhz: int
    power_w: float | None
    reasons: int


class ClockSummary(NamedTuple):
    """Samples taken while a measurement ran: their count, the median SM clock (MHz) and board power (W, ``None``
    where none was reported), and the share of samples under a power or thermal cap (0 to 1)."""

    samples: int
    sm_mhz: float
    power_w: float | None
    capped: float

    @classmethod
    def of(cls, samples: Iterable[ClockSample]) -> ClockSummary | None:
        """The summary of ``samples``; ``None`` without any."""
        samples = list(samples)
        if not samples:
            return None
        powers = [s.power_w for s in samples if s.power_w is not None]
        capped = sum(1 for s in samples if s.reasons & CAP_REASONS) / len(samples)
        return cls(
            len(samples), statistics.median(s.sm_mhz for s in samples), statistics.median(powers) if powers else None,
            capped,
        )  # fmt: skip

    def describe(self) -> str:
        """``"1500 MHz, 698 W, capped 100 %"``: the clock, the power where known, the capped share."""
        power = "" if self.power_w is None else f", {self.power_w:.0f} W"
        return f"{self.sm_mhz:.0f} MHz{power}, capped {100 * self.capped:.0f} %"


def parse_samples(text: str) -> list[ClockSample]:
    """The samples in ``nvidia-smi`` output of :data:`QUERY` (``"1500, 697.12, 0x0000000000000004"`` per line);
    lines that do not parse (a header, ``[N/A]`` clocks, a line cut off when the sampler stopped) are skipped."""
    samples = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 3:
            continue
        try:
            sm_mhz, reasons = int(fields[0]), int(fields[2], 16)
        except ValueError:
            continue
        try:
            power: float | None = float(fields[1])
        except ValueError:
            power = None
        samples.append(ClockSample(sm_mhz, power, reasons))
    return samples


def busy(samples: Iterable[ClockSample]) -> list[ClockSample]:
    """``samples`` without those of an idle GPU (:data:`IDLE_REASON`): a run's host-only stretches (reference math,
    compiling) are not the clock its kernels ran at."""
    return [s for s in samples if not s.reasons & IDLE_REASON]


def smi_targets(device: torch.device) -> list[str]:
    """The ``--id`` values that name ``device`` for ``nvidia-smi``: its PCI bus id first (``CUDA_VISIBLE_DEVICES``
    can renumber devices; the bus id names the same GPU), then its index."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    targets = [str(index)]
    if isinstance(getattr(props, "pci_bus_id", None), int):
        domain, slot = getattr(props, "pci_domain_id", 0), getattr(props, "pci_device_id", 0)
        targets.insert(0, f"{domain:08x}:{props.pci_bus_id:02x}:{slot:02x}.0")
    return targets


class ClockSampler:
    """A context manager that samples the GPU every ``interval_ms`` while it is active (``nvidia-smi -lms``, in a
    process of its own) and keeps the samples in :attr:`samples` (summarised by :meth:`ClockSummary.of`), none
    where nothing was sampled (on CPU, without ``nvidia-smi``, or within a phase shorter than one interval).

    ``command``: the sampling command (for tests); by default ``nvidia-smi`` on ``device``, or nothing where
    ``device`` is not CUDA or ``nvidia-smi`` is missing."""

    def __init__(self, device: torch.device, interval_ms: int = 100, command: list[str] | None = None) -> None:
        if command is None and device.type == "cuda":
            smi = shutil.which("nvidia-smi")
            if smi is not None:
                command = [smi, f"--id={smi_targets(device)[0]}", *QUERY, "-lms", str(interval_ms)]
        self.command = command
        self.samples: list[ClockSample] = []
        self._process: subprocess.Popen[str] | None = None

    def __enter__(self) -> ClockSampler:
        if self.command is not None:
            try:
                self._process = subprocess.Popen(
                    self.command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
                )  # fmt: skip
            except OSError:  # a sampler that cannot start leaves the measurement as it is
                self._process = None
        return self

    def __exit__(self, *exc: object) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            text, _ = process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            text, _ = process.communicate()
        self.samples += parse_samples(text or "")
