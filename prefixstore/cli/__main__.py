"""``python -m prefixstore.cli``: the ``prefixstore`` command."""

import sys

from prefixstore.cli import main

if __name__ == "__main__":
    sys.exit(main())
