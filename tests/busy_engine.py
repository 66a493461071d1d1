"""A busy, healthy engine for tests/test_audit_live.py (not a test module).

    python tests/busy_engine.py ROOT THREADS

Opens a two-rank engine at ROOT with a capacity that forces evictions, then runs
THREADS callers that store conversations sharing prefixes (splits and extensions),
look up and restore them, pin, evict and compact, until stdin is closed. Prints
``READY`` once every thread has stored something, and on exit one line
``OPS n ERRORS e``; an error is any exception a caller saw.
"""

from __future__ import annotations

import os
import random
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conftest import make_layout, seg_tensors, snap_tensors, tokens_for  # noqa: E402

from prefixstore.base.keys import Prefix  # noqa: E402
from prefixstore.engine.api import Engine  # noqa: E402

CAPACITY = 48 << 10


def main(root: str, threads: int) -> int:
    layout = make_layout(ranks=2)
    bt = layout.block_tokens
    shared = tokens_for(1, 3)
    convs = [shared + tokens_for(100 + i, 9) for i in range(threads * 2)]
    stop = threading.Event()
    started = threading.Barrier(threads + 1)
    ops, errors = [0] * threads, []

    def caller(i: int) -> None:
        rng = random.Random(i)
        first = True
        while not stop.is_set():
            toks = convs[rng.randrange(len(convs))][: rng.randint(1, 12) * bt]
            try:
                eng.store(Prefix.from_tokens(toks, bt), seg_tensors(layout, toks), snap_tensors(layout, toks))
                m = eng.lookup(Prefix.from_tokens(toks, bt))
                if m.hit:
                    with eng.pinned(m):
                        eng.restore(m)
                roll = rng.random()
                if roll < 0.05:
                    eng.evict(4096)
                elif roll < 0.08:
                    eng.compact()
            except Exception as exc:  # a healthy engine's callers see no error
                errors.append(f"{type(exc).__name__}: {exc}")
            ops[i] += 1
            if first:
                first = False
                started.wait()

    with Engine.open(root, layout, capacity_bytes=CAPACITY) as eng:
        workers = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(threads)]
        for w in workers:
            w.start()
        started.wait()
        print("READY", flush=True)
        sys.stdin.read()  # until the test closes our stdin
        stop.set()
        for w in workers:
            w.join()
    print(f"OPS {sum(ops)} ERRORS {len(errors)}", *errors[:5], sep="\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
