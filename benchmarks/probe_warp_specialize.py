#!/usr/bin/env python
"""Does Triton's warp specialisation finish on this GPU? Each probe runs in its own process, time-boxed.

``tl.range(..., warp_specialize=True)`` is the lever a Hopper attention kernel needs for its last 20-30 %
(producer warps loading while consumer warp groups compute), and the TRITON backend has a variant that
uses it (the ``ws`` flag of ``MLA_OPS_TRITON_CONFIG``). On an H200 with Triton 3.6.0 every launch of that
variant deadlocked, so a GPU launch of it is refused unless ``MLA_OPS_TRITON_EXPERIMENTAL_WS=1``. This
script answers, for the Triton and GPU at hand, whether that refusal can be lifted:

- ``plain``: a minimal attention loop (one 128-row query block per program, 64-key tiles, TMA
  descriptors, no warp specialisation): the control, which must finish.
- ``ws``: the same loop with ``warp_specialize=True``; ``ws+dev`` builds the K/V descriptors on the
  device, ``ws+mask`` masks the scores, ``ws+zero`` gives one program no key tile, ``ws+pre`` runs a plain
  loop before the specialised one: the features the package's variant combines, one at a time.
- ``mla_ops``: the package's own kernel with ``128,64,4,2,tma,qo,ws`` on a small ragged batch, launched
  with the opt-in set.
- ``gluon`` and ``gluon+ws``: a minimal loop written in Gluon, Triton's explicit-layout language
  (``benchlib/gluon_probe.py``), where the program states its own mbarriers and partitions instead of
  asking the compiler's warp-specialisation pass for them: ``gluon`` in one partition (the control),
  ``gluon+ws`` with its TMA loads issued by a producer warp of its own through ``gl.warp_specialize``.
  They tell whether specialisation itself or the compiler's pass deadlocks.

A probe that has not finished after ``--timeout`` seconds is killed and reported as ``hung``: a deadlocked
kernel never returns, and only ending its process frees the GPU. Writes ``probe_ws.csv``, ``probe_ws.md``
and ``probe_ws.env.json`` into ``--out`` (default ``benchmarks/results/<gpu-slug>/``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The shared modules live next to this script, which is not part of a package.
from benchlib import cli
from benchlib import methods as M
from benchlib import problems as P
from benchlib import report as R

#: The probes, in the order they run, and what each one adds.
PROBES = {
    "plain": "minimal TMA attention loop, no warp specialisation (the control)",
    "ws": "the same loop, warp_specialize=True",
    "ws+dev": "... with K/V descriptors built on the device",
    "ws+mask": "... with masked scores",
    "ws+zero": "... where one program has no key tile",
    "ws+pre": "... after a plain loop",
    "mla_ops": "the package's kernel, config 128,64,4,2,tma,qo,ws, small ragged batch",
    "gluon": "a minimal loop in Gluon: TMA into an mbarrier-guarded ring, wgmma, one partition (control)",
    "gluon+ws": "... with the TMA loads in a producer warp of its own (gl.warp_specialize)",
}
#: The package's warp-specialised configuration that the ``mla_ops`` probe launches.
MLA_OPS_WS_CONFIG = "128,64,4,2,tma,qo,ws"
#: Relative error (against an fp32 reference) above which a probe that finished is reported ``wrong``.
MAX_REL_ERR = 2e-2

FIELDS = R.Fields(
    ("probe", "probe"),
    ("status", "status"),
    ("seconds", "seconds", ".1f"),
    ("rel_err", "rel err", ".1e"),
    ("what", "what it runs"),
    ("detail", "detail"),
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser(__doc__.split("\n\n")[0])
    cli.add_out_dir(parser)
    parser.add_argument(
        "--probes", nargs="+", choices=list(PROBES), default=list(PROBES), metavar="NAME",
        help=f"probes to run, of: {', '.join(PROBES)}",
    )  # fmt: skip
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds a probe may take before it counts as hung")
    parser.add_argument("--child", choices=list(PROBES), help=argparse.SUPPRESS)  # one probe, in this process
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    return args


# --- the probes (run in a child process) ------------------------------------------------------------


def _minimal_kernel():
    """The minimal attention loop, built on first use so that ``--help`` needs no Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def probe_kernel(
        Q, K, V, Out, Scratch, QDesc, KDesc, VDesc, N, qk_scale,
        BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
        WS: tl.constexpr, DEV: tl.constexpr, MASK: tl.constexpr, ZERO: tl.constexpr, PRE: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        m0 = pid * BM
        if PRE:
            for i in range(0, tl.where(pid == 0, 1, 0)):
                tl.store(Scratch + i, 0.0)
        if DEV:
            kd = tl.make_tensor_descriptor(K, shape=[N, D], strides=[D, 1], block_shape=[BN, D])
            vd = tl.make_tensor_descriptor(V, shape=[N, D], strides=[D, 1], block_shape=[BN, D])
        else:
            kd = KDesc
            vd = VDesc
        q = QDesc.load([m0, 0])
        hi = N
        if ZERO:
            hi = tl.where(pid == 0, 0, N)
        offs_n = tl.arange(0, BN)
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        for s in tl.range(0, hi, BN, warp_specialize=WS):
            qk = tl.dot(q, tl.trans(kd.load([s, 0]))) * qk_scale
            if MASK:
                qk = tl.where((s + offs_n)[None, :] < N, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(tl.bfloat16), vd.load([s, 0]), acc)
            m_i = m_new
        out = acc / tl.where(l_i == 0, 1.0, l_i)[:, None]
        rows = m0 + tl.arange(0, BM)
        tl.store(Out + rows[:, None] * D + tl.arange(0, D)[None, :], out.to(tl.bfloat16))

    return probe_kernel


def _run_minimal(name: str) -> float:
    """Launch the minimal loop with the flags in ``name``; returns its relative error."""
    import torch
    import triton
    from triton.tools.tensor_descriptor import TensorDescriptor

    flags = set(name.split("+"))
    # Device-side descriptors need global scratch from the allocator Triton's launcher calls.
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    n, d, bm, bn = 1024, 128, 128, 64
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(n, d, generator=gen).to("cuda", torch.bfloat16) for _ in range(3))
    out, scratch = torch.zeros_like(q), torch.empty(4, device="cuda")
    descs = [TensorDescriptor.from_tensor(t, [block, d]) for t, block in ((q, bm), (k, bn), (v, bn))]
    _minimal_kernel()[(n // bm,)](
        q, k, v, out, scratch, *descs, n, d**-0.5 * 1.4426950408889634, bm, bn, d,
        "ws" in flags, "dev" in flags, "mask" in flags, "zero" in flags, "pre" in flags,
        num_warps=4, num_stages=2,
    )  # fmt: skip
    torch.cuda.synchronize()
    ref = torch.softmax((q.float() @ k.float().T) * d**-0.5, -1) @ v.float()
    rows = slice(bm, None) if "zero" in flags else slice(None)  # program 0 saw no key: its rows are 0
    return M.relative_difference(out[rows], ref[rows])


def _run_mla_ops() -> float:
    """The package's kernel with its warp-specialised configuration; returns its relative error."""
    import torch

    from mla_ops.backends.reference import attention_reference
    from mla_ops.kernels.attention import attention_triton
    from mla_ops.kernels.configs import AttentionConfig

    config = AttentionConfig.parse(MLA_OPS_WS_CONFIG, "probe")
    gen = torch.Generator(device="cpu").manual_seed(0)
    lengths = [300, 0, 700]
    cu = torch.tensor([0, 300, 300, 1000], dtype=torch.int32)
    q, k, v = (torch.randn(1000, 16, dim, generator=gen).to(torch.bfloat16) for dim in (192, 192, 128))
    scale = 192**-0.5
    out, _ = attention_triton(
        q.cuda(), k.cuda(), v.cuda(), cu.cuda(), cu.cuda(), max(lengths), max(lengths), scale, True, config=config
    )
    torch.cuda.synchronize()
    ref, _ = attention_reference(q, k, v, cu, cu, scale, True)
    return M.relative_difference(out.cpu(), ref)


def _run_gluon(name: str) -> float:
    """Launch the Gluon loop, warp-specialised for ``gluon+ws``; returns its relative error."""
    import torch
    from benchlib.gluon_probe import attention_probe_kernel
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    n, d, bm, bn = 1024, 128, 64, 64
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(n, d, generator=gen).to("cuda", torch.bfloat16) for _ in range(3))
    out = torch.zeros_like(q)
    descs = [
        TensorDescriptor.from_tensor(t, [rows, d], gl.NVMMASharedLayout.get_default_for([rows, d], gl.bfloat16))
        for t, rows in ((q, bm), (k, bn), (v, bn))
    ]
    attention_probe_kernel[(n // bm,)](*descs, out, n, d**-0.5 * 1.4426950408889634, name == "gluon+ws", 2, num_warps=4)
    torch.cuda.synchronize()
    ref = torch.softmax((q.float() @ k.float().T) * d**-0.5, -1) @ v.float()
    return M.relative_difference(out, ref)


def run_child(name: str) -> int:
    """Run one probe in this process and print its result as one JSON line."""
    started = time.perf_counter()
    if name == "mla_ops":
        rel_err = _run_mla_ops()
    elif name.startswith("gluon"):
        rel_err = _run_gluon(name)
    else:
        rel_err = _run_minimal(name)
    print(json.dumps({"probe": name, "seconds": time.perf_counter() - started, "rel_err": rel_err}), flush=True)
    return 0


# --- the parent: one child process per probe ---------------------------------------------------------


def probe(name: str, timeout: float) -> dict[str, Any]:
    """Run probe ``name`` in a child process; ``status`` is finished, wrong, hung or failed."""
    env = dict(os.environ)
    if name == "mla_ops":
        from mla_ops.kernels.configs import EXPERIMENTAL_WS_ENV_VAR

        env[EXPERIMENTAL_WS_ENV_VAR] = "1"
    row: dict[str, Any] = {"probe": name, "what": PROBES[name]}
    started = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", name], capture_output=True, text=True, timeout=timeout, env=env
        )
    except subprocess.TimeoutExpired:
        return {**row, "status": "hung", "seconds": timeout, "detail": f"killed after {timeout:.0f} s"}
    row["seconds"] = time.perf_counter() - started
    result = next((json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")), None)
    if proc.returncode != 0 or result is None:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return {**row, "status": "failed", "detail": f"exit {proc.returncode}: {lines[-1] if lines else 'no output'}"}
    row["rel_err"] = result["rel_err"]
    row["status"] = "finished" if result["rel_err"] <= MAX_REL_ERR else "wrong"
    return row


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return run_child(args.child)
    import torch

    device = P.require_cuda("probe_warp_specialize.py", "launching Triton kernels")
    started = time.perf_counter()
    _, env = R.start_run("probe_warp_specialize.py", argv, device, torch.bfloat16, timeout_s=args.timeout)
    print(f"device: {env['gpu']} (sm {env['compute_capability']}), Triton {env['triton']}; {args.timeout:.0f} s each")
    rows = []
    for name in args.probes:
        print(f"{name}: {PROBES[name]}...", flush=True)
        row = probe(name, args.timeout)
        rows.append(row)
        print(f"  {row['status']} in {row['seconds']:.1f} s {row.get('detail', '')}".rstrip(), flush=True)
    out_dir = args.out or R.default_out_dir(device)
    out_dir.mkdir(parents=True, exist_ok=True)
    intro = (
        f"Each probe ran in its own process; one that had not finished after {args.timeout:.0f} s was killed "
        f"(*hung*). *finished* means its output matched an fp32 reference to {MAX_REL_ERR:g} relative error."
    )
    page = R.results_page("Triton warp specialisation", env, intro, FIELDS.table(rows))
    R.end_run(env, {}, started)
    R.write_run(out_dir, "probe_ws", FIELDS.keys, rows, env, page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
