"""The command line as a user meets it: one-line errors (exit 2) instead of tracebacks, bad settings
reported by ``info``, a quiet end when the reader closes the pipe, and the program's own name."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

ENV_VAR = "MLA_OPS_PREFILL_BACKEND"


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    # Only the settings a test names: the package's (and the test suite's own MLA_OPS_HYPOTHESIS_PROFILE) are
    # left out, so that info's table of settings shows what the test set.
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MLA_OPS_")}
    environment.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "mla_ops", *args], capture_output=True, text=True, env=environment, timeout=timeout
    )


def test_info_reports_a_misspelt_override() -> None:
    result = _run("info", env={ENV_VAR: "BOGUS"})
    # The whole report, then the one-line error and status 2 of any bad setting.
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "override: invalid: MLA_OPS_PREFILL_BACKEND='BOGUS': unknown MLA prefill backend 'BOGUS'" in result.stdout
    assert "choose one of: REFERENCE, TRITON, FLASH_ATTN, FLASHINFER" in result.stdout
    assert (
        result.stderr
        == "python -m mla_ops info: error: invalid setting: MLA_OPS_PREFILL_BACKEND (see Settings above)\n"
    )


SETTINGS = {
    "MLA_OPS_PREFILL_BACKEND": ("tpu", "MLA_OPS_PREFILL_BACKEND='tpu': unknown MLA prefill backend 'tpu'"),
    "MLA_OPS_TRITON_CONFIG": ("garbage", "MLA_OPS_TRITON_CONFIG must be 'BLOCK_M,BLOCK_N,num_warps,num_stages"),
    "MLA_OPS_FLASHINFER_WORKSPACE_MB": ("abc", "MLA_OPS_FLASHINFER_WORKSPACE_MB must be a positive number of MiB"),
    "MLA_OPS_NATIVE": ("yes", "MLA_OPS_NATIVE must be 0 (off) or 1 (on, the default), got 'yes'"),
    # The deprecated name of MLA_OPS_NATIVE: not read where MLA_OPS_NATIVE is set (as here), else validated alike.
    "MLA_OPS_NATIVE_MERGE": ("false", None),
    "MLA_OPS_NATIVE_LAUNCH": ("no", "MLA_OPS_NATIVE_LAUNCH must be 0 (off) or 1 (on, the default), got 'no'"),
    "MLA_OPS_CACHE_DIR": ("/dev/null", "MLA_OPS_CACHE_DIR='/dev/null' is not a directory"),
    "MLA_OPS_BATCH_INVARIANT": ("yes", "MLA_OPS_BATCH_INVARIANT must be 0 (off, the default) or 1 (on), got 'yes'"),
}


def test_info_shows_every_setting() -> None:
    result = _run("info", env={"MLA_OPS_TRITON_CONFIG": "128,64,8,3", "MLA_OPS_PREFIL_BACKEND": "TRITON"})
    assert result.returncode == 0, result.stderr
    settings = result.stdout.split("Settings (environment)\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [line.split()[0] for line in settings] == [*SETTINGS, "MLA_OPS_PREFIL_BACKEND"]
    assert "MLA_OPS_TRITON_CONFIG            '128,64,8,3' every TRITON launch as 128,64,8,3" in result.stdout
    assert "MLA_OPS_FLASHINFER_WORKSPACE_MB  unset        128 MiB of FlashInfer workspace per device" in result.stdout
    assert (
        "MLA_OPS_PREFIL_BACKEND           'TRITON'     not a setting of mla_ops: ignored (misspelt?)" in result.stdout
    )


def test_info_names_every_library_a_backend_runs() -> None:
    """The version list names each library behind a backend, FlashAttention-4 (which FLASH_ATTN prefers) included,
    as the cost tables record them (cost_table.BACKEND_LIBRARIES)."""
    from mla_ops import cost_table
    from mla_ops.cli import info

    versions = info.library_versions()
    shown = set(info._LIBRARIES.values())
    for dists in cost_table.BACKEND_LIBRARIES.values():
        assert set(dists) <= shown, dists
    assert "flash_attn.cute (FA4)" in versions and "flash_attn_interface (FA3)" in versions


def test_info_validates_every_setting() -> None:
    result = _run("info", env={variable: value for variable, (value, _) in SETTINGS.items()})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    for variable, (value, message) in SETTINGS.items():
        if message is None:
            assert f"{variable:<32} {value!r:<12} deprecated name of MLA_OPS_NATIVE; not read" in result.stdout
            continue
        assert f"{variable:<32} {value!r:<12} invalid: {message}" in result.stdout
    assert (
        result.stderr
        == f"python -m mla_ops info: error: invalid settings: {', '.join(v for v, (_, m) in SETTINGS.items() if m)} "
        "(see Settings above)\n"
    )


@pytest.mark.parametrize("command", [("demo", "--no-compile"), ("warmup",)])
@pytest.mark.parametrize("variable", ["MLA_OPS_TRITON_CONFIG", "MLA_OPS_FLASHINFER_WORKSPACE_MB"])
def test_commands_refuse_a_bad_setting_in_one_line(command, variable) -> None:
    value, message = SETTINGS[variable]
    result = _run(*command, env={variable: value})
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith(f"python -m mla_ops {command[0]}: error: {message}")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


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
        (("demo", "--device", "tpu"), "--device 'tpu': pass cpu, cuda or cuda:N (N a GPU's index)"),
        (("demo", "--device", "CPU"), "--device 'CPU': pass cpu, cuda or cuda:N (N a GPU's index)"),
        (("demo", "--device", "0"), "--device '0': pass cpu, cuda or cuda:N (N a GPU's index)"),
        (("demo", "--device", "cuda:x"), "--device 'cuda:x': pass cpu, cuda or cuda:N (N a GPU's index)"),
        (("demo", "--device", "meta"), "--device 'meta': pass cpu, cuda or cuda:N (N a GPU's index)"),
        (("warmup", "--device", "banana"), "--device 'banana': pass cuda or cuda:N (N a GPU's index)"),
        (("warmup", "--device", "cuda:x"), "--device 'cuda:x': pass cuda or cuda:N (N a GPU's index)"),
        (("warmup", "--device", "cpu"), "--device cpu: warmup compiles CUDA kernels; name a CUDA device"),
        (("demo", "--dtype", "float32"), "argument --dtype: invalid choice: 'float32'"),
        (("bogus",), "argument COMMAND: invalid choice: 'bogus'"),
    ],
)
def test_user_errors_are_one_line(args: tuple[str, ...], message: str) -> None:
    result = _run(*args, "--no-compile") if args[0] == "demo" else _run(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert message in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr


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


def test_ctrl_c_during_demo_is_one_line_and_status_130() -> None:
    # As a terminal sends it: SIGINT to the whole process group, once the demo is running its batches.
    environment = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    demo = subprocess.Popen(
        [sys.executable, "-m", "mla_ops", "demo", "--device", "cpu"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment,
        start_new_session=True,
    )
    try:
        for line in demo.stdout:
            if line.startswith("batch 0"):
                break
        time.sleep(1.0)  # into the batch's eager and compiled runs
        os.killpg(demo.pid, signal.SIGINT)
        _, stderr = demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
    assert demo.returncode == 130, stderr
    assert stderr.strip() == "python -m mla_ops demo: interrupted", stderr


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


def test_info_prints_the_fp8_rules() -> None:
    """``info --dtype float8_e4m3fn`` prints the fp8 ops' selection rules: on SM90 only TRITON has fp8 kernels, and
    on SM80 none does, with the reason."""
    result = _run("info", "--capability", "9.0", "--dtype", "float8_e4m3fn")
    assert result.returncode == 0, result.stderr
    assert "FLASHINFER  no: dtype float8_e4m3fn is not supported (use bfloat16, float16)" in result.stdout
    assert "TRITON      yes" in result.stdout
    result = _run("info", "--capability", "8.0", "--dtype", "float8_e4m3fn")
    assert "TRITON      no: dtype float8_e4m3fn needs compute capability 8.9 or newer" in result.stdout


def test_warmup_names_what_it_skipped_of_the_backends_asked_for(monkeypatch, capsys) -> None:
    """A backend asked for by name that cannot run for a dtype is skipped with its reason, and the run ends with
    status 1 and one line naming what was skipped (on a simulated SM90 device: nothing compiles here)."""
    from mla_ops.cli import warmup

    warmed = []

    class Ready:
        @staticmethod
        def warmup(device, config, heads):
            warmed.append(str(config.dtype))

    def validate(backend, capability, config):
        if config.dtype == torch.float8_e4m3fn:
            return None, [f"dtype {config.dtype} is not supported"]
        return Ready, []

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(warmup, "parse_device", lambda text, kinds, present=True: torch.device("cuda"))
    monkeypatch.setattr(warmup.DeviceCapability, "of", staticmethod(lambda device: warmup.DeviceCapability(9, 0)))
    monkeypatch.setattr(warmup.native, "load", lambda: False)
    monkeypatch.setattr(warmup, "validate_backend", validate)
    parser = argparse.ArgumentParser()
    warmup.add_arguments(parser)
    args = parser.parse_args(["--backend", "FLASHINFER", "--dtype", "bfloat16", "--dtype", "float8_e4m3fn"])
    assert warmup.main(args) == 1
    out, err = capsys.readouterr()
    assert warmed == ["torch.bfloat16"]
    assert "[2/2] FLASHINFER float8_e4m3fn (128, 64, 128): skipped (dtype torch.float8_e4m3fn is not supported)" in out
    assert err == (
        "warmup: 1 of the 2 asked for cannot run here and were skipped (FLASHINFER float8_e4m3fn (128, 64, 128); "
        "reasons above); the others are ready\n"
    )
    assert warmup.main(parser.parse_args(["--dtype", "bfloat16", "--dtype", "float8_e4m3fn"])) == 0  # not by name
