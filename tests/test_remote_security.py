"""Remote tier URLs, AUTH / ACL and TLS against real redis-server processes; no
credential ever appears in a repr, the stats or the logs."""

from __future__ import annotations

import io
import itertools
import logging
import os
import re
import subprocess
import sys

import pytest
import structlog
from redis_servers import RedisServer
from remote_helpers import blobs_for, chain, store, tier, wait_until

from prefixstore import cli
from prefixstore.base.errors import InvalidArgumentError
from prefixstore.gpu.remote import parse
from prefixstore.gpu.remote import tier as shared_tier

SECRET = "s3cr3t-Pa55word"


@pytest.mark.parametrize(("url", "want"), [
    ("redis://localhost", (False, False, (("localhost", 6379),), 0, None, None)),
    ("redis://h:7000/3", (False, False, (("h", 7000),), 3, None, None)),
    ("rediss://u:p%40ss@h:1/0", (False, True, (("h", 1),), 0, "u", "p@ss")),
    ("redis://:pw@h:2", (False, False, (("h", 2),), 0, None, "pw")),
    ("redis+cluster://a:1,b:2,[::1]:3", (True, False, (("a", 1), ("b", 2), ("::1", 3)), 0, None, None)),
    ("rediss+cluster://u:p@a:1", (True, True, (("a", 1),), 0, "u", "p")),
])
def test_urls_parse(url, want):
    u = parse(url)
    assert (u.cluster, u.tls, u.hosts, u.db, u.username, u.password) == want


@pytest.mark.parametrize("url", [
    "http://h:1", "redis//h", "redis://h:0", "redis://h:x", "redis://a:1,b:2",
    "redis://h:1/x", "redis+cluster://a:1/2", "redis://:pw@", 42,
])
def test_bad_urls_are_refused_naming_remote(url):
    with pytest.raises(InvalidArgumentError) as e:
        parse(url)
    assert e.value.argument == "remote"


def test_bad_url_error_does_not_show_the_password():
    with pytest.raises(InvalidArgumentError) as e:
        parse(f"redis://user:{SECRET}@h:99999")
    assert SECRET not in str(e.value)


# Userinfo with every character that URL syntax gives a meaning to, unencoded: the
# userinfo is everything before the last "@", and no piece of it may reach a message.
USERINFOS = ["Zq7user:pa/ss7Zq", "Zq7user:p@ss/w0rd", "Zq7user:pw#frag?x=1", "Zq7u:a:b:c/d",
             "Zq7user:%zz%41/pw", ":Zq7only/pass", "Zq7user:?/#@:%", "Zq7/slash/user:pw",
             "Zq7user:p,w[1]/x"]
HOSTPARTS = ["h:99999", "h:x/0", "h:1/x", ":1", "", "a:1,b:2", "h:1/0#f", "[::1]:0"]


def _pieces(userinfo: str) -> list[str]:
    """The userinfo and each run of 3+ characters of it between URL delimiters."""
    return [userinfo, *[p for p in re.split(r"[/:@#?%,\[\]]", userinfo) if len(p) >= 3]]


@pytest.mark.parametrize("userinfo", USERINFOS)
def test_no_piece_of_the_userinfo_is_ever_in_an_error(userinfo):
    for scheme in ("redis", "rediss", "redis+cluster"):
        for host in HOSTPARTS:
            url = f"{scheme}://{userinfo}@{host}"
            try:
                u = parse(url)
            except InvalidArgumentError as exc:
                message = f"{exc} {exc!r} {exc.argument}"
                assert not [p for p in _pieces(userinfo) if p in message], (url, message)
            else:
                shown = f"{u!r} {u.redacted()}"
                assert not [p for p in _pieces(userinfo) if p in shown], (url, shown)


@pytest.mark.parametrize(("url", "user", "password", "hosts", "db"), [
    ("redis://user:pa/ss@h:1/0", "user", "pa/ss", (("h", 1),), 0),
    ("redis://u:p@ss/w#?:%@h:7/2", "u", "p@ss/w#?:%", (("h", 7),), 2),
    ("redis+cluster://u:p,q/r@a:1,b:2", "u", "p,q/r", (("a", 1), ("b", 2)), 0),
    ("rediss://:%2Fenc%40@h:3", None, "/enc@", (("h", 3),), 0),
])
def test_a_password_may_hold_url_delimiters_unencoded(url, user, password, hosts, db):
    u = parse(url)
    assert (u.username, u.password, u.hosts, u.db) == (user, password, hosts, db)
    assert password not in repr(u) and password not in u.redacted() and "***@" in u.redacted()


def test_a_password_with_url_delimiters_logs_in(tmp_path):
    password = "pa/ss@w#rd?:x"
    server = RedisServer(tmp_path / "redis", password=password).start()
    try:
        keys = chain(4)
        with tier(f"redis://default:{password}@127.0.0.1:{server.port}/0", write_behind=False) as t:
            blobs = store(t, keys, 0, 4, seed=5)
            assert t.fetch_path(t.deepest(keys).path) == [blobs]
    finally:
        server.stop()


def test_the_cli_never_prints_the_userinfo(tmp_path, capfd):
    """``prefixstore replay --remote URL`` with malformed URLs: exit 2, one line on stderr
    without any piece of the userinfo (in the process, every URL of the table; and one
    run of the real command line)."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [0, 1]}\n')
    for i, (userinfo, host) in enumerate(itertools.product(USERINFOS, ("h:99999", "h:x/0", ""))):
        url = f"redis://{userinfo}@{host}"
        rc = cli.main(["replay", str(trace), str(tmp_path / f"d{i}"), "--remote", url, "--quiet"])
        out, err = capfd.readouterr()
        assert rc == 2 and err.startswith("replay: remote:"), (url, rc, err)
        assert not [p for p in _pieces(userinfo) if p in out + err], (url, out, err)
    url = "redis://user:Zq7pa/ss7Zq@h:x/0"  # a bad port after a password with a "/"
    done = subprocess.run([sys.executable, "-m", "prefixstore.cli", "replay", str(trace), str(tmp_path / "e"),
                           "--remote", url, "--quiet"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 2 and "Zq7pa" not in done.stdout + done.stderr and "ss7Zq" not in done.stderr
    assert done.stderr.startswith("replay: remote:"), done.stderr


def test_password_is_never_shown(tmp_path, monkeypatch):
    text = io.StringIO()
    monkeypatch.setattr(shared_tier, "log", structlog.wrap_logger(
        structlog.PrintLogger(file=text), processors=[structlog.processors.KeyValueRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG)))
    server = RedisServer(tmp_path / "redis", password=SECRET).start()
    url = f"redis://default:{SECRET}@127.0.0.1:{server.port}/0"
    try:
        keys = chain(4)
        t = tier(url, write_behind=False, password=None)
        blobs = store(t, keys, 0, 4, seed=1)
        assert t.fetch_path(t.deepest(keys).path) == [blobs]
        server.stop()  # logs the outage, naming the server
        assert t.deepest(keys) is None
        server.restart()
        assert wait_until(lambda: t.up)  # logs the reconnect
        shown = [repr(t), repr(t.url), t.url.redacted(), repr(t.config), str(t.stats())]
        t.close()
        logged = text.getvalue()
        assert "event='remote_down'" in logged and "event='remote_up'" in logged
        assert f"remote='redis://***@127.0.0.1:{server.port}/0'" in logged
        assert all(SECRET not in part for part in [*shown, logged])
    finally:
        server.stop()


def test_wrong_or_missing_password_is_a_miss(tmp_path):
    server = RedisServer(tmp_path / "redis", password=SECRET).start()
    try:
        keys = chain(4)
        with tier(server.url, write_behind=False) as t:  # no password
            assert not t.put(keys[3], *_one(t, keys))
            assert t.deepest(keys) is None
            assert t.stats()["errors"] >= 1 and not t.up
        with tier(server.url, write_behind=False, password="wrong") as t:
            assert t.deepest(keys) is None and t.stats()["errors"] >= 1
        with tier(server.url, write_behind=False, password=SECRET) as t:  # option, not URL
            blobs = store(t, keys, 0, 4, seed=2)
            assert t.fetch_path(t.deepest(keys).path) == [blobs]
    finally:
        server.stop()


def test_acl_user(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    try:
        server.client().acl_setuser("engine", enabled=True, passwords=[f"+{SECRET}"],
                                    keys=["ps:*"], commands=["+@all"])
        keys = chain(4)
        url = f"redis://engine:{SECRET}@127.0.0.1:{server.port}/0"
        with tier(url, write_behind=False) as t:
            blobs = store(t, keys, 0, 4, seed=3)
            assert t.fetch_path(t.deepest(keys).path) == [blobs]
        with tier(url, write_behind=False, namespace="other") as t:
            assert t.deepest(keys) is None
    finally:
        server.stop()


def test_an_acl_user_without_scripts_reads_with_getrange(tmp_path):
    """Scripts refused by the ACL (NOPERM): reads fall back to one GETRANGE per key, still
    bounded (an oversized manifest is that key's miss); the clean-up script is refused,
    so a checkpoint whose blob is gone stays a miss."""
    server = RedisServer(tmp_path / "redis").start()
    try:
        server.client().acl_setuser("engine", enabled=True, passwords=[f"+{SECRET}"],
                                    keys=["ps:*"], commands=["+@all", "-@scripting"])
        url = f"redis://engine:{SECRET}@127.0.0.1:{server.port}/0"
        r = server.client()
        with tier(url, write_behind=False) as t:
            keys, other = chain(4), chain(4, seed=1)
            blobs = store(t, keys, 0, 4, seed=3)
            store(t, other, 0, 2, seed=4)
            r.setrange(t.keys.manifest(other[3]), 1 << 20, b"x")
            assert t.fetch_path(t.deepest(keys).path) == [blobs]
            assert t.deepest(other).blocks == 2 and t.stats()["oversized"] == 1
            hit = t.deepest(other)
            r.delete(hit.manifest.blobs[0].key)
            assert t.fetch_path(hit.path) == [] and t.deepest(other).blocks == 2
            s = t.stats()
            assert s["up"] == 1 and s["timeouts"] == 0 and s["errors"] == 0 and s["forgotten"] == 0
            assert r.info("commandstats").get("cmdstat_getrange", {}).get("calls", 0) > 0
    finally:
        server.stop()


def test_tls(tmp_path):
    server = RedisServer(tmp_path / "redis", tls=True).start()
    try:
        keys = chain(4)
        with tier(server.url, write_behind=False, tls={"ssl_ca_certs": server.ca_file}) as t:
            blobs = store(t, keys, 0, 4, seed=4)
            assert t.fetch_path(t.deepest(keys).path) == [blobs]
        with tier(server.url, write_behind=False) as t:  # the server's CA is not trusted
            assert t.deepest(keys) is None
            assert wait_until(lambda: t.stats()["errors"] + t.stats()["timeouts"] >= 1)
        plain = f"redis://127.0.0.1:{server.port}/0"  # TLS port, plain client
        with tier(plain, write_behind=False, lookup_timeout=0.3) as t:
            assert t.deepest(keys) is None
            assert wait_until(lambda: t.stats()["errors"] + t.stats()["timeouts"] >= 1)
    finally:
        server.stop()


def _one(t, keys):
    blobs = blobs_for(9)
    return t.manifest_for(keys[3], blobs, start=0, end=4, generation=1, snapshot=False), blobs
