"""Independent CPU-bound pieces of one fixture's work run side by side, one process per
core (not a test module). pytest runs one test at a time, so a fixture that replays a
trace several times otherwise leaves CI's second core idle. The processes are spawned:
they inherit the environment (the debug invariant checks stay on) but no thread, lock or
open engine of the test process. Each piece is a module-level function and its
arguments; what it returns comes back by value.

``PREFIXSTORE_SIDE_BY_SIDE_TIMES=1`` prints each piece's CPU and wall seconds (run
pytest with ``-s`` to see them): on two idle cores the pieces take about the larger of
the two workers' sums."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

Piece = tuple[Callable[..., Any], tuple[Any, ...]]
TIMES = os.environ.get("PREFIXSTORE_SIDE_BY_SIDE_TIMES") == "1"


def _one_thread() -> None:
    """A worker's torch runs its ops on one thread: the workers already take every core,
    and more threads than cores only contend (the pieces' tensors are small)."""
    import torch

    torch.set_num_threads(1)


def _timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float, float]:
    """``fn(*args)``, the CPU seconds of this process meanwhile and the wall seconds."""
    cpu, wall = time.process_time(), time.monotonic()
    out = fn(*args)
    return out, time.process_time() - cpu, time.monotonic() - wall


def run_side_by_side(pieces: Sequence[Piece], workers: int | None = None) -> list[Any]:
    """What each ``(function, args)`` of ``pieces`` returns, in order; run in up to
    ``workers`` (by default one per core this process may run on) spawned processes, the first pieces first (put
    the longest first), or here when there is one core or one piece."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = min(len(pieces), workers or cores)
    t0 = time.monotonic()
    if workers <= 1:
        done = [_timed(fn, *args) for fn, args in pieces]
    else:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_one_thread) as pool:
            futures = [pool.submit(_timed, fn, *args) for fn, args in pieces]
            done = [f.result() for f in futures]
    if TIMES:
        each = ", ".join(f"{cpu:.1f}/{wall:.1f}" for _, cpu, wall in done)
        print(f"\nside by side ({workers} workers): {len(pieces)} pieces, CPU/wall s {each}; "
              f"{time.monotonic() - t0:.1f} s in all", file=sys.stderr)
    return [out for out, _, _ in done]
