"""The benchmark scripts and their shared modules: ``--help``, a tiny CPU run of each script that can run
on CPU, a clean exit of those that cannot, the report files, and the arithmetic and plumbing underneath.

The CPU runs time the REFERENCE backend on tiny shapes; they check that the scripts work end to end
and write what they promise, not the figures themselves.
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import io
import json
import math
import os
import random
import subprocess
import sys
import time
import types
from pathlib import Path

import bench_dispatch as BD
import bench_graph_trees as BGT
import bench_layers as BL
import bench_prefill as BP
import compile_sm90 as CS
import pytest
import sanitize as SAN
import torch
from benchlib import attribution as A
from benchlib import clocks, timing
from benchlib import handout as HO
from benchlib import methods as M
from benchlib import problems as P
from benchlib import report as R
from utils import make_batch

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
#: Every script in benchmarks/: each answers ``--help``.
SCRIPTS = sorted(path.name for path in BENCH_DIR.glob("*.py"))
#: The scripts that print their findings without writing a file, so have no ``--out``.
PRINT_ONLY = {"compile_sm90.py", "sanitize.py"}
#: The scripts whose result rows one ``FIELDS`` list (``benchlib.report.Fields``) describes.
FIELD_SCRIPTS = [
    "bench_dispatch",
    "bench_graphs",
    "bench_graph_trees",
    "bench_layers",
    "bench_transformers",
]
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
CPU = torch.device("cpu")
FAST = ["--rep-ms", "1", "--warmup-ms", "0.5"]


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=BENCH_DIR.parent
    )


def _read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script):
    proc = _run([str(BENCH_DIR / script), "--help"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage:")
    assert ("--out" in proc.stdout) != (script in PRINT_ONLY)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given on machines without CUDA")
@pytest.mark.parametrize(
    ("script", "args"),
    [
        ("bench_graphs.py", []),
        ("tune_triton.py", ["--out", "unused.csv", "--quick"]),
    ],
)
def test_gpu_only_scripts_exit_cleanly_without_cuda(script, args, tmp_path):
    proc = _run([str(BENCH_DIR / script), *args])
    assert proc.returncode == 2
    assert "needs a CUDA device" in proc.stderr and "nothing was measured" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (BENCH_DIR.parent / "unused.csv").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given on machines without CUDA")
def test_sanitize_workload_exits_cleanly_without_cuda():
    proc = _run([str(BENCH_DIR / "sanitize.py"), "--workload"])
    assert proc.returncode == 2
    assert "needs a CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr


def _kernel_line(text: str) -> int:
    """The line of the Gluon kernel's source (mla_ops/kernels/attention_sm90.py) that holds ``text``, once."""
    lines = (Path(__file__).resolve().parent.parent / "mla_ops/kernels/attention_sm90.py").read_text().splitlines()
    found = [i + 1 for i, line in enumerate(lines) if text in line]
    assert len(found) == 1, (text, found)
    return found[0]


def _hazard(kind: str, first: tuple[str, int | None], second: tuple[str, int | None]) -> str:
    """One hazard as compute-sanitizer 2025.3's racecheck prints it with ``--show-backtrace no``."""

    def access(what: str, line: int | None) -> str:
        return f"=========     {what} Thread (351,0,0) at _attn_fwd_sm90+0xeb00" + (
            f" in attention_sm90.py:{line}" if line else ""
        )

    return "\n".join([
        f"========= Error: Potential {kind} hazard detected at __shared__ 0x345c0 in block (96,0,0) :",
        access(*first), access(*second), "=========     Current Value : 96", "========= ",
    ])  # fmt: skip


def test_sanitize_attributes_racecheck_hazards_to_the_kernel_functions(monkeypatch):
    monkeypatch.setattr(SAN, "EXPLAINED", {frozenset({"_put_item", "_get_item"}): "the hand-off, ordered"})
    put = _kernel_line("item_smem.store(gl.full([1], w")
    get = _kernel_line("w = item_smem.load(layout) + token")
    kernel_def = _kernel_line("def _attn_fwd_sm90(")
    softmax = _kernel_line("def _softmax(") + 3
    report = "\n".join([
        *[_hazard("RAW", ("Write", put), ("Read", get))] * 3,
        _hazard("WAR", ("Read", get), ("Write", put)),
        *[_hazard("RAW", ("Write", kernel_def), ("Read", kernel_def))] * 2,
        _hazard("RAW", ("Write", softmax), ("Read", None)),
        "========= RACECHECK SUMMARY: 7 hazards displayed (7 errors, 0 warnings)",
    ])  # fmt: skip
    sites = SAN.racecheck_sites(report)
    assert [count for count, _, _ in sites] == [3, 2, 1, 1]
    handoff = f"RAW: write in _put_item (attention_sm90.py:{put}), read in _get_item (attention_sm90.py:{get})"
    assert sites[0][0] == 3 and sites[0][1] == handoff and "hand-off" in sites[0][2]
    assert f"hand-out: attention_sm90.py:{kernel_def}" in sites[1][1] and sites[1][2] is None  # not in this EXPLAINED
    rest = {description: explanation for _, description, explanation in sites[2:]}
    assert rest[f"WAR: read in _get_item (attention_sm90.py:{get}), write in _put_item (attention_sm90.py:{put})"]
    assert rest[f"RAW: write in _softmax (attention_sm90.py:{softmax}), read in _attn_fwd_sm90+0xeb00"] is None


def test_sanitize_explains_only_hazards_between_accesses_of_the_partitions_hand_out():
    kernel_def = _kernel_line("def _attn_fwd_sm90(")
    partitions = _kernel_line("if pid >= num_workers:")  # the statement that holds gl.warp_specialize
    body = _kernel_line("pid = gl.program_id(0)")  # the kernel's own line between the two
    softmax = _kernel_line("def _softmax(") + 3
    report = "\n".join([
        _hazard("RAW", ("Write", partitions), ("Read", kernel_def)),
        _hazard("RAW", ("Write", kernel_def), ("Read", kernel_def)),
        _hazard("RAW", ("Write", partitions), ("Read", body)),
        _hazard("WAR", ("Read", kernel_def), ("Write", softmax)),
    ])  # fmt: skip
    explained = {description: explanation for _, description, explanation in SAN.racecheck_sites(report)}

    def hand_out(line: int) -> str:
        return f"_attn_fwd_sm90 (its partitions' hand-out: attention_sm90.py:{line})"

    assert "barrier.sync 1" in explained[f"RAW: write in {hand_out(partitions)}, read in {hand_out(kernel_def)}"]
    assert explained[f"RAW: write in {hand_out(kernel_def)}, read in {hand_out(kernel_def)}"]
    own = f"_attn_fwd_sm90 (attention_sm90.py:{body})"
    assert explained[f"RAW: write in {hand_out(partitions)}, read in {own}"] is None
    assert explained[f"WAR: read in {hand_out(kernel_def)}, write in _softmax (attention_sm90.py:{softmax})"] is None

    def grouped(first: int, second: int) -> str:  # racecheck's report of a group of hazards
        return (
            f"========= Error: Race reported between Write access at _attn_fwd_sm90+0x10 in attention_sm90.py:{first}\n"
            f"=========     and Read access at _attn_fwd_sm90+0x20 in attention_sm90.py:{second} [4 hazards]\n"
        )

    # A group whose pair a single hazard already names adds nothing; one that names a new pair is listed.
    sites = SAN.racecheck_sites(report + "\n" + grouped(partitions, kernel_def) + grouped(softmax, body))
    assert sum(count for count, _, _ in sites) == 4 + 4
    assert (4, f"race: write in _softmax (attention_sm90.py:{softmax}), read in {own}", None) in sites


def test_handout_lines_and_the_accesses_there():
    source = (
        "def kernel(x):\n"  # 1
        "    pid = program_id(0)\n"  # 2
        "    if pid > 3:\n"  # 3
        "        gl.store(x, 0)\n"  # 4
        "    else:\n"  # 5
        "        gl.warp_specialize([(a, ()), (b, ())], [4], [232])\n"  # 6
        "def plain(x):\n"  # 7
        "    return x\n"  # 8
    )
    assert HO.handout_lines(source, "kernel") == {1, 3}
    assert HO.handout_lines(source, "plain") == frozenset() and HO.handout_lines(source, "absent") == frozenset()
    ptx = "\n".join([
        "\t.loc\t1 1 0",
        "\tst.shared.v2.b32 \t[global_smem+2048], {0, 50397698};",
        "\tld.shared.b8 \t%r1, [%r2+2044];",
        "\t.loc\t1 3 0",
        "\tst.shared.v2.b32 \t[global_smem+2048], {67372036, 67372036};",
        "\tmbarrier.init.shared.b64 \t[global_smem+8], 1;",
        "\t.loc\t2 3 0",
        "\tld.shared.b32 \t%r3, [global_smem+16];",  # line 3 of another file
        "\t.loc\t1 2 0",
        "\tst.shared.b32 \t[global_smem+32], %r4;",  # a line that is not the hand-out's
        '\t.file\t1 "/src/pkg/kernel.py"',
        '\t.file\t2 "/lib/triton/language/standard.py"',
    ])  # fmt: skip
    lines = frozenset({1, 3})
    found = [op for op, _ in HO.accesses_at(ptx, "kernel.py", lines)]
    assert found == ["st.shared.v2.b32", "ld.shared.b8", "st.shared.v2.b32"]
    assert HO.foreign_accesses(ptx, "kernel.py", lines) == []
    own = ptx.replace("\t.loc\t1 2 0", "\t.loc\t1 3 0")  # the kernel's own store, attributed to a hand-out line
    assert HO.foreign_accesses(own, "kernel.py", lines) == ["st.shared.b32 [global_smem+32], %r4"]
    moved = ptx.replace("[global_smem+2048], {67372036", "[global_smem+4096], {67372036")
    assert HO.foreign_accesses(moved, "kernel.py", lines) == ["state stores to 2 addresses: global_smem+2048, +4096"]
    variant = CS.Variant("128,128,4,2,ovl,gluon,pers", causal=True, handout_foreign=("st.shared.b32 [x], %r4",))
    assert variant.problems(wants_ws=False) == [
        "1 shared-memory access(es) besides Triton's hand-out at its lines (sanitize.py would explain their "
        "hazards): st.shared.b32 [x], %r4"
    ]


@pytest.mark.parametrize("explained_only", [True, False])
def test_sanitize_racecheck_passes_only_explained_hazards(monkeypatch, explained_only):
    monkeypatch.setattr(SAN, "EXPLAINED", {frozenset({"_put_item", "_get_item"}): "the hand-off, ordered"})
    put, get = _kernel_line("item_smem.store(gl.full([1], w"), _kernel_line("w = item_smem.load(layout) + token")
    hazards = [_hazard("RAW", ("Write", put), ("Read", get))]
    if not explained_only:
        hazards.append(_hazard("RAW", ("Write", put), ("Read", put)))
    summary_line = "========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)"
    report = "\n".join([*hazards, "workload passed", summary_line])

    def fake_run(command, **kwargs):
        assert command[command.index("--print-limit") + 1] == "0"  # every hazard, so that each is attributed
        assert command[command.index("--kernel-name") + 1] == "kns=_attn_fwd_sm90"
        return subprocess.CompletedProcess(command, 3, stdout=report, stderr="")

    monkeypatch.setattr(SAN.subprocess, "run", fake_run)
    clean, summary = SAN.run_tool("compute-sanitizer", "racecheck", None, 10, caching=False, kernel="_attn_fwd_sm90")
    assert clean is explained_only
    assert ("NOT EXPLAINED" in summary) is not explained_only and "explained: " in summary


@pytest.fixture
def written(monkeypatch):
    """What the code under test hands ``benchlib.report.write_csv``: ``(fieldnames, rows)`` per file, in order."""
    calls = []
    real = R.write_csv

    def record(path, fieldnames, rows):
        rows = list(rows)
        calls.append((tuple(fieldnames), rows))
        real(path, fieldnames, rows)

    monkeypatch.setattr(R, "write_csv", record)
    return calls


def _assert_fields_written(written, module, csv_path: Path) -> None:
    """The script wrote its CSV with its field list's columns in their order, and no row carried a value the
    list does not declare (the CSV would have dropped it)."""
    ((fieldnames, rows),) = written
    assert fieldnames == module.FIELDS.keys
    assert csv_path.read_text().splitlines()[0] == ",".join(module.FIELDS.keys)
    assert rows and module.FIELDS.undeclared(rows) == set()


def _main(module, argv: list[str]) -> str:
    """Run a script's ``main`` in this process (no second torch import); returns what it printed."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert module.main(argv) == 0
    return buffer.getvalue()


@pytest.fixture
def default_out(tmp_path, monkeypatch):
    """Where a script writes without ``--out`` (``benchmarks/results/cpu/``), moved under ``tmp_path``."""
    monkeypatch.setattr(R, "RESULTS_DIR", tmp_path)
    return tmp_path / "cpu"


def _assert_canonical_files(out_dir: Path, stem: str) -> None:
    """A run wrote exactly ``<stem>.csv``, ``<stem>.env.json`` and ``<stem>.md``: a rerun replaces them."""
    assert sorted(p.name for p in out_dir.iterdir()) == [f"{stem}.csv", f"{stem}.env.json", f"{stem}.md"]


# --- bench_prefill ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prefill_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_prefill")
    argv = ["--device", "cpu", "--out", str(out), *FAST, "--ratio-rounds", "2", "--versus-best-raw", "REFERENCE"]
    argv += ["--versus-best-op", "REFERENCE fp8"]
    printed = _main(BP, argv)
    return out, printed


def test_cpu_run_writes_csv(prefill_run):
    out, _ = prefill_run
    rows = _read_rows(out / "prefill.csv")
    assert set(BP.CSV_FIELDS) == set(rows[0])
    assert {r["shape"] for r in rows} == {s.id for s in P.cpu_shapes()}
    ops = [r for r in rows if r["method"] == "REFERENCE"]
    assert {r["suite"] for r in ops} == {"causal", "chunk"}
    tol = M.OUT_TOL_EPS * torch.finfo(torch.bfloat16).eps
    for r in rows:
        assert r["status"] == "ok", r
        assert float(r["time_ms"]) > 0
        assert float(r["rel_err"]) <= (M.FP8_OUT_TOL if r["kind"] == "fp8" else tol)
        rate = r["gbps"] if r["suite"] == "merge" else r["tflops"]
        assert float(rate) > 0
    # The reference checked against itself: its LSE must agree exactly with the ground truth.
    assert all(float(r["lse_err"]) == 0.0 for r in ops)
    assert all(r["best_baseline"] == "sdpa_cpu" and float(r["ratio_best"]) > 0 for r in ops)
    # --versus-best-raw REFERENCE: against that baseline in rounds of both in turn too, in its rows alone.
    for r in ops:
        assert 0 < float(r["ratio_best_min"]) <= float(r["ratio_best_rounds"]) <= float(r["ratio_best_max"]), r
    assert not any(r["ratio_best_rounds"] for r in rows if r["method"] != "REFERENCE")
    # --versus-best-op 'REFERENCE fp8': against the fastest bf16 op in rounds of both in turn, in its rows alone.
    fp8 = [r for r in rows if r["method"] == "REFERENCE fp8"]
    assert {r["suite"] for r in fp8} == {"causal", "chunk"}
    for r in fp8:
        assert r["best_op"] in ("REFERENCE", "auto") and float(r["ratio_best_bf16"]) > 0, r  # auto is REFERENCE here
        low, median, high = (float(r[f"ratio_best_bf16_{k}"]) for k in ("min", "rounds", "max"))
        assert 0 < low <= median <= high, r
    assert not any(r["ratio_best_bf16_rounds"] for r in rows if r["method"] != "REFERENCE fp8")
    assert not any(r["sm_clock_mhz"] or r["best_sm_clock_mhz"] or r["capped"] for r in rows)  # no clock on CPU
    # The op with no override, against the fastest forced backend (on CPU both are REFERENCE).
    auto = [r for r in rows if r["method"] == "auto"]
    assert len(auto) == len(ops) and all(r["kind"] == "op" and r["status"] == "ok" for r in auto)
    assert all(r["best_op"] == "REFERENCE" and float(r["ratio_auto_best"]) > 0 for r in auto)
    assert all(r["auto_route"] == "REFERENCE" for r in auto) and not any(r["auto_route"] for r in ops)
    assert all(float(r["ratio_auto_best_pace"]) > 0 for r in auto)
    # ... and against it in rounds of both measured in turn, which a single measurement's noise moves less.
    for r in auto:
        assert float(r["ratio_auto_best_min"]) <= float(r["ratio_auto_best_rounds"]) <= float(r["ratio_auto_best_max"])
    # Each timed call's pace: its time, or its host issue time where that is larger (measured for calls under
    # HOST_PACE_MAX_MS, which these tiny shapes mostly are).
    for r in rows:
        time_ms, pace_ms = float(r["time_ms"]), float(r["pace_ms"])
        host_ms = float(r["host_ms"]) if r["host_ms"] else None
        assert pace_ms == (time_ms if host_ms is None else max(time_ms, host_ms)), r
        assert host_ms is not None or time_ms >= M.HOST_PACE_MAX_MS, r
    # Each op is measured against its own raw call in alternating rounds; the spread brackets the median.
    for r in ops:
        assert r["raw_method"] == "reference_raw"
        assert float(r["ratio_raw_min"]) <= float(r["ratio_raw"]) <= float(r["ratio_raw_max"])
    raw = [r for r in rows if r["method"] == "reference_raw"]
    assert len(raw) == len(ops) and all(r["kind"] == "direct" for r in raw)
    # REFERENCE takes fp8 on CPU: its fp8 op on quantised inputs, and with the quantisation timed, on every
    # attention shape, against the best bf16 op of the shape. Quantisation costs accuracy, never all of it.
    for name in ("REFERENCE fp8", "REFERENCE fp8+quant"):
        fp8 = [r for r in rows if r["method"] == name]
        assert len(fp8) == len(ops) and all(r["kind"] == "fp8" for r in fp8)
        assert all(r["best_op"] in ("REFERENCE", "auto") and float(r["ratio_best_bf16"]) > 0 for r in fp8)
        assert all(tol < float(r["rel_err"]) and float(r["lse_err"]) <= M.FP8_LSE_TOL for r in fp8)


def test_cpu_run_writes_markdown_and_env(prefill_run):
    out, printed = prefill_run
    md = (out / "prefill.md").read_text()
    env = json.loads((out / "prefill.env.json").read_text())
    for key in ("gpu", "sm_clock_mhz", "mem_clock_mhz", "date", "torch", "cuda", "triton", "flashinfer",
                "flash_attn", "flash_attn.cute (FA4)", "mla_ops", "timer", "ratio_rounds", "backends",
                "cost_table"):  # fmt: skip
        assert key in env, key
        assert f"**{key}**" in md or key == "backends"
    assert env["torch"] == torch.__version__
    assert env["cost_table"] == "none: routing by size is for CUDA devices"
    assert env["backends"]["REFERENCE"]["valid"] and env["backends"]["REFERENCE"]["implementation"]
    assert "| REFERENCE | yes |" in md
    for title in R.SUITE_TITLES.values():
        assert f"## {title}" in md
    assert "REFERENCE / reference_raw" in md
    assert "REFERENCE / best raw, rounds" in md and "auto / best raw, rounds" not in md
    assert "REFERENCE / sdpa_cpu: " in printed
    assert "REFERENCE fp8+quant / best bf16 op" in md
    assert "## FP8 against the best bf16 op" in md and "- **REFERENCE fp8**, H=2: " in md
    # auto against the fastest forced op, summarised by time and by pace (test_auto_summary has the lines' rules).
    assert "## Automatic choice" in md and "auto against the fastest forced op:\n- by time, " in printed
    assert "- by pace, " in md and "- by pace, " in printed
    assert "fp8 against the best bf16 op (causal sweep):\n- REFERENCE fp8, H=2: " in printed
    assert "REFERENCE fp8 / best bf16 op, settled" in md and "REFERENCE fp8+quant / best bf16 op, settled" not in md
    assert "## FP8 against the best bf16 op, each in phases at its own settled clock" in md
    settled = "fp8 against the best bf16 op, each in phases at its own settled clock:\n- REFERENCE fp8, causal-h2-"
    assert settled in printed
    assert env["settle_ms"] == timing.CPU_WARMUP_MS and env["phase_ms"] == timing.CPU_REP_MS
    assert "sm_clock_under_load" not in env  # nothing samples a CPU
    for skipped in ("flashinfer_raw", "fa4_raw", "fa2_varlen_raw"):
        assert f"not measured: {skipped}: " in printed and "CUDA devices only" in env["not_measured"][skipped]
    if HAS_MATPLOTLIB:
        png = out / "prefill.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size < 200_000
        assert "](prefill.png)" in md
    else:
        assert not (out / "prefill.png").exists()
        assert "matplotlib is not installed" in md and "matplotlib is not installed" in printed


def test_fp8_crossover_is_the_length_from_which_every_longer_one_pays():
    def row(x, ratio, heads=128, method="TRITON fp8+quant"):
        return {"kind": "fp8", "series": "causal", "method": method, "heads": heads, "x": x, "ratio_best_bf16": ratio}

    rows = [row(512, 0.7), row(1024, 1.05), row(2048, 0.98), row(4096, 1.2), row(8192, 1.4)]
    rows += [row(512, 0.5, heads=16), row(1024, 0.9, heads=16)]
    rows.append({**row(4096, 9.0), "series": ""})  # a long shape, off the sweep: not counted
    assert R.fp8_crossover(rows).splitlines() == [
        "- **TRITON fp8+quant**, H=16: does not pay up to s = 1024 (512: 0.50, 1024: 0.90)",
        "- **TRITON fp8+quant**, H=128: pays from s = 4096 (512: 0.70, 1024: 1.05, 2048: 0.98, 4096: 1.20, 8192: 1.40)",
    ]
    assert R.fp8_crossover([r for r in rows if r["kind"] != "fp8"]) == ""


def test_fp8_rounds_lists_the_rows_measured_in_turns():
    def row(method, ratio=None, shape="causal-h128-1x16384"):
        bounds = {} if ratio is None else {"ratio_best_bf16_min": ratio - 0.01, "ratio_best_bf16_max": ratio + 0.02}
        return {"kind": "fp8", "method": method, "shape": shape, "best_op": "FLASH_ATTN",
                "ratio_best_bf16_rounds": ratio, **bounds}  # fmt: skip

    rows = [row("TRITON fp8", 1.284), row("TRITON fp8+quant"), row("TRITON fp8", 1.2, "chunk-h128-1x1024-ctx1x131072")]
    rows.append({"kind": "op", "method": "auto", "shape": "causal-h128-1x16384", "ratio_best_bf16_rounds": 1.0})
    rows[2].update(sm_clock_mhz=1500.0, best_sm_clock_mhz=1305.0, capped=0.96)  # sampled on a GPU
    assert R.fp8_rounds(rows).splitlines() == [
        "- **TRITON fp8**, causal-h128-1x16384: 1.284 of FLASH_ATTN (rounds 1.274..1.304)",
        "- **TRITON fp8**, chunk-h128-1x1024-ctx1x131072: 1.200 of FLASH_ATTN (rounds 1.190..1.220); SM clock 1500 MHz "
        "against 1305; capped 96 % of the time",
    ]
    assert R.fp8_rounds(rows[1:2]) == ""


def test_no_fp8_leaves_the_fp8_rows_out():
    def timed(*extra: str) -> str:
        printed = _main(BP, ["--device", "cpu", "--quick", "--list", *extra])
        return next(line for line in printed.splitlines() if line.startswith("timing: "))

    assert "REFERENCE fp8, REFERENCE fp8+quant" in timed()
    assert "fp8" not in timed("--no-fp8")
    with pytest.raises(SystemExit, match=r"--versus-best-raw: TRITON not timed in this run; the methods timed: "):
        timed("--versus-best-raw", "TRITON")
    with pytest.raises(SystemExit, match=r"--versus-best-op: REFERENCE not an fp8 method .* REFERENCE fp8, "):
        timed("--versus-best-op", "REFERENCE")
    with pytest.raises(SystemExit, match=r"--versus-best-op: REFERENCE fp8 not an fp8 method .*: none \(--no-fp8"):
        timed("--no-fp8", "--versus-best-op", "REFERENCE fp8")


def test_from_csv_rerenders_the_report(prefill_run, tmp_path):
    out, _ = prefill_run
    _main(BP, ["--from-csv", str(out / "prefill.csv"), "--out", str(tmp_path)])

    # Without matplotlib the report's "No plot" note names its own folder; everything else must match.
    def normalised(path):
        return path.read_text().replace(str(tmp_path), "OUT").replace(str(out), "OUT")

    assert normalised(tmp_path / "prefill.md") == normalised(out / "prefill.md")


def test_from_csv_renders_the_committed_results(tmp_path):
    # Results written before the ratio's spread columns existed still render.
    committed = BENCH_DIR / "results" / "h200" / "prefill.csv"
    _main(BP, ["--from-csv", str(committed), "--out", str(tmp_path)])
    md = (tmp_path / "prefill.md").read_text()
    assert "NVIDIA H200" in md and "FLASHINFER / flashinfer_raw" in md


def test_a_run_without_out_writes_prefill_files(default_out):
    _main(BP, ["--device", "cpu", "--shapes", "merge-h2-t256", "--no-progress", *FAST])
    # One merge shape: nothing to plot, so no prefill.png.
    _assert_canonical_files(default_out, "prefill")


def test_committed_results_are_one_set_per_benchmark_and_gpu():
    """``benchmarks/results/<gpu>/<benchmark>.<ext>``, where ``bench_<benchmark>.py`` writes it: the names a
    rerun of the script's default command replaces, and nothing else (no logs, no timestamped copies)."""
    root = BENCH_DIR / "results"
    files = sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())
    assert len(files) <= 30
    for path in files:
        assert len(path.parts) == 2, path
        stem, _, ext = path.name.partition(".")
        assert (BENCH_DIR / f"bench_{stem}.py").is_file() and ext in ("csv", "env.json", "md", "png"), path


def test_runs_without_tqdm_and_matplotlib(tmp_path, monkeypatch):
    # A None entry in sys.modules makes the import fail, as if the package were not installed.
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    printed = _main(BP, ["--device", "cpu", "--quick", "--out", str(tmp_path), *FAST, "--ratio-rounds", "1"])
    # 4 attention shapes x (REFERENCE, auto, REFERENCE fp8, REFERENCE fp8+quant, reference_raw, sdpa_cpu, the ratio
    # rounds of REFERENCE against its raw call and of auto against REFERENCE) + 2 merges x (op, eager merge).
    total = 4 * 8 + 2 * 2
    assert f"[1/{total}]" in printed and f"[{total}/{total}]" in printed
    assert "matplotlib is not installed" in printed
    assert not (tmp_path / "prefill.png").exists()
    assert (tmp_path / "prefill.csv").exists() and "No plot:" in (tmp_path / "prefill.md").read_text()


def test_auto_summary():
    """auto / the fastest forced op by time and by pace: host-bound shapes (fastest forced op under 0.2 ms) apart
    from the others, and all together only where both kinds are present."""

    def shape(name, auto_ms, forced_ms, ratio, pace_ratio):
        return [
            {"shape": name, "method": "TRITON", "status": "ok", "time_ms": forced_ms},
            {"shape": name, "method": "auto", "status": "ok", "time_ms": auto_ms, "best_op": "TRITON",
             "ratio_auto_best": ratio, "ratio_auto_best_pace": pace_ratio},
        ]  # fmt: skip

    rows = shape("small", 0.06, 0.05, 0.84, 1.0) + shape("large", 1.0, 0.95, 0.95, 0.95) + shape("mid", 0.3, 0.3, 1, 1)
    assert R.auto_summary(rows).splitlines() == [
        "- by time, all shapes: median 0.950, minimum 0.840 (small), 3 shapes",
        "- by time, best op >= 0.2 ms: median 0.975, minimum 0.950 (large), 2 shapes",
        "- by time, best op < 0.2 ms: median 0.840, minimum 0.840 (small), 1 shape",
        "- by pace, all shapes: median 1.000, minimum 0.950 (large), 3 shapes",
        "- by pace, best op >= 0.2 ms: median 0.975, minimum 0.950 (large), 2 shapes",
        "- by pace, best op < 0.2 ms: median 1.000, minimum 1.000 (small), 1 shape",
    ]
    only_large = shape("large", 1.0, 0.95, 0.95, None)
    assert R.auto_summary(only_large) == "- by time, best op >= 0.2 ms: median 0.950, minimum 0.950 (large), 1 shape"
    assert R.auto_summary(shape("x", 1.0, 1.0, None, None)) == ""
    # Where the rows say which backend auto was routed to, a line sets it beside the fastest forced op.
    rows[1]["auto_route"], rows[3]["auto_route"] = "FLASHINFER", "TRITON"
    assert R.auto_summary(rows).splitlines()[-1] == (
        "- routed to the fastest forced op on 1 of 2 shapes; elsewhere (routed, fastest, auto / fastest by time): "
        "small (FLASHINFER, TRITON, 0.840)"
    )
    # A ratio in rounds below the target where auto ran the fastest op's backend is that backend against itself.
    rows[3] |= {"ratio_auto_best_rounds": 0.95, "ratio_auto_best_min": 0.94, "ratio_auto_best_max": 1.01}
    rows[1] |= {"ratio_auto_best_rounds": 0.9, "ratio_auto_best_min": 0.9, "ratio_auto_best_max": 0.9}
    assert R.auto_summary(rows).splitlines()[-1] == (
        "- below 0.97 in rounds though routed to the fastest op's own backend (the spread of one backend timed "
        "against itself; auto / fastest, rounds' range): large (TRITON, 0.950, 0.940..1.010)"
    )


def test_append_merges_runs_of_different_shapes(tmp_path):
    common = ["--device", "cpu", "--out", str(tmp_path), "--rep-ms", "1", "--no-progress", "--ratio-rounds", "1"]
    _main(BP, [*common, "--shapes", "merge-h2-*"])
    _main(BP, [*common, "--shapes", "causal-h2-4x32", "merge-h2-*", "--append"])
    rows = _read_rows(tmp_path / "prefill.csv")
    # The merge shape was measured twice: its rows were replaced, not duplicated; the order is the shape list's.
    assert [(r["shape"], r["method"]) for r in rows] == [
        ("causal-h2-4x32", "REFERENCE"),
        ("causal-h2-4x32", "auto"),
        ("causal-h2-4x32", "REFERENCE fp8"),
        ("causal-h2-4x32", "REFERENCE fp8+quant"),
        ("causal-h2-4x32", "reference_raw"),
        ("causal-h2-4x32", "sdpa_cpu"),
        ("merge-h2-t256", "mla.merge_attn_states"),
        ("merge-h2-t256", "torch_eager_merge"),
    ]
    env = json.loads((tmp_path / "prefill.env.json").read_text())
    assert len(env["appended_to"]) == 1 and "merge-h2-*" in env["appended_to"][0]
    assert env["command"].endswith("--append")


def test_a_run_cut_short_keeps_the_shapes_it_finished(tmp_path, monkeypatch):
    """Each shape's rows are written as it completes, so a run stopped by a time limit or Ctrl-C keeps them, and
    --from-csv renders their report."""
    real, calls = BP.run_shape, []

    def stop_at_the_second_shape(shape, *args):
        calls.append(shape.id)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(shape, *args)

    monkeypatch.setattr(BP, "run_shape", stop_at_the_second_shape)
    argv = ["--device", "cpu", "--out", str(tmp_path), "--rep-ms", "1", "--no-progress", "--ratio-rounds", "1"]
    with pytest.raises(KeyboardInterrupt):
        _main(BP, [*argv, "--shapes", "causal-h2-4x32", "merge-h2-*"])
    rows = _read_rows(tmp_path / "prefill.csv")
    assert {r["shape"] for r in rows} == {"causal-h2-4x32"} and {r["status"] for r in rows} == {"ok"}
    env = json.loads((tmp_path / "prefill.env.json").read_text())
    assert env["shapes_measured"] == "1 of 2" and "measure_s" not in env
    assert not (tmp_path / "prefill.md").exists()
    printed = _main(BP, ["--from-csv", str(tmp_path / "prefill.csv")])
    assert "wrote" in printed and "causal-h2-4x32" in (tmp_path / "prefill.md").read_text()


def test_bad_arguments_give_clear_errors():
    with pytest.raises(SystemExit, match="unknown backend"):
        _main(BP, ["--device", "cpu", "--backends", "NOPE", "--list"])
    with pytest.raises(SystemExit, match="unknown \\['nope'\\]"):
        _main(BP, ["--device", "cpu", "--baselines", "nope", "--list"])
    with pytest.raises(SystemExit, match="does not exist"):
        _main(BP, ["--from-csv", "/nonexistent/prefill.csv"])
    with pytest.raises(SystemExit, match="--sizes: cannot parse"):
        _main(BGT, ["--device", "cpu", "--sizes", "lots"])
    with pytest.raises(SystemExit, match=r"--batch: .*at least one new token"):
        _main(BL, ["--device", "cpu", "--batch", "4x8"])


# --- the other scripts on CPU ---------------------------------------------------------------------------


def test_dispatch_cpu_run(default_out, written):
    _main(BD, ["--device", "cpu", "--iters", "5", "--rounds", "3", "--interleaved-samples", "4",
               "--sample-calls", "2"])  # fmt: skip
    _assert_fields_written(written, BD, default_out / "dispatch.csv")
    _assert_canonical_files(default_out, "dispatch")
    rows = {(r["path"], r["backend"]): r for r in _read_rows(default_out / "dispatch.csv")}
    for path in ("prefill", "prefill_context_chunk"):
        r = rows[(path, "REFERENCE")]
        assert r["auto_selected"] == "True"
        for key in ("routing_us", "routing_auto_us", "api_us", "op_us", "direct_us", "raw_us"):
            assert float(r[key]) > 0, key
        # Medians of per-round differences (test_record_series_pairs_each_round), bracketed by their quartiles.
        assert math.isfinite(float(r["op_minus_direct_us"]))
        assert float(r["op_minus_raw_q1_us"]) <= float(r["op_minus_raw_us"]) <= float(r["op_minus_raw_q3_us"])
        low, mid, high = (float(r[f"op_minus_raw_interleaved{part}_us"]) for part in ("_q1", "", "_q3"))
        assert low <= mid <= high and r["interleaved_samples"] == "4"
        assert r["raw_call"] == M.ReferenceRaw.implementation
    assert any(path == "merge_attn_states" for path, _ in rows)
    layer = rows[(BD.LAYER_PATH, "REFERENCE")]
    for key in ("api_us", "op_us", "direct_us", "raw_us"):
        assert float(layer[key]) > 0, key
    assert layer["raw_call"].startswith(M.ReferenceRaw.implementation) and layer["note"] == ""
    md = (default_out / "dispatch.md").read_text()
    assert "| prefill | REFERENCE | yes |" in md and "**torch**" in md
    assert json.loads((default_out / "dispatch.env.json").read_text())["iters"] == 5


def test_dispatch_host_issue_rows(default_out, written):
    """``--host-chunk NEW,CONTEXT`` adds one host-issue row per backend, the op's and the raw call's host time on that
    chunk; on CPU there are none by default (the chunk is sized for a GPU's kernels), and 'none' skips them."""
    argv = ["--device", "cpu", "--iters", "3", "--rounds", "3", "--interleaved-samples", "0", "--host-calls", "2"]
    _main(BD, [*argv, "--host-chunk", "8,40"])
    _assert_fields_written(written, BD, default_out / "dispatch.csv")
    rows = {(r["path"], r["backend"]): r for r in _read_rows(default_out / "dispatch.csv")}
    row = rows[(BD.HOST_ISSUE_PATH, "REFERENCE")]
    assert float(row["host_issue_us"]) > 0 and float(row["host_issue_raw_us"]) > 0
    assert row["tokens"] == "8" and row["note"] == "8 new tokens over 40 keys"
    assert "op host issue µs" in (default_out / "dispatch.md").read_text()
    for chunk in ([], ["--host-chunk", "none"]):
        written.clear()
        _main(BD, argv + chunk)
        assert not any(r["path"] == BD.HOST_ISSUE_PATH for r in _read_rows(default_out / "dispatch.csv"))
    for bad in ("3", "8,x", "0,40"):
        with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
            BD.parse_args(["--host-chunk", bad])


def test_dispatch_merge_parts_allocate_two_outputs_and_launch_once(merge_launches):
    """The merge row's raw column: two fresh outputs and one launch of the fixed kernel per call, with the
    inputs' and those outputs' addresses; nothing where the kernel is not launched directly (CPU)."""
    launches = []

    def fake_launch(*args):
        out, lse = args[4], args[5]
        assert out.shape == (8, 2, 64) and lse.shape == (2, 8)
        return lambda leading: launches.append(leading)

    merge_launches.launch = fake_launch
    args = (torch.randn(8, 2, 64).bfloat16(), torch.randn(2, 8), torch.randn(8, 2, 64).bfloat16(), torch.randn(2, 8))
    assert BD.merge_parts(args, torch.device("cpu")) is None
    parts, allocations, launch = BD.merge_parts(args, torch.device("cuda"))  # CPU tensors stand in for the device's
    parts()
    parts()
    (first, second) = launches
    assert first[:4] == tuple(t.data_ptr() for t in args) and len(first) == 6
    assert first[4] != args[0].data_ptr() and second[:4] == first[:4]
    allocations()
    assert len(launches) == 2  # the allocations alone launch nothing
    launch()
    launch()
    (third, fourth) = launches[2:]
    assert third[:4] == first[:4] and len(third) == 6 and fourth == third  # the launch alone: fixed outputs
    assert third[4:] == tuple(t.data_ptr() for t in launch.outputs)  # ... which it keeps alive


def test_layers_cpu_run(default_out, written):
    _main(BL, ["--device", "cpu", "--rounds", "2", *FAST])
    _assert_fields_written(written, BL, default_out / "layers.csv")
    _assert_canonical_files(default_out, "layers")
    row, auto = _read_rows(default_out / "layers.csv")
    assert row["backend"] == "REFERENCE" and row["status"] == "ok"
    # The stack with no override (REFERENCE on CPU too), against the fastest forced backend.
    assert auto["backend"] == "auto" and auto["status"] == "ok" and auto["best_op"] == "REFERENCE"
    assert float(auto["rel_diff"]) == 0.0 and float(auto["auto_over_best"]) > 0 and float(auto["op_layer_ms"]) > 0
    # The raw layers compute what the ops compute, with the same functions: the outputs agree exactly.
    assert float(row["rel_diff"]) == 0.0
    op_ms, raw_ms, cost_us = (float(row[key]) for key in ("op_layer_ms", "raw_layer_ms", "op_cost_us_per_layer"))
    assert op_ms > 0 and raw_ms > 0
    # The CSV keeps 6 significant digits of each figure: on a slow host (hundreds of ms per layer) that rounds
    # the two times by up to a microsecond.
    assert math.isclose(cost_us, (op_ms - raw_ms) * 1e3, abs_tol=1e-5 * (1e3 * (op_ms + raw_ms) + abs(cost_us)))
    assert "| REFERENCE |" in (default_out / "layers.md").read_text()


def test_layers_cpu_run_attributes_the_op_cost(tmp_path, written):
    printed = _main(BL, ["--device", "cpu", "--out", str(tmp_path), "--rounds", "2", "--attribute", "3", *FAST])
    _assert_fields_written(written, BL, tmp_path / "layers.csv")
    row, _ = _read_rows(tmp_path / "layers.csv")
    # Every form computes the layers the ops compute, with the same functions: exactly the same outputs.
    assert row["status"] == "ok" and float(row["rel_diff"]) == 0.0 and row["attribution_samples"] == "3"
    for form in A.FORMS:
        assert float(row[f"{form}_us"]) > 0 and float(row[f"{form}_forward_us"]) >= float(row[f"{form}_us"])
    for key in [A.part_key(part) for part in A.PARTS] + [A.TOTAL_KEY, A.REST_KEY]:
        assert math.isfinite(float(row[key])), key
    assert "parts: API wrappers" in printed
    md = (tmp_path / "layers.md").read_text()
    assert "## Where the op cost goes" in md and "| backend | api | fused | ops | dispatch |" in md


def test_attribution_forms_take_the_dispatcher_only_where_they_say():
    """Seen from a dispatch mode: the api and fused forms dispatch the fused op, the ops form the three mla ops,
    the dispatch form its own ops of their schemas, and the kernels, backend and raw forms no op of either
    namespace; all give the api form's result."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import mla_ops

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace in ("mla", A.NAMESPACE):
                self.ops.append(f"{func.namespace}::{func._opname}")
            return func(*args, **(kwargs or {}))

    b = make_batch([3, 5], 2, P.DQK, P.DV, torch.bfloat16, seed=1)
    chunk = (b.k[:6], b.v[:6], torch.tensor([0, 2, 6], dtype=torch.int32), 4)
    raw = M.RawLayerAttention(M.ReferenceRaw(), CPU)
    with mla_ops.prefill_backend("REFERENCE"), torch.no_grad():
        backend = mla_ops.selector.route(CPU, torch.bfloat16, P.DQK, P.DV)
        forms = A.attention_forms(backend, CPU, raw)
        want = mla_ops.prefill_with_context(b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen, [chunk], 0.1)
        for form, fn in forms.items():
            with Seen() as seen:
                out, lse = fn(b.q, b.k, b.v, b.cu_seqlens, b.max_seqlen, [chunk], 0.1)
            assert torch.equal(out, want[0]) and torch.equal(lse, want[1]), form
            three = ("prefill", "prefill_context_chunk", "merge_attn_states")
            expected = {
                "api": ["mla::prefill_with_chunk"],  # one chunk, eagerly: the fused op
                "fused": ["mla::prefill_with_chunk"],
                "ops": [f"mla::{op}" for op in three],
                "dispatch": [f"{A.NAMESPACE}::{op}" for op in three],
            }
            assert seen.ops == expected.get(form, []), form


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_transformers_cpu_run(default_out, written):
    import bench_transformers as BT

    _main(BT, ["--device", "cpu", *FAST])
    _assert_fields_written(written, BT, default_out / "transformers.csv")
    _assert_canonical_files(default_out, "transformers")
    rows = {(r["implementation"], r["backend"]): r for r in _read_rows(default_out / "transformers.csv")}
    sdpa, ours = rows[("sdpa", "")], rows[("mla_ops", "REFERENCE")]
    assert float(sdpa["speedup"]) == 1.0 and float(sdpa["rel_diff"]) == 0.0
    # The same model and weights through the ops: logits agree with sdpa's to bf16 rounding.
    assert float(ours["forward_ms"]) > 0 and float(ours["rel_diff"]) < 1e-2
    assert rows[("mla_ops", "TRITON")]["note"].startswith("not measured:")
    assert "| mla_ops | REFERENCE |" in (default_out / "transformers.md").read_text()


def test_graph_trees_cpu_run(default_out, written):
    _main(BGT, ["--device", "cpu", "--steps", "2", "--warmup-steps", "1"])
    _assert_fields_written(written, BGT, default_out / "graph_trees.csv")
    _assert_canonical_files(default_out, "graph_trees")
    rows = _read_rows(default_out / "graph_trees.csv")
    sizes = [P.ServingSize.parse(text) for text in BGT.CPU_DEFAULTS["sizes"].split(",")]
    assert [(r["size"], r["backend"], r["mode"]) for r in rows] == [(s.label, "REFERENCE", "eager") for s in sizes]
    assert all(r["status"] == "ok" and float(r["step_ms"]) > 0 and r["steps"] == "2" for r in rows)
    env = json.loads((default_out / "graph_trees.env.json").read_text())
    assert "needs a CUDA device" in env["not_measured"]["CUDA-graph trees"]


# --- field lists: the CSV columns and the Markdown columns from one list -----------------------------------


def test_fields_give_the_csv_order_and_the_markdown_columns():
    fields = R.Fields(
        ("name", "name"),
        "raw",
        R.Field("ms", "time ms", ".2f"),
        ("low", "range", R.span("low", "high", ".1f")),
        ("high", None),
        ("note", "raw / note", R.text("raw", "note")),
    )
    assert fields.keys == ("name", "raw", "ms", "low", "high", "note")
    assert [header for header, _ in fields.columns] == ["name", "time ms", "range", "raw / note"]
    rows = [{"name": "a|b", "raw": "r", "ms": 1.234, "low": 1, "high": 2.0, "note": ""}, {"name": 3}]
    assert fields.table(rows).splitlines() == [
        "| name | time ms | range | raw / note |",
        "| --- | --- | --- | --- |",
        "| a\\|b | 1.23 | 1.0..2.0 | r |",
        "| 3 | — | —..— |  |",
    ]
    assert fields.undeclared([*rows, {"name": "x", "extra": 1}]) == {"extra"}
    with pytest.raises(ValueError, match="declared more than once: ms"):
        R.Fields(("ms", "time ms", ".2f"), ("ms", None))
    with pytest.raises(ValueError, match="high is in the CSV only"):
        R.Field("high").column()


class _RowReadLog(dict):
    """A row with every key set to 1 that remembers which keys were read."""

    def __init__(self, keys):
        super().__init__((key, 1) for key in keys)
        self.read = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)


@pytest.mark.parametrize("script", FIELD_SCRIPTS)
def test_markdown_columns_read_only_declared_fields(script):
    """Every Markdown cell reads fields of its script's list (a misspelt key would print ``—`` forever), and
    every field with a header is read by its column; GPU-only scripts are checked here too."""
    fields = importlib.import_module(script).FIELDS
    row = _RowReadLog(fields.keys)
    body = fields.table([row]).splitlines()[2]
    assert row.read <= set(fields.keys)
    assert {field.key for field in fields.fields if field.header is not None} <= row.read
    assert "—" not in body


# --- the timer ------------------------------------------------------------------------------------------


def test_measure_counts_calls_and_samples():
    calls = []
    result = timing.measure(lambda: calls.append(1), CPU, samples=4, warmup_calls=3, calls_per_sample=5)
    assert len(calls) == 3 + 4 * 5 and len(result.samples_ms) == 4
    assert result.min_ms <= result.median_ms <= result.max_ms
    calls.clear()
    timing.measure(lambda: calls.append(1), CPU, warmup_ms=0.0, rep_ms=1e-9, min_samples=7)
    assert len(calls) >= 1 + 1 + 7  # the untimed first call, a one-call estimate (it took rep_ms), the samples
    assert len(calls) < 1 + 1 + 5 + 7
    calls.clear()
    timing.measure(lambda: calls.append(1), CPU, warmup_ms=0.0, rep_ms=1e3, min_samples=7, max_samples=7)
    assert len(calls) >= 1 + 1 + 5 + 7  # a call far shorter than rep_ms: five more calls estimate its time


def test_host_issue_times_rounds_of_back_to_back_calls():
    calls = []
    per_call = timing.host_issue(lambda: calls.append(1), CPU, calls=5, rounds=4)
    assert len(calls) == 3 + 4 * 5 and len(per_call) == 4 and all(t >= 0 for t in per_call)
    with pytest.raises(ValueError, match="at least 1"):
        timing.host_issue(lambda: None, CPU, calls=0, rounds=1)


def test_alternating_takes_turns_within_each_round(monkeypatch):
    order = []
    monkeypatch.setattr(timing, "measure", lambda fn, device, **kw: (order.append(fn()), timing.Timing((1.0,)))[1])
    series = timing.alternating({"a": lambda: "a", "b": lambda: "b"}, CPU, rounds=3)
    assert order == ["a", "b"] * 3 and series == {"a": [1.0] * 3, "b": [1.0] * 3}
    with pytest.raises(ValueError, match="at least 1"):
        timing.alternating({"a": lambda: None}, CPU, rounds=0)


def test_alternating_reverses_odd_rounds_on_request(monkeypatch):
    order = []
    monkeypatch.setattr(timing, "measure", lambda fn, device, **kw: (order.append(fn()), timing.Timing((1.0,)))[1])
    timing.alternating({"a": lambda: "a", "b": lambda: "b", "c": lambda: "c"}, CPU, rounds=3, reverse_odd_rounds=True)
    assert order == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]


def test_settled_ratio_times_each_function_in_its_own_phase(monkeypatch):
    # An fp8 op against a bf16 op at a power cap: each settles alone, then is timed alone, the order reversed in odd
    # rounds; the monitor wraps each timed phase and nothing else, each context the whole phase.
    log = []
    times = {"num": iter([2.0, 4.0, 3.0]), "den": iter([1.0, 1.0, 2.0])}

    def measure(fn, device, **kw):
        log.append(("timed", fn()))
        assert kw["warmup_calls"] == 0 and kw["rep_ms"] == 7.0 and kw["flush_l2"] is False
        return timing.Timing((next(times[log[-1][1]]),))

    monkeypatch.setattr(timing, "measure", measure)
    monkeypatch.setattr(timing, "_run_for", lambda fn, device, budget_ms: log.append(("settle", fn(), budget_ms)))

    @contextlib.contextmanager
    def tag(kind, name):
        log.append((kind, name))
        yield
        log.append((f"/{kind}", name))

    ratio = timing.settled_ratio(
        lambda: "num", lambda: "den", CPU, 3, settle_ms=5.0, phase_ms=7.0, flush_l2=False,
        contexts={"numerator": lambda: tag("ctx", "numerator"), "denominator": lambda: tag("ctx", "denominator")},
        monitor=lambda name: tag("mon", name),
    )  # fmt: skip

    def phase(name, fn):
        return [("ctx", name), ("settle", fn, 5.0), ("mon", name), ("timed", fn), ("/mon", name), ("/ctx", name)]

    num, den = phase("numerator", "num"), phase("denominator", "den")
    assert log == num + den + den + num + num + den
    assert (ratio.median, ratio.low, ratio.high, ratio.rounds) == (2.0, 1.5, 4.0, 3)
    assert (ratio.numerator_ms, ratio.denominator_ms) == (3.0, 1.0)
    with pytest.raises(ValueError, match="at least 1"):
        timing.settled_ratio(lambda: None, lambda: None, CPU, rounds=0)


def test_run_for_calls_until_its_budget_has_passed(monkeypatch):
    # Each call takes 2 ms of a stand-in clock, so the count does not depend on how busy the machine is.
    now = [0.0]
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    def call():
        now[0] += 0.002

    calls = []
    timing._run_for(lambda: calls.append(call()), CPU, 0.0)
    assert len(calls) == 1  # at least once
    calls.clear()
    timing._run_for(lambda: calls.append(call()), CPU, 10.0)
    assert len(calls) == 5  # at 2, 4, 6 and 8 ms the budget has not passed; at 10 it has


def test_clock_samples_parse_and_summarise():
    text = "\n".join([
        "clocks.current.sm [MHz], power.draw [W], clocks_event_reasons.active",  # a header: skipped
        "1500, 697.12, 0x0000000000000004",
        "1300, [N/A], 0x0000000000000000",
        "1980, 120.5, 0x0000000000000001",  # idle (0x1): not a cap
        "[N/A], 100.0, 0x0",
        "1350, 698.0",  # cut off when the sampler stopped
    ])  # fmt: skip
    samples = clocks.parse_samples(text)
    assert samples == [
        clocks.ClockSample(1500, 697.12, 4), clocks.ClockSample(1300, None, 0), clocks.ClockSample(1980, 120.5, 1)
    ]  # fmt: skip
    summary = clocks.ClockSummary.of(samples)
    assert summary == clocks.ClockSummary(3, 1500, 408.81, 1 / 3)
    assert summary.describe() == "1500 MHz, 409 W, capped 33 %"
    assert clocks.ClockSummary.of([clocks.ClockSample(1400, None, 0x40)]).describe() == "1400 MHz, capped 100 %"
    assert clocks.ClockSummary.of([]) is None
    assert clocks.busy(samples) == samples[:2]  # the idle GPU's sample is no measurement's


def test_clock_sampler_keeps_what_its_command_printed_while_active(tmp_path):
    # The command stands in for nvidia-smi -lms: two samples, then it runs until the sampler stops it.
    marker = tmp_path / "printed"
    script = (
        "import pathlib, sys, time\nfor c in (1500, 1490):\n    print(f'{c}, 700.0, 0x4', flush=True)\n"
        f"pathlib.Path({str(marker)!r}).touch()\ntime.sleep(60)"
    )
    with clocks.ClockSampler(CPU, command=[sys.executable, "-c", script]) as sampler:
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    assert clocks.ClockSummary.of(sampler.samples) == clocks.ClockSummary(2, 1495, 700.0, 1.0)
    with clocks.ClockSampler(CPU, command=["/nonexistent/nvidia-smi"]) as missing:
        pass
    assert missing.samples == []  # a sampler that cannot start leaves the measurement alone
    with clocks.ClockSampler(CPU) as cpu:  # nothing to sample on CPU
        assert cpu.command is None
    assert cpu.samples == []


def test_difference_of_rounds_is_the_median_of_per_round_differences():
    # The op runs 1 µs above its raw call in every round while the host drifts from 10 to 30 µs; one outlier.
    op, raw = [11.0, 21.0, 31.0, 12.0, 60.0], [10.0, 20.0, 30.0, 10.0, 14.0]
    d = timing.difference_of_rounds(op, raw)
    assert (d.median, d.low, d.high, d.rounds) == (1.0, 1.0, 2.0, 5)
    assert timing.difference_of_rounds([3.0], [1.0]) == timing.RoundsDifference(2.0, 2.0, 2.0, 1)
    with pytest.raises(ValueError, match="same length"):
        timing.difference_of_rounds([1.0], [1.0, 2.0])


def test_record_series_pairs_each_round():
    out = {}
    BD.record_series(out, {"op_us": [11.0, 31.0, 21.0], "direct_us": [9.0, 29.0, 19.0], "raw_us": [10.0, 28.0, 20.0]})
    assert out["op_us"] == 21.0 and out["raw_us"] == 20.0
    assert out["op_minus_direct_us"] == 2.0
    assert (out["op_minus_raw_q1_us"], out["op_minus_raw_us"], out["op_minus_raw_q3_us"]) == (1.0, 1.0, 2.0)
    assert "op_minus_raw_outputs_us" not in out


def test_interleaved_takes_turns_sample_by_sample():
    order = []
    series = timing.interleaved(
        {"a": lambda: order.append("a"), "b": lambda: order.append("b")}, CPU, warmup_ms=0.0, rep_ms=0.0
    )
    assert len(series["a"]) == len(series["b"]) == 6  # min_samples (rep_ms buys no more), made even
    # Per function: one untimed call and one estimate sample (it took rep_ms: no five more), then one warm-up
    # call each, then the samples in turns, each function first in every other one.
    assert order[:2] == ["a"] * 2 and order[2:4] == ["b"] * 2 and order[4:6] == ["a", "b"]
    assert order[6:] == ["a", "b", "b", "a"] * 3


def test_interleaved_enters_each_functions_context_around_its_samples():
    # rounds_ratio's use: auto against a forced backend, each sample inside its own setting.
    log, inside = [], []

    @contextlib.contextmanager
    def setting(name):
        inside.append(name)
        yield
        inside.pop()

    def fn(name):
        return lambda: log.append((name, tuple(inside)))

    series = timing.interleaved(
        {"a": fn("a"), "b": fn("b")}, CPU, warmup_ms=0.0, rep_ms=0.0,
        contexts={"a": lambda: setting("A"), "b": lambda: setting("B")},
    )  # fmt: skip
    assert len(series["a"]) == len(series["b"]) == 6
    assert all(seen == (name.upper(),) for name, seen in log), "every call, timed or not, inside its own context"
    assert [name for name, _ in log[6:]] == ["a", "b", "b", "a"] * 3  # the samples in turns, as without contexts
    assert not inside


def test_rounds_ratio_takes_samples_in_turns_within_each_side_s_context(monkeypatch):
    seen = {}

    def interleaved_ratio(numerator, denominator, device, rounds, **kwargs):
        seen.update(kwargs, numerator=numerator, denominator=denominator, rounds=rounds)
        return "ratio"

    monkeypatch.setattr(timing, "interleaved_ratio", interleaved_ratio)
    ours = M.Prepared(lambda: "ours", None, lambda: "our setting")
    theirs = M.Prepared(lambda: "theirs", None, lambda: "their setting")
    assert M.rounds_ratio(ours, theirs, CPU, 3, rep_ms=1.0) == "ratio"
    assert seen["numerator"]() == "theirs" and seen["denominator"]() == "ours" and seen["rounds"] == 3
    assert seen["contexts"]["numerator"]() == "their setting" and seen["contexts"]["denominator"]() == "our setting"
    assert seen["max_samples"] == M.ROUNDS_RATIO_MAX_SAMPLES and seen["rep_ms"] == 1.0


def test_interleaved_ratio_is_the_median_of_neighbour_ratios_then_of_rounds(monkeypatch):
    # Samples 2j and 2j + 1 (one in each order) make a pair, whose ratio is that of the sums.
    rounds = iter(
        [
            {"numerator": [1.0, 3.0, 5.0, 4.0, 2.0, 1.0], "denominator": [1.0, 1.0, 3.0, 0.0, 2.0, 1.0]},  # 2, 3, 1
            {"numerator": [4.0, 4.0, 4.0, 4.0], "denominator": [1.0, 1.0, 1.0, 1.0]},  # 4, 4
            {"numerator": [1.0, 1.0], "denominator": [1.0, 1.0]},  # 1
        ]
    )
    seen = []

    def fake_interleaved(fns, device, **kw):
        seen.append(list(fns))
        return next(rounds)

    monkeypatch.setattr(timing, "interleaved", fake_interleaved)
    r = timing.interleaved_ratio(lambda: None, lambda: None, CPU, rounds=3)
    assert (r.median, r.low, r.high, r.rounds) == (2.0, 1.0, 4.0, 3)
    assert (r.numerator_ms, r.denominator_ms) == (2.5, 1.0)  # medians over rounds of each side's median
    assert seen == [["denominator", "numerator"]] * 3
    with pytest.raises(ValueError, match="at least 1"):
        timing.interleaved_ratio(lambda: None, lambda: None, CPU, rounds=0)


def test_overhead_ratio_is_raw_over_op_with_the_op_backend_selected(monkeypatch):
    import mla_ops

    seen = []
    times = {"op": iter([2.0, 2.0, 4.0]), "raw": iter([1.0, 3.0, 2.0])}

    def fake_interleaved(fns, device, **kw):
        result = {}
        for key, fn in fns.items():
            name = fn()
            seen.append((name, mla_ops.selector.current_override()))
            result[key] = [next(times[name])] * 2  # one pair of samples
        return result

    monkeypatch.setattr(timing, "interleaved", fake_interleaved)
    op = M.Prepared(lambda: "op", lambda r: r, lambda: mla_ops.prefill_backend("TRITON"))
    raw = M.Prepared(lambda: "raw", lambda r: r)
    ratio = M.overhead_ratio(op, raw, CPU, rounds=3)
    assert ratio.median == 0.5 and ratio.low == 0.5 and ratio.high == 1.5  # rounds: 0.5, 1.5, 0.5
    assert [name for name, _ in seen] == ["op", "raw"] * 3
    assert {backend.name for _, backend in seen} == {"TRITON"}
    assert mla_ops.selector.current_override() is None


def test_prefill_takes_each_ratio_from_overhead_ratio(tmp_path, monkeypatch):
    # bench_prefill.py's ratio_raw is methods.overhead_ratio's figure, the function bench_layers.py's ratios
    # come from as well: for one shape the scripts report one quantity.
    fixed = timing.RoundsRatio(median=0.987, low=0.95, high=1.01, rounds=3, numerator_ms=1.0, denominator_ms=1.0)
    monkeypatch.setattr(M, "overhead_ratio", lambda *args, **kwargs: fixed)
    _main(BP, ["--device", "cpu", "--out", str(tmp_path), "--shapes", "causal-h2-4x32", "--no-progress", *FAST])
    prefill = next(r for r in _read_rows(tmp_path / "prefill.csv") if r["method"] == "REFERENCE")
    assert (float(prefill["ratio_raw"]), float(prefill["ratio_raw_min"]), float(prefill["ratio_raw_max"])) == (
        0.987,
        0.95,
        1.01,
    )


# --- problems ---------------------------------------------------------------------------------------------


def test_flops_follow_the_design_formula():
    causal = P.Shape("causal", 16, (4096,) * 4)
    assert causal.flops() == 2 * 16 * (192 + 128) * 4 * (4096 * 4097 // 2)
    chunk = P.Shape("chunk", 128, (256,) * 4, (2048,) * 4)
    assert chunk.flops() == 2 * 128 * (192 + 128) * 4 * 256 * 2048
    merge = P.Shape("merge", 16, (16384,))
    rows = 16384 * 16
    assert merge.merge_bytes(2) == 3 * rows * 128 * 2 + 3 * rows * 4


def test_gpu_shape_sets():
    shapes = P.gpu_shapes()
    ids = {s.id for s in shapes}
    for required in (
        "causal-h16-4x4096",
        "causal-h128-2x8192",
        "causal-h128-512+1024+2048+3000+700",
        "chunk-h16-1x1024-ctx1x32768",
        "chunk-h128-4x256-ctx4x2048",
        "merge-h128-t16384",
        "causal-h128-1x16384",
        "causal-h128-1x32768",
        "causal-h128-1x131072",
        "chunk-h128-1x1024-ctx1x131072",
    ):
        assert required in ids
    assert {s.id for s in shapes if "long" in s.tags} == {
        "causal-h128-1x32768",
        "causal-h128-1x131072",
        "chunk-h128-1x1024-ctx1x131072",
    }
    sweep = [s for s in shapes if s.series == "causal"]
    assert {s.heads for s in sweep} == {16, 128}
    assert {s.x for s in sweep} == {512, 1024, 2048, 4096, 8192, 16384}
    assert all(16384 <= sum(s.q_lens) <= 32768 for s in sweep)
    quick = P.select_shapes(shapes, [], quick=True)
    assert [s.suite for s in quick].count("causal") == 3
    assert [s.suite for s in quick].count("chunk") == 1
    assert [s.suite for s in quick].count("merge") == 2
    assert [s.id for s in P.select_shapes(shapes, ["merge"], quick=False)] == ["merge-h16-t16384", "merge-h128-t16384"]
    assert [s.id for s in P.select_shapes(shapes, ["ref"], quick=False)] == [
        "causal-h16-4x4096",
        "causal-h128-2x8192",
        "causal-h128-512+1024+2048+3000+700",
    ]
    with pytest.raises(SystemExit, match="matches no shape"):
        P.select_shapes(shapes, ["nothing-*"], quick=False)


def test_problem_layout_is_mla_s():
    p = P.make_problem(P.Shape("chunk", 2, (3, 0, 5), (4, 2, 0)), CPU, torch.bfloat16, padding_rows=2)
    assert p.q.shape == (8 + 2, 2, 192) and p.k.shape == (6 + 2, 2, 192)
    # v is the last 128 channels of a [T, H, 256] projection: a strided view, as MLA hands it over.
    assert p.v.shape == (8, 2, 128) and p.v.stride() == (2 * 256, 256, 1) and p.v.storage_offset() == 128
    assert p.cu_q.tolist() == [0, 3, 3, 8] and p.cu_k.tolist() == [0, 4, 6, 6] and p.cu_q.dtype == torch.int32
    assert (p.max_q, p.max_k, p.causal) == (5, 4, False)
    causal = P.make_problem(P.Shape("causal", 2, (3, 5)), CPU, torch.bfloat16)
    assert causal.cu_k is causal.cu_q and causal.causal


def test_split_lengths():
    rng = random.Random(0)
    for total, parts in ((512, 8), (17, 17), (8192, 32)):
        lengths = P.split_lengths(total, parts, rng)
        assert len(lengths) == parts and sum(lengths) == total and min(lengths) >= 1
    with pytest.raises(ValueError, match="cannot split 3 tokens into 4"):
        P.split_lengths(3, 4, rng)


def test_serving_batches_keep_shapes_and_change_lengths():
    stack = P.mla_stack(P.mla_config(64, 2), 1, CPU, torch.bfloat16)
    size = P.ServingSize.parse("24x4+40")
    batches = P.serving_batches(stack.layers[0], size, 4, seed=3)
    assert len({tuple(b.new_lengths) for b in batches}) > 1  # a new split each step
    for b in batches:
        assert b.hidden.shape == (24, 64) and b.cu_seqlens.tolist()[-1] == 24 and b.max_seqlen == 24
        (chunk,) = b.context
        assert chunk.kv_c.shape[0] == 40 and chunk.cu_seqlens_k.tolist()[-1] == 40 and chunk.max_seqlen_k == 40
    again = P.serving_batches(stack.layers[0], size, 4, seed=3)
    assert [b.new_lengths for b in again] == [b.new_lengths for b in batches]
    assert torch.equal(again[0].hidden, batches[0].hidden)
    (exact,) = P.serving_batches(stack.layers[0], size, 1, seed=3, exact_bounds=True)
    assert exact.max_seqlen == max(exact.new_lengths)
    assert exact.context[0].max_seqlen_k == max(exact.context_lengths)


# --- methods --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("suite", ["causal", "chunk"])
def test_a_sampled_check_compares_each_sequences_first_and_last_rows(monkeypatch, suite):
    """Past SAMPLED_CHECK_ROWS query rows the reference covers the first and last SAMPLE_EDGE_ROWS rows of each
    sequence, each over the keys it sees in the whole sequence; check_and_time compares those rows."""
    monkeypatch.setattr(M, "SAMPLE_EDGE_ROWS", 4)
    k_lens = (30, 5, 12) if suite == "chunk" else ()
    p = P.make_problem(P.Shape(suite, 2, (16, 3, 9), k_lens), CPU, torch.bfloat16, seed=0)
    full_out, full_lse = M.reference_outputs(p, sample=False)
    out, lse, rows = M.reference_outputs(p, sample=True)
    assert rows.tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 24, 25, 26, 27]  # not 23
    torch.testing.assert_close(out, full_out[rows], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, full_lse[:, rows], rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(M, "SAMPLED_CHECK_ROWS", 10)
    sampled = M.reference_outputs(p)
    assert len(sampled) == 3 and torch.equal(sampled[2], rows)
    # check_and_time compares the sampled rows: right where the op is right, WRONG where a sampled row is off.
    assert M.check_and_time(M.ReferenceRaw(), p, sampled, timed=False).status == "ok"
    p.v[p.k_lens[0] + p.k_lens[1] :] += 1.0  # the last sequence's values: its rows, sampled, change
    assert M.check_and_time(M.ReferenceRaw(), p, sampled, timed=False).status == "WRONG"


def test_compare_flags_wrong_masks_and_lse_conventions():
    from mla_ops.backends.reference import attention_reference

    p = P.make_problem(P.Shape("causal", 2, (16, 40, 9)), CPU, torch.bfloat16, seed=0)
    ref_out, ref_lse = M.reference_outputs(p)
    out, lse = attention_reference(p.q, p.k, p.v, p.cu_q, p.cu_k, p.scale, causal=True)
    tol = M.OUT_TOL_EPS * torch.finfo(torch.bfloat16).eps
    rel, lse_err = M.compare(out, lse, ref_out, ref_lse)
    assert rel <= tol and lse_err <= M.LSE_TOL
    wrong, wrong_lse = attention_reference(p.q, p.k, p.v, p.cu_q, p.cu_k, p.scale, causal=False)
    rel, lse_err = M.compare(wrong, wrong_lse, ref_out, ref_lse)
    assert rel > tol and lse_err > M.LSE_TOL
    _, lse_err = M.compare(out, lse / math.log(2), ref_out, ref_lse)  # base-2 LSE
    assert lse_err > M.LSE_TOL
    _, lse_err = M.compare(out, lse.t().reshape(lse.shape), ref_out, ref_lse)  # [T, H] data in an [H, T] shape
    assert lse_err > M.LSE_TOL
    nan_out = out.clone()
    nan_out[3, 1, 5] = float("nan")
    assert M.compare(nan_out, None, ref_out, ref_lse)[0] == math.inf
    # Rows past the batch's tokens are padding: not compared when told where the batch ends.
    padded = torch.cat([out, torch.full_like(out[:2], 7.0)])
    ref_padded = (torch.cat([ref_out, ref_out[:2] * 0]), torch.cat([ref_lse, ref_lse[:, :2]], dim=1))
    assert M.compare(padded, None, *ref_padded, rows=out.shape[0])[0] <= tol
    assert M.compare(padded, None, *ref_padded)[0] > tol


def test_check_and_time_marks_wrong_and_failed_methods():
    p = P.make_problem(P.Shape("causal", 2, (8, 5)), CPU, torch.bfloat16)
    reference = M.reference_outputs(p)

    class Broken(M.Method):
        name = "broken"

        def prepare(self, p):
            def fail():
                raise RuntimeError("no kernel image\nsecond line")

            return M.Prepared(fail, lambda r: r)

    class Noncausal(M.ReferenceRaw):
        def prepare(self, p):
            args = p.attention_args()
            return M.Prepared(lambda: self.call(*args, False), lambda r: (r[0], r[1]))

    good = M.check_and_time(M.ReferenceRaw(), p, reference, samples=2)
    assert good.status == "ok" and good.time_ms > 0 and good.prepared is not None
    wrong = M.check_and_time(Noncausal(), p, reference, samples=2)
    assert wrong.status == "WRONG" and wrong.time_ms > 0 and wrong.lse_err > M.LSE_TOL
    failed = M.check_and_time(Broken(), p, reference)
    assert failed.status == "error" and failed.note == "RuntimeError: no kernel image" and failed.time_ms is None
    unchecked = M.check_and_time(M.ReferenceRaw(), p, reference, timed=False)
    assert unchecked.status == "ok" and unchecked.time_ms is None


def test_best_baseline_ignores_wrong_and_failed_rows():
    rows = [
        {"method": "FLASHINFER", "kind": "op", "status": "ok", "time_ms": 1.02},
        {"method": "TRITON", "kind": "op", "status": "WRONG", "time_ms": 0.5},
        {"method": "triton_raw", "kind": "direct", "status": "ok", "time_ms": 0.4},
        {"method": "flashinfer_raw", "kind": "baseline", "status": "ok", "time_ms": 1.0},
        {"method": "sdpa_efficient", "kind": "baseline", "status": "ok", "time_ms": 3.0},
        {"method": "flex_attention", "kind": "baseline", "status": "WRONG", "time_ms": 0.1},
        {"method": "fa4_raw", "kind": "baseline", "status": "error", "time_ms": None},
    ]
    R.add_best_baseline(rows)
    by = {r["method"]: r for r in rows}
    assert {r["best_baseline"] for r in rows} == {"flashinfer_raw"}  # direct calls are not baselines
    assert by["FLASHINFER"]["ratio_best"] == pytest.approx(1.0 / 1.02)
    assert by["sdpa_efficient"]["ratio_best"] == pytest.approx(1.0 / 3.0)
    assert "ratio_best" not in by["TRITON"] and "ratio_best" not in by["fa4_raw"]


def _stand_in_flash_attn_backend(**libraries):
    from mla_ops.backends.flash_attn import FlashAttnBackend

    return FlashAttnBackend(libraries=libraries)


def test_flash_attn_raw_call_follows_the_implementation_flash_attn_runs():
    fa4 = types.SimpleNamespace(flash_attn_varlen_func=lambda *a, **k: None)
    bundled = torch.ops.aten._flash_attention_forward.default
    with_fa4 = _stand_in_flash_attn_backend(
        **{"flash_attn.cute": fa4, "torch.ops.aten._flash_attention_forward": bundled}
    )
    without = _stand_in_flash_attn_backend(**{"torch.ops.aten._flash_attention_forward": bundled})
    assert M.raw_method_for("FLASH_ATTN", with_fa4, CPU, "fa3").name == "fa4_raw"
    assert M.raw_method_for("FLASH_ATTN", without, CPU, "fa3").name == "fa2_varlen_raw"
    assert M.raw_method_for("FLASHINFER", None, CPU, "fa3").implementation.endswith("(backend='fa3').run")
    assert M.raw_method_for("TRITON", None, CPU, "fa3").name == "triton_raw"
    assert M.raw_method_for("REFERENCE", None, CPU, "fa3").name == "reference_raw"
    assert "CUDA devices only" in M.FlashAttnRaw("flash_attn.cute").unavailable(CPU)


def test_fa4_raw_calls_flash_attn_varlen_func_with_mla_s_tensors():
    p = P.make_problem(P.Shape("chunk", 2, (3, 5), (4, 6)), CPU, torch.bfloat16)
    calls = []

    def flash_attn_varlen_func(q, k, v, **kwargs):
        calls.append((q, k, v, kwargs))
        return torch.zeros(q.shape[0], q.shape[1], v.shape[-1]), torch.zeros(q.shape[1], q.shape[0])

    raw = M.FlashAttnRaw("flash_attn.cute")
    raw._function = flash_attn_varlen_func
    prepared = raw.prepare(p)
    out, lse = prepared.extract(prepared.fn())
    ((q, k, v, kwargs),) = calls
    assert q is p.q and k is p.k and v is p.v  # the strided view, as the op gets it
    assert kwargs == {"cu_seqlens_q": p.cu_q, "cu_seqlens_k": p.cu_k, "max_seqlen_q": 5, "max_seqlen_k": 6,
                      "softmax_scale": p.scale, "causal": False, "return_lse": True}  # fmt: skip
    assert out.shape == (8, 2, 128) and lse is None


def test_fa2_raw_widens_v_as_flash_attn_does():
    p = P.make_problem(P.Shape("causal", 2, (3, 5)), CPU, torch.bfloat16)
    raw = M.FlashAttnRaw("torch.ops.aten._flash_attention_forward")
    v, first = raw.widen(p.v)
    # A wider window over v's own storage (the k_nope channels before it): no copy.
    assert v.shape == (8, 2, 192) and first == 64 and v.data_ptr() == p.v.data_ptr() - 64 * 2
    assert torch.equal(v[..., first:], p.v)


def test_raw_layer_attention_matches_prefill_with_context():
    import mla_ops
    from mla_ops.api import ContextChunk

    p = P.make_problem(P.Shape("causal", 2, (5, 3)), CPU, torch.bfloat16)
    chunk = P.make_problem(P.Shape("chunk", 2, (5, 3), (4, 0)), CPU, torch.bfloat16, seed=1)
    chunks = [ContextChunk(chunk.k, chunk.v, chunk.cu_k, chunk.max_k)]
    attention = M.RawLayerAttention(M.ReferenceRaw(), CPU)
    attention.plan(p.cu_q, [chunk.cu_k], 2, torch.bfloat16, p.scale)
    got = attention(p.q, p.k, p.v, p.cu_q, p.max_q, chunks, p.scale)
    want = mla_ops.prefill_with_context(p.q, p.k, p.v, p.cu_q, p.max_q, chunks, p.scale)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _fake_flashinfer(plans: list) -> types.ModuleType:
    """A stand-in for ``flashinfer``: a ragged wrapper computing with the reference, with FlashInfer's
    conventions (base-2 LSE ``[T, H]``), and ``merge_state`` on base-2 LSEs."""
    from mla_ops.backends.base import MergeCall
    from mla_ops.backends.reference import attention_reference, merge_attn_states_reference

    class Wrapper:
        def __init__(self, workspace, layout, backend):
            assert layout == "NHD"
            self.backend = backend

        def plan(self, cu_q, cu_k, heads_q, heads_kv, dqk, head_dim_vo, causal, sm_scale, q_data_type, kv_data_type):
            plans.append((cu_q.tolist(), cu_k.tolist(), causal))
            self.cu_q, self.cu_k, self.causal, self.scale = cu_q, cu_k, causal, sm_scale

        def run(self, q, k, v, return_lse):
            out, lse = attention_reference(q, k, v, self.cu_q, self.cu_k, self.scale, self.causal)
            return out, (lse / math.log(2)).t().contiguous()

    def merge_state(v_a, s_a, v_b, s_b):
        out, lse = merge_attn_states_reference(MergeCall(v_a, s_a.t() * math.log(2), v_b, s_b.t() * math.log(2)))
        return out, (lse / math.log(2)).t()

    return types.SimpleNamespace(BatchPrefillWithRaggedKVCacheWrapper=Wrapper, merge_state=merge_state)


def test_raw_layer_attention_with_flashinfer_plans_once_per_batch(monkeypatch):
    import mla_ops
    from mla_ops.api import ContextChunk

    plans: list = []
    monkeypatch.setitem(sys.modules, "flashinfer", _fake_flashinfer(plans))
    p = P.make_problem(P.Shape("causal", 2, (5, 3)), CPU, torch.bfloat16)
    chunk = P.make_problem(P.Shape("chunk", 2, (5, 3), (4, 0)), CPU, torch.bfloat16, seed=1)
    chunks = [ContextChunk(chunk.k, chunk.v, chunk.cu_k, chunk.max_k)]
    attention = M.RawLayerAttention(M.FlashInferRaw("fa3"), CPU)
    attention.plan(p.cu_q, [chunk.cu_k], 2, torch.bfloat16, p.scale)
    assert plans == [([0, 5, 8], [0, 5, 8], True), ([0, 5, 8], [0, 4, 4], False)]
    for _ in range(3):  # every layer of a model: the two plans serve them all
        out, _ = attention(p.q, p.k, p.v, p.cu_q, p.max_q, chunks, p.scale)
    assert len(plans) == 2
    want, _ = mla_ops.prefill_with_context(p.q, p.k, p.v, p.cu_q, p.max_q, chunks, p.scale)
    assert M.relative_difference(out, want) < 1e-2


def test_graph_tree_mode_follows_host_planning():
    from mla_ops.backends.flashinfer import FlashInferBackend
    from mla_ops.backends.triton import TritonBackend

    assert BGT.graph_tree_mode({"backend": FlashInferBackend()}) == "reduce-overhead, automatic"
    assert BGT.graph_tree_mode({"backend": TritonBackend()}) == "reduce-overhead"


@pytest.mark.parametrize(
    ("capability", "flash_attn", "want"),
    [
        ((9, 0), ("flash_attn.cute",), "FLASH_ATTN"),
        ((9, 0), ("torch.ops.aten._flash_attention_forward",), "TRITON"),
        ((8, 0), ("flash_attn",), None),
    ],
    ids=["sm90-flash-attention-4", "sm90-flash-attention-2", "sm80-flash-attention-2"],
)
def test_graph_tree_rows_name_the_backend_inside_the_graphs(capability, flash_attn, want):
    # FLASHINFER's row is automatic selection, measured where it is the automatic choice; the others are
    # forced. ``want``: what runs inside the graphs in FLASHINFER's row (None: not measured).
    pytest.importorskip("triton", reason="TRITON is a candidate inside the graphs")
    import standins

    import mla_ops
    from mla_ops.backends.flash_attn import FlashAttnBackend
    from mla_ops.backends.flashinfer import FlashInferBackend
    from mla_ops.selector import backend_installed

    cap = mla_ops.DeviceCapability(*capability)
    config = mla_ops.SelectorConfig(torch.bfloat16, mla_ops.MLADimensions.from_head_dims(P.DQK, P.DV))
    flashinfer = FlashInferBackend(library=standins.flashinfer_module(), workspace_bytes=1 << 20, capability=cap)
    libraries = standins.flash_attn_libraries(*flash_attn)
    with backend_installed(flashinfer), backend_installed(FlashAttnBackend(libraries=libraries)) as fa:
        assert BGT.in_graph_choice({"name": "FLASH_ATTN", "backend": fa}, cap, config) == ("FLASH_ATTN", None)
        inside, why_not = BGT.in_graph_choice({"name": "FLASHINFER", "backend": flashinfer}, cap, config)
        if want is None:  # SM80 ranks FLASH_ATTN first: FLASHINFER is not what automatic selection gives
            assert inside is None
            assert why_not.startswith("reduce-overhead, automatic: automatic selection picks FLASH_ATTN here")
        else:
            assert (inside, why_not) == (want, None)
        with mla_ops.prefill_backend("FLASHINFER"):  # forced, FLASHINFER is refused inside the graphs
            inside, why_not = BGT.in_graph_choice({"name": "FLASHINFER", "backend": flashinfer}, cap, config)
        assert inside is None and "cannot run inside CUDA-graph trees" in why_not


def test_backends_to_time_on_cpu():
    rows = R.backend_table(CPU, torch.bfloat16, P.DQK, P.DV)
    timed, skipped = M.backends_to_time(rows, CPU)
    assert [r["name"] for r in timed] == ["REFERENCE"]
    assert set(skipped) == {"TRITON", "FLASH_ATTN", "FLASHINFER"}
    with pytest.raises(SystemExit, match=r"unknown backend.*choose from REFERENCE"):
        M.backends_to_time(rows, CPU, ["fast"])


# --- report ---------------------------------------------------------------------------------------------


def test_report_marks_wrong_and_failed_methods(tmp_path):
    rows = []
    for shape in P.gpu_shapes()[:2]:
        shape_rows = []
        for method, kind, raw, status, ms in (
            ("FLASHINFER", "op", "flashinfer_raw", "WRONG", 1.0),
            ("flashinfer_raw", "baseline", None, "ok", 1.1),
            ("flex_attention", "baseline", None, "error", None),
        ):
            row = {
                "suite": shape.suite,
                "shape": shape.id,
                "label": shape.label,
                "heads": shape.heads,
                "series": shape.series,
                "x": shape.x,
                "method": method,
                "kind": kind,
                "raw_method": raw,
                "status": status,
                "time_ms": ms,
                "note": "RuntimeError: no kernel" if ms is None else "",
            }
            if ms is not None:
                row["tflops"], row["rel_err"] = shape.flops() / ms / 1e9, 0.5 if status == "WRONG" else 0.004
            shape_rows.append(row)
        R.add_best_baseline(shape_rows)
        rows += shape_rows
    notes = R.write_prefill_report(rows, {"gpu": "test GPU", "dtype": "bfloat16"}, tmp_path)
    md = (tmp_path / "prefill.md").read_text()
    assert md.count("WRONG (") == 2 and md.count("| error |\n") == 2  # flex_attention is the last column
    assert "| FLASHINFER | 5.0e-01 | — | 0 | 2 | 0 |" in md
    assert "| flex_attention | — | — | 0 | 0 | 2 | RuntimeError: no kernel |" in md
    assert "FLASHINFER / flashinfer_raw" in md and "best raw baseline" in md
    assert (tmp_path / "prefill.png").exists() == HAS_MATPLOTLIB and len(notes) == (0 if HAS_MATPLOTLIB else 1)


def test_a_stale_launch_error_is_consumed_once(monkeypatch):
    # A library's failed launch leaves CUDA's last error set; the next launch raises it. One is absorbed,
    # a second failure is real and propagates.
    real_zeros, errors = torch.zeros, ["CUDA error: invalid argument"]

    def zeros(*args, **kwargs):
        if errors:
            raise RuntimeError(errors.pop(0))
        return real_zeros(*args, **{**kwargs, "device": "cpu"})

    monkeypatch.setattr(torch, "zeros", zeros)
    M.clear_launch_error(torch.device("cuda", 0))
    errors[:] = ["CUDA error: invalid argument", "CUDA error: an illegal memory access was encountered"]
    with pytest.raises(RuntimeError, match="illegal memory access"):
        M.clear_launch_error(torch.device("cuda", 0))


_PTXAS_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_attn_fwd_kernel' for 'sm_90a'
ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma \
instructions defining accumulator registers of a wgmma between start and end of the pipeline stage in the function \
'_attn_fwd_kernel'
ptxas info    : Function properties for _attn_fwd_kernel
    0 bytes stack frame, 16 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 168 bytes cmem[0]
"""


def test_compile_sm90_reads_registers_spills_and_serialised_wgmma_from_ptxas():
    assert CS.parse_ptxas_log(_PTXAS_LOG) == (255, 28, "C7515")
    clean = _PTXAS_LOG.replace("16 bytes spill stores, 12 bytes spill", "0 bytes spill stores, 0 bytes spill")
    clean = "\n".join(line for line in clean.splitlines() if "C7515" not in line)
    assert CS.parse_ptxas_log(clean) == (255, 0, None)
    variant = CS.Variant("128,64,8,3", causal=False, registers=255, spill_bytes=0, serialized="C7515")
    assert variant.problems(wants_ws=False) == ["wgmma serialised (C7515)"]
    variant = CS.Variant("128,64,8,3", causal=False, registers=255, spill_bytes=0, scratch_bytes=0, native=False)
    assert variant.problems(wants_ws=False) == ["its parameters are not those a native launch passes"]
    variant.scratch_bytes = 640  # a kernel with scratch is never launched natively: nothing to require
    assert variant.problems(wants_ws=False) == []


def test_compile_sm90_flags_triton_barriers_on_the_handoffs_ids():
    ptx = "bar.sync \t0, 128;\nbarrier.sync \t1;\nbar.arrive 12, 160; mov.b32 $0, $1;\nbar.sync 15, 160;\n"
    assert CS.other_barriers(ptx) == (0, 1)
    assert CS.other_barriers(ptx + "bar.sync \t14, 128;\n") == (0, 1, 14)  # one of the hand-off's ids, Triton's count
    variant = CS.Variant("128,128,4,2,ovl,gluon,pers", causal=True, other_barriers=(0, 1, 2))
    assert variant.problems(wants_ws=False) == []
    variant.other_barriers = (0, 1, 14)
    assert variant.problems(wants_ws=False) == [
        "Triton's own named barriers [14] are the work-item hand-off's (attention_sm90._ITEM_*)"
    ]
    # The fp8 variant's ring and turn barriers take their ids from registers: only Triton's numbers are parsed.
    assert CS.other_barriers(ptx + "bar.arrive %r12, 288;\nbar.sync %r7, 256;\n") == (0, 1)
    variant.other_barriers = (0, 5, 9)
    fp8_ids = "Triton's own named barriers [5, 9] are the fp8 kernel's (_RING_FREE, _TURN)"
    assert variant.problems(wants_ws=False) == [fp8_ids]


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="needs triton and its interpreter (TRITON_INTERPRET=1, set by conftest when CUDA is absent)",
)
def test_triton_raw_fp8_runs_the_kernel_on_quantised_inputs():
    """tune_triton.py --dtype float8_e4m3fn checks each candidate through TritonRaw(config, fp8=True): the fp8
    kernel on the problem's inputs quantised per head, held to the fp8 rows' tolerances."""
    from mla_ops.kernels.configs import AttentionConfig

    problem = P.make_problem(P.Shape("chunk", 2, (5, 0, 17), (9, 3, 0)), torch.device("cpu"), torch.bfloat16)
    method = M.TritonRaw(AttentionConfig(16, 32, 4, 2), fp8=True)
    assert method.name == "triton_raw fp8[16,32,4,2]" and method.tolerance == (M.FP8_OUT_TOL, M.FP8_LSE_TOL)
    checked = M.check_and_time(method, problem, M.reference_outputs(problem), timed=False)
    assert checked.status == "ok", checked
    assert 0 < checked.rel_err <= M.FP8_OUT_TOL and checked.lse_err <= M.FP8_LSE_TOL


def test_routing_table_names_the_table_that_routes_auto(monkeypatch) -> None:
    """A GPU run records which cost table routed its auto rows, with the GPU and date it was measured on."""
    import mla_ops
    from mla_ops import cost_table

    data = {"schema": 1, "gpu": "NVIDIA H100 80GB HBM3", "capability": "9.0", "versions": {}, "command": "tune",
            "created": "2026-12-06T06:00:00Z", "host_us": {"TRITON": 10.0}, "entries": []}  # fmt: skip
    table = cost_table.parse(data)
    seen = []

    def fake_source(capability):
        seen.append(capability)
        return table, "tuned: /cache/sm90.json"

    monkeypatch.setattr(cost_table, "table_source", fake_source)
    monkeypatch.setattr(mla_ops.DeviceCapability, "of", classmethod(lambda cls, device: cls(9, 0)))
    got = R.routing_table(torch.device("cuda"))
    assert got == "tuned: /cache/sm90.json (measured on NVIDIA H100 80GB HBM3, 2026-12-06T06:00:00Z)"
    assert seen == [mla_ops.DeviceCapability(9, 0)]
    undated = cost_table.parse({**data, "created": ""})
    monkeypatch.setattr(cost_table, "table_source", lambda capability: (undated, "committed: sm90.json"))
    assert R.routing_table(torch.device("cuda")) == "committed: sm90.json (measured on NVIDIA H100 80GB HBM3, undated)"
    monkeypatch.setattr(cost_table, "table_source", lambda capability: (None, "none: fixed order"))
    assert R.routing_table(torch.device("cuda")) == "none: fixed order"
