"""The Mooncake Store client layer's contract against a real ``mooncake_master`` and
storage node on loopback: values round trip bit for bit, missing keys are None, replies
never exceed what the caller asked room for, deletion follows Mooncake's leases, a
stopped master costs each call its budget and never freezes the process, a killed master
is unreachable and a restarted one is used again, two processes share the store."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from mooncake_peer import values as peer_values
from mooncake_servers import REPO_TESTS, MooncakeMaster, MooncakeStore, mooncake_store_fixture  # noqa: F401

from prefixstore.base.errors import InvalidArgumentError
from prefixstore.gpu.remote import mooncake_urls
from prefixstore.gpu.remote.mooncake_client import (
    MooncakeClient,
    MooncakeOptions,
    MooncakeRefused,
    MooncakeTimeout,
    MooncakeTooLarge,
    MooncakeUnreachable,
    Removal,
    process_settings,
)

RPC_TIMEOUT = 5.0
"""Mooncake's own RPC timeout here: a call that waited for it would take 5 s."""
BUDGET = 0.3
SLACK = 1.0
"""How late past its budget a call may return: thread scheduling on a loaded machine."""
OPTIONS = MooncakeOptions(rpc_timeout=RPC_TIMEOUT, connect_timeout=1.0)
SECRET = "s3cr3t-Pa55word"


@pytest.fixture(name="client")
def client_fixture(mooncake_store) -> Iterator[MooncakeClient]:
    c = MooncakeClient(mooncake_store.url, OPTIONS)
    c.connect(10.0)
    try:
        yield c
    finally:
        mooncake_store.resume()
        c.close()


def blobs(seed: int, *sizes: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(n) for n in sizes]


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    """``fn()``'s result (or the exception it raised) and the seconds it took."""
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test looks at
        out = exc
    return out, time.perf_counter() - t0


class Heartbeat:
    """A thread that wakes every 10 ms: its longest gap shows whether anything held the
    GIL (a frozen process), which a caller's own timing cannot."""

    def __init__(self) -> None:
        self.gap = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)

    def _beat(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(0.01):
            now = time.perf_counter()
            self.gap, last = max(self.gap, now - last), now

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# -- URLs -------------------------------------------------------------------------------

@pytest.mark.parametrize(("url", "want"), [
    ("mooncake://127.0.0.1:7000?metadata=http://127.0.0.1:8080/metadata",
     ("127.0.0.1", 7000, "http://127.0.0.1:8080/metadata", "127.0.0.1", 0, "127.0.0.1:7000")),
    ("mooncake://localhost?metadata=P2PHANDSHAKE&segment=64MiB",
     ("localhost", 50051, "P2PHANDSHAKE", "127.0.0.1", 64 << 20, "localhost:50051")),
    ("mooncake://[::1]:9?metadata=https://m:1/x&segment=4096",
     ("::1", 9, "https://m:1/x", "127.0.0.1", 4096, "[::1]:9")),
    ("mooncake://10.0.0.1:1?metadata=http://10.0.0.1:2/metadata&local_hostname=10.0.0.2&protocol=tcp",
     ("10.0.0.1", 1, "http://10.0.0.1:2/metadata", "10.0.0.2", 0, "10.0.0.1:1")),
    ("mooncake://h:1?metadata=http%3A%2F%2Fm%3A2%2Fmeta&local_hostname=h2",
     ("h", 1, "http://m:2/meta", "h2", 0, "h:1")),
])
def test_urls_parse(url, want):
    u = mooncake_urls.parse(url)
    assert (u.host, u.port, u.metadata, u.local_hostname, u.segment, u.master) == want


@pytest.mark.parametrize("url", [
    "redis://h:1", "mooncake//h", "mooncake://h:1", "mooncake://h:0?metadata=P2PHANDSHAKE",
    "mooncake://h:x?metadata=P2PHANDSHAKE", "mooncake://u:p@h:1?metadata=P2PHANDSHAKE",
    "mooncake://h:1/db?metadata=P2PHANDSHAKE", "mooncake://10.0.0.1:1?metadata=P2PHANDSHAKE",
    "mooncake://127.0.0.1:1?metadata=ftp://m:1/x", "mooncake://127.0.0.1:1?metadata=http://m/x",
    "mooncake://127.0.0.1:1?metadata=P2PHANDSHAKE&segment=1TB",
    "mooncake://127.0.0.1:1?metadata=P2PHANDSHAKE&protocol=rdma",
    "mooncake://127.0.0.1:1?metadata=P2PHANDSHAKE&colour=red",
    "mooncake://127.0.0.1:1?metadata=P2PHANDSHAKE&metadata=P2PHANDSHAKE",
    "mooncake://127.0.0.1:1?metadata=P2PHANDSHAKE#frag", "mooncake://::1:5?metadata=P2PHANDSHAKE",
    "mooncake://[nope]:5?metadata=P2PHANDSHAKE", 42,
    "mooncake://h:1?metadata=http%3A%2F%2Fm%3A2%2Fmeta%3Fa&local_hostname=h2",
])
def test_bad_urls_are_refused_naming_remote(url):
    with pytest.raises(InvalidArgumentError) as e:
        mooncake_urls.parse(url)
    assert e.value.argument == "remote"


def test_the_metadata_password_is_never_shown():
    u = mooncake_urls.parse(f"mooncake://127.0.0.1:1?metadata=http://ops:{SECRET}@m:2/metadata")
    assert u.metadata == f"http://ops:{SECRET}@m:2/metadata"  # what Mooncake is given
    assert SECRET not in repr(u) and SECRET not in u.redacted()
    assert "http://ops:***@m:2/metadata" in u.redacted()
    for bad in (f"mooncake://127.0.0.1:99999?metadata=http://ops:{SECRET}@m:2/x",
                f"mooncake://127.0.0.1:1?metadata=http://ops:{SECRET}@m:2/x?q",
                f"mooncake://127.0.0.1:1?metadata=http://ops:{SECRET}@m:2/x&{SECRET}=1"):
        with pytest.raises(InvalidArgumentError) as e:
            mooncake_urls.parse(bad)
        assert SECRET not in str(e.value)


# -- the extra --------------------------------------------------------------------------

BLOCK_MOONCAKE = """
import sys
class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "mooncake":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Missing())
from prefixstore.base.errors import MissingExtraError
from prefixstore.gpu.remote import mooncake_client
try:
    mooncake_client.MooncakeClient("mooncake://127.0.0.1:1?metadata=P2PHANDSHAKE")
except MissingExtraError as exc:
    print("MISSING", exc)
"""


def test_without_mooncake_the_module_imports_and_a_client_names_the_extra():
    env = {**os.environ, "PYTHONPATH": os.path.dirname(REPO_TESTS)}
    p = subprocess.run([sys.executable, "-c", BLOCK_MOONCAKE], capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.startswith("MISSING the Mooncake Store remote tier needs")
    assert "pip install 'prefixstore[mooncake]'" in p.stdout and "libibverbs1" in p.stdout


# -- the contract -----------------------------------------------------------------------

def test_values_round_trip_bit_for_bit(client):
    sizes = (1, 4096, 65537, 1 << 20, (4 << 20) + 1)
    values = blobs(1, *sizes)
    keys = [f"v{i}:{{prefix}}:b" for i in range(len(values))]  # braces and colons as the tier's keys have
    client.set_many(list(zip(keys, values, strict=True)), 5.0)
    assert client.get_many(keys, list(sizes), 5.0) == values
    assert client.get_many(keys[::-1], max(sizes), 5.0) == values[::-1]  # room to spare
    assert client.get_many([keys[0], keys[0]], 1, 5.0) == [values[0], values[0]]


def test_concurrent_calls_each_get_their_own_bytes(client):
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for i in range(8):
                values = blobs(100 * t + i, 4096, 70_000)
                keys = [f"c{t}-{i}-a", f"c{t}-{i}-b"]
                client.set_many(list(zip(keys, values, strict=True)), 10.0)
                assert client.get_many(keys, [4096, 70_000], 10.0) == values
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:2]


def test_missing_keys_are_none_beside_present_ones(client):
    (value,) = blobs(2, 4096)
    client.set_many([("here", value)], 5.0)
    assert client.get_many(["nothing", "here", "never"], 4096, 5.0) == [None, value, None]
    assert client.get_many([], 1, 5.0) == []


def test_a_value_larger_than_its_room_is_refused_and_the_others_delivered(client):
    big, small = blobs(3, (1 << 20) + 1, 10)
    client.set_many([("big", big), ("small", small)], 5.0)
    got = client.get_many(["big", "small"], [1 << 20, 10], 5.0)
    assert isinstance(got[0], MooncakeTooLarge) and got[1] == small
    assert client.get_many(["big"], (1 << 20) + 1, 5.0) == [big]  # exactly enough room
    narrow = MooncakeClient(client.url, MooncakeOptions(rpc_timeout=RPC_TIMEOUT, max_reply_bytes=100))
    with pytest.raises(InvalidArgumentError) as e:  # more room than that client allows at once
        narrow.get_many(["big"], 101, 5.0)
    assert e.value.argument == "limits"
    narrow.close()


def test_put_keeps_an_existing_value_and_replace_overwrites_it(client):
    first, second = blobs(4, 100, 200)
    client.set_many([("k", first)], 5.0)
    client.set_many([("k", second)], 5.0)
    assert client.get_many(["k"], 1000, 5.0) == [first]
    client.set_many([("k", second)], 5.0, replace=True)
    assert client.get_many(["k"], 1000, 5.0) == [second]  # replaced although the read leased it


def test_deletion_follows_the_read_leases(client):
    value, = blobs(5, 300)
    client.set_many([("fresh", value), ("read", value)], 5.0)
    assert client.delete("fresh", 5.0) is Removal.REMOVED  # a write takes no lease
    assert client.get_many(["fresh"], 300, 5.0) == [None]
    assert client.delete("fresh", 5.0) is Removal.ABSENT
    assert client.get_many(["read"], 300, 5.0) == [value]
    assert client.delete("read", 5.0) is Removal.LEASED  # the read leased it (1 s in these tests)
    assert client.get_many(["read"], 300, 5.0) == [value]
    deadline = time.monotonic() + 10
    while (r := client.delete("read", 5.0)) is Removal.LEASED and time.monotonic() < deadline:
        time.sleep(0.1)
    assert r is Removal.REMOVED


def test_delete_if_removes_only_the_expected_bytes(client):
    old, new, longer = blobs(6, 300, 300, 301)
    client.set_many([("m", new), ("n", longer)], 5.0)
    assert client.delete_if("m", old, 5.0) is Removal.CHANGED  # another writer's fresh value stays
    assert client.delete_if("n", new, 5.0) is Removal.CHANGED  # longer than expected: not even read
    assert client.get_many(["m", "n"], 301, 5.0) == [new, longer]
    assert client.delete_if("m", new, 5.0) is Removal.REMOVED  # though the compare's read leased it
    assert client.get_many(["m"], 300, 5.0) == [None]
    assert client.delete_if("m", new, 5.0) is Removal.ABSENT


def test_touch_counts_the_keys_present_and_leases_them(client):
    value, = blobs(7, 100)
    client.set_many([("t", value)], 5.0)
    assert client.touch(["t", "absent"], 5.0) == 1
    assert client.delete("t", 5.0) is Removal.LEASED
    assert client.touch([], 5.0) == 0


def test_a_full_store_refuses_writes_and_evicts_the_oldest_lease_first(tmp_path):
    store = MooncakeStore(tmp_path / "mc", segment="32MB", lease_ms=20_000).start()
    try:
        c = MooncakeClient(store.url, OPTIONS)
        c.connect(10.0)
        value, = blobs(8, 4 << 20)
        c.set_many([(f"old{i}", value) for i in range(4)], 5.0)
        assert c.touch(["old0"], 5.0) == 1  # old0 is in use: its lease ends last
        refused, accepted = 0, []
        for i in range(12):
            try:
                c.set_many([(f"new{i}", value)], 5.0)
                accepted.append(f"new{i}")
            except MooncakeRefused as exc:  # the master answered: full (not unreachable)
                assert not isinstance(exc, MooncakeUnreachable) and exc.code == -200
                refused += 1
        assert refused > 0
        unleased = [f"old{i}" for i in range(1, 4)] + accepted
        got = c.get_many(["old0", *unleased], 4 << 20, 5.0)
        assert got[0] == value  # the touched one stayed: its lease protects it
        # the master made room among the keys no lease protects (which of them goes first
        # is Mooncake's choice: an older put is not always evicted before a newer one)
        assert None in got[1:]
        assert all(g is None or g == value for g in got)
        c.close()
    finally:
        store.stop()


def test_bad_arguments_are_typed_errors_and_store_nothing(client):
    for call, argument in [
        (lambda: client.set_many([("a", b"")], 5.0), "items"),
        (lambda: client.set_many([("a", b"x"), ("a", b"y")], 5.0), "items"),
        (lambda: client.set_many([("", b"x")], 5.0), "items"),
        (lambda: client.set_many([("a", b"x")], 0), "budget"),
        (lambda: client.set_many([("a", b"x")], float("nan")), "budget"),
        (lambda: client.get_many("a", 10, 5.0), "keys"),
        (lambda: client.get_many(["a"], 0, 5.0), "limits"),
        (lambda: client.get_many(["a", "b"], [1], 5.0), "limits"),
        (lambda: client.get_many(["a\0"], 1, 5.0), "keys"),
        (lambda: client.delete_if("a", b"", 5.0), "expected"),
        (lambda: client.delete(7, 5.0), "key"),
    ]:
        with pytest.raises(InvalidArgumentError) as e:
            call()
        assert e.value.argument == argument
    assert client.get_many(["a"], 10, 5.0) == [None]
    with pytest.raises(InvalidArgumentError) as e:
        MooncakeOptions(rpc_timeout=0)
    assert e.value.argument == "rpc_timeout"


def test_a_second_client_cannot_advertise_another_address(client):
    assert client.settings["MC_TCP_BIND_ADDRESS"] == "127.0.0.1"
    other = mooncake_urls.parse(client.url.redacted().replace("local_hostname=127.0.0.1", "local_hostname=127.0.0.2"))
    with pytest.raises(InvalidArgumentError) as e:
        process_settings(other, OPTIONS)
    assert "MC_TCP_BIND_ADDRESS" in str(e.value)


# -- faults -------------------------------------------------------------------------------

def test_a_stopped_master_costs_each_call_its_budget(mooncake_store, client):
    value, other = blobs(9, 4096, 4096)
    client.set_many([("s", value), ("d", value)], 5.0)
    mooncake_store.pause()
    calls = {  # each may still take effect once the master runs again: none alters "s"
        "get_many": lambda: client.get_many(["s"], 4096, BUDGET),
        "set_many": lambda: client.set_many([("s2", value)], BUDGET),
        "touch": lambda: client.touch(["s"], BUDGET),
        "delete": lambda: client.delete("d", BUDGET),
        "delete_if": lambda: client.delete_if("s", other, BUDGET),
        "ping": lambda: client.ping(BUDGET),
    }
    with Heartbeat() as beat:
        for name, call in calls.items():
            out, took = timed(call)
            assert isinstance(out, MooncakeTimeout), (name, out)
            assert BUDGET <= took < BUDGET + SLACK, (name, took)
    assert beat.gap < SLACK, beat.gap
    assert client.abandoned >= 1  # they wait on the stopped master, not on the caller
    deadline = time.monotonic() + RPC_TIMEOUT + 3  # Mooncake's RPC timeout ends them (30 s by default)
    while client.abandoned and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.abandoned == 0
    mooncake_store.resume()
    assert client.get_many(["s"], 4096, 5.0) == [value]
    assert client.get_many(["s2"], 4096, 5.0) in ([value], [None])  # the abandoned write may land
    assert client.ping(5.0)


def test_connecting_to_a_stopped_or_dead_master_is_bounded_and_freezes_nothing(tmp_path):
    master = MooncakeMaster(tmp_path / "m").start()
    try:
        url = f"mooncake://127.0.0.1:{master.rpc_port}?metadata={master.metadata}"
        master.pause()
        c = MooncakeClient(url, OPTIONS)
        with Heartbeat() as beat:
            out, took = timed(lambda: c.connect(BUDGET))
        assert isinstance(out, MooncakeUnreachable) and not c.connected, out
        assert took < BUDGET + SLACK and beat.gap < SLACK, (took, beat.gap)
        master.kill()
        out, took = timed(lambda: c.connect(BUDGET))
        assert isinstance(out, MooncakeUnreachable) and took < BUDGET + SLACK, (out, took)
        assert isinstance(timed(lambda: c.ping(BUDGET))[0], MooncakeUnreachable)  # not connected
        c.close()
    finally:
        master.kill()


def test_closing_while_the_master_is_stopped_is_bounded(mooncake_store):
    c = MooncakeClient(mooncake_store.url, OPTIONS)
    c.connect(10.0)
    mooncake_store.pause()
    try:
        with Heartbeat() as beat:
            out, took = timed(lambda: c.close(BUDGET))
        assert out is False and took < BUDGET + SLACK and beat.gap < SLACK, (out, took, beat.gap)
        out = timed(lambda: c.get_many(["x"], 1, BUDGET))[0]
        assert isinstance(out, MooncakeUnreachable) and "closed" in str(out)
    finally:
        mooncake_store.resume()


def test_a_killed_master_is_unreachable_and_a_restarted_one_is_used_again(mooncake_store, client):
    value, = blobs(10, 4096)
    client.set_many([("before", value)], 5.0)
    mooncake_store.kill()
    for call in (lambda: client.get_many(["before"], 4096, BUDGET),
                 lambda: client.set_many([("during", value)], BUDGET),
                 lambda: client.ping(BUDGET), lambda: client.delete("before", BUDGET)):
        out, took = timed(call)
        assert isinstance(out, MooncakeUnreachable), out
        assert took < BUDGET + SLACK, took
    mooncake_store.restart()
    deadline = time.monotonic() + 30
    while True:  # the storage node mounts its memory again, then writes land
        out, _ = timed(lambda: client.set_many([("after", value)], 2.0))
        if out is None or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert out is None, out
    assert client.get_many(["after", "before"], 4096, 5.0) == [value, None]  # the old master's objects are gone
    assert client.ping(5.0)


def test_a_dead_storage_node_costs_its_keys_only(mooncake_store, client):
    value, = blobs(13, 65536)
    client.set_many([("on-node", value)], 5.0)
    mooncake_store.node.kill()
    out, took = timed(lambda: client.get_many(["on-node", "never-written"], 65536, BUDGET))
    assert took < BUDGET + SLACK, took
    assert isinstance(out, list), out  # the master answered: no call-wide failure
    assert isinstance(out[0], MooncakeUnreachable) and out[0].code == -800 and out[1] is None, out
    (alone,) = client.get_many(["on-node"], 65536, BUDGET)  # even when it is every key asked
    assert isinstance(alone, MooncakeUnreachable) and alone.code == -800
    assert client.ping(5.0)  # the tier need not count the store down


def test_two_processes_see_each_others_writes(mooncake_store, client):
    env = {**os.environ, "PYTHONPATH": os.path.dirname(REPO_TESTS)}
    peer = subprocess.Popen([sys.executable, os.path.join(REPO_TESTS, "mooncake_peer.py"), mooncake_store.url],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def ask(line: str) -> str:
        peer.stdin.write(line + "\n")
        peer.stdin.flush()
        return peer.stdout.readline().strip()

    try:
        assert peer.stdout.readline().strip() == "ready"
        assert ask("put peer- 11 6") == "stored"
        theirs = peer_values(11, 6)
        assert client.get_many([f"peer-{i}" for i in range(6)], [len(v) for v in theirs], 5.0) == theirs
        mine = peer_values(12, 5)
        client.set_many([(f"mine-{i}", v) for i, v in enumerate(mine)], 5.0)
        assert ask("check mine- 12 5") == "same"
        assert ask("check mine- 13 5").startswith("differ")  # the check can tell
        assert ask("quit") == ""
        assert peer.wait(60) == 0
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait(10)
