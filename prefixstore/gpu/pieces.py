"""A file read in pieces on several threads, hashed in file order on one.

Reading from the page cache is a copy that runs at one core's memory speed, and the
checksum another pass over the same bytes. ``read_hashed`` splits a read into pieces:
helper threads and the calling thread read pieces as they claim them (in file order),
while the calling thread feeds each piece to the hasher as soon as it has landed, in
order, so the digest is the one a single sequential read gives. Nothing is returned
before every piece that was claimed has landed: no helper writes into a destination
after the call returns.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future

import attrs

PIECE = 1 << 19
"""Bytes per piece: small enough that the last piece's hash (what cannot overlap a
read) is short, large enough that the hand-off costs little against its copy."""


PROBE_S = 0.5
"""Seconds a mode's measured speed stands before a read tries that mode again."""

_WEIGHT = 0.5
"""Weight of a new measurement in a mode's average speed."""

_MARGIN = 0.9
"""Reads with helpers are taken only while measured faster than this share of the
time of reads alone (a helper's hand-off has a cost the average may not show yet)."""

SAMPLE_S = 0.1
"""Seconds between two readings of the CPUs' idle time (``/proc/stat``)."""

WINDOW_S = 1.0
"""The longest interval between two readings whose idle time still says what runs now."""


@attrs.define(eq=False, slots=True)
class Pace:
    """The measured speed of recent reads in pieces with helpers and without (wall
    seconds per byte, an exponential average of each) and when each was last
    measured (``time.perf_counter``): whether helpers, where CPUs are spare, make
    reads faster (a helper that waits for a CPU while the hashing thread waits for its
    piece makes them slower)."""

    alone: float | None = None
    helped: float | None = None
    alone_at: float = float("-inf")
    helped_at: float = float("-inf")

    def helps(self, now: float) -> bool:
        """Whether the next read takes helpers: a mode not measured within ``PROBE_S``
        is tried (the read alone first), else the faster one."""
        if self.alone is None or now - self.alone_at > PROBE_S:
            return False
        if self.helped is None or now - self.helped_at > PROBE_S:
            return True
        return self.helped < _MARGIN * self.alone

    def record(self, helped: bool, seconds: float, nbytes: int, now: float) -> None:
        """One read of ``nbytes`` took ``seconds``, with helpers or without."""
        if nbytes <= 0:
            return
        rate = seconds / nbytes
        if helped:
            self.helped = rate if self.helped is None else self.helped + _WEIGHT * (rate - self.helped)
            self.helped_at = now
        else:
            self.alone = rate if self.alone is None else self.alone + _WEIGHT * (rate - self.alone)
            self.alone_at = now


def _proc_stat() -> tuple[int, int, int, int] | None:
    """(idle, total) clock ticks since boot of the CPUs this process may run on, how
    many they are, and the threads runnable now on the whole machine, from
    ``/proc/stat`` (idle counts I/O wait); None where there is none."""
    cpus = {f"cpu{c}" for c in _affinity()}
    idle = total = seen = running = 0
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if line.startswith(b"procs_running"):
                    running = int(line.split()[1])
                if not line.startswith(b"cpu") or line.startswith(b"cpu "):
                    continue
                name, *ticks = line.split()
                if name.decode() in cpus:
                    t = [int(x) for x in ticks]
                    idle += t[3] + t[4]
                    total += sum(t[:8])  # user..steal (guest time is inside user)
                    seen += 1
    except (OSError, ValueError, IndexError):
        return None
    return (idle, total, seen, running) if total else None


def _affinity() -> list[int]:
    """The CPUs this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this system
        return list(range(os.cpu_count() or 1))


_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@attrs.define(eq=False, slots=True)
class Spare:
    """CPUs left to this process beyond the thread that reads: over the interval since
    the last reading (``SAMPLE_S`` to ``WINDOW_S``), the idle CPU time of the CPUs it
    may run on (``/proc/stat``) plus its own CPU time, per second, less one; at a first
    reading or after a longer pause, the CPUs less the threads runnable at that moment
    (this one among them). What other processes run now, not the one-minute load
    average (which lags a burst by a minute)."""

    stat: Callable[[], tuple[int, int, int, int] | None] = _proc_stat
    own: Callable[[], float] = time.process_time
    hz: float = _HZ
    last: tuple[int, int, float] | None = None
    at: float = float("-inf")
    value: float | None = None

    def now(self, t: float) -> float | None:
        """The spare CPUs (None where ``/proc/stat`` is missing)."""
        if t - self.at < SAMPLE_S:
            return self.value
        got = self.stat()
        if got is None:
            self.value = None
            return None
        ncpu = got[2]
        cur = (got[0], got[1], self.own())
        prev, prev_at, self.last, self.at = self.last, self.at, cur, t
        if prev is None or t - prev_at > WINDOW_S:
            self.value = float(ncpu - got[3])
        elif cur[1] > prev[1]:
            wall = (cur[1] - prev[1]) / self.hz / ncpu
            free = (cur[0] - prev[0]) / self.hz + max(0.0, cur[2] - prev[2])
            self.value = min(float(ncpu), free / wall) - 1.0
        return self.value


@attrs.frozen(eq=False)
class Helpers:
    """Threads that read pieces for ``read_hashed``: ``count`` tasks at most per read,
    on ``pool`` (which must not be the pool whose threads call ``read_hashed`` and wait:
    a helper task never waits, so any pool of its own is safe).

    With ``when_faster`` a read takes helpers only while other processes leave CPUs
    spare (``Spare``, from ``/proc/stat`` over the last tenth of a second to a second:
    as many helpers as spare CPUs, rounded) and reads with them are measured faster than reads
    without (``Pace``; each mode is measured again at least every ``PROBE_S``). A
    change of load turns helpers on or off within a second."""

    pool: Executor
    count: int
    when_faster: bool = True
    pace: Pace = attrs.field(factory=Pace)
    spare: Spare = attrs.field(factory=Spare)

    def now(self) -> int:
        """How many helpers a read takes now."""
        if not self.when_faster or self.count < 1:
            return self.count
        t = time.perf_counter()
        spare = self.spare.now(t)
        n = self.count if spare is None else min(self.count, int(spare + 0.5))
        return n if n >= 1 and self.pace.helps(t) else 0

    def took(self, helped: bool, seconds: float, nbytes: int) -> None:
        """Record a read in pieces (``Pace.record``) when the pace decides."""
        if self.when_faster and self.count >= 1:
            self.pace.record(helped, seconds, nbytes, time.perf_counter())


def usable_cpus() -> int:
    """How many CPUs this process may run on."""
    return len(_affinity())


Destination = memoryview | Sequence[memoryview]
"""Where one piece lands: a buffer, or buffers filled one after the other (one
``preadv`` for several small destinations that follow each other in the file)."""


def nbytes(out: Destination) -> int:
    """The bytes ``out`` takes."""
    return len(out) if out.__class__ is memoryview else sum(map(len, out))


def read_full(fd: int, pos: int, out: Destination) -> int:
    """Read ``nbytes(out)`` bytes at ``pos`` into ``out``; fewer only at end of file."""
    if out.__class__ is not memoryview:
        return _read_vector(fd, pos, out)
    got, n = 0, len(out)
    while got < n:
        k = os.preadv(fd, [out[got:]], pos + got)
        if k <= 0:
            break
        got += k
    return got


def _read_vector(fd: int, pos: int, out: Sequence[memoryview]) -> int:
    """``read_full`` into buffers: one ``preadv``; after a short read, the rest buffer
    by buffer from where it stopped."""
    got = os.preadv(fd, out, pos)
    if got <= 0:
        return 0
    if got >= nbytes(out):
        return got
    done = 0
    for b in out:
        n = len(b)
        if done + n <= got:
            done += n
            continue
        have = max(0, got - done)  # of this buffer, already read
        k = read_full(fd, pos + done + have, b[have:])
        done += have + k
        if have + k < n:  # the end of the file
            break
    return done


def hash_landed(hasher, out: Destination, k: int) -> None:
    """Feed the first ``k`` bytes of ``out`` to ``hasher``."""
    if out.__class__ is memoryview:
        hasher.update(out[:k])
        return
    if k >= nbytes(out):  # all of it (the common case)
        for b in out:
            hasher.update(b)
        return
    for b in out:
        if k <= 0:
            return
        n = len(b)
        hasher.update(b if n <= k else b[:k])
        k -= n


@attrs.define(eq=False, slots=True)
class _Claims:
    """The pieces of one read: which are taken, which landed, what each read got."""

    pieces: Sequence[tuple[int, Destination]]
    shared: Sequence[bool]
    """Pieces read by the hashing thread only (their destination is reused)."""
    landed: list[threading.Event]
    got: list[int]
    errors: list[BaseException | None]
    lock: threading.Lock = attrs.field(factory=threading.Lock)
    next: int = 0
    closed: bool = False

    def take(self) -> int | None:
        """The next piece no one has taken (None once all are or the read ended)."""
        with self.lock:
            while not self.closed and self.next < len(self.pieces):
                i = self.next
                self.next += 1
                if not self.shared[i]:
                    return i
            return None

    def read(self, fd: int, i: int) -> None:
        pos, out = self.pieces[i]
        try:
            self.got[i] = read_full(fd, pos, out)
        except BaseException as exc:  # raised by the hashing thread, in order
            self.errors[i] = exc
        finally:
            self.landed[i].set()

    def close(self) -> int:
        """No piece is taken from now on; how many were."""
        with self.lock:
            self.closed = True
            return self.next


def _help(fd: int, claims: _Claims) -> None:
    while (i := claims.take()) is not None:
        claims.read(fd, i)


def read_hashed(fd: int, pieces: Sequence[tuple[int, Destination]], hasher, helpers: Helpers | None = None,
                shared: Sequence[bool] | None = None) -> int:
    """Read each ``(file offset, destination)`` of ``pieces`` (contiguous, in file
    order) and feed them to ``hasher`` in that order; the bytes read and hashed, up to
    and including the first piece cut short by the end of the file.

    With ``helpers`` (as many as ``Helpers.now`` gives) the pieces not marked
    ``shared`` are read in parallel by helper tasks and this thread; a ``shared`` piece (its destination is reused by the next)
    is read here, in its turn. An I/O error is raised once every piece taken landed.
    """
    n = len(pieces)
    flags = shared if shared is not None else [False] * n
    parallel = n - sum(flags)
    if helpers is None or parallel < 2:
        return _read_alone(fd, pieces, hasher)
    count = helpers.now()
    t0 = time.perf_counter()
    total = _read_alone(fd, pieces, hasher) if count < 1 else _read_helped(fd, pieces, hasher, helpers, count,
                                                                            flags, parallel)
    helpers.took(count >= 1, time.perf_counter() - t0, total)
    return total


def _read_alone(fd: int, pieces: Sequence[tuple[int, Destination]], hasher) -> int:
    total = 0
    for pos, out in pieces:
        k = read_full(fd, pos, out)
        hash_landed(hasher, out, k)
        total += k
        if k < nbytes(out):
            break
    return total


def _read_helped(fd: int, pieces: Sequence[tuple[int, Destination]], hasher, helpers: Helpers, count: int,
                 flags: Sequence[bool], parallel: int) -> int:
    n = len(pieces)
    claims = _Claims(pieces, flags, [threading.Event() for _ in range(n)], [0] * n, [None] * n)
    tasks: list[Future] = []
    try:
        for _ in range(min(count, parallel - 1)):
            tasks.append(helpers.pool.submit(_help, fd, claims))
    except RuntimeError:  # the pool is shut down (the engine closing): this thread reads the rest
        pass
    try:
        return _hash_in_order(fd, claims, hasher)
    finally:
        taken = claims.close()
        for t in tasks:
            t.cancel()
        for i in range(taken):
            if not flags[i]:
                claims.landed[i].wait()


def _hash_in_order(fd: int, claims: _Claims, hasher) -> int:
    """The hashing thread's part: each piece in order, reading what no one has taken."""
    total = 0
    for j, (pos, out) in enumerate(claims.pieces):
        if claims.shared[j]:
            k = read_full(fd, pos, out)
        else:
            while not claims.landed[j].is_set():
                i = claims.take()
                if i is None:
                    claims.landed[j].wait()
                    break
                claims.read(fd, i)
            err = claims.errors[j]
            if err is not None:
                raise err
            k = claims.got[j]
        hash_landed(hasher, out, k)
        total += k
        if k < nbytes(out):
            break
    return total
