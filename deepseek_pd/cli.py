"""The `deepseek-pd` command line (ARCHITECTURE §4).

Each sub-command lives in its own module under `deepseek_pd.commands` and exposes
`register(subparsers)`, which adds its parser and sets `func(args) -> int`. Modules are
discovered, so adding a command touches no shared file. Errors that users can fix
(bad flags, bad input) are raised as `UserError` and printed as one line, never a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from deepseek_pd import commands
from deepseek_pd.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepseek-pd", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"deepseek-pd {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
