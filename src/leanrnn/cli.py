"""The ``leanrnn`` command: one argparse front door; each subcommand lives in its own module.

A subcommand module exposes ``register(subparsers)`` which adds its parser and sets
``func=run(args) -> int``. Modules import heavy things (torch, onnx, matplotlib) inside ``run``
so ``leanrnn --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import LeanRNNError

# (module, ...) in the order they appear in --help. Modules that are missing (a half-installed
# tree) are skipped rather than breaking every other command.
COMMANDS = (
    "leanrnn.commands.info",
    "leanrnn.commands.compile",
    "leanrnn.commands.demo",
    "leanrnn.commands.model",
    "leanrnn.commands.plan",
    "leanrnn.commands.score",
    "leanrnn.bench.cli",
)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(
        prog="leanrnn", description="LSTM/GRU/RNN inference on the CPU with planned memory."
    )
    p.add_argument("--version", action="version", version=f"leanrnn {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if not e.name or not name.startswith(e.name):
                raise
            continue
        mod.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except LeanRNNError as e:
        print(f"leanrnn: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
