"""The directory a command works in: the one the user named, or a temporary one."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from prefixstore.base.errors import InvalidArgumentError


def ensure_dir(option: str, path: str) -> str:
    """``path``, created with its parents when missing. A path that is not a directory,
    or that cannot be created, is refused with an ``InvalidArgumentError`` naming
    ``option`` (one line, exit status 2 from the command line)."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise InvalidArgumentError(f"{option} {path}", "not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise InvalidArgumentError(f"{option} {path}", f"cannot create it: {exc.strerror or exc}") from None
    return path


@contextmanager
def work_dir(command: str, given: str | None, keep: bool, *, prefix: str | None = None,
             stream: TextIO | None = None, option: str = "DIR") -> Iterator[str]:
    """Yield ``given`` (created when missing, see ``ensure_dir``; always kept), or a new
    temporary directory that is named on ``stream`` (default stderr) and removed at the
    end unless ``keep``."""
    if given is not None:
        yield ensure_dir(option, given)
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
