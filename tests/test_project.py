"""Project-level promises: the README's commands, CI running them verbatim, the CLI, and docstrings."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import mla_ops

ROOT = Path(__file__).resolve().parent.parent


def _readme_section(title: str) -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def _quick_start_lines() -> list[str]:
    blocks = re.findall(r"```(?:bash|sh)?\n(.*?)```", _readme_section("Quick start"), flags=re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def _quick_start() -> list[str]:
    return [line for line in _quick_start_lines() if not line.startswith("#")]


def test_quick_start_is_exactly_two_commands() -> None:
    commands = _quick_start()
    assert len(commands) == 2, commands
    assert commands[0].endswith("python -m mla_ops demo")
    assert "pytest" in commands[1]


def test_quick_start_names_the_cpu_build_of_torch_before_any_install() -> None:
    # Read top-down, the block must offer PyTorch's CPU wheel before a command that would resolve torch from
    # PyPI, whose default build is a CUDA one of several GB.
    lines = _quick_start_lines()
    cpu = next(i for i, line in enumerate(lines) if "download.pytorch.org/whl/cpu" in line)
    first_install = next(i for i, line in enumerate(lines) if "pip install" in line and not line.startswith("#"))
    assert cpu < first_install, lines


def test_readme_usage_runs_on_cpu_as_written() -> None:
    section = _readme_section("Using it")
    code = re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]
    namespace: dict = {"__name__": "readme_usage"}
    exec(compile(code, str(ROOT / "README.md"), "exec"), namespace)
    assert namespace["out"].device.type == "cpu"


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    test_command = _quick_start()[1]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in [line.strip() for line in ci]


@pytest.mark.parametrize("command", [[], ["info"], ["demo"], ["warmup"]])
def test_cli_help(command) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mla_ops", *command, "--help"], capture_output=True, text=True, check=True
    )
    assert "usage: python -m mla_ops" in result.stdout


def test_demo_runs_eagerly_and_passes() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mla_ops", "demo", "--no-compile"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "demo passed" in result.stdout
    assert result.stdout.count(" ok") == 3


def test_demo_fails_loudly_when_attention_is_wrong(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from mla_ops.cli import demo

    def wrong(q, k, v, cu_seqlens, max_seqlen, chunks, softmax_scale):
        # Drops the context: exactly the kind of bug the demo must catch.
        return mla_ops.prefill(q, k, v, cu_seqlens, max_seqlen, softmax_scale)

    monkeypatch.setattr(demo, "MLAAttention", _with_attention(demo.MLAAttention, wrong))
    assert demo.run_demo("cpu", compile=False) == 1
    assert "demo FAILED" in capsys.readouterr().out


def _with_attention(cls, attention):
    def build(config, **kwargs):
        kwargs["attention"] = attention
        return cls(config, **kwargs)

    return build


def test_public_functions_are_documented_and_typed() -> None:
    for name in mla_ops.__all__:
        obj = getattr(mla_ops, name)
        assert inspect.getdoc(obj), f"mla_ops.{name} has no docstring"
        if inspect.isfunction(obj):
            hints = inspect.signature(obj)
            assert hints.return_annotation is not inspect.Signature.empty, f"mla_ops.{name} lacks a return type"


def _package_attributes_named(path: Path) -> list[tuple[int, str, str]]:
    """``(line, module, attribute)`` for each ``alias.attribute`` in ``path`` where ``alias`` names an ``mla_ops``
    module (``import mla_ops.x as alias``, ``from mla_ops import x as alias``, ``import mla_ops``)."""
    tree = ast.parse(path.read_text())
    modules: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "mla_ops":
                    modules[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "mla_ops":
            for a in node.names:
                name = f"{node.module}.{a.name}"
                try:
                    importlib.import_module(name)
                except ImportError:
                    continue  # a function or class, not a module
                modules[a.asname or a.name] = name
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            found.append((node.lineno, modules[node.value.id], node.attr))
    return found


def test_gpu_tests_name_attributes_that_exist() -> None:
    """The GPU tests run only where CUDA is, so a rename in the package would first show there: on CPU, every
    ``module.attribute`` they read from an ``mla_ops`` module must exist."""
    missing = []
    for path in sorted((ROOT / "tests").glob("test_gpu_*.py")):
        for line, module, attr in _package_attributes_named(path):
            if not hasattr(importlib.import_module(module), attr):
                missing.append(f"{path.name}:{line}: {module}.{attr}")
    assert not missing, "attributes the GPU tests read that the package does not have:\n" + "\n".join(missing)
    # The walk sees a module imported under an alias inside a function, as test_gpu_transformers.py does.
    named = _package_attributes_named(ROOT / "tests" / "test_gpu_transformers.py")
    assert ("mla_ops.integrations.transformers", "LAYOUTS") in {(m, a) for _, m, a in named}
