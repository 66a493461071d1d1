"""Remote-tier manifests and key names, without a server: any altered byte is refused."""

from __future__ import annotations

import json

import pytest
from remote_helpers import blobs_for, chain

from prefixstore.base.errors import InvalidArgumentError
from prefixstore.gpu.remote import manifest
from prefixstore.gpu.remote.auth import SharedKey
from prefixstore.gpu.remote.keys import KeySpace, check_namespace, layout_id
from prefixstore.gpu.remote.manifest import ManifestError

SPACE = KeySpace("ns", layout_id('{"layout": 1}'))
KEYS = chain(8)


def _encoded(snapshot: bool = True) -> tuple[manifest.Manifest, bytes]:
    m = manifest.build(SPACE, KEYS[7], blobs_for(1), start=4, end=8, generation=3,
                       snapshot=snapshot)
    return m, manifest.encode(SPACE, m)


def test_manifest_round_trip():
    m, data = _encoded()
    assert manifest.decode(SPACE, KEYS[7], data, ranks=2) == m
    assert json.loads(data)["blobs"][1][0] == len(blobs_for(1)[1])
    assert [b.key for b in m.blobs] == [SPACE.blob(KEYS[7], r, b.checksum) for r, b in enumerate(m.blobs)]


def test_every_altered_byte_is_refused():
    _, data = _encoded()
    for i in range(len(data)):
        for flip in (1, 0x20):
            bad = data[:i] + bytes([data[i] ^ flip]) + data[i + 1:]
            with pytest.raises(ManifestError):
                manifest.decode(SPACE, KEYS[7], bad, ranks=2)


@pytest.mark.parametrize("data", [
    b"", b"null", b"[]", b"{}", b"\xff\xfe", b"[" * 100_000, b'{"sum": 1}',
    b'{"a": 1, "sum": "00"}',
])
def test_garbage_is_refused(data):
    with pytest.raises(ManifestError):
        manifest.decode(SPACE, KEYS[7], data, ranks=2)


def test_a_manifest_is_refused_at_another_key_rank_count_or_space():
    _, data = _encoded()
    with pytest.raises(ManifestError):
        manifest.decode(SPACE, KEYS[6], data, ranks=2)
    with pytest.raises(ManifestError):
        manifest.decode(SPACE, KEYS[7], data, ranks=1)
    for other in (KeySpace("ns2", layout_id('{"layout": 1}')), KeySpace("ns", layout_id('{"layout": 2}'))):
        with pytest.raises(ManifestError):
            manifest.decode(other, KEYS[7], data, ranks=2)


def test_a_resealed_manifest_with_bad_fields_is_refused():
    """Even with a correct checksum (someone who knows the format), bad fields are refused."""
    _, data = _encoded()
    for field, value in [("start", 8), ("start", -1), ("generation", -1), ("snapshot", 1),
                         ("blobs", [[1, "zz"], [1, "00"]]), ("extra", 1), ("end", 4.0)]:
        body = json.loads(data)
        del body["sum"]
        body[field] = value
        canon = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        body["sum"] = manifest.shards.checksum(canon)
        with pytest.raises(ManifestError):
            manifest.decode(SPACE, KEYS[7], json.dumps(body).encode(), ranks=2)


def test_key_spaces_differ_by_namespace_and_layout():
    a, b, c = KeySpace("a", "l1"), KeySpace("b", "l1"), KeySpace("a", "l2")
    names = {s.manifest(KEYS[0]) for s in (a, b, c)} | {s.blob(KEYS[0], 0, "0" * 32) for s in (a, b, c)}
    assert len(names) == 6
    assert a.manifest(KEYS[0]).count("{") == 1 and f"{{{KEYS[0].hex()}}}" in a.manifest(KEYS[0])


@pytest.mark.parametrize("bad", ["", "a:b", "{x}", "a b", "x" * 65, None, 3])
def test_bad_namespaces_are_refused(bad):
    with pytest.raises(InvalidArgumentError) as e:
        check_namespace(bad)
    assert e.value.argument == "namespace"


KEY = SharedKey(b"a shared key of this deployment")


def _signed() -> tuple[manifest.Manifest, bytes]:
    blobs = blobs_for(1)
    m = manifest.sign(KEY, manifest.build(SPACE, KEYS[7], blobs, start=4, end=8, generation=3, snapshot=True), blobs)
    return m, manifest.encode(SPACE, m, KEY)


def test_a_signed_manifest_round_trips_and_every_altered_byte_is_refused():
    m, data = _signed()
    got = manifest.decode(SPACE, KEYS[7], data, ranks=2, key=KEY)
    assert got == m and got.stored == data and all(len(b.mac) == 64 for b in got.blobs)
    assert "sum" not in json.loads(data)
    for i in range(len(data)):
        bad = data[:i] + bytes([data[i] ^ 1]) + data[i + 1:]
        with pytest.raises(ManifestError):
            manifest.decode(SPACE, KEYS[7], bad, ranks=2, key=KEY)


def test_a_manifest_is_refused_unsigned_by_another_key_or_without_one():
    m, signed = _signed()
    _, unsigned = _encoded()
    with pytest.raises(ManifestError, match="not signed"):
        manifest.decode(SPACE, KEYS[7], unsigned, ranks=2, key=KEY)
    with pytest.raises(ManifestError, match="signature"):
        manifest.decode(SPACE, KEYS[7], signed, ranks=2, key=SharedKey(b"another tenant's key"))
    with pytest.raises(ManifestError, match="key this reader does not hold"):
        manifest.decode(SPACE, KEYS[7], signed, ranks=2)
    resealed = json.loads(signed)  # a MAC moved into an unkeyed manifest's body is refused too
    del resealed["mac"]
    resealed["sum"] = manifest.shards.checksum(json.dumps(resealed, sort_keys=True, separators=(",", ":")).encode())
    with pytest.raises(ManifestError):
        manifest.decode(SPACE, KEYS[7], json.dumps(resealed).encode(), ranks=2)
    with pytest.raises(ValueError):
        manifest.encode(SPACE, manifest.build(SPACE, KEYS[7], blobs_for(1), start=4, end=8, generation=3,
                                              snapshot=True), KEY)  # its blobs not signed


def test_a_blob_mac_binds_its_key_name_and_bytes():
    data = blobs_for(2)[0]
    a, b = SPACE.blob(KEYS[0], 0, "0" * 32), SPACE.blob(KEYS[1], 0, "0" * 32)
    assert KEY.blob_mac(a, data) != KEY.blob_mac(b, data) != KEY.blob_mac(b, data[:-1])
    assert KEY.blob_mac(a, data) != SharedKey(b"another tenant's key").blob_mac(a, data)
    assert repr(KEY) == "SharedKey(***)"


def test_a_manifest_longer_than_its_maximum_is_refused():
    _, data = _encoded()
    assert len(data) <= manifest.max_bytes(2) < len(data) + 4096
    with pytest.raises(ManifestError, match="longer"):
        manifest.decode(SPACE, KEYS[7], data + b" " * manifest.max_bytes(2), ranks=2)
