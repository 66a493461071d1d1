"""Each remote backend's real servers behind one interface, for the contract tests that
run the same assertions on every backend (``test_remote_contract.py``).

A ``Served`` backend is started once per test module (Mooncake's ``setup`` and
``close`` cost a second or so each, its master a few): ``fresh()`` hands each test a
running, writable store, resuming or restarting it if an earlier test left it stopped,
and each test works in a namespace of its own. ``write`` / ``read`` / ``remove`` reach the
store directly (as an attacker, or as the store's own eviction, would).
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from conftest import store_tokens, tokens_for
from mooncake_servers import MooncakeStore, need_mooncake
from redis_servers import RedisServer, need_redis
from remote_engine_worker import LAYOUT, restored_exactly
from remote_helpers import tier, timed, within

from prefixstore.base.keys import Prefix
from prefixstore.engine.api import Engine
from prefixstore.gpu.remote import BlobRef
from prefixstore.gpu.remote.mooncake_client import MooncakeClient, MooncakeOptions

BACKENDS = ("redis", "mooncake")
BUDGET = {"lookup_timeout": 0.3, "restore_timeout": 0.6, "write_timeout": 0.6, "reconnect_interval": 0.05}
"""Tight budgets, for the tests that time a call against its budget."""
PATIENT = {"lookup_timeout": 5.0, "restore_timeout": 10.0, "write_timeout": 10.0, "reconnect_interval": 0.05}
"""Budgets a loaded CI machine never exhausts, for the tests of what a call answers (a
timed-out lookup is a miss, which would read as the wrong answer)."""
WRITABLE_WAIT = 30.0
"""Seconds a restarted store may take to take writes again (Mooncake's storage node
mounts its memory on the new master by itself)."""


class Served:
    """A running store of one backend and direct access to its keys."""

    name: str

    @property
    def url(self) -> str:
        raise NotImplementedError

    def start(self) -> Served:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def kill(self) -> None:
        """SIGKILL the server (Mooncake: the master)."""
        raise NotImplementedError

    def restart(self) -> None:
        """Kill it and start an empty one at the same URL; return once it takes writes."""
        raise NotImplementedError

    def pause(self) -> None:
        raise NotImplementedError

    def resume(self) -> None:
        raise NotImplementedError

    def alive(self) -> bool:
        raise NotImplementedError

    def write(self, key: str, value: bytes) -> None:
        """Store ``value`` at ``key``, replacing what is there."""
        raise NotImplementedError

    def read(self, key: str, size: int) -> bytes | None:
        raise NotImplementedError

    def remove(self, key: str) -> None:
        raise NotImplementedError

    def fresh(self) -> Served:
        """Running and writable (after a test that stopped or killed it)."""
        self.resume()
        if not self.alive():
            self.restart()
        return self


class RedisServed(Served):
    name = "redis"

    def __init__(self, directory: Path) -> None:
        need_redis()
        self.server = RedisServer(directory / "redis")

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> RedisServed:
        self.server.start()
        return self

    def close(self) -> None:
        self.server.stop()

    def kill(self) -> None:
        self.server.stop()

    def restart(self) -> None:
        self.server.restart()

    def pause(self) -> None:
        self.server.pause()

    def resume(self) -> None:
        if self.alive():
            self.server.resume()

    def alive(self) -> bool:
        return self.server.proc is not None and self.server.proc.poll() is None

    def write(self, key: str, value: bytes) -> None:
        self.server.client().set(key, value)

    def read(self, key: str, size: int) -> bytes | None:
        return self.server.client().get(key)

    def remove(self, key: str) -> None:
        self.server.client().delete(key)


class MooncakeServed(Served):
    """A master and one storage node lending 256 MB, and a client of the test's own."""

    name = "mooncake"

    def __init__(self, directory: Path) -> None:
        need_mooncake()
        self.store = MooncakeStore(directory / "mooncake")
        self.client: MooncakeClient | None = None

    @property
    def url(self) -> str:
        return self.store.url

    def start(self) -> MooncakeServed:
        self.store.start()
        self.client = MooncakeClient(self.url, MooncakeOptions(rpc_timeout=2.0))
        self.client.connect(10.0)
        return self

    def close(self) -> None:
        self.store.resume()
        if self.client is not None:
            self.client.close(5.0)
        self.store.stop()

    def kill(self) -> None:
        self.store.kill()

    def restart(self) -> None:
        self.store.restart()
        self._writable()

    def _writable(self) -> None:
        deadline = time.monotonic() + WRITABLE_WAIT
        while True:  # writes land once the storage node has mounted its memory again
            try:
                self.client.set_many([("prefixstore-test:writable", b"1")], 2.0, replace=True)
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def fresh(self) -> MooncakeServed:
        """Running and writable; after a test that killed the storage node, a new master
        (it forgets the dead node's memory) and a new node."""
        self.resume()
        if not self.store.node.alive:
            self.store.master.restart()
            self.store.node.start()
            self._writable()
        elif not self.alive():
            self.restart()
        return self

    def pause(self) -> None:
        self.store.pause()

    def resume(self) -> None:
        self.store.resume()

    def alive(self) -> bool:
        return self.store.master.alive

    def write(self, key: str, value: bytes) -> None:
        self.client.set_many([(key, value)], 5.0, replace=True)

    def read(self, key: str, size: int) -> bytes | None:
        (value,) = self.client.get_many([key], max(1, size), 5.0)
        return value

    def remove(self, key: str) -> None:
        value = self.read(key, 1 << 24)
        if value is not None:
            self.client.delete_if(key, value, 5.0)  # forced: a read leased it


def serve(name: str, directory: Path) -> Served:
    """The started store of backend ``name``."""
    return {"redis": RedisServed, "mooncake": MooncakeServed}[name](Path(directory)).start()


# -- engines over a served store --------------------------------------------------------------


def namespace_for(request) -> str:
    """A namespace of the running test's own (from its node id)."""
    return "t" + hashlib.blake2b(request.node.nodeid.encode(), digest_size=8).hexdigest()


class Remote:
    """The running store of one test and the test's own namespace in it."""

    def __init__(self, served: Served, namespace: str) -> None:
        self.served = served
        self.namespace = namespace

    @property
    def url(self) -> str:
        return self.served.url

    def open(self, path, budget: dict = BUDGET, **options) -> Engine:
        return Engine.open(path, LAYOUT, 1 << 30, remote=self.url, remote_options={
            **budget, "write_behind": False, "namespace": self.namespace, **options})

    def tier(self, **options):
        return tier(self.url, namespace=self.namespace, **options)


def prefix(tokens) -> Prefix:
    return Prefix.from_tokens(tokens, LAYOUT.block_tokens)


def restore_or_miss(eng: Engine, tokens):
    """Look up and restore ``tokens``, each call within its own budget (plus SLACK); the
    restored tensors (checked bit for bit against what was stored) or None."""
    options = eng.remote.config
    m, took = timed(eng.lookup, prefix(tokens))
    within(took, options.lookup_timeout)
    if not m.hit:
        return None
    r, took = timed(eng.restore, m)
    within(took, options.restore_timeout)
    if r is not None:
        restored_exactly(eng, tokens, r)
    return r


def assert_clean(eng: Engine, remote: Remote) -> None:
    rep = eng.audit()
    assert rep.ok, rep.violations
    assert any(n.startswith(f"remote tier {remote.served.name}") for n in rep.notes), rep.notes


def two_engines(remote: Remote, tmp_path, budget: dict = BUDGET):
    """A writer and a reader, the reader holding one request of its own locally."""
    a = remote.open(tmp_path / "a", budget)
    b = remote.open(tmp_path / "b", budget)
    own = tokens_for(99, 4)
    assert store_tokens(b, own).ok
    return a, b, own


def local_unaffected(b: Engine, own) -> None:
    m, took = timed(b.lookup, prefix(own))
    assert m.source == "local"
    within(took, 0.0)  # no network wait
    restored_exactly(b, own, b.restore(m))


def blob_of(eng: Engine, tokens, rank: int) -> BlobRef:
    """Rank ``rank``'s blob of the checkpoint ``eng`` stored for ``tokens``."""
    hit = eng.remote.deepest(prefix(tokens).keys)
    return hit.manifest.blobs[rank]
