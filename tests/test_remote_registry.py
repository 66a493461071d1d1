"""The remote store registry: a backend that a test registers (``remote_dict``, one module
plus ``register``) is used by ``Engine.open`` and validated by ``EngineConfig`` with
nothing else changed; schemes are listed live; names and schemes are never taken twice."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import remote_dict
from conftest import store_tokens, tokens_for
from remote_engine_worker import LAYOUT, restored_exactly

from prefixstore.base.errors import InvalidArgumentError, InvalidInputError
from prefixstore.base.keys import Prefix
from prefixstore.engine.api import Engine
from prefixstore.engine.config import EngineConfig
from prefixstore.gpu import remote
from prefixstore.gpu.remote import RemoteTier


@pytest.fixture(name="dict_backend")
def dict_backend_fixture():
    remote.register(remote_dict.BACKEND)
    try:
        yield remote_dict
    finally:
        remote.unregister("dict")
        remote_dict.STORES.clear()


def test_a_registered_backend_is_a_remote_tier_of_the_engine(dict_backend, tmp_path):
    tokens = tokens_for(3, 5)
    options = {"write_behind": False}
    with Engine.open(tmp_path / "a", LAYOUT, 1 << 30, remote="dict://shared", remote_options=options) as a:
        assert isinstance(a.remote, RemoteTier) and isinstance(a.remote.store, remote_dict.DictStore)
        assert store_tokens(a, tokens).ok
    with Engine.open(tmp_path / "b", LAYOUT, 1 << 30, remote="dict://shared", remote_options=options) as b:
        m = b.lookup(Prefix.from_tokens(tokens, LAYOUT.block_tokens))
        assert m.source == "remote"
        restored_exactly(b, tokens, b.restore(m))
        assert b.stats()["remote"]["url"] == "dict://shared"
        assert any(n.startswith("remote tier dict://shared: up") for n in b.audit().notes)
    (blob,) = [k for k in remote_dict.STORES["shared"] if k.endswith(m.remote.hit.manifest.blobs[1].checksum)]
    remote_dict.STORES["shared"][blob] = bytes(len(remote_dict.STORES["shared"][blob]))  # altered
    with Engine.open(tmp_path / "c", LAYOUT, 1 << 30, remote="dict://shared", remote_options=options) as c:
        m = c.lookup(Prefix.from_tokens(tokens, LAYOUT.block_tokens))
        assert m.source == "remote" and c.restore(m) is None  # the shared tier's checks hold for any backend
        assert c.stats()["remote"]["verify_failures"] == 1


def test_config_validates_by_the_registry(dict_backend):
    assert "dict" in remote.SCHEMES and "mooncake" in remote.SCHEMES and "redis" in remote.SCHEMES
    EngineConfig(remote="dict://x")
    with pytest.raises(InvalidArgumentError) as e:  # its parser's refusal
        EngineConfig(remote="dict://not a name")
    assert e.value.argument == "remote"
    with pytest.raises(InvalidArgumentError) as e:  # its check of the options
        EngineConfig(remote="dict://x", remote_options={"tls": {"ssl_ca_certs": "/ca"}})
    assert e.value.argument == "remote_options" and "tls" in str(e.value)
    EngineConfig(remote="redis://h:1/0", remote_options={"tls": {"ssl_ca_certs": "/ca"}})  # Redis takes them
    remote.unregister("dict")
    with pytest.raises(InvalidArgumentError) as e:
        EngineConfig(remote="dict://x")
    assert e.value.argument == "remote" and "dict://" not in str(e.value) and "mooncake://" in str(e.value)


def test_a_name_or_a_scheme_is_registered_once(dict_backend):
    with pytest.raises(InvalidInputError):
        remote.register(dict_backend.BACKEND)
    clash = remote.Backend(name="other", schemes=("redis",), url_type=dict_backend.DictURL,
                           parse=dict_backend.parse, open=dict_backend.DictStore)
    with pytest.raises(InvalidInputError):
        remote.register(clash)
    with pytest.raises(InvalidInputError):
        remote.register("dict")
    assert remote.registry.backend_for("redis://h:1").name == "redis"


def test_every_remote_url_the_readme_and_the_remote_pages_show_is_accepted():
    """Each ``remote="..."`` in the README and docs/remote-*.md (adjacent string literals
    joined) is a URL the engine's options accept: an example that cannot work fails here."""
    root = Path(__file__).resolve().parent.parent
    pages = [root / "README.md", *sorted((root / "docs").glob("remote-*.md"))]
    urls = {}
    for page in pages:
        for literal in re.findall(r'remote=((?:"[^"\n]*"\s*)+)', page.read_text()):
            urls["".join(re.findall(r'"([^"\n]*)"', literal))] = page.name
    assert {u.partition("://")[0] for u in urls} >= {"redis", "mooncake"}, urls
    for url, page in urls.items():
        try:
            EngineConfig(remote=url)
        except InvalidArgumentError as exc:
            pytest.fail(f"{page}: {url}: {exc}")
