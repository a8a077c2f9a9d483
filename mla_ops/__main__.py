"""Command line: ``python -m mla_ops {info,demo,warmup}``."""

from __future__ import annotations

import argparse
import sys

from . import demo, info, warmup


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command; returns the process exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m mla_ops", description="MLA prefill attention ops: inspect, demo and warm up."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module, text in (
        ("info", info, "print versions, the device, every backend's validity and the dispatch table"),
        ("demo", demo, "run a DeepSeek-style MLA layer eagerly and compiled, checked against float64"),
        ("warmup", warmup, "compile the kernels of every valid backend ahead of time"),
    ):
        sub = commands.add_parser(name, help=text, description=text)
        module.add_arguments(sub)
        sub.set_defaults(run=module.main)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
