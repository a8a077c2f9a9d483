#!/usr/bin/env python
"""Compile the Triton attention kernels' variants for Hopper (sm_90a) ahead of time, on any machine.

No GPU is needed: Triton's NVIDIA backend ships ``ptxas``, and each variant is built from the exact
arguments, constexprs and options that ``attention_triton`` would launch it with
(:func:`mla_ops.kernels.attention.launch_plan`, or :func:`mla_ops.kernels.attention_sm90.sm90_launch`
for a ``gluon`` configuration, over CPU stand-ins with the GPU tensors' shapes, strides and alignment).
By default it compiles what the SM90 tables launch for ``--dims``: each entry for the path its key names
(causal: new tokens; chunk: a context chunk); with ``--dtype float8_e4m3fn``, what fp8 calls launch (the main
table's entries), the Gluon kernel's fp8 variant (``SM90_GLUON_FP8_ATTENTION``) and the copy that transposes its
values, whose stores must be vectors (scalar stores are a failure). For each
variant it prints whether it compiled, the
registers per thread and spilled bytes (from ``ptxas -v``), the shared memory per program, the global
scratch bytes per program (where the kernel builds TMA descriptors on the device, ``(device)`` in the
last column), the warps per program (the Gluon kernel's partitions add a producer warp group), and what
the TTGIR holds: ``ttg.warp_specialize`` regions and TMA (``async_tma_copy``) operations. A variant that
does not compile, spills, has its wgmma instructions serialised by ptxas (its warnings C7514/C7515: the
tensor cores then finish each product before the next starts), or is the Gluon kernel without its
partitions, or has a shared-memory access of its own at the lines where Triton hands out the partitions (whose
racecheck hazards ``sanitize.py`` explains: :mod:`benchlib.handout`) is reported as a failure (spills only without
``--allow-spills``); the last line sums them up,
and the exit status is 1 if any failed.
``benchmarks/compile_matrix.sh`` runs it under each supported Triton release.

Usage::

    python benchmarks/compile_sm90.py                     # what the SM90 tables launch for (192, 128)
    python benchmarks/compile_sm90.py --dtype float8_e4m3fn  # fp8: the tl.dot variants and the Gluon fp8 one
    python benchmarks/compile_sm90.py --configs "128,64,8,3;128,64,8,3,ovl" --path chunk --dims 192,128
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The shared modules live next to this script, which is not part of a package.
from benchlib import cli
from benchlib.handout import foreign_accesses, handout_lines

#: The compute capability compiled for: Hopper, whose architecture-specific target is sm_90a.
CAPABILITY = 90
#: Tokens and heads of the stand-in tensors: enough for every block size, small enough to allocate.
TOKENS, HEADS = 1024, 16


@dataclass
class Variant:
    """One compiled variant and what the compiler made of it."""

    config: str
    causal: bool
    error: str | None = None
    registers: int | None = None
    spill_bytes: int | None = None
    serialized: str | None = None
    shared_bytes: int | None = None
    scratch_bytes: int | None = None
    warps: int | None = None
    warp_specialized: bool = False
    tma_ops: int = 0
    descriptors: tuple[str, ...] = ()
    native: bool | None = None  # its parameters are a native launch's (mla_ops.kernels.launch.native_abi)
    #: Named barriers the PTX uses besides the Gluon kernel's own hand-off barriers (Triton's), by id.
    other_barriers: tuple[int, ...] = ()
    #: Shared-memory accesses at the lines of Triton's hand-out of the partitions that are not the hand-out's
    #: (:func:`benchlib.handout.foreign_accesses`): sanitize.py would explain racecheck's hazards on them.
    handout_foreign: tuple[str, ...] = ()

    def problems(self, wants_ws: bool) -> list[str]:
        """Why this variant is not fit to launch; empty when it is. ``wants_ws``: it states partitions of its
        own (the Gluon kernel), which the TTGIR must show."""
        if self.error is not None:
            return [self.error]
        found = []
        if self.spill_bytes:
            found.append(f"spills {self.spill_bytes} bytes")
        if self.serialized:
            found.append(f"wgmma serialised ({self.serialized})")
        if wants_ws and not self.warp_specialized:
            found.append("warp specialisation requested but not applied")
        if self.native is False and not self.scratch_bytes:  # kernels with scratch never launch natively
            found.append("its parameters are not those a native launch passes")
        taken = sorted(set(self.other_barriers) & set(_handoff_barriers()))
        if taken:
            found.append(f"Triton's own named barriers {taken} are the work-item hand-off's (attention_sm90._ITEM_*)")
        taken = sorted(set(self.other_barriers) & set(_fp8_barriers()))
        if taken:
            found.append(f"Triton's own named barriers {taken} are the fp8 kernel's (_RING_FREE, _TURN)")
        if self.handout_foreign:
            found.append(
                f"{len(self.handout_foreign)} shared-memory access(es) besides Triton's hand-out at its lines "
                f"(sanitize.py would explain their hazards): {'; '.join(self.handout_foreign[:3])}"
            )
        return found


def _handoff_barriers() -> tuple[int, ...]:
    """The named barrier ids of the Gluon kernel's work-item hand-off (``attention_sm90._ITEM_WRITTEN`` and
    ``_ITEM_READ``, one per consumer warpgroup each)."""
    from mla_ops.kernels import attention_sm90

    return tuple(base + wg for base in (attention_sm90._ITEM_WRITTEN, attention_sm90._ITEM_READ) for wg in (0, 1))


def _fp8_barriers() -> tuple[int, ...]:
    """The named barrier ids of the Gluon kernel's fp8 variant: one per buffer of its rings (at most 4) and one per
    consumer warpgroup's turn. Their ids reach the PTX in registers, so :func:`other_barriers` finds Triton's own."""
    from mla_ops.kernels import attention_sm90

    ring = attention_sm90._RING_FREE
    return (*range(ring, ring + attention_sm90._MAX_FP8_STAGES), attention_sm90._TURN, attention_sm90._TURN + 1)


def other_barriers(ptx: str) -> tuple[int, ...]:
    """The ids of the named barriers in ``ptx`` other than the hand-off's, which are the only ones of
    ``attention_sm90._HANDOFF_THREADS`` threads, written as numbers (the fp8 variant's, :func:`_fp8_barriers`, are
    not)."""
    from mla_ops.kernels.attention_sm90 import _HANDOFF_THREADS

    handoff, ids = _handoff_barriers(), set()
    for bar_id, count in re.findall(
        r"\b(?:bar|barrier)\.(?:sync|arrive|red\.\w+)(?:\.aligned)?\s+(\d+)(?:,\s*(\d+))?", ptx
    ):
        if not (int(bar_id) in handoff and count == str(_HANDOFF_THREADS)):
            ids.add(int(bar_id))
    return tuple(sorted(ids))


def handout_foreign(ptx: str) -> list[str]:
    """The Gluon kernel's shared-memory accesses that ``ptx`` attributes to the lines of Triton's hand-out of its
    partitions but that are not the hand-out's (:func:`benchlib.handout.foreign_accesses`)."""
    from mla_ops.kernels import attention_sm90

    path = Path(attention_sm90.__file__)
    lines = handout_lines(path.read_text(), attention_sm90._attn_fwd_sm90.fn.__name__)
    if not lines:
        return ["the kernel's gl.warp_specialize call was not found in its source"]
    return foreign_accesses(ptx, path.name, lines)


def _stand_ins(dqk: int, dv: int, causal: bool, dtype_name: str = "bfloat16", key_major: bool = False):
    """``(call, out, lse, scales)`` over CPU tensors shaped and strided like the GPU ones: ``v`` a strided view of
    a ``[T, H, Dv + 128]`` kv; for fp8 inputs, bf16 output and per-head descale factors (else ``scales`` None).
    ``key_major``: one sequence and key-major values, as ``quantize_fp8(v, key_major=True)`` makes them (the fp8
    Gluon launch reads them without a copy)."""
    import torch

    from mla_ops.backends.base import Fp8Scales, VarlenCall

    dtype = getattr(torch, dtype_name)
    q = torch.empty(TOKENS, HEADS, dqk, dtype=dtype)
    k = torch.empty(TOKENS, HEADS, dqk, dtype=dtype)
    kv = torch.empty(TOKENS, HEADS, dv + 128, dtype=dtype)
    fp8 = dtype == torch.float8_e4m3fn
    out = torch.empty(TOKENS, HEADS, dv, dtype=torch.bfloat16 if fp8 else dtype)
    lse = torch.empty(HEADS, TOKENS, dtype=torch.float32)
    cu_q = torch.tensor([0, TOKENS // 2, TOKENS], dtype=torch.int32)
    cu_k = cu_q if causal else torch.tensor([0, 300, TOKENS], dtype=torch.int32)
    v = kv[..., 128:]
    if key_major:
        v = torch.empty(HEADS, dv, TOKENS, dtype=dtype).permute(2, 0, 1)
        cu_q = cu_k = torch.tensor([0, TOKENS], dtype=torch.int32)
    call = VarlenCall(q, k, v, cu_q, cu_k, TOKENS, TOKENS, dqk**-0.5, causal)
    descale = torch.ones(HEADS)
    return call, out, lse, Fp8Scales(descale, descale, descale, out.dtype) if fp8 else None


def parse_ptxas_log(log: str) -> tuple[int, int, str | None]:
    """``(registers per thread, spilled bytes stored + loaded, wgmma serialisation warning codes or None)``
    from the output of ``ptxas -v``."""
    registers = max(int(r) for r in re.findall(r"Used (\d+) registers", log))
    spills = sum(int(b) for b in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    # ptxas names each reason with a code of its own ("(C7515) Potential Performance Loss:
    # wgmma.mma_async instructions are serialized due to non wgmma instructions defining accumulator
    # registers of a wgmma between start and end of the pipeline stage", C7514 and others).
    codes = sorted(set(re.findall(r"(C75\d\d)\)?[^\n]*serialized", log)))
    return registers, spills, ",".join(codes) or None


def _ptxas_usage(ptx: str) -> tuple[int, int, str | None]:
    """:func:`parse_ptxas_log` of ``ptxas -v`` compiling ``ptx`` for sm_90a."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        cmd = [get_ptxas(CAPABILITY).path, "-v", f"--gpu-name={sm_arch_from_capability(CAPABILITY)}", str(src)]
        cmd += ["-o", str(Path(tmp) / "kernel.cubin")]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    return parse_ptxas_log(log)


def compile_variant(
    config: Any, dqk: int, dv: int, causal: bool, dtype_name: str = "bfloat16", key_major: bool = False
) -> Variant:
    """Compile ``config`` for sm_90a as ``attention_triton`` would launch it on ``dtype_name`` inputs (``key_major``:
    an fp8 call of one sequence with key-major values, :func:`_stand_ins`); never raises."""
    from triton.compiler import ASTSource

    variant = Variant(str(config), causal)
    try:
        call, out, lse, scales = _stand_ins(dqk, dv, causal, dtype_name, key_major)
        if config.gluon:
            # The Hopper kernel written in Gluon, as attention_sm90 launches it.
            from triton.experimental.gluon._runtime import GluonASTSource as source

            from mla_ops.kernels.attention_sm90 import _attn_fwd_sm90 as kernel
            from mla_ops.kernels.attention_sm90 import sm90_launch

            plan = sm90_launch(
                call, out, lse, config.block_n, config.num_stages, num_sms=132, scales=scales, pingpong=config.pingpong
            )
            # fp8: the device-side value descriptors are over the launcher's transposed copy of v, or over v itself
            # where it is key-major (vK).
            values = "v(device)" if scales is None else "vK(device)" if plan.constexprs["V_DIRECT"] else "vT(device)"
            variant.descriptors = ("q(device)", "k(device)", values)
        else:
            from mla_ops.kernels.attention import launch_plan
            from mla_ops.kernels.attention_kernel import attn_fwd_kernel as kernel

            source = ASTSource
            plan = launch_plan(call, out, lse, config, scales)
        from mla_ops.kernels.launch import native_abi

        compiled = _compile(kernel, plan, source)
        ttgir = compiled.asm["ttgir"]
        variant.registers, variant.spill_bytes, variant.serialized = _ptxas_usage(compiled.asm["ptx"])
        variant.shared_bytes = compiled.metadata.shared
        variant.scratch_bytes = compiled.metadata.global_scratch_size
        variant.warps = compiled.metadata.num_warps
        variant.warp_specialized = "ttg.warp_specialize" in ttgir
        variant.native = native_abi(compiled)
        if config.gluon:
            variant.other_barriers = other_barriers(compiled.asm["ptx"])
            variant.handout_foreign = tuple(handout_foreign(compiled.asm["ptx"]))
        variant.tma_ops = len(re.findall(r"async_tma_copy|async_tma_store|tma_store|descriptor_(?:load|store)", ttgir))
    except Exception as exc:  # a variant the compiler rejects is a result to report
        variant.error = _error_text(exc)
    return variant


def _compile(kernel: Any, plan: Any, source: Any) -> Any:
    """``kernel`` compiled for sm_90a (``CAPABILITY``) as a launch of ``plan`` (a
    :class:`~mla_ops.kernels.launch.LaunchPlan`) would compile it, with the options CachedLaunch adds to every
    launch; ``source`` is Triton's ``ASTSource`` or Gluon's."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    from mla_ops.kernels.triton_compat import COMPILE_OPTIONS

    launch_options = {**plan.options, **COMPILE_OPTIONS}
    target = GPUTarget("cuda", CAPABILITY, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*plan.args, **plan.constexprs, **launch_options)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, dict(launch_options), bound, specialization, options
    )
    return triton.compile(source(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def _error_text(exc: Exception) -> str:
    """A compiler error as one line: its type and its message's last line."""
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"


def compile_copy() -> tuple[dict[str, int], str | None]:
    """The fp8 values' transposed copy (:func:`mla_ops.kernels.transpose.copy_plan`) compiled for sm_90a as the
    Gluon fp8 launch makes it (from the stand-ins' ``v``, a block of lead columns): its global stores by width
    (e.g. ``{"v4.b32": 8}`` per thread), and why it is unfit or ``None``: scalar stores mean the compiler could not
    vectorise them (single bytes made the copy 11 times slower than a plain copy of ``v``)."""
    import torch
    from triton.compiler import ASTSource

    from mla_ops.kernels import configs, transpose

    try:
        call, _, _, _ = _stand_ins(192, 128, False, "float8_e4m3fn")
        lead = configs.SM90_GLUON_FP8_ATTENTION[(192, 128, False)].block_n  # a key tile, as the Gluon launch's
        width = transpose.transposed_width(call.k.shape[0], call.cu_seqlens_k.shape[0] - 1, lead)
        out = torch.empty(HEADS, call.v.shape[-1], width, dtype=call.v.dtype)
        plan = transpose.copy_plan(call.v, call.cu_seqlens_k, out, lead)
        compiled = _compile(transpose._transpose_kernel, plan, ASTSource)
    except Exception as exc:  # a kernel the compiler rejects is a result to report
        return {}, _error_text(exc)
    stores: dict[str, int] = {}
    for width in re.findall(r"\bst\.global(?:\.\w+)*?\.((?:v\d\.)?[bu]\d+)", compiled.asm["ptx"]):
        stores[width] = stores.get(width, 0) + 1
    scalar = sum(n for w, n in stores.items() if not w.startswith("v"))
    return stores, f"{scalar} scalar stores per thread" if scalar or not stores else None


def table_variants(dqk: int, dv: int, fp8: bool = False) -> list[tuple[str, bool]]:
    """``(configuration, causal)`` of every variant the SM90 tables launch for ``(dqk, dv)``: each entry
    with the path its key names, without repeats. ``fp8``: the fp8 calls' (they launch the main table's entries at
    every size), and the Gluon kernel's fp8 variant (``SM90_GLUON_FP8_ATTENTION``, which large fp8 calls run on
    SM90)."""
    from mla_ops.kernels.configs import SM90_ATTENTION, SM90_GLUON_FP8_ATTENTION, SM90_LARGE_BATCH_ATTENTION

    large = SM90_GLUON_FP8_ATTENTION if fp8 else SM90_LARGE_BATCH_ATTENTION
    tables = (*SM90_ATTENTION.items(), *large.items())
    return list(dict.fromkeys((str(config), bool(key[2])) for key, config in tables if key[:2] == (dqk, dv)))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    cli.add_attention_configs(parser, "--configs", "the SM90 tables' entries for --dims, each on its own path")
    parser.add_argument("--dims", default="192,128", help="Dqk,Dv (default 192,128)")
    parser.add_argument(
        "--dtype", choices=("bfloat16", "float16", "float8_e4m3fn"), default="bfloat16",
        help="the inputs' dtype (default bfloat16); float8_e4m3fn compiles the fp8 ops' variants and the Gluon\n"
        "kernel's fp8 variant",
    )  # fmt: skip
    parser.add_argument(
        "--path", choices=("both", "causal", "chunk"), default="both",
        help="which path to compile the --configs for (default both)",
    )  # fmt: skip
    parser.add_argument(
        "--allow-spills", action="store_true",
        help="report spills without counting them as failures (every tabled variant compiles without\n"
        "spills under the supported Triton releases; for trying other --configs)",
    )  # fmt: skip
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        # Under the interpreter @triton.jit builds no compilable kernel, and the launcher would plan for it.
        print("compile_sm90.py compiles for a GPU: run it without TRITON_INTERPRET", file=sys.stderr)
        return 2
    try:
        import triton
        from triton.backends.nvidia.compiler import get_ptxas

        get_ptxas(CAPABILITY)
    except Exception as exc:
        print(f"compile_sm90.py needs Triton with its NVIDIA backend and ptxas: {exc}", file=sys.stderr)
        return 2
    from mla_ops.kernels.configs import AttentionConfig

    dqk, dv = (int(x) for x in args.dims.split(","))
    if args.configs:
        paths = {"both": (True, False), "causal": (True,), "chunk": (False,)}[args.path]
        variants = [(text, causal) for text in args.configs.split(";") for causal in paths]
    else:
        variants = table_variants(dqk, dv, fp8=args.dtype == "float8_e4m3fn")
        if not variants:
            print(f"compile_sm90.py: the SM90 tables list nothing for (Dqk, Dv) = ({dqk}, {dv})", file=sys.stderr)
            return 2
    parsed = [(AttentionConfig.parse(text, "--configs"), causal, False) for text, causal in variants]
    if args.dtype == "float8_e4m3fn":
        # The Gluon fp8 variants again on key-major values of one sequence, which they read without the copy.
        parsed += [(config, causal, True) for config, causal, _ in parsed if config.gluon]
    dtype_label = {"bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8 (e4m3)"}[args.dtype]
    print(f"triton {triton.__version__}, sm_{CAPABILITY}a, (Dqk, Dv) = ({dqk}, {dv}), {dtype_label}")
    header = ("config", "path", "regs", "spill", "smem KiB", "scratch", "warps", "ws", "tma", "native")
    print("{:<31} {:<6} {:>4} {:>5} {:>8} {:>7} {:>5} {:>3} {:>3} {:>6}  descriptors".format(*header))
    failed = compiled = spilled = serialised = 0
    for config, causal, key_major in parsed:
        v = compile_variant(config, dqk, dv, causal, args.dtype, key_major)
        path = "causal" if causal else "chunk"
        problems = v.problems(config.gluon)
        if args.allow_spills:
            problems = [p for p in problems if not p.startswith("spills ")]
        compiled += v.error is None
        spilled += bool(v.spill_bytes)
        serialised += v.serialized is not None
        if v.error is None:
            print(
                f"{v.config:<31} {path:<6} {v.registers:>4} {v.spill_bytes:>5} {v.shared_bytes / 1024:>8.1f} "
                f"{v.scratch_bytes:>7} {v.warps:>5} {'yes' if v.warp_specialized else 'no':>3} {v.tma_ops:>3} "
                f"{'yes' if v.native else 'no':>6}  "
                f"{','.join(v.descriptors) or '-'}{'  FAIL: ' + '; '.join(problems) if problems else ''}"
            )
        else:
            print(f"{v.config:<28} {path:<6} FAIL: {v.error}")
        failed += bool(problems)
    if args.dtype == "float8_e4m3fn" and not args.configs:
        stores, problem = compile_copy()
        widths = ", ".join(f"{n} st.global.{w}" for w, n in sorted(stores.items())) or "-"
        verdict = f"  FAIL: {problem}" if problem else ""
        print(f"{'transposed values copy':<28} {'':<6} stores per thread: {widths}{verdict}")
        failed += problem is not None
    allowed = " (spills allowed)" if args.allow_spills else ""
    inputs = "" if args.dtype == "bfloat16" else f", {dtype_label}"
    print(
        f"triton {triton.__version__}, sm_{CAPABILITY}a{inputs}: {compiled} of {len(parsed)} variants compiled, "
        f"{spilled} spill, {serialised} serialise wgmma; {failed} failed{allowed}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
