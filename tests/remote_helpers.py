"""Shared helpers of the remote-tier tests: layouts, chains and checkpoint bytes."""

from __future__ import annotations

import random
import time

from conftest import make_layout

from prefixstore.base.keys import Prefix
from prefixstore.gpu.remote import RemoteConfig, RemoteTier

LAYOUT = make_layout(ranks=2)

SLACK = 0.25
"""Seconds a call may run past its own budget in these tests. A call that times out
returns within milliseconds of its budget: over the 1,932 timed calls of two runs of
test_remote_faults, _engine, _cluster and _bounds under a load average of 10 on the
2-core machine, no call ran more than 4 ms past its budget, and the slowest event
measured (a trickling server seeing its connection closed, polled every 20 ms) 88 ms.
0.25 s is three times that, yet below every budget the tests use (0.3 s and up): a
timeout twice as long as configured fails them."""


def chain(n: int, seed: int = 0) -> tuple[bytes, ...]:
    """The chained keys of an ``n``-block request."""
    return Prefix.from_ids(range(seed * 1000, seed * 1000 + n)).keys


def blobs_for(seed: int, ranks: int = 2, size: int = 4096) -> list[bytes]:
    """Deterministic per-rank bytes of one checkpoint."""
    rng = random.Random(seed)
    return [rng.randbytes(size + 17 * r) for r in range(ranks)]


def tier(url: str, layout=LAYOUT, **options) -> RemoteTier:
    """A tier with short budgets (a test's fault should not cost seconds)."""
    defaults = {"lookup_timeout": 0.5, "restore_timeout": 1.0, "write_timeout": 1.0,
                "reconnect_interval": 0.05}
    return RemoteTier.for_layout(url, layout, RemoteConfig(**{**defaults, **options}))


def store(t: RemoteTier, keys, start: int, end: int, seed: int, generation: int = 1,
          snapshot: bool = False) -> list[bytes]:
    """Put the checkpoint of blocks ``[start, end)`` of ``keys``; return its blobs."""
    blobs = blobs_for(seed, t.ranks)
    m = t.manifest_for(keys[end - 1], blobs, start=start, end=end, generation=generation,
                       snapshot=snapshot)
    assert t.put(keys[end - 1], m, blobs)
    return blobs


def timed(fn, *args, **kw):
    """``fn(*args, **kw)`` and the seconds it took."""
    t0 = time.monotonic()
    out = fn(*args, **kw)
    return out, time.monotonic() - t0


def within(took: float, budget: float) -> None:
    """Assert that a call that took ``took`` seconds kept to ``budget`` (plus SLACK)."""
    assert took <= budget + SLACK, f"{took:.3f} s against a budget of {budget} s (+{SLACK} s)"


def wait_until(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()
