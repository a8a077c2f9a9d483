"""racecheck's view of Triton's hand-out of a warp-specialised kernel's partitions (``pytest -m gpu``, SM90).

``benchmarks/racecheck_handout.cu`` copies the hand-out in CUDA C++. ``benchmarks/sanitize.py`` explains racecheck's
hazards on the Gluon kernel's hand-out because of what these tests pin down: the program's barriers order its data
(without them the sums come out wrong), and racecheck still reports hazards on the hand-out once the default partition
synchronises its own warps, and none when only a worker does. When a compute-sanitizer release stops reporting them,
the last test fails: then the explanation in ``sanitize.py`` has to go. Design: docs/design/triton-kernels.md (Under
compute-sanitizer).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from sanitize import find_sanitizer

pytestmark = pytest.mark.gpu

SOURCE = Path(__file__).resolve().parent.parent / "benchmarks" / "racecheck_handout.cu"
#: The default partition synchronises its warps (1), partition 0 its own (2), without their barriers (16).
DEFAULT_SYNC, WORKER_SYNC, UNORDERED = 1, 2, 16


def _nvcc() -> str:
    """nvcc from PATH, else from the CUDA toolkit PyTorch builds extensions with."""
    from torch.utils import cpp_extension

    found = shutil.which("nvcc")
    if found is None and cpp_extension.CUDA_HOME and Path(cpp_extension.CUDA_HOME, "bin", "nvcc").exists():
        found = str(Path(cpp_extension.CUDA_HOME, "bin", "nvcc"))
    if found is None:
        pytest.skip("nvcc not found (it ships with the CUDA toolkit)")
    return found


def _sanitizer() -> str:
    found = find_sanitizer(None)
    if found is None:
        pytest.skip("compute-sanitizer not found; set COMPUTE_SANITIZER (it ships with the CUDA toolkit)")
    return found


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the copy is built for sm_90a: needs an SM90 GPU")
    binary = tmp_path_factory.mktemp("handout") / "racecheck_handout"
    build = [_nvcc(), "-gencode", "arch=compute_90a,code=sm_90a", "-lineinfo", "-o", str(binary), str(SOURCE)]
    done = subprocess.run(build, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return binary


def _sums_wrong(output: str) -> int:
    match = re.search(r"(\d+) of \d+ sums wrong", output)
    assert match, output
    return int(match.group(1))


def _hazards(program: Path, flags: int) -> tuple[int, int]:
    """``(hazards, sums wrong)`` of one run under racecheck."""
    command = [_sanitizer(), "--tool", "racecheck", "--racecheck-report", "all", str(program), str(flags)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    summary = re.search(r"RACECHECK SUMMARY: (\d+) hazards?", done.stdout)
    assert summary, done.stdout[-2000:]
    return int(summary.group(1)), _sums_wrong(done.stdout)


def test_the_barriers_order_the_partitions_data(program: Path) -> None:
    ordered = subprocess.run([program, str(DEFAULT_SYNC | WORKER_SYNC)], capture_output=True, text=True, timeout=60)
    unordered = subprocess.run(
        [program, str(DEFAULT_SYNC | WORKER_SYNC | UNORDERED)], capture_output=True, text=True, timeout=60
    )
    assert _sums_wrong(ordered.stdout) == 0
    assert _sums_wrong(unordered.stdout) > 0, "without its barriers the copy still sums right: it shows nothing"


def test_racecheck_reports_the_hand_out_only_where_the_default_partition_synchronises(program: Path) -> None:
    assert _hazards(program, 0) == (0, 0)
    assert _hazards(program, WORKER_SYNC) == (0, 0)
    hazards, wrong = _hazards(program, DEFAULT_SYNC)
    assert wrong == 0
    assert hazards > 0, (
        "racecheck no longer reports Triton's hand-out once the default partition synchronises its warps: remove "
        "sanitize.py's explanation of the Gluon kernel's hand-out and check that racecheck passes without it"
    )
