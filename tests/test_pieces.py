"""A shard read in pieces on several threads (``gpu/pieces.py``) gives the digest and
the bytes of one sequential read, never returns while a helper may still write into a
destination, and a restore that uses it still refuses every damaged byte."""

from __future__ import annotations

import errno
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import xxhash
from conftest import make_layout, seg_tensors

from prefixstore.base.keys import Prefix
from prefixstore.engine.api import Engine
from prefixstore.fuzz.faultfs import flip_bit
from prefixstore.gpu import pieces
from prefixstore.gpu.pieces import PROBE_S, SAMPLE_S, WINDOW_S, Helpers, Pace, Spare

MIB = 1 << 20


class CountingPool(ThreadPoolExecutor):
    submitted = 0

    def submit(self, *a, **k):
        self.submitted += 1
        return super().submit(*a, **k)


@pytest.fixture
def helpers():
    pool = ThreadPoolExecutor(max_workers=3, thread_name_prefix="piece-test")
    yield Helpers(pool, 3, when_faster=False)
    pool.shutdown(wait=True)


def _file(tmp_path, n: int) -> tuple[str, bytes]:
    data = os.urandom(n)
    path = tmp_path / "f"
    path.write_bytes(data)
    return str(path), data


def _split(out: memoryview, step: int, start: int = 0) -> list[tuple[int, memoryview]]:
    return [(start + i, out[i : i + step]) for i in range(0, len(out), step)]


def test_pieces_read_in_parallel_give_the_sequential_digest_and_bytes(tmp_path, helpers):
    path, data = _file(tmp_path, 3 * MIB + 12345)
    out = bytearray(len(data))
    scratch = bytearray(64 << 10)  # a reused destination: read in turn by the hashing thread
    head = 100_000
    todo = [(p, memoryview(scratch)[: len(v)]) for p, v in _split(memoryview(out)[:head], 64 << 10)]
    shared = [True] * len(todo)
    placed = _split(memoryview(out)[head:], 256 << 10, head)
    todo += placed
    shared += [False] * len(placed)
    h = xxhash.xxh3_128()
    fd = os.open(path, os.O_RDONLY)
    try:
        assert pieces.read_hashed(fd, todo, h, helpers, shared) == len(data)
    finally:
        os.close(fd)
    assert h.hexdigest() == xxhash.xxh3_128(data).hexdigest()
    assert bytes(out[head:]) == data[head:]


def test_a_file_cut_short_stops_at_the_cut_piece(tmp_path, helpers):
    path, data = _file(tmp_path, 2 * MIB + 7)
    out = bytearray(4 * MIB)  # planned for a larger file
    h = xxhash.xxh3_128()
    fd = os.open(path, os.O_RDONLY)
    try:
        assert pieces.read_hashed(fd, _split(memoryview(out), 256 << 10), h, helpers) == len(data)
    finally:
        os.close(fd)
    assert h.hexdigest() == xxhash.xxh3_128(data).hexdigest()
    assert bytes(out[: len(data)]) == data


def _grouped(out: memoryview, sizes: list[int], per: int) -> list[tuple[int, list[memoryview]]]:
    """``out`` cut into buffers of ``sizes`` (cycled), ``per`` buffers a piece."""
    bufs, pos, k = [], 0, 0
    while pos < len(out):
        n = sizes[k % len(sizes)]
        bufs.append((pos, out[pos : pos + n]))
        pos += n
        k += 1
    return [(bufs[i][0], [b for _, b in bufs[i : i + per]]) for i in range(0, len(bufs), per)]


@pytest.mark.parametrize("cut", [None, 5 * 1000 + 3])  # the file ends inside a group, inside a buffer
def test_pieces_of_several_buffers_are_read_in_one_call_and_hashed_in_order(tmp_path, helpers, monkeypatch, cut):
    """A piece that is a list of buffers (``verify._pieces`` groups small destinations)
    fills them in order with one ``preadv``; a file cut short stops inside the buffer it
    ends in, and what was read is what was hashed."""
    path, data = _file(tmp_path, 64 * 1000)
    if cut is not None:
        data = data[:cut]
        with open(path, "r+b") as f:
            f.truncate(cut)
    out = bytearray(64 * 1000)
    todo = _grouped(memoryview(out), [1000, 7, 993, 2000], 6)
    calls = []
    real = os.preadv

    def counting(fd, bufs, pos):
        calls.append(len(bufs))
        return real(fd, bufs, pos)

    monkeypatch.setattr(os, "preadv", counting)
    h = xxhash.xxh3_128()
    fd = os.open(path, os.O_RDONLY)
    try:
        assert pieces.read_hashed(fd, todo, h, helpers) == len(data)
    finally:
        os.close(fd)
    assert h.hexdigest() == xxhash.xxh3_128(data).hexdigest()
    assert bytes(out[: len(data)]) == data
    assert bytes(out[len(data):]) == bytes(len(out) - len(data))
    if cut is None:
        assert calls.count(6) == len(todo) - 1  # one call per group (the last may be shorter)


def test_an_io_error_is_raised_only_once_every_taken_piece_has_landed(tmp_path, helpers, monkeypatch):
    """A helper's piece fails while later pieces are still being read by other helpers:
    the error reaches the caller only after those reads finished, so nothing writes
    into the destination after the call returns."""
    path, data = _file(tmp_path, 4 * MIB)
    out = bytearray(len(data))
    step = 512 << 10
    real = os.preadv
    bad = step  # the second piece fails
    in_flight = []

    def preadv(fd, bufs, pos):
        if threading.current_thread().name.startswith("piece-test"):
            if pos == bad:
                raise OSError(errno.EIO, "injected")
            if pos > bad:
                in_flight.append(pos)
                time.sleep(0.05)  # still reading when the failure is found
                try:
                    return real(fd, bufs, pos)
                finally:
                    in_flight.remove(pos)
        elif pos == bad:  # the hashing thread never reads it: make it a helper's
            time.sleep(0.2)
        return real(fd, bufs, pos)

    monkeypatch.setattr(pieces.os, "preadv", preadv)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="injected"):
            pieces.read_hashed(fd, _split(memoryview(out), step), xxhash.xxh3_128(), helpers)
        assert in_flight == []
    finally:
        os.close(fd)


def test_a_shut_down_pool_leaves_the_read_to_the_hashing_thread(tmp_path):
    path, data = _file(tmp_path, 2 * MIB)
    out = bytearray(len(data))
    pool = ThreadPoolExecutor(max_workers=1)
    pool.shutdown()
    h = xxhash.xxh3_128()
    fd = os.open(path, os.O_RDONLY)
    try:
        n = pieces.read_hashed(fd, _split(memoryview(out), 256 << 10), h, Helpers(pool, 1, when_faster=False))
    finally:
        os.close(fd)
    assert n == len(data) and bytes(out) == data and h.hexdigest() == xxhash.xxh3_128(data).hexdigest()


def test_the_pace_tries_each_mode_then_keeps_the_faster():
    p = Pace()
    assert not p.helps(0.0)  # nothing measured: alone first
    p.record(False, 2.0, 1, 0.0)
    assert p.helps(0.1)  # then with helpers
    p.record(True, 1.0, 1, 0.1)
    assert p.helps(0.2)  # helpers measured faster
    p.record(True, 4.0, 1, 0.2)  # the machine got busy: helped now averages 2.5
    assert not p.helps(0.3)
    assert p.helps(0.0 + PROBE_S + 0.01) is False  # alone is stale: measured again
    p.record(False, 2.0, 1, 0.6)
    assert p.helps(0.2 + PROBE_S + 0.01)  # helpers stale: tried again, once
    p.record(True, 8.0, 1, 0.75)
    assert not p.helps(0.8)


def _spare(cpus: float) -> Spare:
    """A reading of ``cpus`` spare CPUs that stands for the whole test."""
    return Spare(at=time.perf_counter() + 60, value=cpus)


def _pace(alone: float, helped: float) -> Pace:
    later = time.perf_counter() + 60  # both measurements fresh for the whole test
    return Pace(alone=alone, helped=helped, alone_at=later, helped_at=later)


def test_helpers_forced_or_none_ignore_the_pace_and_the_spare_cpus():
    slow = _pace(1.0, 9.0)
    assert Helpers(None, 4, pace=slow, spare=_spare(4)).now() == 0  # type: ignore[arg-type]
    assert Helpers(None, 4, when_faster=False, pace=slow, spare=_spare(0)).now() == 4  # type: ignore[arg-type]
    assert Helpers(None, 0, pace=Pace()).now() == 0  # type: ignore[arg-type]


def test_as_many_helpers_as_spare_cpus_and_none_on_a_busy_machine():
    fast = _pace(9.0, 1.0)
    assert Helpers(None, 4, pace=fast, spare=_spare(0.3)).now() == 0  # type: ignore[arg-type]
    assert Helpers(None, 4, pace=fast, spare=_spare(1.6)).now() == 2  # type: ignore[arg-type]
    assert Helpers(None, 4, pace=fast, spare=_spare(7)).now() == 4  # type: ignore[arg-type]
    assert Helpers(None, 2, pace=fast, spare=Spare(stat=lambda: None)).now() == 2  # type: ignore[arg-type]


def test_spare_cpus_from_idle_ticks_and_own_cpu_time():
    """Two CPUs (ticks of 10 ms): a first reading, or one after a pause, counts the
    threads runnable now; then over one second, 0.5 s idle and this process's own 0.5 s
    of CPU leave one CPU for it: none beyond the reading thread."""
    readings = iter([(1000, 5000, 2, 1), (1050, 5200, 2, 5), (1250, 5400, 2, 5), (9000, 9000, 2, 4)])
    own = iter([3.0, 3.5, 3.5, 9.0])
    s = Spare(stat=lambda: next(readings), own=lambda: next(own), hz=100)
    assert s.now(0.0) == 1.0  # only this thread runnable: one CPU spare
    assert s.now(1.0) == pytest.approx(0.0)
    assert s.now(1.0 + SAMPLE_S / 2) == pytest.approx(0.0)  # within the interval: not read again
    assert s.now(2.0) == pytest.approx(1.0)  # then both idle: one CPU spare
    assert s.now(2.0 + WINDOW_S + 0.1) == -2.0  # after a pause: four runnable on two CPUs


@pytest.mark.parametrize("faster", ["helped", "alone"])
def test_a_read_takes_helpers_only_while_they_are_measured_faster(tmp_path, faster):
    """A read follows its pace (no helper task when reads alone were faster) and
    records how long it took in the mode it used; the bytes and digest are the same."""
    path, data = _file(tmp_path, 2 * MIB + 5)
    rates = (1.0, 5.0) if faster == "helped" else (5.0, 1.0)
    pace = _pace(rates[1], rates[0])
    pool = CountingPool(max_workers=2)
    try:
        out = bytearray(len(data))
        h = xxhash.xxh3_128()
        fd = os.open(path, os.O_RDONLY)
        try:
            n = pieces.read_hashed(fd, _split(memoryview(out), 256 << 10), h, Helpers(pool, 2, pace=pace, spare=_spare(4)))
        finally:
            os.close(fd)
    finally:
        pool.shutdown(wait=True)
    assert n == len(data) and bytes(out) == data and h.hexdigest() == xxhash.xxh3_128(data).hexdigest()
    assert (pool.submitted >= 1) == (faster == "helped")
    measured, other = (pace.helped, pace.alone) if faster == "helped" else (pace.alone, pace.helped)
    assert measured is not None and measured < rates[0 if faster == "helped" else 1]  # a real read: far below 1 s/byte
    assert other == rates[1 if faster == "helped" else 0]


@pytest.mark.parametrize("where", ["none", "first piece", "middle", "last byte"])
@pytest.mark.parametrize("into", [False, True])
def test_a_restore_read_in_pieces_refuses_any_damaged_byte(tmp_path, where, into):
    """A shard of many pieces, read with helpers forced on: restored exactly when
    intact; any flipped byte (whichever thread read it) is a miss."""
    bt = 256
    L = make_layout(snapshot=False, bt=bt)
    blocks = max(4, 3 * pieces.PIECE // (bt * L.payload_bytes(1, False)) + 1)
    toks = list(range(blocks * bt))
    root = str(tmp_path / "c")
    with Engine.open(root, L, 1 << 30) as eng:
        assert eng.store(Prefix.from_tokens(toks, bt), seg_tensors(L, toks)[0]).ok
    (path,) = [os.path.join(dp, f) for dp, _, fs in os.walk(root) for f in fs if f.endswith(".st")]
    size = os.path.getsize(path)
    assert size > 3 * pieces.PIECE
    if where != "none":
        flip_bit(path, {"first piece": size // 2 - pieces.PIECE - 3, "middle": size // 2, "last byte": size - 1}[where])
    with Engine.open(root, L, 1 << 30) as eng:
        pool = CountingPool(max_workers=2)
        eng.transfers.pieces = Helpers(pool, 2, when_faster=False)
        try:
            m = eng.lookup(Prefix.from_tokens(toks, bt))
            outs = [{s.name: torch.empty((m.tokens, *s.shape), dtype=s.torch_dtype) for s in L.segments}]
            r = eng.restore(m, into=outs) if into else eng.restore(m)
        finally:
            pool.shutdown(wait=True)
        assert pool.submitted >= 1  # the shard was read with helpers
        if where == "none":
            assert r is not None
            want = seg_tensors(L, toks)[0]
            assert all(torch.equal(r.segments[0][n], want[n]) for n in want)
        else:
            assert r is None
            assert eng.counters.snapshot().get("lookups.damaged_on_restore") == 1
