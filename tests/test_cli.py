"""The command line as a user meets it: one-line errors (exit 2) instead of tracebacks, bad settings
reported by ``info``, a quiet end when the reader closes the pipe, and the program's own name."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ENV_VAR = "MLA_OPS_PREFILL_BACKEND"


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    environment.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "mla_ops", *args], capture_output=True, text=True, env=environment, timeout=timeout
    )


def test_info_reports_a_misspelt_override() -> None:
    result = _run("info", env={ENV_VAR: "BOGUS"})
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "override: invalid: MLA_OPS_PREFILL_BACKEND='BOGUS': unknown MLA prefill backend 'BOGUS'" in result.stdout
    assert "choose one of: REFERENCE, TRITON, FLASH_ATTN, FLASHINFER" in result.stdout


def test_info_says_an_override_concerns_cuda_only() -> None:
    result = _run("info", env={ENV_VAR: "TRITON"})
    assert result.returncode == 0, result.stderr
    if "device: CPU only" in result.stdout:
        assert "override: TRITON, which applies to CUDA devices only; CPU tensors always run REFERENCE" in result.stdout
        assert "selected: REFERENCE" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("info", "--dims", "0,0,0"), "qk_nope and qk_rope must be >= 0 with a positive sum"),
        (("info", "--dims", "128,64"), "--dims must be three integers"),
        (("info", "--capability", "-1.0"), "is not a CUDA capability"),
        (("info", "--capability", "nine"), "cannot parse compute capability"),
        (("info", "--dtype", "float99"), "is not a torch dtype"),
        (("warmup", "--dims", "1,x,2"), "--dims must be three integers"),
    ],
)
def test_user_errors_are_one_line(args: tuple[str, ...], message: str) -> None:
    result = _run(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert message in result.stderr


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="checks the message for a machine without a CUDA device"
)
def test_demo_on_a_missing_gpu_is_one_line() -> None:
    result = _run("demo", "--device", "cuda", "--no-compile")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--device cuda: no CUDA device is visible" in result.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU rule is what this checks")
def test_demo_with_a_cuda_override_runs_on_cpu_and_says_so() -> None:
    result = _run("demo", "--no-compile", env={ENV_VAR: "TRITON"}, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "backend: REFERENCE" in result.stdout
    assert "the override TRITON, from MLA_OPS_PREFILL_BACKEND or set_prefill_backend, applies to CUDA devices" in (
        result.stdout
    )
    assert "demo passed" in result.stdout


def test_a_closed_pipe_ends_quietly() -> None:
    command = f"{sys.executable} -m mla_ops info | head -n 1"
    result = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=120)
    assert result.stdout.startswith("mla_ops ")
    assert "BrokenPipeError" not in result.stderr and "Traceback" not in result.stderr
    assert result.returncode == 0


def test_the_console_script_names_itself() -> None:
    script = shutil.which("mla-ops")
    if script is None:
        pytest.skip("the mla-ops console script is not on PATH (install the package with pip to get it)")
    result = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("usage: mla-ops ")
    assert _run("--help").stdout.startswith("usage: python -m mla_ops ")
