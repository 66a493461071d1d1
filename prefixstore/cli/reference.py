"""The command-line reference page (``docs/cli-reference.md``), rendered from the
commands' own parsers, so that it lists every command and option as ``--help`` does.

    python -m prefixstore.cli.reference --write docs/cli-reference.md   # regenerate
    python -m prefixstore.cli.reference --check docs/cli-reference.md   # exit 1 if out of date
"""

from __future__ import annotations

import argparse
import functools
import sys
from types import ModuleType

from prefixstore.cli import COMMANDS, build_parser, description

WIDTH = 100
"""Usage lines are wrapped at this width, whatever the terminal's."""
FORMATTER = functools.partial(argparse.RawDescriptionHelpFormatter, width=WIDTH)
PLAIN_GROUPS = ("positional arguments", "options", "optional arguments")
HEADER = """\
# Command-line reference

Every command and option of `prefixstore`, rendered from the commands' own parsers by
`python -m prefixstore.cli.reference --write docs/cli-reference.md` (`tests/test_docs.py`
fails when this page is out of date: edit the command's module in `prefixstore/cli/`, then
regenerate). `prefixstore COMMAND --help` prints the same. What the commands have in common
(exit status, temporary directories, extras) is on [the command line page](cli.md).
"""


def render() -> str:
    """The whole page."""
    top = build_parser()
    top.formatter_class = FORMATTER
    out = [HEADER, "## prefixstore", "", "```text", top.format_usage().rstrip(), "```", ""]
    out += ["| command | what it does |", "| --- | --- |"]
    out += [f"| [`{m.NAME}`](#prefixstore-{m.NAME}) | {_cell(m.HELP)} |" for m in COMMANDS]
    for mod in COMMANDS:
        out += ["", *_command(mod)]
    return "\n".join(out) + "\n"


def _command(mod: ModuleType) -> list[str]:
    parser = argparse.ArgumentParser(prog=f"prefixstore {mod.NAME}", description=description(mod),
                                     formatter_class=FORMATTER)
    mod.add_arguments(parser)
    out = [f"## prefixstore {mod.NAME}", "", _cell(mod.HELP[:1].upper() + mod.HELP[1:]) + ".", "",
           "```text", parser.format_usage().rstrip(), "```", ""]
    if parser.description:
        out += ["```text", parser.description.strip("\n"), "```", ""]
    plain = [g for g in parser._action_groups if g.title in PLAIN_GROUPS]
    titled = [g for g in parser._action_groups if g.title not in PLAIN_GROUPS]
    for title, groups in [(None, plain), *((g.title, [g]) for g in titled)]:
        rows = [_row(parser.prog, a) for g in groups for a in g._group_actions
                if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]
        if rows:
            out += ([f"*{title}*", ""] if title else [])
            out += ["| argument | default | what it does |", "| --- | --- | --- |", *rows, ""]
    return out[:-1]


def _row(prog: str, action: argparse.Action) -> str:
    return f"| {_cell(_names(action))} | {_cell(_default(action))} | {_cell(_help(prog, action))} |"


def _names(action: argparse.Action) -> str:
    meta = action.metavar or (
        "{" + ",".join(map(str, action.choices)) + "}" if action.choices else action.dest.upper())
    if not action.option_strings:
        return f"`{meta}`" + (" (optional)" if action.nargs == "?" else "")
    args = {0: "", None: f" {meta}", "?": f" [{meta}]", "+": f" {meta} [{meta} ...]",
            "*": f" [{meta} ...]"}.get(action.nargs, f" {meta}")
    return ", ".join(f"`{flag}{args}`" for flag in action.option_strings)


def _default(action: argparse.Action) -> str:
    d = action.default
    if action.nargs == 0 or d is None or d is argparse.SUPPRESS:
        return "-"
    return f"`{' '.join(map(str, d)) if isinstance(d, list) else d}`"


def _help(prog: str, action: argparse.Action) -> str:
    """The help text as ``--help`` shows it (argparse's ``%(...)s`` expanded)."""
    text = action.help or ""
    if "%" not in text:
        return text
    params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
    params = {k: getattr(v, "__name__", v) for k, v in params.items()}
    if params.get("choices") is not None:
        params["choices"] = ", ".join(map(str, params["choices"]))
    return text % {**params, "prog": prog}


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefixstore.cli.reference", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", metavar="PATH", help="write the page there")
    mode.add_argument("--check", metavar="PATH", help="exit 1 when the page there is not the one rendered now")
    args = p.parse_args(argv)
    page = render()
    if args.write:
        with open(args.write, "w") as f:
            f.write(page)
        return 0
    with open(args.check) as f:
        same = f.read() == page
    if not same:
        print(f"{args.check} is out of date: python -m prefixstore.cli.reference --write {args.check}",
              file=sys.stderr)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
