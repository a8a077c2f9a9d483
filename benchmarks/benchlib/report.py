"""What the benchmarks write: the environment record, progress messages, and CSV / Markdown / PNG files.

Every script writes ``<stem>.csv`` and ``<stem>.env.json`` (and most a ``<stem>.md``) into
``benchmarks/results/<gpu-slug>/`` unless told otherwise. The environment record names the GPU, its
clocks, the date, and the versions of Python, torch, CUDA, Triton, FlashInfer, flash-attn and
``mla_ops``, with every backend's validity and what it runs.
"""

from __future__ import annotations

import csv
import datetime
import importlib
import importlib.metadata
import importlib.util
import io
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
from typing import TYPE_CHECKING, Any, NamedTuple

from . import clocks, timing

if TYPE_CHECKING:
    import torch

BENCH_DIR = Path(__file__).resolve().parent.parent
RESULTS_DIR = BENCH_DIR / "results"


# --- output location ------------------------------------------------------------------------------


def gpu_slug(device: torch.device) -> str:
    """A short folder name for the device: ``"h200"`` for an NVIDIA H200, ``"cpu"`` without a GPU."""
    import torch

    if device.type != "cuda":
        return "cpu"
    return gpu_name_slug(torch.cuda.get_device_name(device))


def gpu_name_slug(name: str) -> str:
    """:func:`gpu_slug` from the GPU's name, for a process that leaves the GPUs to others:
    ``"NVIDIA H200"`` -> ``"h200"``."""
    name = re.sub(r"^nvidia\s+", "", name.lower())
    name = re.sub(r"^(geforce|tesla|quadro)\s+", "", name)
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


def default_out_dir(device: torch.device) -> Path:
    """``benchmarks/results/<gpu-slug>/``."""
    return RESULTS_DIR / gpu_slug(device)


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """The command that produced a result, for its record: ``python benchmarks/<script> ARGS``."""
    return " ".join([f"python benchmarks/{script}", *(sys.argv[1:] if argv is None else argv)])


# --- environment record ---------------------------------------------------------------------------


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def module_version(module: str, *dists: str) -> str:
    """The installed version of ``module`` (by distribution metadata, else ``__version__``), or why not."""
    try:
        found = importlib.util.find_spec(module) is not None
    except Exception:  # a submodule whose parent package is missing, or fails to import
        found = False
    if not found:
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
        query = "--query-gpu=clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem"
        for target in clocks.smi_targets(device):
            try:
                text = subprocess.run(
                    [smi, f"--id={target}", query, "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                    timeout=10,
                    check=True,
                ).stdout.strip()
            except (subprocess.SubprocessError, OSError):
                continue
            values = [v.strip() for v in text.splitlines()[0].split(",")] if text else []
            if len(values) == 4:
                return dict(zip(unknown, values))
    try:
        rate = torch.cuda.clock_rate(device)  # needs pynvml
        return {**unknown, "sm_clock_mhz": str(rate)}
    except Exception:
        return unknown


def backend_table(device: torch.device, dtype: torch.dtype, dqk: int, dv: int) -> list[dict[str, Any]]:
    """Every registered backend: whether it is valid here, why not, what it runs, and its instance."""
    import mla_ops
    from mla_ops.selector import validate_backend

    capability = mla_ops.DeviceCapability.of(device)
    config = mla_ops.SelectorConfig(dtype, mla_ops.MLADimensions.from_head_dims(dqk, dv))
    rows = []
    for member in mla_ops.PrefillBackendEnum:
        try:
            backend, reasons = validate_backend(member, capability, config)
        except Exception as exc:  # a half-written backend must not stop the benchmark
            backend, reasons = None, [f"validation raised {exc!r}"]
        try:
            impl = backend.describe(capability, config) if backend is not None else "not importable"
        except Exception as exc:
            impl = f"describe() raised {exc!r}"
        rows.append(
            {"name": member.name, "valid": not reasons, "reasons": reasons, "implementation": impl, "backend": backend}
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


def routing_table(device: torch.device) -> str:
    """The cost table that routes this device's calls by size (:func:`mla_ops.cost_table.table_source`): where it
    comes from, the GPU it was measured on and when, since an ``auto`` row's route depends on it."""
    import mla_ops
    from mla_ops import cost_table

    if device.type != "cuda":
        return "none: routing by size is for CUDA devices"
    table, source = cost_table.table_source(mla_ops.DeviceCapability.of(device))
    # Worded as `python -m mla_ops info` words it ("undated" where the table records no date).
    return source if table is None else f"{source} (measured on {table.gpu}, {table.created or 'undated'})"


def collect_env(
    device: torch.device,
    dtype: torch.dtype,
    dqk: int,
    dv: int,
    backends: list[dict[str, Any]] | None = None,
    *,
    command: str = "",
) -> dict[str, Any]:
    """The record of a run: device, clocks, date, library versions, the backend table and the timer.

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
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "gpu": gpu,
        "compute_capability": capability,
        "gpu_memory": memory,
        **query_clocks(device),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "n/a (CPU build)",
        "triton": module_version("triton", "triton"),
        "flashinfer": module_version("flashinfer", "flashinfer-python", "flashinfer"),
        "flash_attn": module_version("flash_attn", "flash-attn", "flash_attn"),
        "flash_attn.cute (FA4)": module_version("flash_attn.cute", "flash-attn-4"),
        "flash_attn_interface (FA3)": module_version("flash_attn_interface", "flash-attn-3", "flash_attn_3"),
        "mla_ops": mla_ops.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "head_dims (Dqk, Dv)": f"({dqk}, {dv})",
        "auto_selected_backend": auto_selected(device, dtype, dqk, dv),
        "cost_table": routing_table(device),
        "timer": timing.describe(device),
        "backends": {
            row["name"]: {"valid": row["valid"], "reasons": row["reasons"], "implementation": row["implementation"]}
            for row in backends
        },
    }
    if command:
        env["command"] = command
    return env


def cpu_model() -> str:
    """The host CPU's model name (``/proc/cpuinfo`` on Linux), else what :mod:`platform` knows.

    Host-bound figures (per-call µs of eager ops) differ between hosts of one GPU model, so a run records
    which CPU it ran on.
    """
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def start_run(
    script: str, argv: Sequence[str] | None, device: torch.device, dtype: torch.dtype, **record: Any
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``(backend table, environment record)`` of a run of ``script`` for (192, 128) heads; ``record``
    (the run's settings) is added to the record."""
    from .problems import DQK, DV

    backends = backend_table(device, dtype, DQK, DV)
    env = collect_env(device, dtype, DQK, DV, backends, command=command_line(script, argv))
    env.update(record)
    return backends, env


def env_markdown(env: dict[str, Any]) -> str:
    """The environment record as Markdown: a key/value list and the backend table."""
    lines = []
    for key, value in env.items():
        if key in ("backends", "not_measured", "command"):
            continue
        lines.append(f"- **{key}**: {value}")
    backends = env.get("backends", {})
    if backends:
        lines += ["", "| backend | valid here | implementation / reasons |", "| --- | --- | --- |"]
        for name, info in backends.items():
            detail = info["implementation"] if info["valid"] else "; ".join(info["reasons"])
            lines.append(f"| {name} | {'yes' if info['valid'] else 'no'} | {md_escape(detail)} |")
    not_measured = env.get("not_measured", {})
    if not_measured:
        lines += ["", "Not measured in this run:", ""]
        lines += [f"- {name}: {md_escape(why)}" for name, why in not_measured.items()]
    return "\n".join(lines)


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


def md_escape(text: object) -> str:
    """``text`` made safe inside a Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A GitHub Markdown table."""
    lines = ["| " + " | ".join(md_escape(h) for h in headers) + " |", "|" + " --- |" * len(headers)]
    lines += ["| " + " | ".join(md_escape(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


#: A table column: its header, and how a row (a dict) becomes the cell's text.
Column = tuple[str, Callable[[dict[str, Any]], str]]


def num(key: str, spec: str) -> Callable[[dict[str, Any]], str]:
    """A cell: the number ``row[key]`` formatted with ``spec`` (``—`` when missing)."""
    return lambda row: fmt(row.get(key), spec)


def span(low: str, high: str, spec: str) -> Callable[[dict[str, Any]], str]:
    """A cell: ``low..high`` of two numbers of the row (a range over rounds or samples)."""
    return lambda row: f"{fmt(row.get(low), spec)}..{fmt(row.get(high), spec)}"


def text(*keys: str) -> Callable[[dict[str, Any]], str]:
    """A cell: the row's non-empty values of ``keys``, joined by ``; ``."""
    return lambda row: "; ".join(str(row[k]) for k in keys if row.get(k) not in (None, ""))


def rows_table(rows: Iterable[dict[str, Any]], columns: Sequence[Column]) -> str:
    """A Markdown table of ``rows`` with ``columns``."""
    return markdown_table([header for header, _ in columns], [[cell(row) for _, cell in columns] for row in rows])


class Field(NamedTuple):
    """A value of a script's result rows: its CSV column ``key`` and, unless ``header`` is ``None``, a column of
    the Markdown table.

    ``cell`` makes that column's text from a row: a format spec (``".3f"``) formats the number ``row[key]``
    (:func:`num`); a function of the row builds a cell from several values (:func:`span`, :func:`text`); ``None``
    gives the value as text.
    """

    key: str
    header: str | None = None
    cell: str | Callable[[dict[str, Any]], str] | None = None

    def column(self) -> Column:
        """The Markdown column (only for a field with a header)."""
        if self.header is None:
            raise ValueError(f"{self.key} is in the CSV only: it has no Markdown column")
        if self.cell is None:
            return self.header, text(self.key)
        if isinstance(self.cell, str):
            return self.header, num(self.key, self.cell)
        return self.header, self.cell


class Fields:
    """Every value a script's result rows carry, in CSV order: the one list from which both the CSV columns
    (:attr:`keys`) and the Markdown table's columns (:attr:`columns`: the fields with a header, in the same
    order) are made, so that a field is named once.

    Each argument is a :class:`Field`, a tuple of its arguments (``("op_ms", "op ms", ".4f")``), or the bare key
    of a field in the CSV only (``"rounds"``).
    """

    def __init__(self, *fields: Field | tuple[Any, ...] | str) -> None:
        self.fields = tuple(Field(field) if isinstance(field, str) else Field(*field) for field in fields)
        #: The CSV columns, in order.
        self.keys = tuple(field.key for field in self.fields)
        twice = sorted({key for key in self.keys if self.keys.count(key) > 1})
        if twice:
            raise ValueError(f"fields declared more than once: {', '.join(twice)}")
        #: The Markdown table's columns.
        self.columns: list[Column] = [field.column() for field in self.fields if field.header is not None]

    def table(self, rows: Iterable[dict[str, Any]]) -> str:
        """A Markdown table of ``rows`` (:func:`rows_table` with :attr:`columns`)."""
        return rows_table(rows, self.columns)

    def undeclared(self, rows: Iterable[dict[str, Any]]) -> set[str]:
        """The keys that some of ``rows`` carries and no field declares: values :func:`write_csv` would drop."""
        return {key for row in rows for key in row} - set(self.keys)


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
    path.parent.mkdir(parents=True, exist_ok=True)
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


def read_csv(path: Path, text_columns: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Read a CSV written by :func:`write_csv`, turning numeric cells back into numbers (empty: ``None``);
    ``text_columns`` stay text even when they look like numbers."""
    rows = []
    with path.open(newline="") as f:
        for raw in csv.DictReader(f):
            row = {key: _parse_cell(value) for key, value in raw.items()}
            for key in text_columns:
                if row.get(key) is not None:
                    row[key] = str(raw[key])
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
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def read_env(csv_path: Path) -> dict[str, Any]:
    """The ``<stem>.env.json`` next to a ``<stem>.csv``, or a stand-in that says it is missing."""
    env_path = csv_path.with_name(csv_path.stem + ".env.json")
    if env_path.is_file():
        return json.loads(env_path.read_text())
    return {"gpu": "unknown", "note": f"{env_path} missing"}


def write_results(
    out_dir: Path, stem: str, fieldnames: Sequence[str], rows: list[dict[str, Any]], env: dict[str, Any], markdown: str
) -> list[Path]:
    """Write ``<stem>.csv``, ``<stem>.env.json`` and ``<stem>.md`` into ``out_dir``; returns the paths."""
    paths = [out_dir / f"{stem}.csv", out_dir / f"{stem}.env.json", out_dir / f"{stem}.md"]
    write_csv(paths[0], fieldnames, rows)
    write_json(paths[1], env)
    paths[2].write_text(markdown)
    return paths


def end_run(env: dict[str, Any], not_measured: dict[str, str], started: float) -> None:
    """Print what was not measured and why, and add it to the record ``env`` with the seconds since
    ``started`` (a ``time.perf_counter()`` reading)."""
    for name, why in not_measured.items():
        print(f"not measured: {name}: {why}")
    env["not_measured"] = not_measured
    env["elapsed_s"] = round(time.perf_counter() - started, 1)


def write_run(
    out_dir: Path, stem: str, fieldnames: Sequence[str], rows: list[dict[str, Any]], env: dict[str, Any], markdown: str
) -> None:
    """:func:`write_results` after :func:`end_run`, saying what was written where and how long the run took."""
    write_results(out_dir, stem, fieldnames, rows, env, markdown)
    print(f"wrote {stem}.csv, {stem}.md, {stem}.env.json to {out_dir} in {env['elapsed_s']:.0f} s")


def finish_run(
    out_dir: Path | None,
    device: torch.device,
    stem: str,
    fieldnames: Sequence[str],
    rows: list[dict[str, Any]],
    env: dict[str, Any],
    not_measured: dict[str, str],
    started: float,
    render: Callable[[], str],
) -> None:
    """:func:`end_run`, then :func:`write_run` into ``out_dir`` (``--out``; by default :func:`default_out_dir`)
    with the Markdown page ``render()`` makes of the finished record."""
    end_run(env, not_measured, started)
    write_run(out_dir or default_out_dir(device), stem, fieldnames, rows, env, render())


def results_markdown(title: str, env: dict[str, Any], intro: str, table: str, notes: Sequence[str] = ()) -> str:
    """A results page: title, command, an introduction, the table, notes, then the environment record."""
    parts = [f"# {title}", "", f"Command: `{env.get('command', '')}`", "", intro, "", table, ""]
    for note in notes:
        parts += [note, ""]
    parts += ["## Environment", "", env_markdown(env), ""]
    return "\n".join(parts)


def results_page(subject: str, env: dict[str, Any], intro: str, table: str, *, extra: Sequence[str] = ()) -> str:
    """``results_markdown`` titled ``subject: GPU, dtype[, extra...]`` from the environment record."""
    title = ", ".join([f"{subject}: {env.get('gpu')}", str(env.get("dtype")), *extra])
    return results_markdown(title, env, intro, table)


def short_error(exc: BaseException, limit: int = 160) -> str:
    """``Type: first line of the message``, cut to ``limit`` characters."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    message = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return message if len(message) <= limit else message[: limit - 1] + "…"


def save_small_png(fig: Any, path: Path) -> None:
    """Save a matplotlib figure as a PNG with a 256-colour palette: a third of the bytes, so results stay
    small in git."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=72)
    try:
        from PIL import Image  # a dependency of matplotlib

        with Image.open(buffer) as image:
            image.convert("RGB").quantize(colors=256).save(path, optimize=True)
    except Exception:  # any Pillow trouble: keep the full-colour image
        path.write_bytes(buffer.getvalue())


# --- bench_prefill's report: prefill.csv, prefill.md, prefill.png ------------------------------------

#: The name bench_prefill's files share: ``prefill.csv``, ``prefill.env.json``, ``prefill.md``, ``prefill.png``.
PREFILL_STEM = "prefill"
#: The columns of ``prefill.csv`` (described in benchmarks/README.md).
PREFILL_FIELDS = [
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
    "host_ms",
    "pace_ms",
    "tflops",
    "gbps",
    "rel_err",
    "lse_err",
    "raw_method",
    "ratio_raw",
    "ratio_raw_min",
    "ratio_raw_max",
    "best_baseline",
    "ratio_best",
    "ratio_best_rounds",
    "ratio_best_min",
    "ratio_best_max",
    "best_op",
    "auto_route",
    "ratio_auto_best",
    "ratio_auto_best_pace",
    "ratio_auto_best_rounds",
    "ratio_auto_best_min",
    "ratio_auto_best_max",
    "ratio_best_bf16",
    "ratio_best_bf16_rounds",
    "ratio_best_bf16_min",
    "ratio_best_bf16_max",
    "sm_clock_mhz",
    "best_sm_clock_mhz",
    "capped",
    "note",
]
_PREFILL_TEXT = ("method", "series", "shape", "label", "raw_method", "best_baseline", "best_op", "auto_route", "note")

SUITE_TITLES = {
    "causal": "Causal new-tokens path (`mla_ops.prefill`), TFLOP/s",
    "chunk": "Context-chunk path (`mla_ops.prefill_context_chunk`), TFLOP/s",
    "merge": "Merge (`mla_ops.merge_attn_states`), GB/s",
}
PLOT_XLABEL = {
    "causal": "sequence length s (batches of equal total tokens)",
    "chunk": "context tokens in the chunk (all sequences)",
}
PLOT_TITLE = {
    "causal": "causal new tokens",
    "chunk 1 seq": "context chunk, 1 sequence",
    "chunk 4 seqs": "context chunk, 4 sequences",
}


def _ordered(values: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(values))


def add_best_baseline(rows: list[dict[str, Any]]) -> None:
    """Fill ``best_baseline`` (the fastest correct baseline of the shape) and ``ratio_best`` (its time /
    the method's time) in the rows of one shape, in place. WRONG or failed baselines never count."""
    times = {r["method"]: r["time_ms"] for r in rows if r["status"] == "ok" and r.get("time_ms")}
    baselines = {r["method"]: r["time_ms"] for r in rows if r["kind"] == "baseline" and r["method"] in times}
    best = min(baselines, key=baselines.get) if baselines else None
    for r in rows:
        r["best_baseline"] = best
        if best is not None and r["method"] in times:
            r["ratio_best"] = baselines[best] / times[r["method"]]


def add_auto_ratio(rows: list[dict[str, Any]], auto: str = "auto") -> None:
    """Fill ``best_op`` (the fastest correct op with a backend forced) and ``ratio_auto_best`` (the automatic
    choice's throughput / that op's; 1 where the automatic choice is the fastest) in the ``auto`` row of one
    shape's rows, in place; and ``ratio_auto_best_pace``, the same by ``pace_ms`` (the larger of a call's time and
    its host issue time: the pace of a stream of such calls) where every op has one."""
    ok = [r for r in rows if r["status"] == "ok" and r.get("time_ms") and r["kind"] == "op"]
    forced = {r["method"]: r["time_ms"] for r in ok}
    auto_time = forced.pop(auto, None)
    if not forced or auto_time is None:
        return
    best = min(forced, key=forced.get)
    paces = {r["method"]: r.get("pace_ms") for r in ok}
    auto_pace = paces.pop(auto)
    for r in rows:
        if r["method"] == auto:
            r["best_op"], r["ratio_auto_best"] = best, forced[best] / auto_time
            if auto_pace and all(paces.values()):
                r["ratio_auto_best_pace"] = min(paces.values()) / auto_pace


def add_fp8_ratio(rows: list[dict[str, Any]]) -> None:
    """Fill ``best_op`` (the fastest correct bf16 op, ``auto`` included) and ``ratio_best_bf16`` (the fp8 row's
    throughput / that op's, the FLOPs counted alike) in the fp8 rows of one shape's rows, in place."""
    times = {r["method"]: r["time_ms"] for r in rows if r["status"] == "ok" and r.get("time_ms")}
    ops = {r["method"]: times[r["method"]] for r in rows if r["kind"] == "op" and r["method"] in times}
    if not ops:
        return
    best = min(ops, key=ops.get)
    for r in rows:
        if r["kind"] == "fp8" and r["method"] in times:
            r["best_op"], r["ratio_best_bf16"] = best, ops[best] / times[r["method"]]


def fp8_crossover(rows: list[dict[str, Any]]) -> str:
    """Per fp8 method and head count, the causal sweep's ratios to the best bf16 op and the length from which
    fp8 pays (every longer length too); empty without fp8 rows on the sweep."""
    lines = []
    sweep = [r for r in rows if r["kind"] == "fp8" and r["series"] == "causal" and r.get("ratio_best_bf16")]
    for m in _ordered(r["method"] for r in sweep):
        for heads in sorted({r["heads"] for r in sweep if r["method"] == m}):
            mine = (r for r in sweep if r["method"] == m and r["heads"] == heads)
            points = sorted((int(r["x"]), r["ratio_best_bf16"]) for r in mine)
            pays = [x for i, (x, _) in enumerate(points) if all(ratio >= 1 for _, ratio in points[i:])]
            verdict = f"pays from s = {pays[0]}" if pays else f"does not pay up to s = {points[-1][0]}"
            ratios = ", ".join(f"{x}: {ratio:.2f}" for x, ratio in points)
            lines.append(f"- **{m}**, H={heads}: {verdict} ({ratios})")
    return "\n".join(lines)


def fp8_rounds(rows: list[dict[str, Any]]) -> str:
    """Per fp8 row measured with ``--versus-best-op``, its ratio to the best bf16 op from settled phases of each
    (``ratio_best_bf16_rounds``), its rounds' range and, where sampled, the SM clock of both sides' phases and the
    share of their samples under a power or thermal cap; empty without such rows."""
    lines = []
    measured = [r for r in rows if r["kind"] == "fp8" and r.get("ratio_best_bf16_rounds") is not None]
    for r in measured:
        line = (
            f"- **{r['method']}**, {r['shape']}: {r['ratio_best_bf16_rounds']:.3f} of {r['best_op']} "
            f"(rounds {r['ratio_best_bf16_min']:.3f}..{r['ratio_best_bf16_max']:.3f})"
        )
        if r.get("sm_clock_mhz") is not None and r.get("best_sm_clock_mhz") is not None:
            capped = "" if r.get("capped") is None else f"; capped {100 * r['capped']:.0f} % of the time"
            line += f"; SM clock {r['sm_clock_mhz']:.0f} MHz against {r['best_sm_clock_mhz']:.0f}{capped}"
        lines.append(line)
    return "\n".join(lines)


def load_prefill_rows(csv_path: Path) -> list[dict[str, Any]]:
    """Rows of a prefill.csv, with numbers parsed and text columns kept as text."""
    return read_csv(csv_path, _PREFILL_TEXT)


def merge_rows(old: list[dict[str, Any]], new: list[dict[str, Any]], order: Sequence[str]) -> list[dict[str, Any]]:
    """``old`` rows of shapes not in ``new``, plus ``new``, sorted by the shape ids in ``order``."""
    measured = {r["shape"] for r in new}
    rank = {shape_id: i for i, shape_id in enumerate(order)}
    kept = [r for r in old if r["shape"] not in measured]
    return sorted(kept + new, key=lambda r: rank.get(r["shape"], len(rank)))


def write_prefill_outputs(rows: list[dict[str, Any]], env: dict[str, Any], out_dir: Path) -> list[str]:
    """Write prefill.csv, prefill.env.json, prefill.md and prefill.png; returns notes (why no PNG, say)."""
    write_csv(out_dir / f"{PREFILL_STEM}.csv", PREFILL_FIELDS, rows)
    write_json(out_dir / f"{PREFILL_STEM}.env.json", env)
    # The report is rendered from the CSV as written, so a later --from-csv re-render gives the same
    # figures; rendering the unrounded rows could round a derived column differently in its last digit.
    return write_prefill_report(load_prefill_rows(out_dir / f"{PREFILL_STEM}.csv"), env, out_dir)


def write_checkpoint(rows: list[dict[str, Any]], env: dict[str, Any], out_dir: Path) -> None:
    """Write prefill.csv and prefill.env.json of the rows so far (no report: rendering one per shape would cost
    more than writing the rows); ``--from-csv`` renders prefill.md and prefill.png from them."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(out_dir / f"{PREFILL_STEM}.csv", PREFILL_FIELDS, rows)
    write_json(out_dir / f"{PREFILL_STEM}.env.json", env)


def write_prefill_report(rows: list[dict[str, Any]], env: dict[str, Any], out_dir: Path) -> list[str]:
    """Write prefill.md and prefill.png from rows; returns notes."""
    out_dir.mkdir(parents=True, exist_ok=True)
    notes = []
    png = out_dir / f"{PREFILL_STEM}.png"
    note = render_prefill_plot(rows, env, png)
    markdown = render_prefill_markdown(rows, env)
    if note is None:
        markdown = markdown.replace("## Environment", f"![TFLOP/s against length]({png.name})\n\n## Environment", 1)
    else:
        notes.append(note)
        markdown += f"\nNo plot: {note}\n"
        png.unlink(missing_ok=True)  # a plot left by an earlier run would not match
    (out_dir / f"{PREFILL_STEM}.md").write_text(markdown)
    return notes


def render_prefill_markdown(rows: list[dict[str, Any]], env: dict[str, Any]) -> str:
    """The results as Markdown: header, one speed table and one ratio table per suite, checks, summary."""
    from .problems import DQK, DV

    title = f"# MLA prefill benchmark: {env.get('gpu')}, {env.get('dtype')}, (Dqk, Dv) = ({DQK}, {DV})"
    parts = [title, "", f"Command: `{env.get('command', '')}`", "", "## Environment", "", env_markdown(env), ""]
    summary = overhead_summary(rows)
    if summary:
        parts += ["## Op overhead (op throughput / its own raw call's; target >= 0.97)", "", summary, ""]
    summary = auto_summary(rows)
    if summary:
        parts += ["## Automatic choice (auto / the fastest forced op; pace: the larger of time and host time)", ""]
        parts += [summary, ""]
    for suite in ("causal", "chunk", "merge"):
        srows = [r for r in rows if r["suite"] == suite]
        if not srows:
            continue
        metric = "gbps" if suite == "merge" else "tflops"
        methods = _ordered(r["method"] for r in srows)
        shapes = _ordered(r["shape"] for r in srows)
        cell = {(r["shape"], r["method"]): r for r in srows}
        firsts = {shape_id: next(r for r in srows if r["shape"] == shape_id) for shape_id in shapes}
        table = [
            [f"H={firsts[s]['heads']}", firsts[s]["label"], *(_speed_cell(cell.get((s, m)), metric) for m in methods)]
            for s in shapes
        ]
        parts += [f"## {SUITE_TITLES[suite]}", "", markdown_table(["H", "shape", *methods], table), ""]
        kinds = {r["method"]: r["kind"] for r in srows}
        raw_of = {r["method"]: r["raw_method"] for r in srows if r.get("raw_method")}
        columns = []  # (header, method, row key)
        for m in (m for m in methods if kinds[m] in ("op", "direct", "fp8")):
            if m in raw_of:
                columns.append((f"{m} / {raw_of[m]}", m, "ratio_raw"))
            columns.append((f"{m} / best raw", m, "ratio_best"))
            if any(cell.get((s, m), {}).get("ratio_best_rounds") is not None for s in shapes):
                columns.append((f"{m} / best raw, rounds", m, "ratio_best_rounds"))
            if any(cell.get((s, m), {}).get("ratio_auto_best") is not None for s in shapes):
                columns.append((f"{m} / best op", m, "ratio_auto_best"))
            if any(cell.get((s, m), {}).get("ratio_auto_best_pace") is not None for s in shapes):
                columns.append((f"{m} / best op, pace", m, "ratio_auto_best_pace"))
            if any(cell.get((s, m), {}).get("ratio_auto_best_rounds") is not None for s in shapes):
                columns.append((f"{m} / best op, rounds", m, "ratio_auto_best_rounds"))
            if any(cell.get((s, m), {}).get("ratio_best_bf16") is not None for s in shapes):
                columns.append((f"{m} / best bf16 op", m, "ratio_best_bf16"))
            if any(cell.get((s, m), {}).get("ratio_best_bf16_rounds") is not None for s in shapes):
                columns.append((f"{m} / best bf16 op, settled", m, "ratio_best_bf16_rounds"))
        if columns:
            table = []
            for s in shapes:
                line = [f"H={firsts[s]['heads']}", firsts[s]["label"], firsts[s].get("best_baseline") or "—"]
                line += [fmt(cell.get((s, m), {}).get(key), ".2f") for _, m, key in columns]
                table.append(line)
            headers = ["H", "shape", "best raw baseline", *(h for h, _, _ in columns)]
            parts += [
                f"Ratios ({suite}): throughput of the method / throughput of the named call (above 1: the method "
                "is faster). Against its own raw call an op's ratio is the median over alternating rounds; against "
                "the best raw baseline it compares the single measurements of the table above, and with ', rounds' "
                "the median over rounds of the ratios of neighbouring samples of both, taken in turns; against the "
                "best bf16 op with ', settled' the median over rounds of the ratios of phases in which each ran at "
                "its own settled clock"
            ]
            parts += ["", markdown_table(headers, table), ""]
    crossover = fp8_crossover(rows)
    if crossover:
        parts += ["## FP8 against the best bf16 op (causal sweep, quantisation excluded and included)", ""]
        parts += [crossover, ""]
    settled = fp8_rounds(rows)
    if settled:
        parts += ["## FP8 against the best bf16 op, each in phases at its own settled clock (`--versus-best-op`)", ""]
        parts += [settled, ""]
    parts += ["## Correctness (checked once per shape before timing, against fp32 reference math)", ""]
    parts += [correctness_table(rows), ""]
    parts += ["Columns and methods are described in `benchmarks/README.md`.", ""]
    return "\n".join(parts)


def _speed_cell(r: dict[str, Any] | None, metric: str) -> str:
    if r is None:
        return "—"
    if r["status"] == "ok":
        return fmt_rate(r.get(metric))
    if r["status"] == "WRONG":
        return f"WRONG ({fmt_rate(r.get(metric))})"
    return r["status"]


#: A shape whose fastest forced op takes less than this (ms) is host-bound: its calls' pace is set by the host.
HOST_BOUND_MS = 0.2

#: The least auto / fastest forced op the selector aims at on shapes of at least HOST_BOUND_MS.
AUTO_TARGET = 0.97


def auto_summary(rows: list[dict[str, Any]]) -> str:
    """The automatic choice against the fastest forced op over the shapes, by time and by pace: median, minimum
    and the shape of the minimum, apart for the shapes whose fastest forced op takes at least
    :data:`HOST_BOUND_MS` and for the faster, host-bound ones; empty without ``auto`` rows."""
    times = {(r["shape"], r["method"]): r.get("time_ms") for r in rows if r["status"] == "ok"}
    lines = []
    labels = {"ratio_auto_best": "time", "ratio_auto_best_pace": "pace", "ratio_auto_best_rounds": "samples in turns"}
    for key, label in labels.items():
        autos = [r for r in rows if r["method"] == "auto" and r.get(key) is not None]
        groups = {"all shapes": [], f"best op >= {HOST_BOUND_MS} ms": [], f"best op < {HOST_BOUND_MS} ms": []}
        for r in autos:
            best = times.get((r["shape"], r["best_op"]))
            groups["all shapes"].append(r)
            if best is not None:
                groups[f"best op {'>=' if best >= HOST_BOUND_MS else '<'} {HOST_BOUND_MS} ms"].append(r)
        # Both kinds of shape: "all shapes" adds a line; else it would repeat the one kind's.
        shown = groups if all(groups.values()) else {name: g for name, g in groups.items() if name != "all shapes"}
        lines += [_auto_line(f"{label}, {name}", group, key) for name, group in shown.items() if group]
    routed = [r for r in rows if r["method"] == "auto" and r.get("auto_route") and r.get("best_op")]
    if routed:
        others = [r for r in routed if r["auto_route"] != r["best_op"]]
        line = f"- routed to the fastest forced op on {len(routed) - len(others)} of {len(routed)} shapes"
        if others:
            line += "; elsewhere (routed, fastest, auto / fastest by time): " + "; ".join(
                f"{r['shape']} ({r['auto_route']}, {r['best_op']}, {r['ratio_auto_best']:.3f})" for r in others
            )
        lines.append(line)
        # Where auto ran the fastest op's own backend, a ratio below the target is one backend against itself.
        spread = [
            r for r in routed
            if r["auto_route"] == r["best_op"] and (r.get("ratio_auto_best_rounds") or AUTO_TARGET) < AUTO_TARGET
        ]  # fmt: skip
        if spread:
            lines.append(
                f"- below {AUTO_TARGET} in rounds though routed to the fastest op's own backend (the spread of one "
                "backend timed against itself; auto / fastest, rounds' range): "
                + "; ".join(
                    f"{r['shape']} ({r['auto_route']}, {r['ratio_auto_best_rounds']:.3f}, "
                    f"{r['ratio_auto_best_min']:.3f}..{r['ratio_auto_best_max']:.3f})"
                    for r in spread
                )
            )
    return "\n".join(lines)


def _auto_line(label: str, group: list[dict[str, Any]], key: str) -> str:
    low = min(group, key=lambda r: r[key])
    median = statistics.median(r[key] for r in group)
    count = f"{len(group)} shape{'' if len(group) == 1 else 's'}"
    return f"- by {label}: median {median:.3f}, minimum {low[key]:.3f} ({low['shape']}), {count}"


def overhead_summary(rows: list[dict[str, Any]]) -> str:
    """One line per op: min and median over the shapes of its ratio to its own raw call."""
    lines = []
    for m in _ordered(r["method"] for r in rows if r["kind"] == "op"):
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
    for m in _ordered(r["method"] for r in rows):
        mrows = [r for r in rows if r["method"] == m]
        rels = [r["rel_err"] for r in mrows if r.get("rel_err") is not None]
        lses = [r["lse_err"] for r in mrows if r.get("lse_err") is not None]
        counts = {s: sum(r["status"] == s for r in mrows) for s in ("ok", "WRONG", "error")}
        errors = _ordered(r["note"] for r in mrows if r["status"] == "error" and r.get("note"))
        table.append(
            [
                m,
                fmt(max(rels) if rels else None, ".1e"),
                fmt(max(lses) if lses else None, ".1e"),
                counts["ok"],
                counts["WRONG"],
                counts["error"],
                "; ".join(errors)[:300],
            ]
        )
    return markdown_table(["method", "max rel err (out)", "max lse err", "ok", "WRONG", "error", "errors"], table)


def render_prefill_plot(rows: list[dict[str, Any]], env: dict[str, Any], path: Path) -> str | None:
    """Plot TFLOP/s against length, one panel per (series, H), one line per method; ``None`` on success,
    else a note saying why no plot was written."""
    from .problems import DQK, DV

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return (
            "matplotlib is not installed, so no prefill.png was written; install it (pip install matplotlib) "
            f"and rerun with --from-csv {path.with_suffix('.csv')}"
        )
    prows = [r for r in rows if r.get("series") and r["suite"] != "merge" and r.get("tflops") is not None]
    if not prows:
        return "no plottable rows (the length sweeps were not run), so no prefill.png was written"
    series = _ordered(r["series"] for r in prows)
    heads = sorted({r["heads"] for r in prows})
    methods = _ordered(r["method"] for r in prows)
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
    save_small_png(fig, path)
    plt.close(fig)
    return None
