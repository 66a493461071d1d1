"""Independent CPU-bound pieces of one fixture's work run side by side, one process per
core (not a test module). pytest runs one test at a time, so a fixture that replays a
trace several times otherwise leaves CI's second core idle. The processes are spawned:
they inherit the environment (the debug invariant checks stay on) but no thread, lock or
open engine of the test process. Each piece is a module-level function and its
arguments; what it returns comes back by value."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

Piece = tuple[Callable[..., Any], tuple[Any, ...]]


def run_side_by_side(pieces: Sequence[Piece], workers: int | None = None) -> list[Any]:
    """What each ``(function, args)`` of ``pieces`` returns, in order; run in up to
    ``workers`` (by default one per core) spawned processes, the first pieces first (put
    the longest first), or here when there is one core or one piece."""
    workers = min(len(pieces), workers or os.cpu_count() or 1)
    if workers <= 1:
        return [fn(*args) for fn, args in pieces]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(fn, *args) for fn, args in pieces]
        return [f.result() for f in futures]
