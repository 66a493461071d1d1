"""Bandwidth calibration for the restore cost rule.

``Engine.open(..., bandwidth=...)``:

- ``None`` (default): the ``CostModel``'s own ``bandwidth_bytes_per_s`` (configured).
- a number: bytes per second, configured here (overrides the cost model's).
- ``"measure"``: the stored value (the engine keeps it in the catalog meta, see
  ``engine/calibration.py``) when it was measured for the same backing and executor;
  otherwise a short probe now, whose result the caller stores.
- ``"remeasure"``: probe now, whatever is cached.

The probe (about ``PROBE_BYTES``, tens of milliseconds) times the two stages of a
restore: uploading a staging buffer into a freshly allocated device tensor (the
executor's host-to-device path, output allocation included) and, for backings whose
shards are files in the rank directories (``Capability.RANK_DIRS``), reading a freshly
written, fsynced file whose pages were dropped from the page cache
(``posix_fadvise(DONTNEED)``; where the OS keeps them anyway the figure is the page
cache's). A restore overlaps the two (``transfers.restore_nodes``), so the restore
bandwidth is the slower of them. A backing with RAM in front of its files is calibrated
on its file path: a RAM hit only makes a restore cheaper than estimated. The probe file lives in the cache root, never in a rank
directory, and is removed (a leftover from a crash is removed by the next probe).
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import attrs
import torch

from prefixstore.base.errors import InvalidInputError
from prefixstore.gpu import tiers
from prefixstore.gpu.executor import Executor
from prefixstore.gpu.tier import Capability

PROBE_NAME = "calibrate.probe"
PROBE_BYTES = 16 << 20


@attrs.frozen
class Calibration:
    """The outcome of the ``bandwidth`` option.

    ``value``: the calibration used (None: the cost model's own bandwidth);
    ``to_store``: the encoded value for the caller to persist (None: nothing new measured).
    """

    value: dict[str, Any] | None
    to_store: str | None = None


def resolve(bandwidth: Any, stored: str | None, *, executor: Executor, backing_kind: str,
            root: str) -> Calibration:
    """Apply the ``bandwidth`` option given the value stored earlier (or None).

    ``root`` is the directory the read probe may write its file into (never a rank directory).
    """
    if bandwidth is None:
        return Calibration(None)
    if isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float, str)):
        raise InvalidInputError(f"bandwidth must be a number, 'measure' or 'remeasure', got {bandwidth!r}")
    if isinstance(bandwidth, str):
        if bandwidth not in ("measure", "remeasure"):
            raise InvalidInputError(f"bandwidth must be a number, 'measure' or 'remeasure', got {bandwidth!r}")
        key = f"{backing_kind}|{executor.describe()}"
        cached = decode(stored)
        if bandwidth == "measure" and cached is not None and cached.get("key") == key:
            return Calibration({**cached, "source": "cached"})
        cal = {"key": key, **probe(executor, backing_kind, root), "measured_at": time.time()}
        return Calibration({**cal, "source": "measured"}, json.dumps(cal, sort_keys=True))
    if not math.isfinite(bandwidth) or bandwidth <= 0:
        raise InvalidInputError(f"bandwidth must be positive, got {bandwidth}")
    return Calibration({"source": "configured", "bytes_per_s": float(bandwidth)})


def decode(stored: str | None) -> dict[str, Any] | None:
    """A stored calibration, or None when there is none or it does not parse as one."""
    if not stored:
        return None
    try:
        cal = json.loads(stored)
    except ValueError:
        return None
    if not isinstance(cal, dict) or not isinstance(cal.get("bytes_per_s"), (int, float)) or cal["bytes_per_s"] <= 0:
        return None
    return cal


def probe(executor: Executor, backing_kind: str, root: str, nbytes: int = PROBE_BYTES,
          reps: int = 3) -> dict[str, Any]:
    """Measure upload and (for file-backed tiers) read bandwidth; bytes per second."""
    ex = executor
    buf = ex.pool.acquire(nbytes)
    try:
        buf.view().fill_(0x5A)
        best = math.inf
        for _ in range(reps):
            t0 = time.perf_counter()
            dst = ex.empty((nbytes,), torch.uint8)  # a restore allocates its output too
            ex.begin_uploads()
            ex.upload(dst, buf.view())
            done = ex.record()
            ex.finish_uploads()
            done.wait()
            best = min(best, time.perf_counter() - t0)
        h2d = nbytes / max(best, 1e-9)
        read = _read_bps(root, buf.mv()) if Capability.RANK_DIRS in tiers.capabilities(backing_kind) else None
    finally:
        buf.release()
    bps = h2d if read is None else min(h2d, read)
    return {"bytes_per_s": bps, "h2d_bytes_per_s": h2d, "read_bytes_per_s": read, "probe_bytes": nbytes}


def _read_bps(root: str, mv: memoryview) -> float:
    path = os.path.join(root, PROBE_NAME)
    if os.path.lexists(path):
        os.unlink(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        view = mv
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        got, view = 0, mv
        while view:
            n = os.preadv(fd, [view], got)
            if n <= 0:
                break
            got += n
            view = view[n:]
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
    return got / max(dt, 1e-9)
