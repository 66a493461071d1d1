"""The ``prefixstore`` command line.

Each subcommand lives in its own module exposing ``NAME``, ``HELP``,
``add_arguments(parser)`` and ``run(args) -> int``; list it in COMMANDS.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = [
    "prefixstore.engine.cmd_demo",
    "prefixstore.engine.cmd_audit",
    "prefixstore.engine.cmd_rank_server",
    "prefixstore.replay.cmd_replay",
    "prefixstore.fuzz.cmd_fuzz",
    "prefixstore.fuzz.soak",
    "prefixstore.fuzz.fiu",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixstore",
        description="A transactional host-tier storage engine for LLM prefix caches.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for modname in COMMANDS:
        mod = importlib.import_module(modname)
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
