"""One engine per directory, whatever happens to the ``LOCK`` file's name.

While an engine runs, its ``LOCK`` is deleted, or replaced by a new file: a second
engine opened in another process still gets ``LockedError``, ``audit`` still sees a
running engine and ``repair`` still refuses. After the first engine closes, the
directory opens again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_layout, store_tokens, tokens_for

from prefixstore.base import errors as E
from prefixstore.base.keys import Prefix
from prefixstore.engine import dirlock
from prefixstore.engine.api import LOCK_NAME, Engine
from prefixstore.engine.audit import engine_running
from prefixstore.engine.repair import repair

REPO = Path(__file__).resolve().parents[1]
L = make_layout()
CAP = 1 << 20
A = tokens_for(1, 3)

OPENER = """
import sys
from prefixstore.base import errors as E
from prefixstore.engine.api import Engine
from prefixstore.base.layout import Layout
root, layout, capacity = sys.argv[1], Layout.from_json(sys.argv[2]), int(sys.argv[3])
for _ in sys.stdin:  # one open per line read
    try:
        Engine.open(root, layout, capacity).close()
    except E.LockedError:
        print("LockedError", flush=True)
    else:
        print("opened", flush=True)
"""


class Opener:
    """Another process that opens (and closes) the cache each time it is asked."""

    def __init__(self, root: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", OPENER, root, L.to_json(), str(CAP)],
            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )

    def open(self) -> str:
        self.proc.stdin.write("open\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline().strip()
        assert line, f"the opener died (exit {self.proc.poll()})"
        return line

    def stop(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        finally:
            self.proc.kill()


def test_second_opener_is_locked_out_whatever_happened_to_lock(cache_dir):
    eng = Engine.open(cache_dir, L, CAP)
    other = Opener(cache_dir)
    lock = os.path.join(cache_dir, LOCK_NAME)
    try:
        try:
            assert store_tokens(eng, A).status == "stored"
            os.unlink(lock)
            assert other.open() == "LockedError"
            assert engine_running(cache_dir)
            Path(lock + ".new").write_text("")
            os.replace(lock + ".new", lock)  # a new file under the old name
            assert other.open() == "LockedError"
            with pytest.raises(E.LockedError):  # another engine in this process, too
                Engine.open(cache_dir, L, CAP)
            assert engine_running(cache_dir)
            with pytest.raises(E.LockedError):
                repair(cache_dir)
            assert eng.lookup(Prefix.from_tokens(A, 4)).hit  # the first engine is unharmed
            assert eng.audit().ok
        finally:
            eng.close()
        assert not engine_running(cache_dir)
        assert other.open() == "opened"
    finally:
        other.stop()
    with Engine.open(cache_dir, L, CAP) as again:
        assert again.restore(again.lookup(Prefix.from_tokens(A, 4))) is not None
        assert again.audit().ok


PROBER = """
import sys, time
from prefixstore.engine.audit import engine_running
root, until = sys.argv[1], time.monotonic() + float(sys.argv[2])
print("probing", flush=True)
n = 0
while time.monotonic() < until:
    engine_running(root)
    n += 1
print(n, flush=True)
"""


def test_an_audit_probing_the_lock_never_locks_out_an_opener(cache_dir):
    """``audit``'s probe (an instant's shared lock, in another process, in a tight loop)
    never makes an open or a repair fail with LockedError: only an engine holds it."""
    Engine.open(cache_dir, L, CAP).close()
    prober = subprocess.Popen([sys.executable, "-c", PROBER, cache_dir, "60"], stdout=subprocess.PIPE,
                              text=True, cwd=REPO)
    try:
        assert prober.stdout.readline().strip() == "probing"
        for _ in range(500):
            dirlock.acquire(cache_dir, "is open in another engine").release()
        for _ in range(30):
            Engine.open(cache_dir, L, CAP).close()
        repair(cache_dir)
        with Engine.open(cache_dir, L, CAP) as eng:  # an engine holding it is still seen
            assert engine_running(cache_dir)
            with pytest.raises(E.LockedError):
                dirlock.acquire(cache_dir, "is open in another engine")
            assert eng.audit().ok
    finally:
        prober.kill()
        prober.wait()
