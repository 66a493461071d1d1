"""Moved to ``prefixstore.cli``; this re-export goes when every caller names the new path."""

import sys

from prefixstore.cli import COMMANDS, build_parser, main, one_line

__all__ = ["COMMANDS", "build_parser", "main", "one_line"]

if __name__ == "__main__":
    sys.exit(main())
