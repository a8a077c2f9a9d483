"""``python -m mla_ops tune`` on CPU: the measuring loop end to end against stand-in backends and a stand-in GPU's
timer (tests/standins.py), the table it writes, the selector's use of it, its progress output and its errors."""

from __future__ import annotations

import argparse
import io
import json

import pytest
import standins
import torch

from mla_ops import DeviceCapability, MLADimensions, SelectorConfig, cost_table
from mla_ops import selector as sel
from mla_ops.__main__ import main as cli_main
from mla_ops.cli import tune

SM90 = DeviceCapability(9, 0)
CONFIG = SelectorConfig(torch.bfloat16, MLADimensions(128, 64, 128))


class StandinTimer:
    """The stand-in GPU's timer: the backend measured is the override in force (tune measures through the op); the
    times are tests/standins.py's model of the call's size class. With ``run``, it calls ``fn`` once (on CPU the
    op runs REFERENCE, whatever the override)."""

    def __init__(self, run: bool = False) -> None:
        self.run = run
        self.measured: list[tuple[str, float]] = []

    def __call__(self, fn, rep_ms: float, shape: tune.TuneShape) -> tuple[float, float]:
        if self.run:
            out, _ = fn()
            assert torch.isfinite(out).all()
        name = sel.current_override().name
        self.measured.append((name, rep_ms))
        return standins.STANDIN_HOST_US[name], standins.standin_device_us(name, shape.size_class())


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    tune.add_arguments(parser)
    return parser.parse_args(list(argv))


def _machine(timer) -> tune.Machine:
    return tune.Machine(torch.device("cpu"), SM90, "Stand-in GPU", timer)


@pytest.fixture
def user_tables(tmp_path):
    cost_table.LOCATIONS.user_dir = tmp_path / "tables"
    sel.clear_cache()
    yield tmp_path / "tables"
    sel.clear_cache()


@pytest.fixture
def sizing_timer():
    return StandinTimer()


@pytest.mark.usefixtures("all_installed")
def test_tune_writes_the_table_that_the_selector_then_uses(user_tables, sizing_timer, capsys) -> None:
    # Two heads keep the inputs small: the stand-in timer does not run the calls.
    assert tune.main(_args("--quick", "--heads", "2", "--rep-ms", "2"), machine=_machine(sizing_timer)) == 0
    path = user_tables / "sm90.json"
    data = json.loads(path.read_text())
    assert data["gpu"] == "Stand-in GPU" and data["capability"] == "9.0" and data["schema"] == cost_table.SCHEMA
    assert data["versions"] == cost_table.library_versions()
    assert data["command"].startswith("python -m mla_ops tune")
    assert data["host_us"] == standins.STANDIN_HOST_US
    shapes = tune.default_shapes([2], quick=True)
    assert len(data["entries"]) == len(shapes)
    assert all(entry["host_us"] == standins.STANDIN_HOST_US for entry in data["entries"])  # each class's own
    assert {name for name, _ in sizing_timer.measured} == {"FLASHINFER", "FLASH_ATTN", "TRITON"}
    # Every backend in each of the rounds (more for a near-tie), each round the asked-for milliseconds of calls.
    counts = {name: sum(1 for n, _ in sizing_timer.measured if n == name) for name in standins.STANDIN_HOST_US}
    assert len(set(counts.values())) == 1 and counts["TRITON"] >= tune.DEFAULT_ROUNDS * len(shapes)
    assert {ms for _, ms in sizing_timer.measured} == {2.0}
    out = capsys.readouterr()
    assert f"wrote {path}" in out.out
    assert "about" in out.err and f"{3 * len(shapes)}/{3 * len(shapes)}" in out.err and "[####" in out.err
    # The selector reads it: each measured class routes to the stand-in GPU's fastest backend.
    assert cost_table.table_source(SM90)[1] == f"tuned: {path}"
    for shape in shapes:
        size = shape.size_class()
        fastest = min(
            standins.STANDIN_HOST_US, key=lambda b: standins.STANDIN_HOST_US[b] + standins.standin_device_us(b, size)
        )
        assert sel.select_backend(SM90, CONFIG, size=size).name == fastest
    assert {sel.select_backend(SM90, CONFIG, size=s.size_class()).name for s in shapes} >= {"TRITON", "FLASHINFER"}


@pytest.mark.usefixtures("all_installed")
def test_tune_measures_through_the_op_and_writes_where_asked(tmp_path, sizing_timer) -> None:
    sizing_timer.run = True
    output = tmp_path / "here.json"
    progress = io.StringIO()
    shapes = [tune.TuneShape(True, 2, (5, 0, 9)), tune.TuneShape(False, 2, (3, 4), (0, 7))]
    table = tune.measure(_machine(sizing_timer), shapes, [CONFIG], [sel.B.TRITON], 1.0, "cmd", progress)
    cost_table.write(table, output)
    assert set(cost_table.load(output).device_us[("bfloat16", 192, 128)]) == {s.size_class() for s in shapes}
    assert progress.getvalue().count("\n") >= 3  # the plan, then a line per tenth where the stream is no terminal


class ScriptedTimer:
    """A timer that returns, for the backend under override, the next of its scripted ``(host_us, device_us)``
    rounds (the last one again once they run out), and logs the order in which backends were timed."""

    def __init__(self, script: dict[str, list[tuple[float, float]]]) -> None:
        self.script = {name: list(rounds) for name, rounds in script.items()}
        self.order: list[str] = []

    def __call__(self, fn, rep_ms: float, shape: tune.TuneShape) -> tuple[float, float]:
        name = sel.current_override().name
        self.order.append(name)
        rounds = self.script[name]
        return rounds.pop(0) if len(rounds) > 1 else rounds[0]


MEMBERS = [sel.B.FLASHINFER, sel.B.FLASH_ATTN, sel.B.TRITON]
SHAPE = tune.TuneShape(True, 2, (4,))


def test_backends_are_timed_in_interleaved_rounds_in_alternating_order() -> None:
    timer = ScriptedTimer({"FLASHINFER": [(5.0, 100.0)], "FLASH_ATTN": [(5.0, 200.0)], "TRITON": [(5.0, 300.0)]})
    samples = tune.measure_shape(_machine(timer), lambda: None, SHAPE, MEMBERS, 1.0, rounds=3)
    forward, backward = ["FLASHINFER", "FLASH_ATTN", "TRITON"], ["TRITON", "FLASH_ATTN", "FLASHINFER"]
    assert timer.order == forward + backward + forward  # no near-tie: the 3 rounds asked for
    assert samples["FLASH_ATTN"] == [(5.0, 200.0)] * 3


def test_a_near_tie_gets_more_rounds_and_an_outlier_round_does_not_decide() -> None:
    # FLASH_ATTN is 2 % faster than FLASHINFER, except in one round disturbed by something else on the GPU.
    timer = ScriptedTimer({
        "FLASHINFER": [(5.0, 100.0)],
        "FLASH_ATTN": [(5.0, 98.0), (5.0, 160.0), (5.0, 98.0)],
        "TRITON": [(5.0, 300.0)],
    })  # fmt: skip
    samples = tune.measure_shape(_machine(timer), lambda: None, SHAPE, MEMBERS, 1.0, rounds=3)
    assert tune.near_tie(samples)
    assert {len(rounds) for rounds in samples.values()} == {7}  # 2 * 3 + 1: the most a near-tie gets
    best = min(samples, key=lambda name: tune._predicted(samples[name]))
    assert best == "FLASH_ATTN"  # the median drops the disturbed round
    # Apart by more than NEAR_TIE: no extra rounds.
    timer = ScriptedTimer({"FLASHINFER": [(5.0, 100.0)], "FLASH_ATTN": [(5.0, 90.0)], "TRITON": [(5.0, 300.0)]})
    assert {len(r) for r in tune.measure_shape(_machine(timer), lambda: None, SHAPE, MEMBERS, 1.0, 3).values()} == {3}
    # Host-bound: the prediction is the host time, so equal device times far below it are no near-tie.
    timer = ScriptedTimer({"FLASHINFER": [(50.0, 10.0)], "FLASH_ATTN": [(100.0, 10.0)], "TRITON": [(15.0, 10.0)]})
    assert not tune.near_tie(tune.measure_shape(_machine(timer), lambda: None, SHAPE, MEMBERS, 1.0, 1))


def test_the_default_grid_has_one_shape_per_size_class() -> None:
    for quick in (False, True):
        shapes = tune.default_shapes([16, 128], quick)
        classes = [s.size_class() for s in shapes]
        assert len(set(classes)) == len(classes)
        assert {s.causal for s in shapes} == {True, False}
    full = tune.default_shapes([16, 128])
    assert {s.heads for s in full} == {16, 128} and len(full) > 30
    assert tune.TuneShape(False, 16, (512, 512), (4096, 4096)).label() == "H16 2x512 over 2x4096"


def test_backends_that_are_not_valid_are_left_out_with_why(sizing_timer) -> None:
    # No stand-ins installed: FLASHINFER and FLASH_ATTN have no library here.
    progress = io.StringIO()
    members = [sel.B.FLASHINFER, sel.B.FLASH_ATTN]
    with pytest.raises(ValueError, match="no backend is valid here"):
        tune.measure(_machine(sizing_timer), [tune.TuneShape(True, 2, (4,))], [CONFIG], members, 1.0, "", progress)
    assert "tune: FLASHINFER bfloat16 (128, 64, 128): not measured (flashinfer is not installed" in progress.getvalue()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a machine without a CUDA device")
def test_tune_without_a_gpu_is_one_line(capsys) -> None:
    assert cli_main(["tune", "--quick"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "python -m mla_ops tune: error: tune measures CUDA devices, and no CUDA device is visible; run it on the GPU "
        "to tune\n"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--heads", "0"], "--heads must be at least 1, got 0"),
        (["--rep-ms", "-1"], "--rep-ms must be a positive number of milliseconds, got -1.0"),
        (["--rounds", "0"], "--rounds must be at least 1, got 0"),
        (["--dims", "1,x,2"], "--dims must be three integers"),
        (["--output", "."], "--output .: is a directory"),
    ],
)
def test_bad_options_are_one_line(capsys, argv, message) -> None:
    assert cli_main(["tune", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_ctrl_c_during_tune_is_one_line_and_status_130(monkeypatch, capsys) -> None:
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(tune, "main", interrupted)  # what the parser binds to the command
    assert cli_main(["tune"]) == 130
    assert capsys.readouterr().err.strip() == "python -m mla_ops tune: interrupted"


def test_the_grid_measures_every_class_that_bench_prefill_times() -> None:
    """Each attention shape of bench_prefill.py's GPU set falls in a class the default grid measures, so the table
    predicts it from its own class, not from a neighbour's scaled times; only the 131072-token causal prompt (a
    second per call and backend) is left to the nearest class, 32768 tokens."""
    from benchlib import problems

    grid = {shape.size_class() for shape in tune.default_shapes((16, 128))}
    missing = []
    for shape in problems.gpu_shapes():
        if shape.suite == "merge":
            continue
        size = tune.TuneShape(shape.suite == "causal", shape.heads, shape.q_lens, shape.k_lens).size_class()
        if size not in grid:
            missing.append(shape.id)
    assert missing == ["causal-h128-1x131072"]


def test_tune_times_the_values_laid_out_as_the_layer_and_the_benchmark_make_them(monkeypatch) -> None:
    """The values tune times are the last Dv channels of kv_b_proj's [Tk, H, qk_nope_head_dim + Dv] output, as
    mla_ops.model's layer makes them and bench_prefill.py times them: the kernels load value rows with that stride,
    so a stride no model makes would time another speed than the benchmark's."""
    from benchlib import problems

    seen = {}

    def prefill_context_chunk(q, k, v, *args):
        seen.update(q=q, k=k, v=v)

    monkeypatch.setattr(torch.ops.mla, "prefill_context_chunk", prefill_context_chunk)
    shape = tune.TuneShape(False, 2, (3, 5), (7, 9))
    tune._inputs(shape, CONFIG, torch.device("cpu"))()
    q, k, v = seen["q"], seen["k"], seen["v"]
    assert q.shape == (8, 2, 192) and k.shape == (16, 2, 192) and v.shape == (16, 2, 128)
    width = problems.KV_NOPE + problems.DV
    assert width == 256 and v.stride() == (2 * width, width, 1)
    assert v.storage_offset() == problems.KV_NOPE
