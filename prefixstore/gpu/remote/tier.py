"""A remote tier many engines share: checkpoints in a remote store, any registered
backend (``registry``, ``protocol.RemoteStore``) beneath the logic here.

Blobs are immutable and self-verifying (see ``keys``, ``manifest``): a checkpoint is
usable only when its manifest and every rank's blob are present and verify; anything
else is a miss, counted, never wrong bytes. No call waits on the network past its
budget: ``deepest`` within ``lookup_timeout``, ``fetch`` / ``fetch_path`` within
``restore_timeout``. A failed or timed-out call marks the server down: later calls are
misses at once while a background thread reconnects. No call raises for a network fault.
No call reads more than it can use (``guard``, and the backend's bounded reads): a value
longer than that, or not a string, is that key's miss (counted as ``oversized``), and a
call past its budget has its connection shut so that its thread stops reading too.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs

from prefixstore.base.errors import InvalidArgumentError
from prefixstore.base.log import log
from prefixstore.gpu.remote import auth, guard, manifest, registry
from prefixstore.gpu.remote.config import RemoteConfig
from prefixstore.gpu.remote.keys import KeySpace, layout_id
from prefixstore.gpu.remote.manifest import Manifest, ManifestError
from prefixstore.gpu.remote.protocol import Refused, RemoteStore
from prefixstore.gpu.remote.stats import RemoteStats
from prefixstore.gpu.remote.writeback import WriteBehind

T = TypeVar("T")
PURPOSES = ("lookup", "restore", "write")
BACKGROUND_BUDGETS = 10
"""A call no caller waits for (connecting ahead, reconnecting, touch, forget) may take
this many times its purpose's timeout (a TLS handshake on a loaded host takes a while);
each socket wait stays within the timeout itself."""


@attrs.frozen
class RemoteHit:
    """The deepest checkpoint found: ``path`` are the manifests covering blocks
    ``[path[0].start, blocks)`` in chain order (the last one ends at ``blocks``)."""

    path: tuple[Manifest, ...]
    below: tuple[Manifest, ...] = ()
    """When ``path`` builds on blocks the caller holds (it starts past ``have``): the
    remote's own copy of those blocks up to ``path[0].start``, if it has one (read, not
    fetched: ``touch`` keeps its blobs fresh)."""

    @property
    def manifest(self) -> Manifest:
        return self.path[-1]

    @property
    def blocks(self) -> int:
        return self.path[-1].end

    @property
    def index(self) -> int:
        """The chain index of the deepest block covered."""
        return self.path[-1].end - 1


class RemoteTier:
    """Checkpoints of one layout in one namespace in the store at ``url`` (a URL of any
    registered backend, as text or parsed by it).

    ``layout_json``: the layout's canonical JSON (``Layout.to_json()``); ``ranks``: its
    number of ranks. Thread-safe.
    """

    def __init__(self, url: Any, layout_json: str, ranks: int, config: RemoteConfig | None = None) -> None:
        self.url = registry.parse(url)
        if config is not None and not isinstance(config, RemoteConfig):
            raise InvalidArgumentError("config", f"must be a RemoteConfig, got {type(config).__name__}")
        self.config = config or RemoteConfig()
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
            raise InvalidArgumentError("ranks", f"must be a positive integer, got {ranks!r}")
        self.ranks = ranks
        self.keys = KeySpace(self.config.namespace, layout_id(layout_json))
        self._key = auth.load(self.config.auth_key_env, self.config.auth_key_file)
        self._manifest_limit = manifest.max_bytes(ranks)
        self.url, self.store = registry.open_store(self.url, self.config)
        self._faults = self.store.faults
        self._allowance = self.store.reply_bytes([])
        self._lock = threading.Lock()
        self._up = True
        self._back = threading.Event()  # set while up: the writer waits on it
        self._back.set()
        self._closed = False
        self._reconnecting: threading.Thread | None = None
        self._wake = threading.Event()
        self._calls = concurrent.futures.ThreadPoolExecutor(
            self.config.call_threads, "prefixstore-remote-call")
        self.counts = RemoteStats(self._gauges)
        self._queue = WriteBehind(
            self._write_checked,
            max_items=self.config.queue_items,
            max_bytes=self.config.queue_bytes,
            attempts=self.config.write_attempts,
            backoff=self.config.retry_backoff,
            on_retry=lambda: self.counts.add("write_retries"),
            on_written=lambda: self.counts.add("writes"),
            on_dropped=lambda: self.counts.add("dropped"),
        ) if self.config.write_behind else None
        for purpose in PURPOSES:  # connect now, so that no call's budget pays for it
            self._calls.submit(self._warm, purpose)

    def __repr__(self) -> str:
        return f"RemoteTier({self.url.redacted()!r}, space={self.keys.base!r}, up={self._up})"

    @classmethod
    def for_layout(cls, url: Any, layout: Any, config: RemoteConfig | None = None) -> RemoteTier:
        """The tier for a ``Layout`` (anything with ``to_json()`` and ``ranks``)."""
        return cls(url, layout.to_json(), layout.ranks, config)

    # -- public API ---------------------------------------------------------------

    @property
    def up(self) -> bool:
        """Whether the last call reached the server (False while reconnecting)."""
        return self._up

    def manifest_for(
        self, prefix_key: bytes, blobs: Sequence[bytes], *, start: int, end: int,
        generation: int, snapshot: bool, checksums: Sequence[str] | None = None,
    ) -> Manifest:
        """The manifest of one checkpoint: blocks ``[start, end)`` ending at ``prefix_key``,
        one blob (the rank's shard file bytes) per rank; ``checksums``: their
        ``shards.checksum`` if known (the catalog's), else computed here."""
        if len(blobs) != self.ranks:
            raise InvalidArgumentError("blobs", f"got {len(blobs)} blobs for {self.ranks} ranks")
        if checksums is not None and len(checksums) != self.ranks:
            raise InvalidArgumentError("checksums", f"got {len(checksums)} for {self.ranks} ranks")
        return manifest.build(self.keys, prefix_key, blobs, start=start, end=end,
                              generation=generation, snapshot=snapshot, checksums=checksums)

    def put(self, prefix_key: bytes, m: Manifest, blobs: Sequence[bytes]) -> bool:
        """Store a checkpoint: its blobs, then its manifest (a blob that is not ``bytes`` is
        copied first, so the caller may reuse its buffer). Write-behind: queue it (False if
        the queue is full: dropped, counted). Write-through: write it now within
        ``write_timeout`` (False if that failed). Never raises for a network fault."""
        if m.prefix != prefix_key.hex() or len(blobs) != len(m.blobs):
            raise InvalidArgumentError("manifest", "does not describe these blobs at this key")
        item = (prefix_key, m, tuple(b if isinstance(b, bytes) else bytes(b) for b in blobs))
        if self._queue is not None:
            if self._queue.offer(item, m.nbytes):
                return True
            self.counts.add("dropped")
            return False
        ok = self._call(self._write, item, "write", self.config.write_timeout) is not None
        self.counts.add("writes" if ok else "dropped")
        return ok

    def deepest(
        self, chain_keys: Sequence[bytes], *, have: int = 0, reach: int | None = None,
        need_snapshot: bool = False,
    ) -> RemoteHit | None:
        """The deepest checkpoint path over ``chain_keys`` (the request's chained keys from
        the root), in one round trip. Blocks before ``have`` are already held, so a path
        may start at any block ``<= have``; ``reach`` (``>= have``, default ``have``): the
        blocks the caller can read elsewhere (its local tiers), so a path may also start
        at any block ``<= reach`` and build on them. Every manifest from ``have`` on is
        read. ``need_snapshot``: the deepest checkpoint must hold a snapshot. None (a
        miss) when nothing beyond ``have`` is covered."""
        self.counts.add("lookups")
        names = [self.keys.manifest(k) for k in chain_keys[have:]]
        values = self._get("lookup_seconds", names, [self._manifest_limit] * len(names), "lookup",
                           self.config.lookup_timeout)
        reach = have if reach is None else max(have, reach)
        hit = None if values is None else self._deepest_path(chain_keys, have, reach, values, need_snapshot)
        self.counts.add("hits" if hit else "misses")
        return hit

    def fetch(self, m: Manifest, rank: int) -> bytes | None:
        """Rank ``rank``'s verified blob of checkpoint ``m``, or None (a miss), within
        ``restore_timeout``."""
        self.counts.add("fetches")
        ref = m.blobs[rank]
        values = self._get("fetch_seconds", [ref.key], [ref.size], "restore", self.config.restore_timeout)
        data = self._verified(ref, values[0]) if values else None
        if data is None:
            self.counts.add("fetch_misses")
        return data

    def fetch_path(self, path: Sequence[Manifest]) -> list[list[bytes]]:
        """Every rank's verified blob of each checkpoint of ``path`` in one round trip (per
        cluster node), within ``restore_timeout``: the longest prefix of ``path`` whose
        blobs all verify (empty on a miss)."""
        refs = [ref for m in path for ref in m.blobs]
        self.counts.add("fetches", len(refs))
        values = self._get("fetch_seconds", [r.key for r in refs], [r.size for r in refs], "restore",
                           self.config.restore_timeout) or [None] * len(refs)
        self._count_node_failures(values)
        out: list[list[bytes]] = []
        i = 0
        for m in path:
            got = values[i:i + len(m.blobs)]
            datas = [self._verified(ref, v) for ref, v in zip(m.blobs, got, strict=True)]
            i += len(m.blobs)
            if any(d is None for d in datas):
                if any(v is None for v in got):
                    self._forget(m)  # the server answered that a blob is gone (evicted)
                break
            out.append(datas)  # type: ignore[arg-type]
        self.counts.add("fetch_misses", len(refs) - sum(len(d) for d in out))
        return out

    def refused(self, m: Manifest, rank: int, why: str) -> None:
        """Count a blob of ``m`` that verified here but that the caller's own check
        refused (its shard header names another checkpoint, span or rank): a verify
        failure, logged."""
        self.counts.add("verify_failures")
        log.warning("remote_bad_blob", key=m.blobs[rank].key, reason=why)

    def flush(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for queued writes; True if none is left."""
        return True if self._queue is None else self._queue.flush(timeout)

    def stats(self) -> dict[str, float]:
        """Counters and gauges (names as in ``stats.COUNTERS`` / ``stats.GAUGES``)."""
        return self.counts.snapshot()

    def close(self, timeout: float = 5.0) -> bool:
        """Flush queued writes within ``timeout`` seconds, then stop the threads and
        disconnect. True if every queued write finished in time."""
        deadline = time.monotonic() + timeout
        done = True if self._queue is None else self._queue.stop(timeout)
        self._closed = True
        self._wake.set()
        self._back.set()
        self._calls.shutdown(wait=False, cancel_futures=True)
        self.store.close(max(0.001, deadline - time.monotonic()))
        return done

    def __enter__(self) -> RemoteTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------

    def _gauges(self) -> dict[str, int]:
        q = self._queue
        return {"queue_depth": q.depth if q else 0, "queue_bytes": q.nbytes if q else 0,
                "up": int(self._up)}

    def _timeout(self, purpose: str) -> float:
        return {"lookup": self.config.lookup_timeout, "restore": self.config.restore_timeout,
                "write": self.config.write_timeout}[purpose]

    def _background(self, purpose: str) -> guard.CallBudget:
        return guard.CallBudget(BACKGROUND_BUDGETS * self._timeout(purpose), self._allowance)

    def _warm(self, purpose: str) -> None:
        try:
            with guard.running(self._background(purpose)):
                self.store.prepare(purpose)
        except Exception as exc:  # a fault or an unreadable reply: reconnect later
            self._failed("errors", purpose, type(exc).__name__)

    def _call(self, fn: Callable[[RemoteStore, T], Any], arg: T, purpose: str, seconds: float,
              nbytes: int | None = None) -> Any:
        """``fn(store, arg)`` within ``seconds``, reading at most ``nbytes`` (default: the
        store's allowance for a call); None (counted) on any network fault, a timeout, or
        while the server is down. A call past its budget has its sockets shut: its thread
        stops reading too."""
        if not self._up or self._closed:
            self.counts.add("skipped")
            return None
        budget = guard.CallBudget(seconds, self._allowance if nbytes is None else nbytes)
        try:
            fut = self._calls.submit(self._run, fn, arg, budget)
        except RuntimeError:  # closed meanwhile
            return None
        try:
            return fut.result(timeout=seconds)
        except concurrent.futures.TimeoutError:
            budget.abort()
            self._failed("timeouts", purpose, "no answer within the budget")
        except self._faults.lost as exc:
            self._failed("errors", purpose, type(exc).__name__)
        except self._faults.answered as exc:  # the server answered: it is up
            self.counts.add("errors")
            log.warning("remote_refused", remote=self.url.redacted(), call=purpose,
                        reason=type(exc).__name__)
        except self._faults.network as exc:
            if budget.overran:  # the server sent more than anything asked for can be
                self.counts.add("oversized")
                self._failed("errors", purpose, f"a reply of more than {budget.nbytes} bytes")
            else:
                kind = "timeouts" if isinstance(exc, self._faults.timeout) else "errors"
                self._failed(kind, purpose, type(exc).__name__)
        except Exception as exc:  # a reply the client could not make sense of (or close() shut it)
            if not self._closed:
                self._failed("errors", purpose, f"unreadable reply ({type(exc).__name__})")
        return None

    def _run(self, fn: Callable[[RemoteStore, T], Any], arg: T, budget: guard.CallBudget) -> Any:
        with guard.running(budget):
            return fn(self.store, arg)

    def _get(self, counter: str, keys: list[str], limits: list[int], purpose: str,
             seconds: float) -> list[Any] | None:
        """The store's ``get_many`` of ``keys`` (each value at most its ``limits`` entry)
        within ``seconds`` (a part of the store that does not answer in time fails alone,
        its keys' values the exception), its time added to ``counter`` when the server
        answered."""
        fn = functools.partial(_get_many, purpose=purpose, limits=limits, seconds=seconds)
        t0 = time.perf_counter()
        out = self._call(fn, keys, purpose, seconds, self.store.reply_bytes(limits))
        if out is not None:
            self.counts.add(counter, time.perf_counter() - t0)
        return out

    def _failed(self, kind: str, purpose: str, why: str) -> None:
        """Count a failed call and mark the tier down (calls are misses until the
        background reconnect answers). Where a failed write may concern one part of the
        store only (a cluster node's slots), it is counted, and the lookups find for
        themselves whether the store still answers (they fail only when every part they
        need failed)."""
        self.counts.add(kind)
        if self._closed or (purpose == "write" and self.store.partial_writes):
            return
        with self._lock:
            was_up, self._up = self._up, False
            self._back.clear()
            start = self._reconnecting is None and not self._closed
            if start:
                self._reconnecting = threading.Thread(
                    target=self._reconnect, name="prefixstore-remote-reconnect", daemon=True)
        if was_up:
            log.warning("remote_down", remote=self.url.redacted(), call=purpose, reason=why)
        if start:
            self._reconnecting.start()

    def _reconnect(self) -> None:
        try:
            while not self._closed:
                self._wake.wait(self.config.reconnect_interval)
                if self._closed:
                    return
                try:
                    with guard.running(self._background("lookup")):
                        if self.store.prepare("lookup"):
                            break
                except Exception:  # a fault, an unreadable reply, or closed under it: try again
                    continue
            else:
                return
            self._up = True
            self._back.set()
            self.counts.add("reconnects")
            log.info("remote_up", remote=self.url.redacted())
        finally:
            with self._lock:
                self._reconnecting = None

    def _deepest_path(
        self, chain_keys: Sequence[bytes], have: int, reach: int, values: list[Any], need_snapshot: bool
    ) -> RemoteHit | None:
        # end block -> its covering path from a start <= have (own), <= reach (joined)
        own: dict[int, tuple[Manifest, ...]] = {}
        joined: dict[int, tuple[Manifest, ...]] = {}
        best: tuple[Manifest, ...] | None = None
        self._count_node_failures(values)
        for i, value in enumerate(values, start=have):
            m = self._manifest_at(chain_keys, i, value)
            if m is None:
                continue
            for paths, limit in ((own, have), (joined, reach)):
                before = () if m.start <= limit else paths.get(m.start)
                if before is not None:
                    paths[m.end] = (*before, m)
            if m.end in joined and (not need_snapshot or m.snapshot):
                best = joined[m.end]
        if best is None:
            return None
        if best[-1].end <= reach:  # nothing past what the caller holds: the remote's own copy
            return RemoteHit(own.get(best[-1].end, best))
        return RemoteHit(best, own.get(best[0].start, ()) if best[0].start > have else ())

    def _count_node_failures(self, values: list[Any]) -> None:
        """Count the parts of the store (cluster nodes, storage processes) that failed
        (their keys' values are the exception): as timeouts when they did not answer in
        time, else as errors."""
        failed = {id(v): v for v in values if isinstance(v, Exception)}.values()
        hung = sum(isinstance(v, self._faults.timeout) for v in failed)
        if hung:
            self.counts.add("timeouts", hung)
        if len(failed) > hung:
            self.counts.add("errors", len(failed) - hung)

    def _manifest_at(self, chain_keys: Sequence[bytes], i: int, value: Any) -> Manifest | None:
        """The manifest stored for chain block ``i`` when it decodes and ends there."""
        if isinstance(value, Refused):
            self._oversized(self.keys.manifest(chain_keys[i]), value)
            return None
        if not isinstance(value, bytes):
            return None
        try:
            m = manifest.decode(self.keys, chain_keys[i], value, self.ranks, self._key)
        except ManifestError as exc:
            self.counts.add("verify_failures")
            log.warning("remote_bad_manifest", key=chain_keys[i].hex(), reason=str(exc))
            return None
        return m if m.end == i + 1 else None

    def _verified(self, ref: manifest.BlobRef, value: Any) -> bytes | None:
        if isinstance(value, Refused):
            self._oversized(ref.key, value)
            return None
        if value is None or not isinstance(value, bytes):
            return None
        if not ref.verify(value) or (
                self._key is not None and not auth.SharedKey.same(self._key.blob_mac(ref.key, value), ref.mac)):
            self.counts.add("verify_failures")
            log.warning("remote_bad_blob", key=ref.key, size=len(value), want=ref.size)
            return None
        self.counts.add("bytes_in", len(value))
        return value

    def _oversized(self, key: str, value: Refused) -> None:
        """Count a value refused unread (that key's miss; the server is fine)."""
        self.counts.add("oversized")
        log.warning("remote_refused_value", key=key, reason=value.why)

    def touch(self, path: Sequence[Manifest]) -> None:
        """Mark, in the background, the blobs of checkpoints found but not fetched (the
        caller holds them already) as used: the store's eviction (its LRU, or leases)
        then ages a checkpoint's blobs with its manifest (which every lookup
        reads) instead of evicting blobs still in use."""
        if not self._up or self._closed or not path:
            return
        keys = [ref.key for m in path for ref in m.blobs]
        with contextlib.suppress(RuntimeError):  # closed meanwhile
            self._calls.submit(self._quietly, _touch, keys)

    def _quietly(self, fn: Callable[[RemoteStore, Any], Any], arg: Any) -> Any:
        """``fn(store, arg)`` in a call no caller waits for (``BACKGROUND_BUDGETS``); None on a fault."""
        with guard.running(self._background("write")), contextlib.suppress(Exception):
            return fn(self.store, arg)
        return None

    def _forget(self, m: Manifest) -> None:
        """Delete, in the background, the manifest of a checkpoint a blob of which the
        store evicted, if it still holds the bytes it was read from: later lookups stop finding
        a checkpoint that cannot be read, and a manifest another engine has written there
        since stays (an altered blob is a miss each time, counted, and left for its
        writer to put again)."""
        if not self._up or self._closed or m.stored is None:
            return
        with contextlib.suppress(RuntimeError):  # closed meanwhile
            self._calls.submit(self._delete, self.keys.manifest(m.prefix_key), m.stored)

    def _delete(self, key: str, stored: bytes) -> None:
        got = self._quietly(_delete_if, (key, stored))
        if got:  # None (a fault): a miss stays a miss, the next failed fetch tries again
            self.counts.add("forgotten" if got > 0 else "superseded")

    def _write(self, store: RemoteStore, item: tuple[bytes, Manifest, tuple[bytes, ...]]) -> bool:
        prefix_key, m, blobs = item
        store.set_many([(r.key, b) for r, b in zip(m.blobs, blobs, strict=True)], replace=False)
        if self._key is not None:
            m = manifest.sign(self._key, m, blobs)
        body = manifest.encode(self.keys, m, self._key)
        store.set_many([(self.keys.manifest(prefix_key), body)], replace=True)
        self.counts.add("bytes_out", m.nbytes + len(body))
        return True

    def _write_checked(self, item: tuple[bytes, Manifest, tuple[bytes, ...]]) -> None:
        """One write-behind attempt in the writer thread (after waiting, at most
        ``write_timeout``, for a reconnect if the server is down); raises if it did not land."""
        self._back.wait(self.config.write_timeout)
        if self._call(self._write, item, "write", self.config.write_timeout) is None:
            raise ConnectionError("remote write failed")


def _get_many(store: RemoteStore, keys: list[str], *, purpose: str, limits: list[int], seconds: float) -> list[Any]:
    return store.get_many(purpose, keys, limits, seconds)


def _touch(store: RemoteStore, keys: list[str]) -> None:
    store.touch(keys)


def _delete_if(store: RemoteStore, arg: tuple[str, bytes]) -> int:
    return store.delete_if(*arg)
