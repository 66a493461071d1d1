"""The ``prefixstore`` command line.

Each subcommand lives in its own module exposing ``NAME``, ``HELP``,
``add_arguments(parser)`` and ``run(args) -> int``; list it in COMMANDS.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from prefixstore.base.errors import PrefixStoreError

COMMANDS = [
    "prefixstore.engine.cmd_demo",
    "prefixstore.engine.cmd_audit",
    "prefixstore.engine.cmd_catalog",
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
        p.set_defaults(handler=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        rc = int(args.handler(args) or 0)
        sys.stdout.flush()  # a closed pipe fails here, not in the interpreter's exit
        return rc
    except PrefixStoreError as exc:
        print(f"prefixstore {args.command}: {one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _quiet_stdout()
        return 141  # what a shell reports for a process ended by SIGPIPE


def one_line(exc: BaseException) -> str:
    """An error's message on one line (its type name when it has none)."""
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def _quiet_stdout() -> None:
    """The reader of stdout is gone: point stdout at /dev/null so the interpreter's
    final flush does not fail a second time."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    finally:
        os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
