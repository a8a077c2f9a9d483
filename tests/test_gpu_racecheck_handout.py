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

pytestmark = pytest.mark.gpu

SOURCE = Path(__file__).resolve().parent.parent / "benchmarks" / "racecheck_handout.cu"
#: The default partition synchronises its warps (1), partition 0 its own (2), without their barriers (16).
DEFAULT_SYNC, WORKER_SYNC, UNORDERED = 1, 2, 16


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        for home in ("/usr/local/cuda/bin", "/usr/local/bin"):
            if Path(home, name).exists():
                return str(Path(home, name))
        pytest.skip(f"{name} is not on PATH (it ships with the CUDA toolkit)")
    return path


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the copy is built for sm_90a: needs an SM90 GPU")
    binary = tmp_path_factory.mktemp("handout") / "racecheck_handout"
    build = [_tool("nvcc"), "-gencode", "arch=compute_90a,code=sm_90a", "-lineinfo", "-o", str(binary), str(SOURCE)]
    done = subprocess.run(build, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return binary


def _sums_wrong(output: str) -> int:
    match = re.search(r"(\d+) of \d+ sums wrong", output)
    assert match, output
    return int(match.group(1))


def _hazards(program: Path, flags: int) -> tuple[int, int]:
    """``(hazards, sums wrong)`` of one run under racecheck."""
    command = [_tool("compute-sanitizer"), "--tool", "racecheck", "--racecheck-report", "all", str(program), str(flags)]
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
