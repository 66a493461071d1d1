"""One engine process of the shared-remote tests (``test_remote_engine.py``).

    python remote_engine_worker.py BARRIER CACHE URL INDEX WORKERS REQUESTS [NAMESPACE]

Store the requests ``i`` with ``i % WORKERS == INDEX``, flush the remote's queue, mark
``BARRIER/INDEX`` and wait until every worker has; then look up and restore every
request, compare each restored tensor bit for bit with what was stored, and print a JSON
summary ``{"local": n, "remote": n, "miss": n}`` (a wrong byte raises: exit status 1).
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conftest import make_layout, seg_tensors, snap_tensors, store_tokens, tokens_for  # noqa: E402

from prefixstore.base.keys import Prefix  # noqa: E402
from prefixstore.engine.api import Engine  # noqa: E402

LAYOUT = make_layout(ranks=2)
OPTIONS = {"lookup_timeout": 2.0, "restore_timeout": 5.0, "write_timeout": 5.0}


def request(i: int) -> list[int]:
    """Request ``i``: requests of one family share their first blocks."""
    family = tokens_for(1000 + i % 3, 8)
    return family[: 4 * (2 + i % 5)] + tokens_for(i, 2)


def restored_exactly(eng: Engine, tokens: list[int], r) -> None:
    m = r.match
    want = seg_tensors(LAYOUT, tokens[: m.tokens])
    snaps = snap_tensors(LAYOUT, tokens[: m.tokens])
    for rank in range(LAYOUT.ranks):
        for name, t in r.segments[rank].items():
            if not t.equal(want[rank][name][m.gpu_tokens:]):
                raise AssertionError(f"wrong bytes: request rank {rank} {name} ({m.source})")
        for name, t in r.snapshot[rank].items():
            if not t.equal(snaps[rank][name]):
                raise AssertionError(f"wrong snapshot: rank {rank} {name} ({m.source})")


def barrier(directory: str, index: int, workers: int, timeout: float = 60.0) -> None:
    open(os.path.join(directory, str(index)), "w").close()
    deadline = time.monotonic() + timeout
    while len(os.listdir(directory)) < workers:
        if time.monotonic() > deadline:
            raise TimeoutError("the other workers did not store in time")
        time.sleep(0.02)


def main(directory: str, cache: str, url: str, index: int, workers: int, requests: int,
         namespace: str = "default") -> None:
    counts = {"local": 0, "remote": 0, "miss": 0}
    with Engine.open(cache, LAYOUT, 1 << 30, remote=url, remote_options={**OPTIONS, "namespace": namespace}) as eng:
        for i in range(index, requests, workers):
            assert store_tokens(eng, request(i)).ok
        assert eng.remote.flush(30.0)
        barrier(directory, index, workers)
        for i in range(requests):
            tokens = request(i)
            m = eng.lookup(Prefix.from_tokens(tokens, LAYOUT.block_tokens))
            r = eng.restore(m) if m.hit else None
            if r is None or m.blocks != len(tokens) // LAYOUT.block_tokens:
                counts["miss"] += 1
                continue
            restored_exactly(eng, tokens, r)
            counts[m.source] += 1
        assert eng.audit().ok
    print(json.dumps(counts))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7]), *sys.argv[7:8])
