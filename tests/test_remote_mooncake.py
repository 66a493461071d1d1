"""The Mooncake Store remote tier beyond the contract (``test_remote_contract.py``): engine
processes and the replay's instances share one store; the options Mooncake cannot honour
are refused before anything opens; the metadata service's password is never shown; a
forged size costs no memory; a dead storage node costs its keys only; without Mooncake's
package the API and the command line name the extra. A real ``mooncake_master`` and
storage node on loopback, one for the module."""

from __future__ import annotations

import io
import json
import logging
import os
import resource
import sqlite3
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import structlog
from conftest import store_tokens, tokens_for
from remote_backends import BUDGET, Remote, namespace_for, prefix, serve
from remote_engine_worker import LAYOUT
from remote_helpers import blobs_for, chain, store, timed, wait_until, within

from prefixstore.base.errors import InvalidArgumentError
from prefixstore.engine import remote as engine_remote
from prefixstore.engine.api import Engine
from prefixstore.gpu.remote import RemoteConfig, RemoteTier, manifest
from prefixstore.gpu.remote import tier as shared_tier

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).with_name("remote_engine_worker.py")
TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
SECRET = "s3cr3t-Pa55word"


@pytest.fixture(name="served", scope="module")
def served_fixture(tmp_path_factory):
    s = serve("mooncake", tmp_path_factory.mktemp("mooncake"))
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(name="remote")
def remote_fixture(served, request) -> Remote:
    return Remote(served.fresh(), namespace_for(request))


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


# -- sharing ------------------------------------------------------------------------------------


def test_engine_processes_share_one_store(remote, tmp_path):
    """Two engine processes (own cache directories, own Mooncake clients) each restore bit
    for bit what the other stored (``remote``), their own from their local tier."""
    workers, requests = 2, 10
    (tmp_path / "barrier").mkdir()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(tmp_path / "barrier"), str(tmp_path / f"e{i}"),
                               remote.url, str(i), str(workers), str(requests), remote.namespace],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
             for i in range(workers)]
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    for i, (out, _) in enumerate(outs):
        mine = len(range(i, requests, workers))
        assert json.loads(out.strip().splitlines()[-1]) == {"local": mine, "remote": requests - mine, "miss": 0}, i


@pytest.mark.slow
def test_replay_instances_share_the_store(remote):
    if not TRACE.exists():
        pytest.fail(f"the Mooncake trace is missing: {TRACE}")
    out = subprocess.run(
        [sys.executable, "-m", "prefixstore.cli", "replay", str(TRACE), "--limit", "200", "--instances", "3",
         "--capacity", "2.5%", "--json", "--quiet", "--remote", remote.url, "--remote-namespace", remote.namespace],
        capture_output=True, text=True, timeout=300, env=_env())
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    assert got["instances"] == 3 and got["restores_remote"] > 0 and got["remote"]["writes"] > 0
    assert got["wrong_bytes"] == 0 and got["audit_ok"] and got["remote"]["verify_failures"] == 0


# -- options and secrets ------------------------------------------------------------------------


@pytest.mark.parametrize(("option", "value"), [
    ("ttl", 60.0), ("username", "u"), ("password", SECRET), ("tls", {"ssl_ca_certs": "/ca.pem"})])
def test_options_mooncake_cannot_honour_are_refused_before_anything_opens(tmp_path, option, value):
    url = "mooncake://127.0.0.1:1?metadata=P2PHANDSHAKE"
    with pytest.raises(InvalidArgumentError) as e:
        Engine.open(tmp_path / "x", LAYOUT, 1 << 20, remote=url, remote_options={option: value})
    assert e.value.argument == "remote_options" and option in str(e.value) and SECRET not in str(e.value)
    assert not (tmp_path / "x").exists()
    with pytest.raises(InvalidArgumentError) as e:  # the tier alone refuses it too
        RemoteTier.for_layout(url, LAYOUT, RemoteConfig(**{option: value}))
    assert e.value.argument == option


def test_a_bad_url_names_remote_and_lists_the_registered_schemes(tmp_path):
    for url, words in [("mooncake://127.0.0.1:1", "metadata="), ("memcached://h:1", "mooncake://"),
                       (f"mooncake://127.0.0.1:1?metadata=http://ops:{SECRET}@m:2/x&colour=red", "parameter")]:
        with pytest.raises(InvalidArgumentError) as e:
            Engine.open(tmp_path / "x", LAYOUT, 1 << 20, remote=url)
        assert e.value.argument == "remote" and words in str(e.value) and SECRET not in str(e.value)
    assert not (tmp_path / "x").exists()


def test_the_metadata_password_is_never_shown_by_prefixstore(remote, tmp_path, monkeypatch):
    """A metadata URL with a password works; prefixstore's own outputs (logs, stats, the
    audit, reprs, the catalog) never show it. (Mooncake's own C++ log lines quote the
    metadata URL as given: see docs/remote-mooncake.md.)"""
    text = io.StringIO()
    logger = structlog.wrap_logger(
        structlog.PrintLogger(file=text), processors=[structlog.processors.KeyValueRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    monkeypatch.setattr(shared_tier, "log", logger)
    monkeypatch.setattr(engine_remote, "log", logger)
    url = remote.url.replace("metadata=http://", f"metadata=http://ops:{SECRET}@")
    tokens = tokens_for(5, 4)
    with Engine.open(tmp_path / "a", LAYOUT, 1 << 30, remote=url, remote_options={
            **BUDGET, "write_behind": False, "namespace": remote.namespace}) as a:
        assert store_tokens(a, tokens).ok
        remote.served.pause()  # logs the outage, naming the store
        try:
            m = a.lookup(prefix(tokens + tokens_for(6, 1)))
            assert m.source == "local" and not a.stats()["remote"]["up"]
        finally:
            remote.served.resume()
        assert wait_until(lambda: a.stats()["remote"]["up"])  # logs the reconnect
        shown = [repr(a.remote), repr(a.remote.url), json.dumps(a.stats()["remote"]), " ".join(a.audit().notes)]
        m = a.lookup(prefix(tokens))
        assert m.source == "local" and a.stats()["remote"]["writes"] == 1
    logged = text.getvalue()
    assert all(f"event='{e}'" in logged for e in ("remote_opened", "remote_down", "remote_up"))
    assert "metadata=http://ops:***@127.0.0.1" in logged
    dump = "\n".join(sqlite3.connect(tmp_path / "a" / "catalog.db").iterdump())
    assert all(SECRET not in part for part in [*shown, logged, dump])


# -- reads ----------------------------------------------------------------------------------------


def _forge(t, keys, end: int, sizes: list[int]) -> tuple[manifest.Manifest, bytes]:
    """Rewrite the stored manifest of the checkpoint ending at block ``end`` to claim
    blobs of ``sizes`` bytes (resealed: its checksum is unkeyed)."""
    hit = t.deepest(keys[:end])
    m = hit.manifest
    forged = attrs.evolve(m, blobs=[attrs.evolve(b, size=n) for b, n in zip(m.blobs, sizes, strict=True)])
    return forged, manifest.encode(t.keys, forged)


def test_a_forged_size_costs_no_memory_and_is_that_checkpoint_s_miss(remote):
    """A manifest claiming a 2 GiB blob: refused unread (``oversized``: past the call's
    1 GiB of room); claiming 900 MiB (within it): read into room that takes memory only
    where the store wrote, and a verify failure (the size is wrong). Each a miss; the
    tier stays up, and the RSS does not grow by anything like those sizes."""
    keys = chain(8)
    with remote.tier(write_behind=False) as t:
        store(t, keys, 0, 4, seed=1)
        good = store(t, keys, 4, 8, seed=2)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
        for sizes, counter in (([2 << 30, len(good[1])], "oversized"), ([900 << 20, len(good[1])], "verify_failures")):
            forged, body = _forge(t, keys, 8, sizes)
            remote.served.write(t.keys.manifest(keys[7]), body)
            hit = t.deepest(keys)
            assert hit.manifest == forged
            got, took = timed(t.fetch_path, hit.path)
            assert len(got) == 1 and t.stats()[counter] >= 1 and t.up  # the first checkpoint still verifies
            within(took, t.config.restore_timeout)
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        assert grown < 128 << 10, f"RSS grew {grown} KiB"
        remote.served.write(t.keys.manifest(keys[7]), manifest.encode(t.keys, t.manifest_for(
            keys[7], good, start=4, end=8, generation=1, snapshot=False)))
        assert t.fetch_path(t.deepest(keys).path)[1] == good  # the real one still reads


def test_a_tier_that_missed_the_master_s_restart_writes_at_its_first_try(remote):
    """The master restarts while a tier is idle: Mooncake's client fails its next two or
    three requests at once (its connections to the old master), then works. The tier's
    first write after the restart still lands (no error, no drop, the tier up), each
    round, and another tier reads it."""
    with remote.tier(write_behind=False) as t:
        for round_ in range(3):
            keys = chain(4, seed=round_)
            store(t, keys, 0, 4, seed=round_)  # connected to this master
            remote.served.restart()
            good, took = timed(store, t, chain(4, seed=10 + round_), 0, 4, 20 + round_)
            within(took, t.config.write_timeout)
            assert t.stats()["errors"] == 0 and t.stats()["dropped"] == 0 and t.up
            with remote.tier() as other:
                assert other.fetch_path(other.deepest(chain(4, seed=10 + round_)).path) == [good]


def test_a_dead_storage_node_costs_each_call_at_most_its_budget(remote):
    """The storage node holding every object dies. The first read of its keys fails at
    once (errors, counted; the master answered: the tier stays up); until the master
    forgets the dead node (its ``-client_ttl``, 10 s), later reads wait on Mooncake's
    transfer engine: each a miss within its budget, the tier down and back. Never an
    exception, never wrong bytes."""
    keys = chain(4)
    with remote.tier(write_behind=False) as t:
        store(t, keys, 0, 4, seed=3)
        hit = t.deepest(keys)
        remote.served.store.node.kill()
        try:
            got, took = timed(t.fetch_path, hit.path)
            assert got == [] and t.stats()["errors"] >= 1 and t.up
            within(took, t.config.restore_timeout)
            for _ in range(3):
                got, took = timed(t.deepest, keys)
                assert got is None
                within(took, t.config.lookup_timeout)
                assert wait_until(lambda: t.up)  # the master answers the reconnect
                got, took = timed(t.fetch_path, hit.path)
                assert got == []
                within(took, t.config.restore_timeout)
        finally:
            remote.served.fresh()  # a new master and storage node


def test_a_write_to_a_store_without_memory_is_dropped_and_counted(remote):
    keys = chain(4)
    remote.served.store.node.kill()
    try:
        with remote.tier(write_behind=False) as t:
            assert not t.put(keys[3], *_checkpoint(t, keys))
            s = t.stats()
            assert s["dropped"] == 1 and s["errors"] == 1 and t.up  # answered: no memory lent
    finally:
        remote.served.fresh()


def _checkpoint(t, keys):
    blobs = blobs_for(4, t.ranks)
    return t.manifest_for(keys[3], blobs, start=0, end=4, generation=1, snapshot=False), blobs


# -- the extra ------------------------------------------------------------------------------------

_WITHOUT_MOONCAKE = """
import sys
class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "mooncake":
            print("IMPORTING", name)
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Missing())
"""


def test_without_mooncake_the_api_and_the_cli_name_the_extra(tmp_path):
    code = _WITHOUT_MOONCAKE + f"""
from prefixstore import Layout, TensorSpec
from prefixstore.base.errors import MissingExtraError
from prefixstore.cli import main
from prefixstore.engine.api import Engine
layout = Layout(segments=[TensorSpec("k", "float32", (2,))], block_tokens=4, ranks=1)
print("OPENING", flush=True)
try:
    Engine.open({str(tmp_path / "e")!r}, layout, 1 << 20, remote="mooncake://127.0.0.1:1?metadata=P2PHANDSHAKE")
except MissingExtraError as exc:
    print("MISSING", exc)
sys.exit(main(sys.argv[1:]))
"""
    p = subprocess.run([sys.executable, "-c", code, "replay", str(TRACE), "--limit", "5", "--remote",
                        "mooncake://127.0.0.1:1?metadata=P2PHANDSHAKE"],
                       capture_output=True, text=True, timeout=120, env=_env())
    # importing prefixstore (the API, the command line) loads nothing of Mooncake: a tier does
    assert p.stdout.startswith("OPENING\nIMPORTING mooncake"), p.stdout + p.stderr[-3000:]
    missing = p.stdout.splitlines()[2]
    assert missing.startswith("MISSING the Mooncake Store remote tier needs"), p.stdout
    assert "pip install 'prefixstore[mooncake]'" in missing
    lines = p.stderr.strip().splitlines()  # the command line: exit 2, one line
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    assert lines[0].startswith("prefixstore replay: the Mooncake Store remote tier needs")
    assert "pip install 'prefixstore[mooncake]'" in lines[0]
