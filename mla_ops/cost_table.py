"""Size classes of a call, and the measured cost tables that rank the backends per class.

A call's :class:`SizeClass` is read from what the host knows without a device sync: the path, the query and
key rows, the heads, the number of sequences and the two ``max_seqlen`` bounds, each as its bit length
(powers of two). A :class:`CostTable` holds, per GPU, each backend's host cost per call and its device time
on measured size classes; :meth:`CostTable.choose` predicts every candidate's time on a class and returns
the least. :func:`table_for` finds the table of a capability: this machine's (``python -m mla_ops tune``,
in :func:`user_table_path`) where it is fresh, else the one committed in ``mla_ops/tables/``, else none
(the selector keeps its fixed order). A missing table is silent; a stale or corrupt one warns once per
process and is passed over. Nothing here raises into a call. Design: docs/design/backends.md (Size classes).
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import statistics
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch

from . import native
from .backends.registry import PrefillBackendEnum
from .specs import DeviceCapability
from .version import __version__

#: The version of the table format; a table of another version is stale.
SCHEMA = 1

#: The paths a table distinguishes, by their JSON name: ``causal=True`` (new tokens) and ``False`` (a chunk).
PATHS = {"new": True, "chunk": False}

#: The distributions whose versions a table records; a user's table measured under others is stale.
VERSIONED = ("mla_ops", "torch", "triton", "flashinfer-python", "flash-attn-4", "flash-attn", "flash-attn-3")

#: The distributions whose kernels each backend runs. A committed table's times of a backend hold only where the
#: same ones are installed: FLASH_ATTN runs FlashAttention-4, -3, -2 or PyTorch's bundled copy, whichever is here.
BACKEND_LIBRARIES = {
    "FLASHINFER": ("flashinfer-python",),
    "FLASH_ATTN": ("flash-attn-4", "flash-attn-3", "flash-attn"),
    "TRITON": ("triton",),
}
#: What runs a backend's kernels where none of its :data:`BACKEND_LIBRARIES` is installed (the others cannot run).
BUNDLED = {"FLASH_ATTN": "PyTorch's bundled FlashAttention-2"}

#: The version :func:`library_versions` gives a distribution that is not installed.
NOT_INSTALLED = "not installed"

#: What to run to measure a fresh table, as the warnings say it.
TUNE_COMMAND = "python -m mla_ops tune"


class SizeClass(NamedTuple):
    """A call's size class: ``causal`` (the path) and the bit lengths of the query rows ``Tq``, the key rows
    ``Tk``, the heads ``H``, the sequences ``B`` and the bounds ``max_seqlen_q`` and ``max_seqlen_k``.

    Bit lengths make the classes powers of two (``0`` is 0, ``1`` is 1, ``2`` is 2-3, ``13`` is
    4096-8191), so a workload meets few of them and a warm route stays one dict lookup. Every field is a
    shape or an int argument: no device sync, and calls with one native launch layout (which records every
    shape and bound) share one class.
    """

    causal: bool
    rows_q: int
    rows_k: int
    heads: int
    seqs: int
    max_q: int
    max_k: int

    @classmethod
    def of(cls, causal: bool, rows_q: int, rows_k: int, heads: int, seqs: int, max_q: int, max_k: int) -> SizeClass:
        """The class of a call with these sizes (``seqs`` is ``cu_seqlens_q.shape[0] - 1``)."""
        return cls(
            bool(causal), rows_q.bit_length(), rows_k.bit_length(), heads.bit_length(), seqs.bit_length(),
            max_q.bit_length(), max_k.bit_length(),
        )  # fmt: skip

    @property
    def path(self) -> str:
        """``"new"`` or ``"chunk"``, as tables name the path."""
        return "new" if self.causal else "chunk"

    def bounds(self) -> str:
        """The sizes the class covers, for ``info``: e.g. ``new Tq 4096-8191 H 16-31 B 4-7 ...``."""
        parts = [self.path]
        for label, bits in zip(("Tq", "Tk", "H", "B", "max_q", "max_k"), self[1:]):
            if self.causal and label in ("Tk", "max_k"):
                continue
            low, high = (0, 0) if bits == 0 else (1 << (bits - 1), (1 << bits) - 1)
            parts.append(f"{label} {low}" if low == high else f"{label} {low}-{high}")
        return " ".join(parts)

    def work(self) -> float:
        """The query-key pairs times heads that a call of the class computes, estimated from the middle of
        each field's range: sequences of equal length, capped by the ``max_seqlen`` bounds (a causal pair
        counts half). Only ratios of it are used, to carry a measured class's time to a near one."""
        tq, tk, heads, seqs, max_q, max_k = (0.75 * (1 << bits) if bits else 0.0 for bits in self[1:])
        seqs = max(seqs, 1.0)
        if self.causal:
            return heads * min(tq * tq / seqs, tq * max_q) / 2
        return heads * min(tq * tk / seqs, tq * max_k, tk * max_q)


def size_class(call: Any) -> SizeClass:
    """The :class:`SizeClass` of a :class:`~mla_ops.backends.base.VarlenCall` (only its shapes and ints)."""
    rows_q, heads, _ = call.q.shape
    return SizeClass.of(
        call.causal, rows_q, call.k.shape[0], heads, call.cu_seqlens_q.shape[0] - 1, call.max_seqlen_q,
        call.max_seqlen_k,
    )  # fmt: skip


class CostTableError(ValueError):
    """A table file that cannot be used: unreadable, malformed, or of another version (the message says which)."""


def library_versions() -> dict[str, str]:
    """The versions of :data:`VERSIONED` installed here (``"not installed"`` when absent), and CUDA's."""
    versions = {}
    for dist in VERSIONED:
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = NOT_INSTALLED
    versions["mla_ops"] = __version__
    versions["torch"] = torch.__version__
    versions["cuda"] = str(torch.version.cuda)
    return versions


#: A table's configuration key: ``(dtype name, Dqk, Dv)``.
ConfigKey = tuple[str, int, int]


@dataclass
class CostTable:
    """One GPU's measurements: ``host_us[backend]``, the median host time of one call (µs) over every measured
    class, and per ``(dtype name, Dqk, Dv)`` and :class:`SizeClass`, ``device_us[backend]``, the device time of
    one call, and ``class_host_us[backend]``, the host time of one call of that class.

    The predicted time of a call is the larger of its backend's host cost and its device time on the call's
    class (:meth:`predict`): the host issues a call while the device runs the previous ones, so in a stream of
    calls the slower side sets the pace, and a sum charges a device-bound call for host time it hides. A class
    without a measurement takes the nearest measured class's times, the device time scaled by
    :meth:`SizeClass.work` and never below the backend's fastest measured call. The host cost is the
    class's own where the table has it, since one backend's host time differs by class (a small TRITON call
    launches one ``tl.dot`` kernel, a large one on SM90 its Gluon kernel): a single median per backend
    misranks the small, host-bound calls. Tables without it use ``host_us``.
    """

    capability: DeviceCapability
    gpu: str
    versions: dict[str, str]
    command: str
    host_us: dict[str, float]
    device_us: dict[ConfigKey, dict[SizeClass, dict[str, float]]]
    source: str = "memory"
    created: str = ""
    class_host_us: dict[ConfigKey, dict[SizeClass, dict[str, float]]] = field(default_factory=dict)
    _floors: dict[tuple[ConfigKey, bool, str], float] = field(default_factory=dict, repr=False)

    def without(self, backends: Iterable[str]) -> CostTable:
        """A copy that predicts nothing for ``backends`` (they are no candidates where it ranks)."""
        drop = set(backends)
        return replace(self, host_us={b: t for b, t in self.host_us.items() if b not in drop}, _floors={})

    def foreign_backends(self, installed: Mapping[str, str]) -> dict[str, str]:
        """The measured backends that would run other kernels here, each with why: another set of their
        :data:`BACKEND_LIBRARIES` is installed than the table's (FLASH_ATTN measured on FlashAttention-4 says
        nothing of FlashAttention-2). A backend none of whose libraries is installed cannot run here, so it is
        left out only where something else runs it (:data:`BUNDLED`)."""
        foreign = {}
        for backend in sorted(self.host_us):
            dists = BACKEND_LIBRARIES.get(backend, ())
            had = [d for d in dists if self.versions.get(d, NOT_INSTALLED) != NOT_INSTALLED]
            has = [d for d in dists if installed.get(d, NOT_INSTALLED) != NOT_INSTALLED]
            if had == has or (not has and backend not in BUNDLED):
                continue
            there = ", ".join(had) or BUNDLED.get(backend, "none of " + ", ".join(dists))
            foreign[backend] = f"measured with {there}, here {', '.join(has) or BUNDLED[backend]}"
        return foreign

    def covers(self, key: ConfigKey) -> bool:
        """Whether the table measured ``(dtype name, Dqk, Dv)`` at all."""
        return key in self.device_us

    def measured(self, key: ConfigKey) -> set[str]:
        """The backends measured on ``key`` (on any class) that have a host cost."""
        return {b for classes in self.device_us.get(key, {}).values() for b in classes if b in self.host_us}

    def predict(self, backend: str, key: ConfigKey, size: SizeClass) -> float | None:
        """``backend``'s predicted time (µs) of one call of class ``size`` on ``key``; ``None`` where the table
        has no measurement of ``backend`` on ``key``'s path."""
        host = self.host_us.get(backend)
        classes = self.device_us.get(key)
        if host is None or classes is None:
            return None
        exact = classes.get(size, {}).get(backend)
        if exact is not None:
            return max(self._host(backend, key, size, host), exact)
        nearest, best = None, None
        for measured, times in classes.items():
            if measured.causal != size.causal or backend not in times:
                continue
            distance = sum(abs(a - b) for a, b in zip(measured[1:], size[1:]))
            if best is None or distance < best:
                nearest, best = measured, distance
        if nearest is None:
            return None
        device = classes[nearest][backend]
        work, near_work = size.work(), nearest.work()
        if near_work > 0:
            device *= work / near_work
        return max(self._host(backend, key, nearest, host), device, self._floor(key, size.causal, backend))

    def _host(self, backend: str, key: ConfigKey, size: SizeClass, median: float) -> float:
        return self.class_host_us.get(key, {}).get(size, {}).get(backend, median)

    def _floor(self, key: ConfigKey, causal: bool, backend: str) -> float:
        floor = self._floors.get((key, causal, backend))
        if floor is None:
            times = [t[backend] for c, t in self.device_us[key].items() if c.causal == causal and backend in t]
            floor = self._floors[(key, causal, backend)] = min(times)
        return floor

    def choose(self, candidates: Sequence[str], key: ConfigKey, sizes: Iterable[SizeClass]) -> str | None:
        """The candidate with the least predicted time over ``sizes`` (one class per call; the fused op's two
        parts are two), the earlier candidate on a tie; ``None`` where no candidate has a prediction for every
        class (then the fixed order decides)."""
        sizes = list(sizes)
        best_name, best_time = None, math.inf
        for name in candidates:
            total = 0.0
            for size in sizes:
                predicted = self.predict(name, key, size)
                if predicted is None:
                    total = math.inf
                    break
                total += predicted
            if total < best_time:
                best_name, best_time = name, total
        return best_name

    # --- the file format ------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The table as the file holds it (see :func:`parse`)."""
        entries = []
        for (dtype, dqk, dv), classes in sorted(self.device_us.items()):
            for size, times in sorted(classes.items(), key=lambda item: (not item[0].causal, tuple(item[0]))):
                entries.append(
                    {
                        "dtype": dtype,
                        "dims": [dqk, dv],
                        "path": size.path,
                        "class": list(size[1:]),
                        "sizes": size.bounds(),
                        "device_us": {b: round(t, 3) for b, t in sorted(times.items())},
                    }
                )
                hosts = self.class_host_us.get((dtype, dqk, dv), {}).get(size)
                if hosts:
                    entries[-1]["host_us"] = {b: round(t, 3) for b, t in sorted(hosts.items())}
        return {
            "schema": SCHEMA,
            "gpu": self.gpu,
            "capability": str(self.capability),
            "versions": dict(self.versions),
            "command": self.command,
            "created": self.created,
            "host_us": {b: round(t, 3) for b, t in sorted(self.host_us.items())},
            "entries": entries,
        }


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise CostTableError(f"{where} must be a finite number of microseconds >= 0, got {value!r:.40}")
    return float(value)


def _backend_times(value: Any, where: str) -> dict[str, float]:
    if not isinstance(value, Mapping):
        raise CostTableError(f"{where} must map backend names to microseconds, got {type(value).__name__}")
    times = {}
    for name, time in value.items():
        if name not in PrefillBackendEnum.__members__:
            raise CostTableError(f"{where} names no backend: {name!r:.40}")
        times[name] = _number(time, f"{where}[{name!r}]")
    return times


def parse(data: Any, source: str = "memory") -> CostTable:
    """A :class:`CostTable` from a file's JSON; raises :class:`CostTableError` saying what is wrong.

    The format (``schema`` 1)::

        {"schema": 1, "gpu": "NVIDIA H200", "capability": "9.0",
         "versions": {"mla_ops": "0.1.0", "torch": "...", "triton": "...", "flashinfer-python": "...", ...},
         "command": "python -m mla_ops tune ...", "created": "2026-12-05T10:00:00Z",
         "host_us": {"FLASHINFER": 31.0, "FLASH_ATTN": 19.5, "TRITON": 6.2},
         "entries": [{"dtype": "bfloat16", "dims": [192, 128], "path": "new", "class": [13, 13, 5, 3, 12, 12],
                      "sizes": "new Tq 4096-8191 ...", "device_us": {"FLASHINFER": 210.4, "TRITON": 230.9},
                      "host_us": {"FLASHINFER": 61.2, "TRITON": 21.7}}]}

    ``class`` holds the bit lengths of ``Tq, Tk, H, B, max_seqlen_q, max_seqlen_k`` (:class:`SizeClass`);
    ``sizes`` is for readers only; an entry's ``host_us`` (the class's host times) is optional.
    """
    if not isinstance(data, Mapping):
        raise CostTableError(f"the file holds {type(data).__name__}, not a JSON object")
    schema = data.get("schema")
    if schema != SCHEMA:
        raise CostTableError(f"it has schema {schema!r:.20}; this mla_ops reads schema {SCHEMA}")
    try:
        capability = DeviceCapability.parse(str(data.get("capability", "")))
    except ValueError as exc:
        raise CostTableError(f"capability: {exc}") from None
    versions = data.get("versions")
    if not isinstance(versions, Mapping) or not all(isinstance(v, str) for v in versions.values()):
        raise CostTableError("versions must map distribution names to version strings")
    gpu, command, created = data.get("gpu"), data.get("command", ""), data.get("created", "")
    if not isinstance(gpu, str) or not isinstance(command, str) or not isinstance(created, str):
        raise CostTableError("gpu, command and created must be strings")
    host_us = _backend_times(data.get("host_us"), "host_us")
    entries = data.get("entries")
    if not isinstance(entries, list):
        raise CostTableError("entries must be a list")
    device_us: dict[ConfigKey, dict[SizeClass, dict[str, float]]] = {}
    class_host_us: dict[ConfigKey, dict[SizeClass, dict[str, float]]] = {}
    for i, entry in enumerate(entries):
        where = f"entries[{i}]"
        if not isinstance(entry, Mapping):
            raise CostTableError(f"{where} must be an object")
        dtype, dims, path, bits = entry.get("dtype"), entry.get("dims"), entry.get("path"), entry.get("class")
        if dtype not in ("bfloat16", "float16"):
            raise CostTableError(f"{where}.dtype must be 'bfloat16' or 'float16', got {dtype!r:.40}")
        if not (isinstance(dims, list) and len(dims) == 2 and all(type(d) is int and d > 0 for d in dims)):
            raise CostTableError(f"{where}.dims must be [Dqk, Dv], two positive ints, got {dims!r:.40}")
        if path not in PATHS:
            raise CostTableError(f"{where}.path must be one of {list(PATHS)}, got {path!r:.40}")
        if not (isinstance(bits, list) and len(bits) == 6 and all(type(b) is int and 0 <= b <= 64 for b in bits)):
            raise CostTableError(f"{where}.class must be six bit lengths (ints 0 to 64), got {bits!r:.60}")
        times = _backend_times(entry.get("device_us"), f"{where}.device_us")
        size = SizeClass(PATHS[path], *bits)
        device_us.setdefault((dtype, dims[0], dims[1]), {}).setdefault(size, {}).update(times)
        if "host_us" in entry:
            hosts = _backend_times(entry["host_us"], f"{where}.host_us")
            class_host_us.setdefault((dtype, dims[0], dims[1]), {}).setdefault(size, {}).update(hosts)
    return CostTable(capability, gpu, dict(versions), command, host_us, device_us, source, created, class_host_us)


def load(path: Path) -> CostTable:
    """Read and :func:`parse` the table at ``path``; raises :class:`CostTableError` (``FileNotFoundError`` where
    there is no file)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise CostTableError(f"cannot read it: {exc}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise CostTableError(f"it is not JSON: {exc}") from None
    return parse(data, str(path))


def write(table: CostTable, path: Path) -> None:
    """Write ``table`` to ``path`` atomically (a reader sees the old file or the new one, never a part)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        partial.write_text(json.dumps(table.to_json(), indent=1) + "\n")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def measured_host_cost(samples: Iterable[float]) -> float:
    """A host cost from per-call host times (µs): their median (a backend's over every measured shape, or over
    the shapes of one class)."""
    return statistics.median(samples)


# --- where tables are found ---------------------------------------------------------------------------


def table_name(capability: DeviceCapability) -> str:
    """The file name of a capability's table, e.g. ``sm90.json``."""
    return f"sm{capability.major}{capability.minor}.json"


class Locations:
    """Where tables are looked for, and what this process has warned about: one instance, :data:`LOCATIONS`.

    ``user_dir`` (``None``: ``<cache root>/tables``, see :func:`mla_ops.native.cache_root`) holds the tables
    that ``python -m mla_ops tune`` measured on this machine; ``committed_dir`` those shipped in the package.
    Tests point both elsewhere rather than patching module globals.
    """

    def __init__(self) -> None:
        self.user_dir: Path | None = None
        self.committed_dir: Path = Path(__file__).resolve().parent / "tables"
        self.warned: set[str] = set()

    def user_directory(self) -> Path | None:
        """The directory of this machine's tables (``None`` where ``MLA_OPS_CACHE_DIR`` is invalid)."""
        if self.user_dir is not None:
            return self.user_dir
        try:
            return native.cache_root() / "tables"
        except ValueError:  # an invalid MLA_OPS_CACHE_DIR: info reports it; a call never fails for it
            return None


#: This process's table locations.
LOCATIONS = Locations()


def user_table_path(capability: DeviceCapability) -> Path | None:
    """Where ``python -m mla_ops tune`` writes this machine's table for ``capability``:
    ``$MLA_OPS_CACHE_DIR/tables/sm<NN>.json``, else ``$XDG_CACHE_HOME/mla_ops/tables/...``, else
    ``~/.cache/mla_ops/tables/...``."""
    directory = LOCATIONS.user_directory()
    return None if directory is None else directory / table_name(capability)


def committed_table_path(capability: DeviceCapability) -> Path:
    """Where the package's own table for ``capability`` is (it may not exist)."""
    return LOCATIONS.committed_dir / table_name(capability)


def _warn_once(path: Path, problem: str, fallback: str) -> None:
    key = str(path)
    if key in LOCATIONS.warned:
        return
    LOCATIONS.warned.add(key)
    warnings.warn(
        f"mla_ops: the backend cost table {path} is not used: {problem}. Routing uses {fallback} instead; "
        f"run `{TUNE_COMMAND}` to measure a fresh one for this machine (or delete the file)",
        RuntimeWarning,
        stacklevel=2,
    )


def stale_reason(table: CostTable, capability: DeviceCapability) -> str | None:
    """Why this machine's ``table`` does not describe it now, or ``None``: another capability, other library
    versions, or another GPU of the capability (where one is visible)."""
    if table.capability != capability:
        return f"it was measured on compute capability {table.capability}, not {capability}"
    current = library_versions()
    changed = [
        f"{d} {table.versions.get(d, 'absent')} -> {v}" for d, v in current.items() if table.versions.get(d) != v
    ]
    if changed:
        return "it was measured with other versions (" + ", ".join(changed) + ")"
    if torch.cuda.is_available():
        names = {
            torch.cuda.get_device_name(i)
            for i in range(torch.cuda.device_count())
            if DeviceCapability(*torch.cuda.get_device_capability(i)) == capability
        }
        if names and table.gpu not in names:
            return f"it was measured on {table.gpu}, not on this machine's {', '.join(sorted(names))}"
    return None


def _committed(capability: DeviceCapability) -> tuple[CostTable | None, str]:
    path = committed_table_path(capability)
    try:
        table = load(path)
        if table.capability != capability:
            raise CostTableError(f"it describes compute capability {table.capability}, not {capability}")
    except FileNotFoundError:
        return None, "none: fixed order"
    except CostTableError as exc:
        _warn_once(path, str(exc), "the fixed order of backends")
        return None, f"none: fixed order (the committed table {path} is not used: {exc})"
    # The committed table comes from another machine: a backend whose kernels come from other libraries here
    # keeps no times (it is no candidate); the others' library versions may differ, as on any user's machine.
    foreign = table.foreign_backends(library_versions())
    if foreign:
        left_out = "; ".join(f"{b} left out: {why}" for b, why in foreign.items())
        return table.without(foreign), f"committed: {path} ({left_out})"
    return table, f"committed: {path}"


_tables: dict[DeviceCapability, tuple[CostTable | None, str]] = {}


def table_for(capability: DeviceCapability) -> CostTable | None:
    """The table that ranks the backends on ``capability``: this machine's where it is fresh, else the
    committed one, else ``None``; read once per process (until :func:`forget`). Never raises; a stale or
    corrupt file warns once per process."""
    return table_source(capability)[0]


def table_source(capability: DeviceCapability) -> tuple[CostTable | None, str]:
    """:func:`table_for`'s table and where it comes from, in words: ``"tuned: <path>"``,
    ``"committed: <path>"`` or ``"none: fixed order"`` (with why a file present was passed over)."""
    found = _tables.get(capability)
    if found is None:
        found = _tables[capability] = _resolve(capability)
    return found


def _resolve(capability: DeviceCapability) -> tuple[CostTable | None, str]:
    committed, committed_source = _committed(capability)
    fallback = "the committed table" if committed is not None else "the fixed order of backends"
    path = user_table_path(capability)
    if path is None:
        return committed, committed_source
    try:
        table = load(path)
        reason = stale_reason(table, capability)
        if reason is not None:
            raise CostTableError(reason)
    except FileNotFoundError:
        return committed, committed_source
    except CostTableError as exc:
        _warn_once(path, str(exc), fallback)
        return committed, f"{committed_source} (this machine's {path} is not used: {exc})"
    return table, f"tuned: {path}"


def forget() -> None:
    """Read the tables again on next use (``mla_ops.clear_cache`` calls this); warnings stay given."""
    _tables.clear()
