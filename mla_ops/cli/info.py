"""``python -m mla_ops info``: what would run where, and why.

The output has four parts: the versions and the device; the selection rules for the device (a pure
function of capability, dtype and dims, so ``--capability`` reproduces any GPU's rules anywhere); the size
classes of the device's cost table, with the backend each runs; and what this machine's installed libraries
make of them, with the dispatch table of the ops.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os

import torch

from .. import cost_table, invariance, native
from ..backends.base import PrefillBackend
from ..backends.registry import PrefillBackendEnum
from ..runtime.merge_dispatch import merge_description
from ..selector import (
    ENV_VAR,
    SizedRoute,
    backend_priorities,
    current_override,
    env_override,
    order_evidence,
    routing_entry,
    select_backend,
    unsupported_platform_reason,
    validate_backend,
)
from ..specs import DEEPSEEK_V3, DeviceCapability, MLADimensions, SelectorConfig
from ..version import __version__

_LIBRARIES = {
    "torch": "torch",
    "triton": "triton",
    "flashinfer": "flashinfer-python",
    "flash_attn": "flash-attn",
    "flash_attn_interface (FA3)": "flash-attn-3",
    "flash_attn.cute (FA4)": "flash-attn-4",
}


def library_versions() -> dict[str, str]:
    """Installed versions of the libraries the backends use (``"not installed"`` when absent)."""
    versions = {}
    for label, dist in _LIBRARIES.items():
        try:
            versions[label] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[label] = "not installed"
    versions["torch"] = torch.__version__
    versions["CUDA (torch build)"] = str(torch.version.cuda)
    return versions


def _setting_value(variable: str) -> str:
    """What ``variable``, one of :data:`SETTINGS`, makes the package do, parsed by the code that reads it;
    raises that code's ``ValueError`` where the value is invalid."""
    from ..backends import flashinfer
    from ..kernels import configs

    if variable == ENV_VAR:
        forced = env_override()
        return f"{forced.name} on CUDA devices" if forced else "automatic selection"
    if variable == configs.CONFIG_ENV_VAR:
        config = configs.env_attention_config()
        return f"every TRITON launch as {config}" if config else "the configuration tables"
    if variable == flashinfer.WORKSPACE_ENV:
        return f"{flashinfer.workspace_bytes_from_env() >> 20} MiB of FlashInfer workspace per device"
    if variable == native.DISABLE_VARIABLE:
        return "native library used" if native.switch(variable) else "native library never built"
    if variable == native.DEPRECATED_DISABLE_VARIABLE:
        if native.disable_setting()[0] != variable:  # MLA_OPS_NATIVE set, or the old name unset
            return f"deprecated name of {native.DISABLE_VARIABLE}; not read"
        on = native.switch(native.DISABLE_VARIABLE)
        return f"deprecated name of {native.DISABLE_VARIABLE}: native library " + ("used" if on else "never built")
    if variable == native.LAUNCH_VARIABLE:
        return "TRITON launches handed to it" if native.switch(variable) else "TRITON launched through Python"
    if variable == native.CACHE_VARIABLE:
        return f"builds and tuned cost tables kept in {native.cache_root()}"
    if variable == invariance.ENV_VAR:
        if invariance.env_setting():
            return "batch-invariant: one backend for every size, only batch-invariant backends"
        return "calls routed by size class where a cost table exists"
    raise KeyError(variable)


#: Every environment variable the package reads (``python -m mla_ops info`` shows each).
SETTINGS = (
    ENV_VAR,
    "MLA_OPS_TRITON_CONFIG",
    "MLA_OPS_FLASHINFER_WORKSPACE_MB",
    native.DISABLE_VARIABLE,
    native.DEPRECATED_DISABLE_VARIABLE,
    native.LAUNCH_VARIABLE,
    native.CACHE_VARIABLE,
    invariance.ENV_VAR,
)


def setting_problems() -> dict[str, str]:
    """Each invalid setting's error, by variable (empty when every setting is valid)."""
    problems = {}
    for variable in SETTINGS:
        try:
            _setting_value(variable)
        except ValueError as exc:
            problems[variable] = str(exc)
    return problems


def check_settings() -> None:
    """Raise the first invalid setting's ``ValueError`` (the commands call it before they start)."""
    problems = setting_problems()
    if problems:
        raise ValueError(next(iter(problems.values())))


def settings_table() -> tuple[str, dict[str, str]]:
    """Every ``MLA_OPS_*`` setting with its value and what it does (or why it is invalid), plus variables named
    ``MLA_OPS_*`` that are not settings; and the invalid settings' errors."""
    lines = ["Settings (environment)"]
    problems = setting_problems()
    for variable in SETTINGS:
        text = os.environ.get(variable)
        shown = "unset" if text is None else repr(text)
        verdict = f"invalid: {problems[variable]}" if variable in problems else _setting_value(variable)
        lines.append(f"  {variable:<32} {shown:<12} {verdict}")
    for variable in sorted(os.environ):
        if variable.startswith("MLA_OPS_") and variable not in SETTINGS:
            lines.append(f"  {variable:<32} {os.environ[variable]!r:<12} not a setting of mla_ops: ignored (misspelt?)")
    return "\n".join(lines), problems


def _device_name(capability: DeviceCapability | None) -> str:
    return "CPU" if capability is None else f"compute capability {capability}"


def selection_rules(capability: DeviceCapability | None, config: SelectorConfig) -> str:
    """The priority list for ``capability`` and whether each backend's kernels cover ``config``.

    Ignores what is installed: the same arguments print the same table on every machine.
    """
    lines = [f"Selection rules for {_device_name(capability)} and {config!r}"]
    priorities = backend_priorities(capability, config)
    invariant = _invariant_mode()
    if not priorities:
        assert capability is not None
        lines.append(f"  {unsupported_platform_reason(capability)}")
        return "\n".join(lines)
    lines.append(f"  {'order':<6} {'backend':<11} covers this config")
    first = None
    rest = [b for b in PrefillBackendEnum if b not in priorities]
    for rank, backend in [(str(i + 1), b) for i, b in enumerate(priorities)] + [("-", b) for b in rest]:
        try:
            reasons = backend.backend().rule_reasons(capability, config)
            if invariant and not reasons and capability is not None and not backend.backend().batch_invariant:
                reasons = ["does not guarantee batch-invariant results (batch-invariant mode)"]
        except ImportError as exc:
            reasons = [f"ImportError: {exc}"]
        verdict = "yes" if not reasons else "no: " + "; ".join(reasons)
        if rank == "-":
            verdict += " (explicit override only)" if not reasons else ""
        elif first is None and not reasons:
            first = backend.name
        lines.append(f"  {rank:<6} {backend.name:<11} {verdict}")
    if capability is not None and capability.major == 9 and PrefillBackendEnum.FLASH_ATTN in priorities:
        lines.append("  (FLASH_ATTN ranks after TRITON where the FlashAttention it runs pads v: FlashAttention-2)")
    if capability is not None and capability.major == 10 and priorities[0] is PrefillBackendEnum.FLASHINFER:
        lines.append(
            "  (FLASHINFER ranks after FLASH_ATTN where its FlashInfer lacks trtllm_ragged_attention_deepseek)"
        )
    evidence = order_evidence(capability, config)
    if evidence is not None:
        lines.append(f"  order from: {evidence}")
    lines.append(f"  automatic choice when every library is installed: {first or 'none'}")
    return "\n".join(lines)


def _invariant_mode() -> bool:
    """Whether the batch-invariant mode is on (an invalid setting counts as off here; Settings reports it)."""
    try:
        return invariance.resolve()
    except ValueError:
        return False


def rule_candidates(capability: DeviceCapability | None, config: SelectorConfig) -> list[str]:
    """The backends that the rules let run ``config`` on ``capability`` when every library is installed, in the
    priority order: what a cost table ranks there (the batch-invariant mode's exclusions applied)."""
    invariant = _invariant_mode()
    names = []
    for member in backend_priorities(capability, config):
        try:
            backend = member.backend()
            if backend.rule_reasons(capability, config) or (invariant and not backend.batch_invariant):
                continue
        except ImportError:
            continue
        names.append(member.name)
    return names


def size_class_table(capability: DeviceCapability | None, config: SelectorConfig) -> str:
    """The cost table of ``capability`` in use (this machine's, the committed one, or none) and, for each size
    class it measured for ``config``, every backend's predicted time and the one automatic routing runs when
    every library is installed (the choice for other classes follows from the same predictions)."""
    lines = [f"Size classes for {_device_name(capability)} and {config!r}"]
    if capability is None:
        lines.append("  CPU: REFERENCE for every size")
        return "\n".join(lines)
    table, source = cost_table.table_source(capability)
    lines.append(f"  table: {source}")
    if table is None:
        lines.append(
            f"  every size runs the fixed order above; `{cost_table.TUNE_COMMAND}` on this GPU measures a table"
        )
        return "\n".join(lines)
    versions = ", ".join(f"{d} {v}" for d, v in table.versions.items() if v != cost_table.NOT_INSTALLED)
    lines.append(f"  measured on {table.gpu} ({table.created or 'undated'}) with {versions}")
    lines.append(f"  by: {table.command or 'unknown command'}")
    lines.append("  median host µs per call: " + ", ".join(f"{b} {t:.1f}" for b, t in sorted(table.host_us.items())))
    if _invariant_mode():
        lines.append("  not used: the batch-invariant mode runs one backend for every size")
        return "\n".join(lines)
    key = (str(config.dtype).removeprefix("torch."), config.head_dim_qk, config.head_dim_v)
    if not table.covers(key):
        lines.append("  not measured for this dtype and these dims: every size runs the fixed order above")
        return "\n".join(lines)
    candidates = rule_candidates(capability, config)
    measured = sorted(table.measured(key), key=[b.name for b in PrefillBackendEnum].index)
    lines.append(
        f"  predicted µs per call (max of host, device){'':<15} " + " ".join(f"{b:>11}" for b in measured) + "  choice"
    )
    for size in sorted(table.device_us[key], key=lambda c: (not c.causal, tuple(c))):
        predicted = [table.predict(b, key, size) for b in measured]
        cells = " ".join(f"{t:>11.1f}" if t is not None else f"{'-':>11}" for t in predicted)
        choice = table.choose(candidates, key, (size,)) or (candidates[0] if candidates else "none")
        lines.append(f"  {size.bounds():<58} {cells}  {choice}")
    return "\n".join(lines)


def machine_table(capability: DeviceCapability | None, config: SelectorConfig, simulated: bool) -> str:
    """Each backend's validity with this machine's libraries, and the backend that would be selected."""
    where = _device_name(capability) + (", simulated" if simulated else "")
    lines = [f"On this machine ({where})", f"  {'backend':<11} {'valid':<6} implementation or reasons"]
    for backend in PrefillBackendEnum:
        cls, reasons = validate_backend(backend, capability, config)
        detail = cls.describe(capability, config) if not reasons and cls is not None else "; ".join(reasons)
        lines.append(f"  {backend.name:<11} {'yes' if not reasons else 'no':<6} {detail}")
    try:
        override = current_override()
    except ValueError as exc:  # a misspelt MLA_OPS_PREFILL_BACKEND: report it, the ops would raise it
        lines.append(f"  override: invalid: {exc}")
        return "\n".join(lines)
    if override is None:
        lines.append(f"  override: none ({ENV_VAR} unset)")
    elif capability is None:
        lines.append(
            f"  override: {override.name}, which applies to CUDA devices only; CPU tensors always run REFERENCE"
        )
    else:
        lines.append(f"  override: {override.name}")
    try:
        selected = select_backend(capability, config)
    except ValueError as exc:
        lines.append(f"  selected: none ({exc})")
        return "\n".join(lines)
    entry = routing_entry(capability, config)
    if type(entry) is SizedRoute:
        names = ", ".join(b.name for b in entry.may_run())
        lines.append(f"  selected: by size class among {names} (see Size classes); {selected.name} by the fixed order")
    else:
        lines.append(f"  selected: {selected.name}")
    if capability is not None:
        lines.append(f"  CUDA-graph trees: {_in_graph_choice(selected, capability, config)}")
    return "\n".join(lines)


def _in_graph_choice(selected: PrefillBackend, capability: DeviceCapability, config: SelectorConfig) -> str:
    """What calls through the Python API run inside torch.compile's CUDA-graph trees, given ``selected``."""
    if not selected.plans_on_host:
        return f"{selected.name} too (it reads the offsets on the device)"
    try:
        inside = select_backend(capability, config, in_graph=True)
    except ValueError as exc:  # a forced host planner, or no backend that reads the offsets on the device
        return f"none: {exc}"
    return f"{inside.name} ({selected.name} plans on the host)"


def dispatch_table(capability: DeviceCapability | None, config: SelectorConfig) -> str:
    """What each dispatch key of the ``mla`` ops runs for ``config``."""
    if capability is None:
        cuda = "no CUDA device visible (pass --capability to see a GPU's rules)"
    else:
        try:
            selected = select_backend(capability, config)
            cuda = f"{selected.name} for prefill and prefill_context_chunk"
            if selected.launches_natively:
                cuda += f" ({native.launch_status()})"
        except ValueError:
            cuda = "no valid backend (see above): the ops raise ValueError"
        cuda += f"; merge_attn_states: {merge_description()}"
    return "\n".join(
        [
            "Dispatch keys of torch.ops.mla.*",
            "  Meta/fake  mla_ops.meta shape functions",
            "  CPU        REFERENCE (PyTorch, fp32 accumulation)",
            f"  CUDA       {cuda}",
        ]
    )


def _capability(text: str) -> DeviceCapability:
    try:
        capability = DeviceCapability.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if capability.major < 1 or capability.minor < 0:
        raise argparse.ArgumentTypeError(f"compute capability {text!r} is not a CUDA capability; e.g. 8.0, 9.0, 10.0")
    return capability


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--capability", type=_capability, default=None, help="simulate a CUDA device, e.g. 9.0, 10.0, 8.0"
    )
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        help="dtype of q/k/v: bfloat16, float16 or float8_e4m3fn (others print why they fail)",
    )
    parser.add_argument(
        "--dims",
        default=",".join(map(str, DEEPSEEK_V3)),
        help="MLA dims qk_nope,qk_rope,v (default %(default)s, DeepSeek-V3)",
    )
    parser.add_argument("--device", default=None, help="CUDA device to describe (default: the current one)")


def parse_device(text: str, types: tuple[str, ...] = ("cpu", "cuda"), present: bool = True) -> torch.device:
    """``--device`` as a ``torch.device``: ``cpu``, ``cuda`` or ``cuda:N`` (of ``types``), with ``present``
    naming a device this machine has; raises ``ValueError`` saying what to pass instead."""
    kind, colon, index = text.partition(":")
    if kind not in types or (colon and (kind != "cuda" or not index.isdigit())):
        choices = ", ".join(types).replace("cuda", "cuda, cuda:N").rsplit(", ", 1)
        raise ValueError(f"--device {text!r}: pass {' or '.join(choices)} (N a GPU's index)")
    device = torch.device(text)
    if present and device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {text}: no CUDA device is visible (torch.cuda.is_available() is False)")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"--device {text}: there is no such GPU; this machine shows {count} (cuda:0 to cuda:{count - 1})"
            )
    return device


def parse_dims(text: str) -> MLADimensions:
    """``"qk_nope,qk_rope,v"`` as :class:`MLADimensions`; raises ``ValueError`` saying what is wrong."""
    try:
        nope, rope, v = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--dims must be three integers qk_nope,qk_rope,v (e.g. 128,64,128), got {text!r}") from None
    if nope < 0 or rope < 0 or nope + rope <= 0 or v <= 0:
        raise ValueError(
            f"--dims {text!r}: qk_nope and qk_rope must be >= 0 with a positive sum, and v must be positive"
        )
    return MLADimensions(nope, rope, v)


def main(args: argparse.Namespace) -> int:
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"--dtype {args.dtype!r} is not a torch dtype (e.g. bfloat16, float16)")
    config = SelectorConfig(dtype, parse_dims(args.dims))
    device = None
    if torch.cuda.is_available():
        device = torch.device(args.device or f"cuda:{torch.cuda.current_device()}")
    capability = args.capability or (DeviceCapability.of(device) if device is not None else None)

    print(f"mla_ops {__version__}")
    for label, version in library_versions().items():
        print(f"  {label}: {version}")
    if device is not None:
        print(f"device: {device} {torch.cuda.get_device_name(device)}, capability {DeviceCapability.of(device)}")
    else:
        print("device: CPU only (no CUDA device visible)")
    print()
    table, problems = settings_table()
    print(table)
    for section in (
        lambda: selection_rules(capability, config),
        lambda: size_class_table(capability, config),
        lambda: machine_table(capability, config, simulated=args.capability is not None),
        lambda: dispatch_table(capability, config),
    ):
        print()
        try:
            print(section())
        except ValueError as exc:  # an invalid setting that this part reads: reported above, and below
            print(f"  (not shown: {exc})")
    if problems:
        names = ", ".join(problems)
        raise ValueError(f"invalid setting{'s' if len(problems) > 1 else ''}: {names} (see Settings above)")
    return 0
