"""The one verified read of a shard from a tier, and the checks it makes.

Every path that trusts shard bytes (restore, the prior-record check of a failed store,
audit, recovery's re-attaching) reads and checks them here and gets a typed outcome:

- ``Shard``: the bytes passed (size and checksum against the catalog row, and the
  header when asked): ``data`` (bytes) or ``buffer`` (a staging ``Buffer`` the caller
  releases);
- ``Damage(why)``: the tier answered and the shard is missing, not a regular file,
  the wrong size, altered, or its header names another shard: proof of damage;
- ``Transient(why)``: an I/O error or a rank that cannot answer: proves nothing.
"""

from __future__ import annotations

import bisect
import itertools
import os
import threading
from collections.abc import Mapping

import attrs
import torch
import xxhash

from prefixstore.base.errors import NotRegularFileError, RankUnavailableError, ShardError
from prefixstore.base.layout import Layout
from prefixstore.gpu import fileio, pieces, shards
from prefixstore.gpu.executor import Buffer, CopyStats, StagingPool
from prefixstore.gpu.pieces import Helpers
from prefixstore.gpu.tier import Capability, Tier, has


@attrs.frozen
class Damage:
    """The shard is not what the catalog says: ``why``."""

    why: str


@attrs.frozen
class Transient:
    """The shard could not be read (``unavailable``: the rank cannot answer at all)."""

    why: str
    unavailable: bool = False


@attrs.frozen
class Header:
    """What a shard's header must say: the layout, its token rows, whether it carries a
    snapshot, and its metadata (key, generation, span, rank)."""

    layout: Layout
    tokens: int
    with_snapshot: bool
    meta: Mapping[str, str]


@attrs.define(eq=False)
class Shard:
    """Verified shard bytes: ``data``, or ``buffer`` (the caller's reference); with its
    decoded ``segments`` and ``snapshot`` tensors when a header was checked."""

    data: bytes | None = None
    buffer: Buffer | None = None
    segments: dict[str, torch.Tensor] = attrs.field(factory=dict)
    snapshot: dict[str, torch.Tensor] = attrs.field(factory=dict)


def read(
    tier: Tier,
    name: str,
    size: int,
    checksum: str,
    *,
    pool: StagingPool | None = None,
    stats: CopyStats | None = None,
    header: Header | None = None,
    helpers: Helpers | None = None,
) -> Shard | Damage | Transient:
    """Read ``name`` from ``tier`` and check it against its catalog row (``size``,
    ``checksum``) and, when given, ``header``.

    With ``pool`` the shard lands in a staging buffer (read in place where the tier
    ``READS_INTO``; copies are counted in ``stats``) and its header, if asked, is
    parsed there without copying; otherwise it is read as bytes. ``helpers``: threads
    that read pieces of it in parallel (``gpu/pieces.py``).
    """
    if pool is None:
        got = _read_bytes(tier, name)
        return got if not isinstance(got, bytes) else check(got, size, checksum, header, name)
    buf = pool.acquire(size)
    try:
        if has(tier, Capability.READS_FD):  # hashed as it lands
            got = _guarded(tier.read_shard_with, name, lambda fd: _read_whole(fd, size, buf.mv(), helpers))  # type: ignore[attr-defined]
            n, digest = got if isinstance(got, tuple) else (got, None)
        else:
            n, digest = _read_into(tier, name, buf.mv(), stats), None
    except BaseException:
        buf.release()
        raise
    if isinstance(n, Damage | Transient):
        buf.release()
        return n
    if stats is not None:
        stats.add(tier_read_bytes=min(n, size))
    why = _size_problem(n, size, name)
    if why is None and (digest if digest is not None else shards.checksum(buf.mv())) != checksum:
        why = f"shard {name}: checksum mismatch"
    if why is None and header is not None:
        parsed = parse_header(buf, header)
        if isinstance(parsed, Damage):
            why = parsed.why
        else:
            return Shard(buffer=buf, segments=parsed[0], snapshot=parsed[1])
    if why is not None:
        buf.release()
        return Damage(why)
    return Shard(buffer=buf)


Destination = pieces.Destination

Placement = Mapping[str, tuple[int, Destination]]
"""Where a placed read puts a shard's tensors: ``entry name -> (byte offset inside the
entry, destination)``; the destination takes the entry's bytes from that offset on, as
many as it holds (pieces: the first piece's bytes, then the next one's, ...). Every
other byte is read and hashed, and kept nowhere."""


def read_placed(tier: Tier, name: str, size: int, checksum: str, header: Header, place: Placement,
                stats: CopyStats | None = None, helpers: Helpers | None = None) -> Shard | Damage | Transient | None:
    """Read ``name`` straight into the destinations of ``place`` (the caller's final
    buffers: no staging, no second copy), hashing each piece as it lands, and check it
    as ``read`` does: the size, the checksum over every byte of the file, the header
    (against ``header``). On ``Damage`` or ``Transient`` the destinations hold whatever
    was read: the caller must not use them. None when the tier cannot (no ``READS_FD``).
    ``helpers``: threads that read pieces of it in parallel (``gpu/pieces.py``).
    """
    if not has(tier, Capability.READS_FD):
        return None
    got = _guarded(tier.read_shard_with, name,  # type: ignore[attr-defined]
                   lambda fd: _read_placed(fd, name, size, checksum, header, place, helpers))
    if isinstance(got, Transient | Damage):
        return got
    n, why = got
    if stats is not None:
        stats.add(tier_read_bytes=min(n, size))
    return Damage(why) if why is not None else Shard()


_SCRATCH = threading.local()


def _scratch() -> memoryview:
    """This thread's buffer for bytes that are hashed and kept nowhere."""
    mv = getattr(_SCRATCH, "mv", None)
    if mv is None:
        mv = _SCRATCH.mv = shards.buffer_view(torch.empty(fileio.READ_CHUNK, dtype=torch.uint8))
    return mv


def _read_whole(fd: int, size: int, out: memoryview, helpers: Helpers | None) -> tuple[int, str] | int:
    """The file at ``fd`` into ``out`` (its size when that is not ``size``)."""
    actual = os.fstat(fd).st_size
    if actual != size:
        return actual
    fileio.advise_sequential(fd)
    h = xxhash.xxh3_128()
    return pieces.read_hashed(fd, _split(0, out[:size]), h, helpers), h.hexdigest()


def _split(pos: int, out: memoryview) -> list[tuple[int, memoryview]]:
    """``out`` (to be read from file offset ``pos``) in ``pieces.PIECE`` pieces."""
    step = pieces.PIECE
    return [(pos + i, out[i : i + step]) for i in range(0, len(out), step)]


def _read_placed(fd: int, name: str, size: int, checksum: str, header: Header,
                 place: Placement, helpers: Helpers | None) -> tuple[int, str | None]:
    """(bytes read, why the shard is damaged or None) of a placed read. The checks
    come in ``read``'s order: size, checksum, header."""
    actual = os.fstat(fd).st_size
    if actual != size:
        return actual, _size_problem(actual, size, name)
    fileio.advise_sequential(fd)
    h, scratch = xxhash.xxh3_128(), _scratch()
    head_why, plan = None, []
    first = scratch[: min(8, size)]
    pos = fileio.read_hashed(fd, 0, first, h)
    if pos < 8:
        head_why = "shard shorter than its header length field"
    else:
        try:
            n = shards.header_length(bytes(first), size)
            text = bytearray(n)
            pos += fileio.read_hashed(fd, 8, memoryview(text), h)
            entries = shards.parse_entries(bytes(text), size, header.layout, header.tokens,
                                           header.with_snapshot, header.meta)
            plan = _plan(entries, place)
        except shards.ShardError as exc:
            head_why = str(exc)
    todo, shared = _pieces(pos, size, plan, scratch)
    pos += pieces.read_hashed(fd, todo, h, helpers, shared)
    if pos != size:  # the file shrank while it was read
        return pos, _size_problem(pos, size, name)
    if h.hexdigest() != checksum:
        return pos, f"shard {name}: checksum mismatch"
    return pos, head_why


IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 1024
"""Buffers one ``preadv`` fills at most."""


def _pieces(pos: int, size: int, plan: list[tuple[int, Destination]],
            scratch: memoryview) -> tuple[list[tuple[int, Destination]], list[bool]]:
    """The pieces that read the file from ``pos`` to ``size``: each placed destination
    (in ``pieces.PIECE`` pieces; small buffers that follow each other in the file grouped
    into one piece of several buffers, up to ``PIECE`` bytes and ``IOV_MAX`` buffers,
    read by one ``preadv``) and the bytes between them through ``scratch`` (marked
    shared: read in turn by the hashing thread). A placed piece that does not start
    where the last ended (a header that lies about its offsets) ends the placing: the
    rest goes through ``scratch``."""
    out: list[tuple[int, Destination]] = []
    shared: list[bool] = []
    group: list[memoryview] = []
    at = held = 0  # the group's first byte in the file, its bytes
    step = pieces.PIECE

    def flush() -> None:
        nonlocal held
        if group:
            out.append((at, group.copy() if len(group) > 1 else group[0]))
            shared.append(False)
            group.clear()
            held = 0

    def gap(end: int) -> None:
        nonlocal pos
        flush()
        while pos < end:
            k = min(len(scratch), end - pos)
            out.append((pos, scratch[:k]))
            shared.append(True)
            pos += k

    def large(dst: memoryview) -> None:
        nonlocal pos
        flush()
        for p in _split(pos, dst):
            out.append(p)
            shared.append(False)
        pos += len(dst)

    for begin, dst in plan:  # in file order, contiguous
        if begin != pos:
            gap(begin)
            if pos != begin:
                break
        bufs = [dst] if dst.__class__ is memoryview else dst
        ends = list(itertools.accumulate(map(len, bufs)))  # each buffer's end, from this entry's start
        i, done = 0, 0
        while i < len(bufs):
            j = min(bisect.bisect_right(ends, done + step - held, i), i + IOV_MAX - len(group))
            if j == i:  # the next buffer does not fit the group
                if group:
                    flush()
                else:
                    large(bufs[i])
                    done = ends[i]
                    i += 1
                continue
            if not group:
                at = pos
            group.extend(bufs[i:j])
            held += ends[j - 1] - done
            pos += ends[j - 1] - done
            done, i = ends[j - 1], j
    gap(size)
    return out, shared


def _plan(entries: list[shards.Entry], place: Placement) -> list[tuple[int, Destination]]:
    """(file offset, destination) of each placed entry, in file order."""
    out = []
    for x in entries:
        p = place.get(x.name)
        if p is None:
            continue
        off, dst = p
        n = pieces.nbytes(dst)
        if off < 0 or off + n > x.nbytes:
            raise ValueError(f"placement of {x.name} ({off}+{n}) exceeds its {x.nbytes} bytes")
        if n:
            out.append((x.begin + off, dst))
    return out


def _guarded(read_with, name: str, fn):
    """``read_with(name, fn)`` with the tier's errors as outcomes: a missing or
    irregular file is ``Damage``, an I/O error ``Transient``."""
    try:
        return read_with(name, fn)
    except FileNotFoundError:
        return Damage(f"shard {name} missing")
    except NotRegularFileError as exc:
        return Damage(f"shard {name} {exc.strerror}")
    except OSError as exc:
        return Transient(str(exc), isinstance(exc, RankUnavailableError))


def check(data: bytes, size: int, checksum: str, header: Header | None = None, name: str = "") -> Shard | Damage:
    """``data`` (a shard's bytes from anywhere: a tier, the remote) checked against its
    ``size``, ``checksum`` and, when given, ``header`` (then decoded)."""
    why = problem(data, size, checksum, None, name)
    if why is not None:
        return Damage(why)
    if header is None:
        return Shard(data=data)
    try:
        segs, snap = shards.decode(data, header.layout, header.tokens, header.with_snapshot, header.meta)
    except ShardError as exc:
        return Damage(str(exc))
    return Shard(data=data, segments=segs, snapshot=snap)


def resident(tier: Tier, name: str, size: int) -> Shard | Damage | None:
    """The tier's RAM-resident buffer of ``name`` (retained for the caller) when it
    declares ``RESIDENT_VIEWS`` and holds the shard at the catalog's ``size``; None when
    not resident. A resident copy is the verified buffer a store or read put there: its
    checksum is not taken again."""
    if not has(tier, Capability.RESIDENT_VIEWS):
        return None
    buf = tier.view_shard(name)  # type: ignore[attr-defined]
    if buf is None:
        return None
    if buf.nbytes != size:
        buf.release()
        return Damage(f"RAM copy of {name} is {buf.nbytes} bytes, catalog says {size}")
    return Shard(buffer=buf)


def stat(tier: Tier, name: str, size: int) -> Damage | Transient | None:
    """Presence and size of ``name`` on ``tier`` (None: as the catalog says)."""
    try:
        actual = tier.size(name)
    except NotRegularFileError as exc:
        return Damage(f"shard {name} {exc.strerror}")
    except OSError as exc:
        return Transient(str(exc), isinstance(exc, RankUnavailableError))
    if actual is None:
        return Damage(f"shard {name} missing")
    why = _size_problem(actual, size, name)
    return None if why is None else Damage(why)


def problem(data: bytes, size: int | None, checksum: str | None, header: Header | None = None,
            name: str = "") -> str | None:
    """Why ``data`` is not the shard its catalog row (``size``: None to skip,
    ``checksum``) and ``header`` describe; None when it is."""
    label = f"shard {name}" if name else "shard"
    if size is not None and len(data) != size:
        return _size_problem(len(data), size, name)
    if shards.checksum(data) != checksum:
        return f"{label}: checksum mismatch" if name else "checksum mismatch"
    if header is not None:
        try:
            shards.decode(data, header.layout, header.tokens, header.with_snapshot, header.meta)
        except ShardError as exc:
            return str(exc)
    return None


def parse_header(buf: Buffer, header: Header) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | Damage:
    """Views of the segments and snapshot of the shard in ``buf``, its header checked."""
    try:
        return shards.parse(buf.view(), header.layout, header.tokens, header.with_snapshot, header.meta)
    except ShardError as exc:
        return Damage(str(exc))


def _size_problem(actual: int, size: int, name: str) -> str | None:
    return None if actual == size else f"shard {name} is {actual} bytes, catalog says {size}"


def _read_bytes(tier: Tier, name: str) -> bytes | Damage | Transient:
    try:
        return tier.read_shard(name)
    except FileNotFoundError:  # the tier answered: the shard is not there
        return Damage(f"shard {name} missing")
    except NotRegularFileError as exc:  # a symlink, FIFO or device in its place
        return Damage(f"shard {name} {exc.strerror}")
    except OSError as exc:  # an I/O error or a rank process down: proves nothing
        return Transient(str(exc), isinstance(exc, RankUnavailableError))


def _read_into(tier: Tier, name: str, out: memoryview, stats: CopyStats | None) -> int | Damage | Transient:
    """Read ``name`` into ``out``; the shard's full size (it may exceed ``out``)."""
    if not has(tier, Capability.READS_INTO):
        data = _read_bytes(tier, name)
        if not isinstance(data, bytes):
            return data
        n = min(len(data), len(out))
        out[:n] = memoryview(data)[:n]
        if stats is not None:
            stats.host_copy(n)
        return len(data)
    try:
        got = tier.read_shard_into(name, out)  # type: ignore[attr-defined]
    except FileNotFoundError:
        return Damage(f"shard {name} missing")
    except NotRegularFileError as exc:
        return Damage(f"shard {name} {exc.strerror}")
    except OSError as exc:
        return Transient(str(exc), isinstance(exc, RankUnavailableError))
    if stats is not None and has(tier, Capability.COPIES_ON_READ):
        stats.host_copy(min(got, len(out)))
    return got
