"""Command line: ``python -m mla_ops {info,demo,warmup,tune}`` (installed as ``mla-ops`` too)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from .cli import demo, info, tune, warmup


def _program_name() -> str:
    return "mla-ops" if os.path.basename(sys.argv[0]) == "mla-ops" else "python -m mla_ops"


class _Parser(argparse.ArgumentParser):
    """argparse, with an error in one line: what ``--help`` would show is not repeated above it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command; returns the process exit code.

    A user error (a bad option or setting) prints one line and returns 2; no command shows a
    traceback for one. Ctrl-C prints one line and returns 130, as a shell reports SIGINT. Output cut short
    by the reader (``mla-ops info | head``) ends quietly.
    """
    prog = _program_name()
    parser = _Parser(prog=prog, description="MLA prefill attention ops: inspect, demo, warm up and tune.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module, text in (
        ("info", info, "print versions, the device, every backend's validity and the dispatch table"),
        ("demo", demo, "run a DeepSeek-style MLA layer eagerly and compiled, checked against float64"),
        ("warmup", warmup, "compile the kernels of every valid backend ahead of time"),
        ("tune", tune, "measure this GPU's backend cost table, which routes each call by its size"),
    ):
        sub = commands.add_parser(name, help=text, description=text)
        module.add_arguments(sub)
        sub.set_defaults(run=module.main)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError) as exc:  # what the package raises for bad options and settings
        print(f"{prog} {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, and the shell's status for SIGINT
        print(f"\n{prog} {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away; point stdout at /dev/null so that the interpreter's final flush is quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
