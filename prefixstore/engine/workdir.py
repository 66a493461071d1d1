"""The directory a command works in: the one the user named, or a temporary one."""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO


@contextmanager
def work_dir(command: str, given: str | None, keep: bool, *, prefix: str | None = None,
             stream: TextIO | None = None) -> Iterator[str]:
    """Yield ``given`` (always kept), or a new temporary directory that is named on
    ``stream`` (default stderr) and removed at the end unless ``keep``."""
    if given is not None:
        yield given
        return
    out = stream if stream is not None else sys.stderr
    root = tempfile.mkdtemp(prefix=f"prefixstore-{prefix or command}-")
    print(f"{command}: working in {root} (removed at the end; --keep keeps it)", file=out)
    try:
        yield root
    finally:
        if keep:
            print(f"{command}: kept {root}", file=out)
        else:
            shutil.rmtree(root, ignore_errors=True)
            print(f"{command}: removed {root}", file=out)
