"""Run the package's own CUDA kernels under NVIDIA compute-sanitizer, on awkward shapes.

The kernels: the Hopper Gluon attention kernel (calls of at least 65536 key rows x heads on SM90), the
``tl.dot`` attention kernel (smaller calls, and every call elsewhere; its fp8 variant for the fp8 ops), the fp8
quantiser's maxima and conversion kernels, the Triton merge and LSE kernels, and the native library's C++
launches of them (a layout's second call). The workload runs each path of the TRITON backend eagerly (first
call through Python, second through the native library) and inside a CUDA graph replayed with new lengths, on
ragged batches with an empty sequence, one-token sequences, lengths that are not multiples of any block,
padding rows and ``v`` as a strided view at the end of each row of a wider tensor; it checks every result
against the CPU reference.

    python benchmarks/sanitize.py                       # memcheck, racecheck, initcheck, synccheck
    python benchmarks/sanitize.py --tools racecheck --log-dir /tmp/sanitize
    python benchmarks/sanitize.py --tools racecheck --kernel _attn_fwd_sm90   # the Gluon kernel only
    python benchmarks/sanitize.py --workload            # the workload alone, without the sanitizer

Prints one summary line per tool and exits 1 if any tool reports an error, racecheck a hazard that is not
explained, or the workload fails. racecheck's hazards are listed by the two accesses that make each (the package
function and line of each); :data:`EXPLAINED` names the pairs shown to be ordered, and why: today the Gluon kernel's
hand-out of its partitions, which Triton generates (:mod:`benchlib.handout`; docs/design/triton-kernels.md, Under
compute-sanitizer).

Needs a CUDA GPU, Triton and compute-sanitizer (from the CUDA toolkit; ``--sanitizer`` or ``$COMPUTE_SANITIZER`` if
it is not on PATH). The sanitizer runs with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1``, so that memcheck sees each tensor's
own bounds rather than the caching allocator's blocks, and again with the caching allocator for the CUDA-graph part
(capture cannot allocate without it).
"""

from __future__ import annotations

import argparse
import ast
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The shared modules live next to this script, which is not part of a package.
from benchlib.handout import function_handout_lines

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
#: Extra options per tool: racecheck prints every hazard (warnings too), without backtraces, so that each one's
#: accesses can be attributed (:func:`racecheck_sites`); the others print the first 50 errors.
_TOOL_OPTIONS = {
    "memcheck": ["--leak-check", "no", "--print-limit", "50"],
    "racecheck": ["--racecheck-report", "all", "--show-backtrace", "no", "--print-limit", "0"],
    "initcheck": ["--print-limit", "50"],
    "synccheck": ["--print-limit", "50"],
}
_SUMMARY = re.compile(r"(ERROR SUMMARY: \d+ errors?|RACECHECK SUMMARY: .*)")
_COUNT = re.compile(r"(\d+) (?:errors?|hazards?)")
#: One racecheck hazard: its kind, then the two accesses (``Write Thread (351,0,0) at kernel+0xeb00 in file.py:108``).
_HAZARD = re.compile(
    r"Potential (?P<kind>\w+) hazard detected at __shared__.*\n"
    r"=+\s+(?P<first>\w+) Thread \S+ at (?P<first_at>\S+)(?: in (?P<first_src>\S+:\d+))?.*\n"
    r"=+\s+(?P<second>\w+) Thread \S+ at (?P<second_at>\S+)(?: in (?P<second_src>\S+:\d+))?"
)
#: racecheck's summary of hazards it groups (``Race reported between Read access at kernel+0x120 in file.py:121`` and,
#: on the next line, ``and Write access at ... [5 hazards]``); the summary line counts each such report too.
_RACE = re.compile(
    r"Race reported between (?P<first>\w+) access at (?P<first_at>\S+)(?: in (?P<first_src>\S+:\d+))?.*\n"
    r"=+\s+and (?P<second>\w+) access at (?P<second_at>\S+)(?: in (?P<second_src>\S+:\d+))?.*?\[(?P<n>\d+) hazards?\]"
)
#: Hazards whose two accesses are in these places (either order; a function's name, or ``NAME hand-out`` for the
#: lines of a warp-specialised kernel where Triton hands out its partitions, :mod:`benchlib.handout`) are explained:
#: why each is not a race. The work-item hand-off (_put_item, _get_item) is not among them: it goes through named
#: barriers, whose order racecheck sees, so a hazard there is a real one.
EXPLAINED: dict[frozenset[str], str] = {
    frozenset({"_attn_fwd_sm90 hand-out"}): (
        "Triton's state bytes, ordered by barrier.sync 1 over every thread; racecheck loses that order once the "
        "default partition has synchronised its own warps (bar.sync 0, 128), as benchmarks/racecheck_handout.cu "
        "shows without Triton; compile_sm90.py checks that no other access is at these lines"
    ),
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Run the package's CUDA kernels (Gluon and tl.dot attention, the fp8 attention and quantiser, "
        "merge, LSE, the native launches) under compute-sanitizer on awkward shapes, eagerly and in CUDA graphs.",
    )
    parser.add_argument("--tools", nargs="+", choices=TOOLS, default=list(TOOLS), help="sanitizer tools to run")
    parser.add_argument("--sanitizer", default=None, help="path of compute-sanitizer (default: PATH, CUDA home)")
    parser.add_argument("--log-dir", type=Path, default=None, help="write each tool's full report here")
    parser.add_argument("--workload", action="store_true", help="run the workload once, without the sanitizer")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per tool (default 900)")
    parser.add_argument(
        "--kernel",
        default=None,
        help="check only the kernels whose name contains this (e.g. _attn_fwd_sm90, the Gluon kernel); the workload "
        "still runs every kernel, the others uninstrumented and faster",
    )
    return parser.parse_args(argv)


# --- the workload ---------------------------------------------------------------------------------


def _offsets(lengths: Sequence[int], device: str) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def _inputs(rows: int, heads: int, padding: int, seed: int):
    """``q``, ``k`` ``[rows + padding, H, 192]`` and ``v`` ``[rows + padding, H, 128]``, the last 128 channels of
    a ``[.., H, 64 + 128]`` tensor (a strided view, as MLA's ``kv_nope`` gives), bf16 on the GPU."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    total = rows + padding
    q = torch.randn(total, heads, 192, generator=g).bfloat16().cuda()
    k = torch.randn(total, heads, 192, generator=g).bfloat16().cuda()
    kv = torch.randn(total, heads, 64 + 128, generator=g).bfloat16().cuda()
    return q, k, kv[..., 64:]


def _check(name: str, got, want, rows: int, tol: float = 2e-2, out_tol: float | None = None) -> None:
    """Raise if ``got`` (GPU ``(out, lse)``) is not the CPU reference ``want`` within ``tol`` (``out_tol`` for
    ``out`` where given) in the first ``rows`` rows (the ops leave ``out``'s padding rows unwritten; reading them
    would be initcheck's finding)."""
    out, lse = got[0][:rows].float().cpu(), got[1][:, :rows].cpu()
    ref_out, ref_lse = want[0][:rows].float(), want[1][:, :rows]
    finite = torch.isfinite(ref_lse)
    if not torch.equal(finite, torch.isfinite(lse)):
        raise AssertionError(f"{name}: rows without keys differ from the reference (lse = -inf)")
    err_out = (out - ref_out).abs().max().item()
    err_lse = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    if not (err_out <= (tol if out_tol is None else out_tol) and err_lse <= tol):
        raise AssertionError(f"{name}: max |out - ref| {err_out:.3g}, max |lse - ref| {err_lse:.3g} > {tol}")
    print(f"  {name}: ok (max |out - ref| {err_out:.2e}, max |lse - ref| {err_lse:.2e})", flush=True)


def _written(result, rows: int):
    """An op's ``(out, lse)`` cut to its first ``rows`` rows, those it writes."""
    return result[0][:rows], result[1][:, :rows]


def _cpu(t):
    return t.cpu() if hasattr(t, "cpu") else t


def _fp8_workload(new_lengths: Sequence[int], chunk_q: Sequence[int], chunk_k: Sequence[int]) -> None:
    """The fp8 ops: the quantiser's kernel on the views, then the fp8 variant of the ``tl.dot`` kernel on both paths
    (a launch, then its relaunch), against REFERENCE on the same quantised inputs: the kernel rounds P to e4m3 and
    the reference does not, so ``out`` gets a loose bound and the LSE the usual one."""
    import mla_ops

    heads = 16
    q, k, v = _inputs(sum(new_lengths), heads, 64, seed=7)
    cu = _offsets(new_lengths, "cuda")
    (q8, dq), (k8, dk), (v8, dv) = (mla_ops.quantize_fp8(x) for x in (q, k, v))
    want_q8, _ = mla_ops.quantize_fp8(_cpu(q))
    if not torch.equal(q8.cpu().float(), want_q8.float()):
        raise AssertionError("quantize_fp8: the CUDA kernel and PyTorch's conversion differ")
    print("  quantize_fp8: ok", flush=True)
    # The maxima's kernel, which quantize_fp8 takes only for large tensors: here directly, on the strided view v
    # (4118 rows: 17 programs per head) and over the whole tensor, against PyTorch's reduction.
    from mla_ops.kernels.quantize import amax_rows

    for per_head, dims in ((True, (0, 2)), (False, (0, 1, 2))):
        if not torch.equal(amax_rows(v, per_head), torch.linalg.vector_norm(v, ord=math.inf, dim=dims).float()):
            raise AssertionError(f"amax_rows(per_head={per_head}) and PyTorch's reduction differ")
    print("  amax_rows: ok", flush=True)
    fp8_new = (q8, k8, v8, cu, max(new_lengths), dq, dk, dv)
    want = mla_ops.prefill_fp8(*(_cpu(t) for t in fp8_new))
    for attempt in ("launch", "relaunch"):
        _check(f"fp8 new tokens ({attempt})", mla_ops.prefill_fp8(*fp8_new), want, sum(new_lengths), out_tol=0.35)
    qc, _, _ = _inputs(sum(chunk_q), heads, 16, seed=8)
    _, kc, vc = _inputs(sum(chunk_k), heads, 8, seed=9)
    (qc8, dqc), (kc8, dkc), (vc8, dvc) = (mla_ops.quantize_fp8(x, per_head=False) for x in (qc, kc, vc))
    chunk = (qc8, kc8, vc8, _offsets(chunk_q, "cuda"), _offsets(chunk_k, "cuda"), max(chunk_q), max(chunk_k), dqc,
             dkc, dvc)  # fmt: skip
    want = mla_ops.prefill_context_chunk_fp8(*(_cpu(t) for t in chunk))
    for attempt in ("launch", "relaunch"):
        got = mla_ops.prefill_context_chunk_fp8(*chunk)
        _check(f"fp8 context chunk ({attempt})", got, want, sum(chunk_q), out_tol=0.35)


def run_workload(graphs: bool) -> int:
    """Every kernel, eagerly (twice: Python, then the native launch) and, with ``graphs``, in a replayed CUDA
    graph."""
    import mla_ops
    from mla_ops.kernels.lse import lse_base2_to_natural_triton

    if not torch.cuda.is_available():
        print("sanitize.py: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    new_lengths = [1, 3000, 17, 1100]  # one token, lengths no block divides
    chunk_q, chunk_k = [100, 5, 300], [4097, 0, 129]  # a sequence without context
    with mla_ops.prefill_backend("TRITON"):
        # H=16: >= 65536 key rows x heads, the Gluon kernel on SM90; H=4: the tl.dot kernel.
        for heads in (16, 4):
            q, k, v = _inputs(sum(new_lengths), heads, 64, seed=heads)
            cu = _offsets(new_lengths, "cuda")
            want = mla_ops.prefill(_cpu(q), _cpu(k), _cpu(v), cu.cpu(), max(new_lengths))
            for attempt in ("python", "native"):
                got = mla_ops.prefill(q, k, v, cu, max(new_lengths))
                _check(f"new tokens H={heads} ({attempt})", got, want, sum(new_lengths))

            qc, _, _ = _inputs(sum(chunk_q), heads, 16, seed=heads + 1)
            _, kc, vc = _inputs(sum(chunk_k), heads, 8, seed=heads + 2)
            cq, ck = _offsets(chunk_q, "cuda"), _offsets(chunk_k, "cuda")
            args = (cq, ck, max(chunk_q), max(chunk_k))
            want_c = mla_ops.prefill_context_chunk(_cpu(qc), _cpu(kc), _cpu(vc), *(_cpu(a) for a in args))
            for attempt in ("python", "native"):
                got_c = mla_ops.prefill_context_chunk(qc, kc, vc, *args)
                _check(f"context chunk H={heads} ({attempt})", got_c, want_c, sum(chunk_q))

            # The merge of the chunk with the new tokens' own attention over the same rows.
            got_n = mla_ops.prefill(qc, qc.clone(), vc.new_empty(qc.shape[0], heads, 128).normal_(), cq, max(chunk_q))
            # The reference from the rows the ops write: copying their outputs whole would read the padding rows
            # of `out` they leave unwritten, which initcheck reports against the copy.
            rows = sum(chunk_q)
            want_m = mla_ops.merge_attn_states(*(_cpu(t) for r in (got_c, got_n) for t in _written(r, rows)))
            for attempt in ("python", "native"):
                merged = mla_ops.merge_attn_states(*got_c, *got_n)
                _check(f"merge H={heads} ({attempt})", merged, want_m, sum(chunk_q))

            if not graphs:
                continue
            # A CUDA graph captured on one batch and replayed with other lengths (same shapes).
            static_cu = cu.clone()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                mla_ops.prefill(q, k, v, static_cu, sum(new_lengths))
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                graphed = mla_ops.prefill(q, k, v, static_cu, sum(new_lengths))
            for lengths in ([2048, 0, 1, 2069], [4118, 0, 0, 0]):
                static_cu.copy_(_offsets(lengths, "cuda"))
                graph.replay()
                want_g = mla_ops.prefill(_cpu(q), _cpu(k), _cpu(v), static_cu.cpu(), max(lengths))
                _check(f"graph replay H={heads} {lengths}", graphed, want_g, sum(lengths))

        if torch.cuda.get_device_capability() >= (8, 9):  # fp8 tensor cores
            _fp8_workload(new_lengths, chunk_q, chunk_k)

    # The LSE kernel (FLASHINFER's base-2 [n, H] LSE into natural-log [H, n]), with -inf rows.
    lse2 = torch.randn(777, 16, device="cuda")
    lse2[::7] = float("-inf")
    out = torch.empty(16, 777, device="cuda")
    lse_base2_to_natural_triton(lse2, out)
    torch.testing.assert_close(out.cpu(), (lse2.t() * 0.6931471805599453).cpu(), rtol=1e-6, atol=0)
    print("  LSE conversion: ok", flush=True)
    torch.cuda.synchronize()
    print("workload passed", flush=True)
    return 0


# --- the driver -----------------------------------------------------------------------------------


def find_sanitizer(explicit: str | None) -> str | None:
    """compute-sanitizer's path: ``explicit``, ``$COMPUTE_SANITIZER``, PATH, then the CUDA toolkit's bin."""
    for candidate in (explicit, os.environ.get("COMPUTE_SANITIZER"), shutil.which("compute-sanitizer")):
        if candidate:
            return candidate
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "compute-sanitizer").exists():
            return str(Path(home) / "bin" / "compute-sanitizer")
    return None


def _source_function(site: str) -> tuple[str, str]:
    """The package function whose source holds ``site`` (``file.py:line`` as the sanitizer prints it): ``(where,
    place)``, ``where`` the function with the line, ``place`` the function's name, or ``NAME hand-out`` at the lines
    where Triton hands out a warp-specialised kernel's partitions (:func:`benchlib.handout.function_handout_lines`).
    Another kernel's ``def`` line is code Triton generates for the kernel as a whole."""
    name, _, line_text = site.rpartition(":")
    line = int(line_text)
    for path in sorted(Path(__file__).resolve().parent.parent.joinpath("mla_ops").rglob(Path(name).name)):
        functions = [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)]
        enclosing = [node for node in functions if node.lineno <= line <= (node.end_lineno or node.lineno)]
        best = max(enclosing, key=lambda node: node.lineno, default=None)  # the innermost
        if best is not None:
            if line in function_handout_lines(best):
                return f"{best.name} (its partitions' hand-out: {site})", f"{best.name} hand-out"
            where = "def line: code Triton generates for the kernel" if line == best.lineno else site
            return f"{best.name} ({where})", best.name
    return site, site


def racecheck_sites(report: str) -> list[tuple[int, str, str | None]]:
    """racecheck's hazards in ``report`` grouped by their two accesses: ``(count, description, explanation)``, most
    frequent first; ``explanation`` is ``None`` where :data:`EXPLAINED` has none."""
    counts: Counter[tuple[str, str, str, str, str]] = Counter()
    for m in _HAZARD.finditer(report):
        first = m["first_src"] or m["first_at"]
        second = m["second_src"] or m["second_at"]
        counts[(m["kind"], m["first"], first, m["second"], second)] += 1
    # A grouped report adds its pair only where no single hazard names it (either order), so that nothing it
    # covers goes unlisted and nothing is counted twice.
    pairs = {frozenset({(first, a), (second, b)}) for _, first, a, second, b in counts}
    for m in _RACE.finditer(report):
        first, second = m["first_src"] or m["first_at"], m["second_src"] or m["second_at"]
        if frozenset({(m["first"], first), (m["second"], second)}) not in pairs:
            counts[("race", m["first"], first, m["second"], second)] += int(m["n"])
    sites = []
    for (kind, first, first_site, second, second_site), count in counts.most_common():
        (where_a, place_a), (where_b, place_b) = (
            _source_function(site) if ":" in site else (site, site) for site in (first_site, second_site)
        )
        explanation = EXPLAINED.get(frozenset({place_a, place_b}))
        sites.append((count, f"{kind}: {first.lower()} in {where_a}, {second.lower()} in {where_b}", explanation))
    return sites


def run_tool(
    sanitizer: str, tool: str, log_dir: Path | None, timeout: float, caching: bool, kernel: str | None = None
) -> tuple[bool, str]:
    """``(clean, summary)`` of the workload under ``tool``: eagerly without PyTorch's caching allocator (so
    that each tensor has bounds of its own), or with it (``caching``), which CUDA-graph capture needs. Under
    racecheck, hazards whose accesses :data:`EXPLAINED` explains do not count against ``clean``; the summary gives
    every pair of accesses with its count."""
    only = ["--kernel-name", f"kns={kernel}"] if kernel else []
    command = [sanitizer, "--tool", tool, *_TOOL_OPTIONS[tool], *only, "--error-exitcode", "3",
               sys.executable, __file__, "--workload"]  # fmt: skip
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="0" if caching else "1")
    tool_name = f"{tool} ({'with CUDA graphs, caching allocator' if caching else 'eager, no caching allocator'})"
    started = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"{tool_name}: timed out after {timeout:.0f} s"
    report = done.stdout + done.stderr
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / f"{tool}{'-graphs' if caching else ''}.log").write_text(report)
    summaries = _SUMMARY.findall(report)
    counts = [int(n) for line in summaries for n in _COUNT.findall(line)]
    passed = "workload passed" in report
    clean = done.returncode == 0 and passed and bool(summaries) and not any(counts)
    what = "; ".join(summaries) if summaries else "no summary line"
    if not passed:
        what += "; the workload did not pass (see the log)"
    lines = [f"{tool_name}: {what} (exit {done.returncode}, {time.perf_counter() - started:.0f} s)"]
    if tool == "racecheck" and any(counts):
        sites = racecheck_sites(report)
        if not sites:
            lines.append("      no hazard could be attributed (see the log)")
        for count, description, explanation in sites:
            lines.append(f"      {count:>7} {description}")
            lines.append(f"              {'explained: ' + explanation if explanation else 'NOT EXPLAINED'}")
        clean = passed and bool(sites) and all(explanation for _, _, explanation in sites)
    return clean, "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.workload:
        # Capture needs PyTorch's caching allocator (a cudaMalloc is not permitted while capturing).
        return run_workload(graphs=os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") != "1")
    sanitizer = find_sanitizer(args.sanitizer)
    if sanitizer is None:
        print("sanitize.py: compute-sanitizer not found; pass --sanitizer PATH or set COMPUTE_SANITIZER "
              "(it ships with the CUDA toolkit)", file=sys.stderr)  # fmt: skip
        return 2
    all_clean = True
    for tool in args.tools:
        for caching in (False, True):
            print(f"{tool}: running the workload under compute-sanitizer (minutes)...", flush=True)
            clean, summary = run_tool(sanitizer, tool, args.log_dir, args.timeout, caching, args.kernel)
            all_clean &= clean
            print(("ok    " if clean else "FAIL  ") + summary, flush=True)
    return 0 if all_clean else 1


if __name__ == "__main__":
    sys.exit(main())
