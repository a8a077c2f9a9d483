"""``python -m mla_ops warmup``: build every just-in-time kernel before serving.

FlashInfer compiles its attention kernels on first use (minutes on a bare machine), the native library
(:mod:`mla_ops.native`: the merge and TRITON's launches) on the first CUDA merge or TRITON call (seconds,
once per machine) and Triton on first launch (seconds). Doing it ahead of time keeps that out of the first
request and, more importantly, out of CUDA-graph capture (the native library is not built during capture:
the Triton merge and TRITON's Python launches run there until it is).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from .. import native
from ..backends.registry import PrefillBackendEnum
from ..selector import validate_backend
from ..specs import DEEPSEEK_V3, DeviceCapability, SelectorConfig
from .info import check_settings, parse_device, parse_dims


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dtype",
        action="append",
        choices=["bfloat16", "float16", "float8_e4m3fn"],
        help="dtype to compile for (repeatable; default bfloat16)",
    )
    parser.add_argument(
        "--dims",
        action="append",
        help=f"MLA dims qk_nope,qk_rope,v (repeatable; default {','.join(map(str, DEEPSEEK_V3))})",
    )
    parser.add_argument("--heads", type=int, default=16, help="query heads per device (default %(default)s)")
    parser.add_argument(
        "--backend",
        action="append",
        choices=[b.name for b in PrefillBackendEnum],
        help="warm up only these backends (repeatable; default: every backend valid here)",
    )
    parser.add_argument("--device", default="cuda", help="CUDA device (default %(default)s)")


def main(args: argparse.Namespace) -> int:
    dtypes = [getattr(torch, d) for d in (args.dtype or ["bfloat16"])]
    dims_list = [parse_dims(d) for d in (args.dims or [",".join(map(str, DEEPSEEK_V3))])]
    if args.heads < 1:
        raise ValueError(f"--heads must be at least 1, got {args.heads}")
    check_settings()
    if args.device == "cpu":
        raise ValueError("--device cpu: warmup compiles CUDA kernels; name a CUDA device (cuda or cuda:N)")
    # The option's form is checked on every machine, so that a script's mistake shows before it meets a GPU.
    parse_device(args.device, ("cuda",), present=False)
    if not torch.cuda.is_available():
        print("warmup: no CUDA device visible; the CPU path (REFERENCE) has nothing to compile")
        return 0
    device = parse_device(args.device, ("cuda",))
    capability = DeviceCapability.of(device)
    wanted = [PrefillBackendEnum[name] for name in args.backend] if args.backend else list(PrefillBackendEnum)
    jobs = [(b, SelectorConfig(dt, dims)) for b in wanted for dt in dtypes for dims in dims_list]
    start = time.perf_counter()
    loaded = native.load()
    print(
        f"merge_attn_states: {native.status()}" + (f", ready in {time.perf_counter() - start:.1f} s" if loaded else "")
    )
    failures = []
    for i, (backend, config) in enumerate(jobs, 1):
        dtype = str(config.dtype).removeprefix("torch.")
        job = f"{backend.name} {dtype} {tuple(config.mla_dimensions)}"
        label = f"[{i}/{len(jobs)}] {job}"
        cls, reasons = validate_backend(backend, capability, config)
        if reasons:
            print(f"{label}: skipped ({'; '.join(reasons)})", flush=True)
            if args.backend:  # asked for by name: not warming it up is an error, not a choice
                failures.append(job)
            continue
        print(f"{label}: compiling ...", flush=True)
        start = time.perf_counter()
        cls.warmup(device, config, args.heads)
        torch.cuda.synchronize(device)
        print(f"{label}: ready in {time.perf_counter() - start:.1f} s", flush=True)
    if failures:
        print(
            f"warmup: {len(failures)} of the {len(jobs)} asked for cannot run here and were skipped "
            f"({', '.join(failures)}; reasons above); the others are ready",
            file=sys.stderr,
        )
        return 1
    return 0
