"""The benchmark scripts: ``--help``, a tiny CPU run of each, the report files, and their arithmetic.

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
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = ["bench_prefill.py", "bench_dispatch.py"]
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None

sys.path.insert(0, str(BENCH_DIR))
import bench_dispatch as BD  # noqa: E402
import bench_prefill as BP  # noqa: E402


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
    assert "--out" in proc.stdout


def _main(module, argv: list[str]) -> str:
    """Run a script's ``main`` in this process (no second torch import); returns what it printed."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert module.main(argv) == 0
    return buffer.getvalue()


@pytest.fixture(scope="module")
def prefill_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_prefill")
    printed = _main(BP, ["--device", "cpu", "--out", str(out), "--rep-ms", "1", "--warmup-ms", "0.5"])
    return out, printed


def test_cpu_run_writes_csv(prefill_run):
    out, _ = prefill_run
    rows = _read_rows(out / "results.csv")
    assert set(BP.CSV_FIELDS) == set(rows[0])
    shapes = {s.id for s in BP.cpu_shapes()}
    assert {r["shape"] for r in rows} == shapes
    ops = [r for r in rows if r["method"] == "REFERENCE"]
    assert {r["suite"] for r in ops} == {"causal", "chunk"}
    tol = BP.OUT_TOL_EPS * torch.finfo(torch.bfloat16).eps
    for r in rows:
        assert r["status"] == "ok", r
        assert float(r["time_ms"]) > 0
        assert float(r["rel_err"]) <= tol
        rate = r["gbps"] if r["suite"] == "merge" else r["tflops"]
        assert float(rate) > 0
    # The reference checked against itself: its LSE must agree exactly with the ground truth.
    assert all(float(r["lse_err"]) == 0.0 for r in ops)
    assert all(r["best_baseline"] == "sdpa_cpu" and float(r["ratio_best"]) > 0 for r in ops)


def test_cpu_run_writes_markdown_and_env(prefill_run):
    out, printed = prefill_run
    md = (out / "results.md").read_text()
    env = json.loads((out / "results.env.json").read_text())
    for key in (
        "gpu",
        "sm_clock_mhz",
        "mem_clock_mhz",
        "date",
        "torch",
        "cuda",
        "triton",
        "flashinfer",
        "flash_attn",
        "mla_ops",
        "backends",
    ):
        assert key in env, key
        assert f"**{key}**" in md or key == "backends"
    assert env["torch"] == torch.__version__
    assert env["backends"]["REFERENCE"]["valid"] and env["backends"]["REFERENCE"]["implementation"]
    assert "| REFERENCE | yes |" in md
    for title in BP.SUITE_TITLES.values():
        assert f"## {title}" in md
    assert "not measured: flashinfer_raw" in printed
    if HAS_MATPLOTLIB:
        png = out / "results.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size < 200_000
        assert "](results.png)" in md
    else:
        assert not (out / "results.png").exists()
        assert "matplotlib is not installed" in md and "matplotlib is not installed" in printed


def test_from_csv_rerenders_the_report(prefill_run, tmp_path):
    out, _ = prefill_run
    _main(BP, ["--from-csv", str(out / "results.csv"), "--out", str(tmp_path)])

    # Without matplotlib the report's "No plot" note names its own folder; everything else must match.
    def normalised(path):
        return path.read_text().replace(str(tmp_path), "OUT").replace(str(out), "OUT")

    assert normalised(tmp_path / "results.md") == normalised(out / "results.md")


def test_runs_without_tqdm_and_matplotlib(tmp_path, monkeypatch):
    # A None entry in sys.modules makes the import fail, as if the package were not installed.
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    printed = _main(BP, ["--device", "cpu", "--quick", "--out", str(tmp_path), "--rep-ms", "1"])
    total = sum(1 for s in BP.select_shapes(BP.cpu_shapes(), [], quick=True) for _ in range(2))
    assert f"[1/{total}]" in printed and f"[{total}/{total}]" in printed
    assert "matplotlib is not installed" in printed
    assert not (tmp_path / "results.png").exists()
    assert (tmp_path / "results.csv").exists() and "No plot:" in (tmp_path / "results.md").read_text()


def test_dispatch_cpu_run(tmp_path):
    _main(BD, ["--device", "cpu", "--out", str(tmp_path), "--iters", "5", "--rounds", "3"])
    rows = {(r["path"], r["backend"]): r for r in _read_rows(tmp_path / "dispatch.csv")}
    for path in ("prefill", "prefill_context_chunk"):
        r = rows[(path, "REFERENCE")]
        assert r["auto_selected"] == "True"
        for key in ("routing_us", "api_us", "op_us", "direct_us", "raw_us"):
            assert float(r[key]) > 0, key
        expected = float(r["op_us"]) - float(r["direct_us"])
        # The CSV keeps 6 significant digits of each figure.
        tol = 1e-5 * (abs(float(r["op_us"])) + abs(float(r["direct_us"])))
        assert math.isclose(float(r["op_minus_direct_us"]), expected, abs_tol=tol)
    assert any(path == "merge_attn_states" for path, _ in rows)
    md = (tmp_path / "dispatch.md").read_text()
    assert "| prefill | REFERENCE | yes |" in md and "**torch**" in md
    assert json.loads((tmp_path / "dispatch.env.json").read_text())["iters"] == 5


# --- arithmetic and checks, in process --------------------------------------------------------------


def test_flops_follow_the_design_formula():
    causal = BP.Shape("causal", 16, (4096,) * 4)
    assert causal.flops() == 2 * 16 * (192 + 128) * 4 * (4096 * 4097 // 2)
    chunk = BP.Shape("chunk", 128, (256,) * 4, (2048,) * 4)
    assert chunk.flops() == 2 * 128 * (192 + 128) * 4 * 256 * 2048
    merge = BP.Shape("merge", 16, (16384,))
    rows = 16384 * 16
    assert merge.merge_bytes(2) == 3 * rows * 128 * 2 + 3 * rows * 4


def test_gpu_shape_sets():
    shapes = BP.gpu_shapes()
    ids = {s.id for s in shapes}
    for required in (
        "causal-h16-4x4096",
        "causal-h128-2x8192",
        "causal-h128-512+1024+2048+3000+700",
        "chunk-h16-1x1024-ctx1x32768",
        "chunk-h128-4x256-ctx4x2048",
        "merge-h128-t16384",
    ):
        assert required in ids
    sweep = [s for s in shapes if s.series == "causal"]
    assert {s.heads for s in sweep} == {16, 128}
    assert {s.x for s in sweep} == {512, 1024, 2048, 4096, 8192, 16384}
    assert all(16384 <= sum(s.q_lens) <= 32768 for s in sweep)
    quick = BP.select_shapes(shapes, [], quick=True)
    assert [s.suite for s in quick].count("causal") == 3
    assert [s.suite for s in quick].count("chunk") == 1
    assert [s.suite for s in quick].count("merge") == 2
    assert [s.id for s in BP.select_shapes(shapes, ["merge"], quick=False)] == ["merge-h16-t16384", "merge-h128-t16384"]
    with pytest.raises(SystemExit, match="matches no shape"):
        BP.select_shapes(shapes, ["nothing-*"], quick=False)


def test_compare_flags_wrong_masks_and_lse_conventions():
    from mla_ops.backends.reference import attention_reference

    p = BP.make_problem(BP.Shape("causal", 2, (16, 40, 9)), torch.device("cpu"), torch.bfloat16, seed=0)
    ref_out, ref_lse = BP.reference_outputs(p)
    t = p.tensors
    out, lse = attention_reference(t["q"], t["k"], t["v"], t["cu_q"], t["cu_k"], p.scale, causal=True)
    tol = BP.OUT_TOL_EPS * torch.finfo(torch.bfloat16).eps
    rel, lse_err = BP.compare(out, lse, ref_out, ref_lse)
    assert rel <= tol and lse_err <= BP.LSE_TOL
    wrong, wrong_lse = attention_reference(t["q"], t["k"], t["v"], t["cu_q"], t["cu_k"], p.scale, causal=False)
    rel, lse_err = BP.compare(wrong, wrong_lse, ref_out, ref_lse)
    assert rel > tol and lse_err > BP.LSE_TOL
    _, lse_err = BP.compare(out, lse / math.log(2), ref_out, ref_lse)  # base-2 LSE
    assert lse_err > BP.LSE_TOL
    _, lse_err = BP.compare(out, lse.t().reshape(lse.shape), ref_out, ref_lse)  # [T, H] data in an [H, T] shape
    assert lse_err > BP.LSE_TOL
    nan_out = out.clone()
    nan_out[3, 1, 5] = float("nan")
    assert BP.compare(nan_out, None, ref_out, ref_lse)[0] == math.inf


def test_ratios_use_the_own_raw_call_and_the_best_baseline():
    rows = [
        {"method": "FLASHINFER", "kind": "op", "status": "ok", "time_ms": 1.02, "raw_method": "flashinfer_raw"},
        {"method": "TRITON", "kind": "op", "status": "WRONG", "time_ms": 0.5, "raw_method": "triton_direct"},
        {"method": "flashinfer_raw", "kind": "baseline", "status": "ok", "time_ms": 1.0, "raw_method": None},
        {"method": "sdpa_efficient", "kind": "baseline", "status": "ok", "time_ms": 3.0, "raw_method": None},
        {"method": "flex_attention", "kind": "baseline", "status": "WRONG", "time_ms": 0.1, "raw_method": None},
    ]
    BP.add_ratios(rows)
    by = {r["method"]: r for r in rows}
    assert by["FLASHINFER"]["ratio_raw"] == pytest.approx(1.0 / 1.02)
    assert by["FLASHINFER"]["best_baseline"] == "flashinfer_raw"  # a WRONG baseline never counts as best
    assert by["sdpa_efficient"]["ratio_best"] == pytest.approx(1.0 / 3.0)
    assert "ratio_raw" not in by["TRITON"] and "ratio_best" not in by["TRITON"]


def test_report_marks_wrong_and_failed_methods(tmp_path):
    rows = []
    for shape in BP.gpu_shapes()[:2]:
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
        BP.add_ratios(shape_rows)
        rows += shape_rows
    notes = BP.write_report(rows, {"gpu": "test GPU", "dtype": "bfloat16"}, tmp_path)
    md = (tmp_path / "results.md").read_text()
    assert md.count("WRONG (") == 2 and md.count("| error |\n") == 2  # flex_attention is the last column
    assert "| FLASHINFER | 5.0e-01 | — | 0 | 2 | 0 |" in md
    assert "| flex_attention | — | — | 0 | 0 | 2 | RuntimeError: no kernel |" in md
    assert "FLASHINFER / flashinfer_raw" in md and "best raw baseline" in md
    assert (tmp_path / "results.png").exists() == HAS_MATPLOTLIB and len(notes) == (0 if HAS_MATPLOTLIB else 1)


def test_append_merges_runs_of_different_shapes(tmp_path):
    common = ["--device", "cpu", "--out", str(tmp_path), "--rep-ms", "1", "--no-progress"]
    _main(BP, [*common, "--shapes", "merge-h2-*"])
    _main(BP, [*common, "--shapes", "causal-h2-4x32", "merge-h2-*", "--append"])
    rows = _read_rows(tmp_path / "results.csv")
    # The merge shape was measured twice: its rows were replaced, not duplicated; the order is the shape list's.
    assert [(r["shape"], r["method"]) for r in rows] == [
        ("causal-h2-4x32", "REFERENCE"),
        ("causal-h2-4x32", "sdpa_cpu"),
        ("merge-h2-t256", "mla.merge_attn_states"),
        ("merge-h2-t256", "torch_eager_merge"),
    ]
    env = json.loads((tmp_path / "results.env.json").read_text())
    assert len(env["appended_to"]) == 1 and "merge-h2-*" in env["appended_to"][0]
    assert env["command"].endswith("--append")
