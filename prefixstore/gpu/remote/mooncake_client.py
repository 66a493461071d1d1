"""A bounded client of a Mooncake Store (``mooncake.store.MooncakeDistributedStore``):
the primitive operations a remote tier needs, each within the caller's budget.

Every call runs on one of the client's daemon threads while the caller waits at most its
``budget`` seconds; past it the caller gets ``MooncakeTimeout`` and the call runs on,
abandoned, until Mooncake's own RPC timeout (``rpc_timeout``) ends it (a SIGSTOPped
master would otherwise hold each call 30 s). Mooncake's negative return codes become
typed outcomes: a missing key is ``None``; a master that does not answer is
``MooncakeUnreachable``; an answer refusing the call is ``MooncakeRefused``. Replies are
read into buffers the caller sized (``batch_get_into``): a value larger than what the
caller can use is refused by Mooncake before it is sent (``MooncakeTooLarge``). Writes
are sent from the caller's bytes (``batch_put_from``), never through Mooncake's local
buffer, so a value's size is bounded by the store's memory only.

What Mooncake does differently from Redis, and what the operations mean here:

- **Leases.** Every read (a get, an existence check, a size query) gives the key a read
  lease (the master's ``-default_kv_lease_ttl``, 10 s by default) during which a plain
  ``remove`` is refused (``Removal.LEASED``); writes take none. The lease's end is also
  Mooncake's eviction order (objects whose lease ends first go first), so ``touch``
  renews the leases of keys in use: it is Redis's LRU touch.
- **Writes.** ``set_many(replace=False)`` is Mooncake's ``put``: a key that exists keeps
  its value (meant for keys whose bytes never change, such as content-addressed blobs);
  ``replace=True`` is ``upsert`` (allowed under a lease). An empty value is refused.
- **Compare-and-delete.** Mooncake has no scripts. ``delete_if`` reads the value (at
  most ``len(expected)`` bytes), and if it equals ``expected`` removes the key with
  ``force`` (the read just leased it); a value being written meanwhile is left alone
  (``Removal.WRITING``). The window between the read and the remove is one round trip: a
  value another client wrote into it is removed too. That costs that writer a miss,
  never wrong bytes, as long as readers verify what they read (a forced remove can also
  hand a reader still copying the old value torn bytes).
- **The GIL.** Mooncake's ``setup`` and ``close`` hold the GIL: while they run the whole
  process waits (``close`` takes about a second even when all is well). ``connect``
  therefore first asks the master's RPC port, in Python and within the budget, whether
  it answers (``probe``); ``close`` skips Mooncake's teardown when it does not (the
  process's exit then does it, at Mooncake's cost).
- **The process environment.** Mooncake reads its settings from ``MC_*`` variables: the
  first client of a process sets ``MC_RPC_TIMEOUT_MS``, ``MC_RPC_CONNECT_TIMEOUT_MS`` and
  ``MC_TCP_BIND_ADDRESS`` (the address this process advertises: the URL's
  ``local_hostname``) unless they are set already, and they hold for every client of the
  process; loading Mooncake's library (when the first client is built, not when this
  module is imported) sets ``MC_LOG_LEVEL`` to ``WARNING`` if it is not set (Mooncake
  reads it then). Mooncake's transfer engine still listens on
  every interface; peers reach it at the advertised address only.
- **Where the bytes live.** In the memory that clients lend (the URL's ``segment``) or
  that ``mooncake_client`` storage processes serve; a client that closes takes the
  objects in its own segment with it (later reads of them are misses).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import math
import mmap
import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs

from prefixstore.base.errors import InvalidArgumentError, MissingExtraError
from prefixstore.gpu.remote.mooncake_outcomes import (
    ANSWERED_ERRORS,
    NETWORK_ERRORS,
    OK,
    TIMEOUT_ERRORS,
    UNREACHABLE_CODES,
    MooncakeError,
    MooncakeRefused,
    MooncakeTimeout,
    MooncakeTooLarge,
    MooncakeUnreachable,
    Removal,
    code_name,
    error,
    read_value,
    removal,
    within,
)
from prefixstore.gpu.remote.mooncake_urls import MooncakeURL, parse

__all__ = [
    "ANSWERED_ERRORS", "NETWORK_ERRORS", "TIMEOUT_ERRORS", "MooncakeClient", "MooncakeError",
    "MooncakeOptions", "MooncakeRefused", "MooncakeTimeout", "MooncakeTooLarge",
    "MooncakeUnreachable", "Removal", "probe", "process_settings", "require",
]

_LIBRARY: list[Any] = []
"""Once loaded: Mooncake's store class (None if it cannot be imported) and why not."""
_LIBRARY_LOCK = threading.Lock()

MISSING = ("the Mooncake Store remote tier needs Mooncake's client: pip install 'prefixstore[mooncake]' "
           "and pip install --no-deps mooncake-transfer-engine-non-cuda==0.3.13.post1 "
           "(with the system package libibverbs1)")

T = TypeVar("T")

PROBE_KEY = "prefixstore:probe"
"""The key ``ping`` asks about (it is never written)."""
MAX_KEY_CHARS = 4096
MAPPED_ROOM = 1 << 20
"""Reply buffers larger than this are anonymous mappings (``_room``)."""
CORO_RPC_MAGIC = 21
CORO_RPC_REQUEST = struct.Struct("<BBBBIIII")
CORO_RPC_REPLY = struct.Struct("<BBBBIII")


def _library() -> Any:
    """Mooncake's ``MooncakeDistributedStore``, imported on first use (a process that
    never builds a client never loads Mooncake's native library); None if it cannot be."""
    with _LIBRARY_LOCK:
        if not _LIBRARY:
            given = "MC_LOG_LEVEL" in os.environ  # read once, when the library loads (INFO logs every setup)
            os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
            try:  # the `mooncake` extra (and the system's libibverbs1, which its library links)
                from mooncake.store import MooncakeDistributedStore  # noqa: PLC0415 - loaded on first use
            except ImportError as exc:
                if not given:
                    del os.environ["MC_LOG_LEVEL"]
                _LIBRARY.extend([None, f"{type(exc).__name__}: {exc}"])
            else:
                _LIBRARY.extend([MooncakeDistributedStore, ""])
        return _LIBRARY[0]


def require() -> None:
    """Raise MissingExtraError when Mooncake's client cannot be imported."""
    if _library() is None:
        raise MissingExtraError(f"{MISSING} ({_LIBRARY[1]})")


def _seconds(inst: Any, attr: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise InvalidArgumentError(attr.name, f"must be a positive number of seconds, got {value!r}")


def _count(inst: Any, attr: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(attr.name, f"must be a positive integer, got {value!r}")


@attrs.frozen
class MooncakeOptions:
    """How the client behaves.

    ``rpc_timeout`` / ``connect_timeout``: Mooncake's own limits on one master RPC and on
    connecting to the master (``MC_RPC_TIMEOUT_MS``, ``MC_RPC_CONNECT_TIMEOUT_MS``): an
    abandoned call holds its thread about this long. ``call_threads``: the threads that
    run calls (abandoned ones included; when all are busy a call waits for one, within
    its budget). ``max_reply_bytes``: the most one ``get_many`` may ask room for.
    """

    rpc_timeout: float = attrs.field(default=1.0, validator=_seconds)
    connect_timeout: float = attrs.field(default=1.0, validator=_seconds)
    call_threads: int = attrs.field(default=8, validator=_count)
    max_reply_bytes: int = attrs.field(default=1 << 30, validator=_count)


_ENV_LOCK = threading.Lock()


def process_settings(url: MooncakeURL, options: MooncakeOptions) -> dict[str, str]:
    """Set Mooncake's ``MC_*`` variables for this process where they are not set yet, and
    return the values in effect. InvalidArgumentError if the process already advertises
    another address than ``url.local_hostname``."""
    wanted = {
        "MC_RPC_TIMEOUT_MS": str(max(1, round(options.rpc_timeout * 1000))),
        "MC_RPC_CONNECT_TIMEOUT_MS": str(max(1, round(options.connect_timeout * 1000))),
        "MC_TCP_BIND_ADDRESS": url.local_hostname,
    }
    with _ENV_LOCK:
        for name, value in wanted.items():
            os.environ.setdefault(name, value)
        settings = {name: os.environ[name] for name in wanted}
    if settings["MC_TCP_BIND_ADDRESS"] != url.local_hostname:
        raise InvalidArgumentError(
            "remote", f"this process advertises {settings['MC_TCP_BIND_ADDRESS']} to Mooncake "
                      f"(MC_TCP_BIND_ADDRESS), not local_hostname={url.local_hostname}")
    return settings


def probe(host: str, port: int, timeout: float) -> bool:
    """Whether a coro_rpc server (the master) at ``host:port`` answers a request within
    ``timeout`` seconds: it is sent a call of an unregistered function, which a live
    server refuses at once; a stopped one accepts the connection and says nothing."""
    deadline = time.monotonic() + timeout
    head = b""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(CORO_RPC_REQUEST.pack(CORO_RPC_MAGIC, 0, 0, 0, 1, 0, 0, 0))
            while len(head) < CORO_RPC_REPLY.size:
                s.settimeout(max(0.001, deadline - time.monotonic()))
                chunk = s.recv(CORO_RPC_REPLY.size - len(head))
                if not chunk:
                    return False
                head += chunk
    except OSError:
        return False
    magic, _, _, _, seq, _, _ = CORO_RPC_REPLY.unpack(head)
    return magic == CORO_RPC_MAGIC and seq == 1


class _Workers:
    """Daemon threads running calls: a caller stops waiting at its budget while a hung
    call ends on its own (daemon, so that one never holds up the process's exit)."""

    def __init__(self, n: int, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True)
                         for i in range(n)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((fut, fn))
        return fut

    def stop(self) -> None:
        for _ in self._threads:
            self._queue.put(None)

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            fut, fn = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed to the caller, if it still waits
                fut.set_exception(exc)


def _room(n: int) -> bytearray | mmap.mmap:
    """A writable buffer of ``n`` zero bytes; past ``MAPPED_ROOM`` an anonymous mapping,
    whose pages take memory only once written: room asked for a value (a size from a
    manifest) costs what the value holds, not what was asked."""
    return bytearray(n) if n <= MAPPED_ROOM else mmap.mmap(-1, n)


def _buffer_address(buf: bytearray | mmap.mmap) -> int:
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


def _bytes_address(data: bytes) -> int:
    """The address of ``data``'s own bytes (no copy; valid while ``data`` lives)."""
    return ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0


def _budget(budget: object) -> float:
    if isinstance(budget, bool) or not isinstance(budget, int | float) or not math.isfinite(budget) or budget <= 0:
        raise InvalidArgumentError("budget", f"must be a positive number of seconds, got {budget!r}")
    return float(budget)


def _keys(keys: object, argument: str = "keys") -> list[str]:
    if isinstance(keys, str) or not isinstance(keys, Sequence):
        raise InvalidArgumentError(argument, "must be a sequence of key strings")
    for k in keys:
        if not isinstance(k, str) or not 0 < len(k) <= MAX_KEY_CHARS or "\0" in k:
            raise InvalidArgumentError(argument, f"every key must be a string of 1-{MAX_KEY_CHARS} characters without NUL")
    return list(keys)


def _limits(limits: object, n: int, most: int) -> list[int]:
    caps = [limits] * n if isinstance(limits, int) else limits
    if not isinstance(caps, Sequence) or len(caps) != n or any(
            isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in caps):
        raise InvalidArgumentError("limits", "must be a positive byte count, or one per key")
    if sum(caps) > most:
        raise InvalidArgumentError("limits", f"ask room for {sum(caps)} bytes, more than max_reply_bytes={most}")
    return list(caps)


class MooncakeClient:
    """One process's client of the Mooncake Store at ``url`` (a ``mooncake://`` URL or a
    parsed one). Building it connects nothing; ``connect`` does. Thread-safe."""

    def __init__(self, url: str | MooncakeURL, options: MooncakeOptions | None = None) -> None:
        self.url = url if isinstance(url, MooncakeURL) else parse(url)
        require()
        if options is not None and not isinstance(options, MooncakeOptions):
            raise InvalidArgumentError("options", f"must be MooncakeOptions, got {type(options).__name__}")
        self.options = options or MooncakeOptions()
        self.settings = process_settings(self.url, self.options)
        self._lock = threading.Condition()
        self._store: Any = None
        self._connecting: concurrent.futures.Future | None = None
        self._closed = False
        self._active = 0  # calls given the store and not ended: close waits for them
        self._abandoned = 0
        self._workers = _Workers(self.options.call_threads, "prefixstore-mooncake")

    def __repr__(self) -> str:
        return f"MooncakeClient({self.url.redacted()!r}, connected={self.connected})"

    @property
    def connected(self) -> bool:
        """Whether ``connect`` succeeded (the master may be down since: calls say so)."""
        return self._store is not None

    @property
    def abandoned(self) -> int:
        """Calls whose caller stopped waiting that still run (they end at Mooncake's RPC timeout)."""
        return self._abandoned

    # -- connecting and closing -------------------------------------------------------

    def connect(self, budget: float) -> None:
        """Register with the master (Mooncake's ``setup``) within ``budget`` seconds:
        MooncakeUnreachable if it does not answer (then nothing started), MooncakeTimeout
        if setup outlasts the budget (it finishes in the background and later calls use
        it). Connecting again once connected does nothing."""
        budget = _budget(budget)
        deadline = time.monotonic() + budget
        with self._lock:
            if self._closed:
                raise MooncakeUnreachable("the client is closed")
            if self._store is not None:
                return
            fut = self._connecting
        if fut is None:
            if not probe(self.url.host, self.url.port, budget):
                raise MooncakeUnreachable(f"the master at {self.url.master} does not answer")
            with self._lock:
                if self._connecting is None and self._store is None:
                    self._connecting = self._workers.submit(self._setup)
                fut = self._connecting
            if fut is None:
                return
        if not concurrent.futures.wait([fut], timeout=max(0.0, deadline - time.monotonic())).done:
            raise MooncakeTimeout(f"setup did not finish within {budget:g} s")
        fut.result()

    def _setup(self) -> None:
        store = _library()()
        try:
            rc = store.setup({
                "local_hostname": self.url.local_hostname,
                "metadata_server": self.url.metadata,
                "global_segment_size": self.url.segment,
                "local_buffer_size": 0,
                "protocol": self.url.protocol,
                "rdma_devices": "",
                "master_server_addr": self.url.master,
            })
        except BaseException:
            with self._lock:
                self._connecting = None
            raise
        with self._lock:
            self._connecting = None
            keep = rc == OK and not self._closed
            if keep:
                self._store = store
        if keep:
            return
        store.close()
        if rc != OK:
            raise MooncakeUnreachable(f"setup failed: {code_name(rc)}", rc)
        raise MooncakeUnreachable("the client was closed while it connected")

    def close(self, budget: float = 5.0) -> bool:
        """Stop using the store, waiting at most ``budget`` seconds for calls under way,
        then Mooncake's teardown (which unmounts this client's segment: objects in it are
        gone) if the master answers; otherwise the teardown is left to the process's exit.
        True if torn down. Later calls raise MooncakeUnreachable."""
        budget = _budget(budget)
        deadline = time.monotonic() + budget
        with self._lock:
            was_closed, self._closed = self._closed, True
            store, self._store = self._store, None
            idle = self._lock.wait_for(lambda: self._active == 0, timeout=budget)
        self._workers.stop()
        if was_closed or store is None:
            return False
        left = max(0.001, deadline - time.monotonic())
        if not idle or not probe(self.url.host, self.url.port, left):
            _UNCLOSED.append(store)
            return False
        return store.close() == OK

    def __enter__(self) -> MooncakeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- operations -------------------------------------------------------------------

    def get_many(self, keys: Sequence[str], limits: int | Sequence[int], budget: float) -> list[Any]:
        """Values of ``keys`` in one request: ``bytes``, ``None`` when absent (never
        written, removed, evicted, or being written), or the error that key met:
        MooncakeTooLarge when its value is larger than ``limits`` (one byte count for
        all, or one per key) allows, MooncakeUnreachable (code TRANSFER_FAIL) when the
        storage process holding it did not deliver, MooncakeRefused for other refusals.
        Raises MooncakeUnreachable when the master did not answer, MooncakeTimeout past
        ``budget``."""
        keys = _keys(keys)
        caps = _limits(limits, len(keys), self.options.max_reply_bytes)
        if not keys:
            return []
        room: dict[str, int] = {}  # each key once: Mooncake fills one buffer of a repeated key
        for k, c in zip(keys, caps, strict=True):
            room[k] = max(c, room.get(k, 0))
        unique = list(room)

        def run(store: Any) -> list[Any]:
            bufs = [_room(room[k]) for k in unique]
            codes = store.batch_get_into(unique, [_buffer_address(b) for b in bufs], [len(b) for b in bufs])
            return [read_value(b, c) for b, c in zip(bufs, _per_key(codes, unique), strict=True)]

        got = dict(zip(unique, self._call("get_many", run, budget), strict=True))
        out = [within(got[k], c) for k, c in zip(keys, caps, strict=True)]
        if all(isinstance(v, MooncakeUnreachable) and v.code in UNREACHABLE_CODES for v in out):
            raise out[0]
        return out

    def set_many(self, items: Sequence[tuple[str, bytes]], budget: float, *, replace: bool = False) -> None:
        """Store every ``(key, value)`` in one request; raise if any write failed
        (MooncakeUnreachable if the master did not answer, MooncakeRefused with
        Mooncake's code otherwise, e.g. NO_AVAILABLE_HANDLE when the store is full).
        ``replace``: overwrite a key that exists (``upsert``); without it, such a key
        keeps its value (``put``). Values must not be empty; keys not repeated."""
        keys = _keys([k for k, _ in items], "items")
        if len(set(keys)) != len(keys):
            raise InvalidArgumentError("items", "a key is given twice")
        values = [v if isinstance(v, bytes) else bytes(v) for _, v in items]
        if any(not v for v in values):
            raise InvalidArgumentError("items", "Mooncake stores no empty value")
        if not keys:
            return

        def run(store: Any) -> list[int]:
            write = store.batch_upsert_from if replace else store.batch_put_from
            return write(keys, [_bytes_address(v) for v in values], [len(v) for v in values])

        codes = _per_key(self._call("set_many", run, budget), keys)
        bad = [c for c in codes if c != OK]
        if bad:
            code = next((c for c in bad if c in UNREACHABLE_CODES), bad[0])
            raise error(code, f"set_many: {len(bad)} of {len(keys)} writes failed, e.g.")

    def touch(self, keys: Sequence[str], budget: float) -> int:
        """Renew the read lease of each of ``keys`` that exists (Mooncake evicts the
        objects whose lease ends first: this marks them used); the number that exist."""
        keys = _keys(keys)
        if not keys:
            return 0
        codes = _per_key(self._call("touch", lambda store: store.batch_is_exist(keys), budget), keys)
        if all(c in UNREACHABLE_CODES for c in codes):
            raise error(codes[0], "touch:")
        return sum(c == 1 for c in codes)

    def delete(self, key: str, budget: float) -> Removal:
        """Remove ``key`` unless a reader leased it (``Removal.LEASED``) or it is being
        written (``Removal.WRITING``)."""
        (key,) = _keys([key], "key")
        return removal(self._call("delete", lambda store: store.remove(key), budget), "delete:")

    def delete_if(self, key: str, expected: bytes, budget: float) -> Removal:
        """Remove ``key`` if it holds ``expected`` (``Removal.CHANGED`` if it holds other
        bytes, which are left alone). Not atomic: see the module's notes."""
        (key,) = _keys([key], "key")
        if not isinstance(expected, bytes) or not expected:
            raise InvalidArgumentError("expected", "must be the non-empty bytes the key should hold")

        def run(store: Any) -> Removal:
            buf = bytearray(len(expected))
            (code,) = _per_key(store.batch_get_into([key], [_buffer_address(buf)], [len(buf)]), [key])
            value = read_value(buf, code)
            if value is None:
                return Removal.ABSENT
            if isinstance(value, MooncakeTooLarge):
                return Removal.CHANGED
            if isinstance(value, MooncakeError):
                raise value
            if value != expected:
                return Removal.CHANGED
            return removal(store.remove(key, True), "delete_if:")

        return self._call("delete_if", run, budget)

    def ping(self, budget: float) -> bool:
        """True if the master answers a request of this client within ``budget``;
        otherwise raises (MooncakeUnreachable, MooncakeTimeout)."""
        code = self._call("ping", lambda store: store.is_exist(PROBE_KEY), budget)
        if code < 0:
            raise error(code, "ping:")
        return True

    # -- internals ----------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[[Any], T], budget: float) -> T:
        """``fn(store)`` on a worker thread, waited for at most ``budget`` seconds."""
        budget = _budget(budget)
        with self._lock:
            store = self._store
            if store is None:
                raise MooncakeUnreachable(f"{what}: {'closed' if self._closed else 'not connected'}")
            self._active += 1
        fut = self._workers.submit(functools.partial(self._run, fn, store))
        if concurrent.futures.wait([fut], timeout=budget).done:
            return fut.result()
        if fut.cancel():  # it never started
            self._ended()
        else:
            with self._lock:
                self._abandoned += 1
            fut.add_done_callback(self._abandon_ended)
        raise MooncakeTimeout(f"{what}: no answer within {budget:g} s")

    def _run(self, fn: Callable[[Any], T], store: Any) -> T:
        try:
            return fn(store)
        finally:
            self._ended()

    def _ended(self) -> None:
        with self._lock:
            self._active -= 1
            self._lock.notify_all()

    def _abandon_ended(self, fut: concurrent.futures.Future) -> None:
        with self._lock:
            self._abandoned -= 1


_UNCLOSED: list[Any] = []
"""Stores whose master did not answer at ``close``: kept for the process's exit to tear
down (a store dropped here would be torn down by its destructor, holding the GIL)."""


def _per_key(codes: Any, keys: Sequence[str]) -> list[int]:
    if not isinstance(codes, list) or len(codes) != len(keys):
        raise MooncakeRefused(f"Mooncake answered {len(codes) if isinstance(codes, list) else codes!r} "
                              f"results for {len(keys)} keys")
    return codes
