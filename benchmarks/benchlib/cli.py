"""The command-line options the benchmark scripts share, each written once.

A script builds its parser with :func:`parser`, adds its own options, and adds the shared ones with the
``add_*`` functions at the place they should appear in its ``--help``. Options whose default depends on
the device (``--warmup-ms``, ``--rep-ms``, a stack's size) default to ``None`` here and are filled in by
:func:`benchlib.problems.setup_device` once the device is known.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .timing import DEFAULT_ROUNDS


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default after its help, except where the help already gives it in words (those
    whose default depends on the device) or there is none to show (``None``, a flag's ``False``)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False:
            return text
        return super()._get_help_string(action)


def parser(description: str) -> argparse.ArgumentParser:
    """A script's parser: ``description`` on top, every option's default shown in ``--help``."""
    return argparse.ArgumentParser(description=description, formatter_class=_DefaultsFormatter)


def add_out_dir(parser: argparse.ArgumentParser) -> None:
    """``--out``: the folder a script writes ``<stem>.csv``, ``<stem>.md`` and ``<stem>.env.json`` into."""
    parser.add_argument("--out", type=Path, help="output folder (default: benchmarks/results/<gpu-slug>/)")


def add_backends(parser: argparse.ArgumentParser, help: str = "backends to measure (default: all valid here)") -> None:
    """``--backends NAME ...``: the names :func:`benchlib.methods.backends_to_time` takes."""
    parser.add_argument("--backends", nargs="+", metavar="NAME", help=help)


def add_timer(parser: argparse.ArgumentParser) -> None:
    """``--warmup-ms`` and ``--rep-ms``: the budgets of :func:`benchlib.timing.measure`."""
    parser.add_argument("--warmup-ms", type=float, help="warm-up per measurement (default: 25 on GPU, 2 on CPU)")
    parser.add_argument("--rep-ms", type=float, help="timed ms per measurement (default: 100 on GPU, 10 on CPU)")


def add_rounds(parser: argparse.ArgumentParser, help: str) -> None:
    """``--rounds``: alternating rounds of an op/raw ratio (:func:`benchlib.timing.alternating`); check it
    with :func:`check_rounds`."""
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help=help)


def check_rounds(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with a usage error when ``--rounds`` is below 1."""
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")


def add_stack(parser: argparse.ArgumentParser, gpu_defaults: Mapping[str, Any]) -> None:
    """``--layers``, ``--heads`` and ``--hidden`` of a stack of MLA layers; ``gpu_defaults`` names the GPU
    defaults in the help (the CPU ones are smaller, filled in by :func:`benchlib.problems.setup_device`)."""
    parser.add_argument("--layers", type=int, help=f"layers in the stack (default {gpu_defaults['layers']})")
    parser.add_argument("--heads", type=int, help=f"query heads (default {gpu_defaults['heads']})")
    parser.add_argument("--hidden", type=int, help=f"hidden size (default {gpu_defaults['hidden']})")


def add_attention_configs(parser: argparse.ArgumentParser, flag: str, default: str) -> None:
    """``flag``: ';'-separated Triton attention configurations in the form ``AttentionConfig.parse`` reads
    (:mod:`mla_ops.kernels.configs`); ``default`` says what is used without it. The help breaks its line only
    under ``argparse.RawTextHelpFormatter``."""
    parser.add_argument(
        flag,
        default="",
        help="';'-separated attention configs "
        "'BLOCK_M,BLOCK_N,num_warps,num_stages[,ovl][,gluon,ovl,pers[,pp]]'\n"
        f"(default: {default})",
    )


def add_device(parser: argparse.ArgumentParser) -> None:
    """``--device``, ``--dtype`` and ``--seed``: what :func:`benchlib.problems.setup_device` reads, and the
    seed of the inputs."""
    parser.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda if available)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
