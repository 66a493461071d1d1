"""The ``prefixstore`` command line.

Each subcommand is one module of this package exposing ``NAME``, ``HELP``,
``add_arguments(parser)`` and ``run(args) -> int`` (its ``--help`` description is
its docstring, or ``DESCRIPTION`` when it has one); import it here and list it in
COMMANDS. A command module holds only its arguments and output; the work it runs lives
in the layer it belongs to (``engine``, ``replay``, ``fuzz``, ``gpu``).
"""

from __future__ import annotations

import argparse
import os
import sys
from types import ModuleType

from prefixstore.base.errors import PrefixStoreError
from prefixstore.cli import audit, catalog, demo, fiu, fuzz, rank_server, replay, soak

COMMANDS = (demo, audit, catalog, rank_server, replay, fuzz, soak, fiu)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixstore",
        description="A transactional host-tier storage engine for LLM prefix caches.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in COMMANDS:
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=description(mod),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(handler=mod.run)
    return parser


def description(mod: ModuleType) -> str | None:
    """What ``prefixstore NAME --help`` says of a command: its ``DESCRIPTION``, else its
    module's docstring."""
    return getattr(mod, "DESCRIPTION", mod.__doc__)


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
