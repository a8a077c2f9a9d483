"""Helpers shared by the benchmark scripts: environment header, timing, progress, tables, output.

Everything here imports ``torch`` lazily or is cheap, so that ``--help`` of the scripts stays fast.
"""

from __future__ import annotations

import csv
import datetime
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"


# --- device and output location -------------------------------------------------------------------


def pick_device(requested: str | None) -> torch.device:
    """``cuda`` when a GPU is present (or ``requested``), else ``cpu``; raises if CUDA was asked for but is absent."""
    import torch

    if requested:
        device = torch.device(requested)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise SystemExit(
                f"--device {requested}: torch.cuda.is_available() is False on this machine; use --device cpu"
            )
        return device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def gpu_slug(device: torch.device) -> str:
    """A short folder name for the device: ``"h200"`` for an NVIDIA H200, ``"cpu"`` without a GPU."""
    import torch

    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    name = re.sub(r"^nvidia\s+", "", name)
    name = re.sub(r"^(geforce|tesla|quadro)\s+", "", name)
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


def default_out_dir(device: torch.device) -> Path:
    """``benchmarks/results/<gpu-slug>/``."""
    return RESULTS_DIR / gpu_slug(device)


# --- environment header ---------------------------------------------------------------------------


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _module_version(module: str, *dists: str) -> str:
    """The installed version of ``module`` (by distribution metadata, else ``__version__``), or why not."""
    if importlib.util.find_spec(module) is None:
        return "not installed"
    version = _dist_version(*dists)
    if version is not None:
        return version
    try:
        return str(getattr(importlib.import_module(module), "__version__", "unknown"))
    except Exception as exc:  # a broken install must not stop the benchmark's header
        return f"import failed: {type(exc).__name__}"


def query_clocks(device: torch.device) -> dict[str, str]:
    """SM and memory clocks (current and maximum, MHz) from ``nvidia-smi``, else ``"unknown"``."""
    import torch

    unknown = {
        "sm_clock_mhz": "unknown",
        "mem_clock_mhz": "unknown",
        "max_sm_clock_mhz": "unknown",
        "max_mem_clock_mhz": "unknown",
    }
    if device.type != "cuda":
        return {key: "n/a (cpu)" for key in unknown}
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        # CUDA_VISIBLE_DEVICES can renumber devices; the PCI bus id names the same GPU for nvidia-smi.
        props = torch.cuda.get_device_properties(device)
        targets = [str(index)]
        if isinstance(getattr(props, "pci_bus_id", None), int):
            domain, slot = getattr(props, "pci_domain_id", 0), getattr(props, "pci_device_id", 0)
            targets.insert(0, f"{domain:08x}:{props.pci_bus_id:02x}:{slot:02x}.0")
        query = "--query-gpu=clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem"
        for target in targets:
            try:
                text = (
                    subprocess.run(
                        [smi, f"--id={target}", query, "--format=csv,noheader,nounits"],
                        capture_output=True,
                        text=True,
                        timeout=10,
                        check=True,
                    )
                    .stdout.strip()
                    .splitlines()
                )
            except (subprocess.SubprocessError, OSError):
                continue
            values = [v.strip() for v in text[0].split(",")] if text else []
            if len(values) == 4:
                return dict(zip(unknown, values))
    try:
        rate = torch.cuda.clock_rate(device)  # needs pynvml
        return {**unknown, "sm_clock_mhz": str(rate)}
    except Exception:
        return unknown


def backend_table(device: torch.device, dtype: torch.dtype, dqk: int, dv: int) -> list[dict[str, Any]]:
    """Every registered backend: whether it is valid here, why not, and what it runs."""
    import mla_ops
    from mla_ops.selector import validate_backend

    capability = mla_ops.DeviceCapability.of(device)
    config = mla_ops.SelectorConfig(dtype, mla_ops.MLADimensions.from_head_dims(dqk, dv))
    rows = []
    for member in mla_ops.PrefillBackendEnum:
        try:
            cls, reasons = validate_backend(member, capability, config)
        except Exception as exc:  # a half-written backend must not stop the benchmark
            cls, reasons = None, [f"validation raised {exc!r}"]
        try:
            impl = cls.implementation() if cls is not None else "not importable"
        except Exception as exc:
            impl = f"implementation() raised {exc!r}"
        rows.append(
            {"name": member.name, "valid": not reasons, "reasons": reasons, "implementation": impl, "class": cls}
        )
    return rows


def auto_selected(device: torch.device, dtype: torch.dtype, dqk: int, dv: int) -> str:
    """The backend automatic selection picks for this device and config, or why none is."""
    import mla_ops

    capability = mla_ops.DeviceCapability.of(device)
    config = mla_ops.SelectorConfig(dtype, mla_ops.MLADimensions.from_head_dims(dqk, dv))
    env = os.environ.get(mla_ops.selector.ENV_VAR, "").strip()
    try:
        name = mla_ops.select_backend(capability, config).name
    except Exception as exc:
        return f"none: {exc}"
    return f"{name} (forced by {mla_ops.selector.ENV_VAR}={env})" if env else name


def collect_env(
    device: torch.device, dtype: torch.dtype, dqk: int, dv: int, backends: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The header of a results file: device, clocks, date, library versions and backend table.

    ``backends`` is :func:`backend_table`'s result when the caller already has it.
    """
    import torch

    import mla_ops

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = torch.cuda.get_device_name(device)
        capability = f"{props.major}.{props.minor}"
        memory = f"{props.total_memory / 2**30:.0f} GiB"
    else:
        gpu, capability, memory = "none (CPU)", "n/a", "n/a"
    if backends is None:
        backends = backend_table(device, dtype, dqk, dv)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "gpu": gpu,
        "compute_capability": capability,
        "gpu_memory": memory,
        **query_clocks(device),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "n/a (CPU build)",
        "triton": _module_version("triton", "triton"),
        "flashinfer": _module_version("flashinfer", "flashinfer-python", "flashinfer"),
        "flash_attn": _module_version("flash_attn", "flash-attn", "flash_attn"),
        "flash_attn_interface (FA3)": _module_version("flash_attn_interface", "flash-attn-3", "flash_attn_3"),
        "mla_ops": mla_ops.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "head_dims (Dqk, Dv)": f"({dqk}, {dv})",
        "auto_selected_backend": auto_selected(device, dtype, dqk, dv),
        "backends": {
            row["name"]: {"valid": row["valid"], "reasons": row["reasons"], "implementation": row["implementation"]}
            for row in backends
        },
    }


def env_markdown(env: dict[str, Any]) -> str:
    """The environment header as Markdown: a key/value list and the backend table."""
    lines = []
    for key, value in env.items():
        if key in ("backends", "not_measured"):
            continue
        lines.append(f"- **{key}**: {value}")
    backends = env.get("backends", {})
    if backends:
        lines += ["", "| backend | valid here | implementation / reasons |", "| --- | --- | --- |"]
        for name, info in backends.items():
            detail = info["implementation"] if info["valid"] else "; ".join(info["reasons"])
            lines.append(f"| {name} | {'yes' if info['valid'] else 'no'} | {_md_escape(detail)} |")
    not_measured = env.get("not_measured", {})
    if not_measured:
        lines += ["", "Not measured in this run:", ""]
        lines += [f"- {name}: {_md_escape(why)}" for name, why in not_measured.items()]
    return "\n".join(lines)


# --- timing ---------------------------------------------------------------------------------------


def _synchronize(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timer_description(device: torch.device) -> str:
    """What :func:`time_ms` measures with on this device."""
    if device.type != "cuda":
        return "time.perf_counter, median of repeats after warm-up"
    if importlib.util.find_spec("triton") is not None:
        return "triton.testing.do_bench (median, L2 flushed between calls, warm-up)"
    return "CUDA events (median of repeats, L2 flushed between calls, warm-up)"


def time_ms(fn: Callable[[], Any], device: torch.device, warmup_ms: float = 25.0, rep_ms: float = 100.0) -> float:
    """Median wall time of one call of ``fn`` in milliseconds.

    CUDA: ``triton.testing.do_bench`` when Triton imports, else CUDA events, each with warm-up and an L2
    flush between calls. CPU: ``time.perf_counter`` around each call.
    """
    if device.type == "cuda":
        try:
            import triton.testing
        except ImportError:
            return _cuda_events_ms(fn, device, warmup_ms, rep_ms)
        import inspect

        if "return_mode" in inspect.signature(triton.testing.do_bench).parameters:
            return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5]))
    return _perf_counter_ms(fn, warmup_ms, rep_ms)


def _repeats(estimate_ms: float, budget_ms: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, budget_ms / max(estimate_ms, 1e-6))))


def _perf_counter_ms(fn: Callable[[], Any], warmup_ms: float, rep_ms: float) -> float:
    start = time.perf_counter()
    fn()
    estimate = (time.perf_counter() - start) * 1e3
    for _ in range(_repeats(estimate, warmup_ms, 1, 100)):
        fn()
    samples = []
    for _ in range(_repeats(estimate, rep_ms, 5, 1000)):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _cuda_events_ms(fn: Callable[[], Any], device: torch.device, warmup_ms: float, rep_ms: float) -> float:
    import torch

    # Zeroing a buffer larger than L2 between calls makes every call start with a cold cache, as do_bench does.
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device)
    fn()
    torch.cuda.synchronize(device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(5):
        flush.zero_()
        fn()
    end.record()
    torch.cuda.synchronize(device)
    estimate = begin.elapsed_time(end) / 5
    for _ in range(_repeats(estimate, warmup_ms, 1, 1000)):
        fn()
    n = _repeats(estimate, rep_ms, 5, 1000)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def per_call_us(fns: dict[str, tuple[Callable[[], Any], int]], device: torch.device, rounds: int) -> dict[str, float]:
    """Per-call wall time in µs of each ``name: (fn, iters)``: the median over ``rounds`` of the mean
    time of ``iters`` back-to-back calls.

    The functions take turns within each round, so a slow phase of a shared machine hits all of them
    alike. On CUDA the device is synchronised around each batch of calls, so a figure is the larger of
    the host's issue cost and the device's execution time per call.
    """
    for fn, iters in fns.values():
        for _ in range(max(3, iters // 10)):
            fn()
    _synchronize(device)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, (fn, iters) in fns.items():
            _synchronize(device)
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            _synchronize(device)
            samples[name].append((time.perf_counter() - start) * 1e6 / iters)
    return {name: statistics.median(values) for name, values in samples.items()}


# --- progress -------------------------------------------------------------------------------------


class Progress:
    """A progress bar: tqdm when it is installed, else a printed ``[i/n]`` counter."""

    def __init__(self, total: int, desc: str, enabled: bool = True) -> None:
        self.total, self.count, self.enabled = total, 0, enabled
        self._bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm

                self._bar = tqdm(total=total, desc=desc, dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                print(f"{desc}: {total} measurements (install tqdm for a progress bar)", flush=True)

    def step(self, label: str) -> None:
        """Announce the measurement about to run."""
        self.count += 1
        if self._bar is not None:
            self._bar.set_postfix_str(label, refresh=False)
            self._bar.update(1)
        elif self.enabled:
            print(f"[{self.count}/{self.total}] {label}", flush=True)

    def write(self, message: str) -> None:
        """Print a line without breaking the bar."""
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


# --- tables and files -----------------------------------------------------------------------------


def _md_escape(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A GitHub Markdown table."""
    lines = ["| " + " | ".join(_md_escape(h) for h in headers) + " |", "|" + " --- |" * len(headers)]
    lines += ["| " + " | ".join(_md_escape(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value: object, spec: str = ".1f", missing: str = "—") -> str:
    """Format a number, or ``missing`` for ``None``/NaN/empty."""
    if value is None or value == "" or (isinstance(value, float) and math.isnan(value)):
        return missing
    return format(value, spec)


def fmt_rate(value: object) -> str:
    """A throughput: one decimal from 10 up, three significant digits below (tiny CPU figures stay visible)."""
    if isinstance(value, (int, float)) and not math.isnan(value) and abs(value) < 10:
        return format(value, ".3g")
    return fmt(value)


def write_csv(path: Path, fieldnames: Sequence[str], rows: Iterable[dict[str, Any]]) -> None:
    """Write ``rows`` (dicts) as CSV; ``None`` becomes an empty cell, floats keep 6 significant digits."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fieldnames, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_cell(row.get(k)) for k in fieldnames})


def _csv_cell(value: object) -> object:
    if value is None:
        return ""
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    return value


def read_csv(path: Path) -> list[dict[str, Any]]:
    """Read a CSV written by :func:`write_csv`, turning numeric cells back into numbers (empty: ``None``)."""
    rows = []
    with path.open(newline="") as f:
        for raw in csv.DictReader(f):
            row: dict[str, Any] = {}
            for key, value in raw.items():
                row[key] = _parse_cell(value)
            rows.append(row)
    return rows


def _parse_cell(value: str | None) -> Any:
    if value is None or value == "":
        return None
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            continue
    return value


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as indented JSON."""
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def short_error(exc: BaseException, limit: int = 160) -> str:
    """``Type: first line of the message``, cut to ``limit`` characters."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    message = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return message if len(message) <= limit else message[: limit - 1] + "…"
