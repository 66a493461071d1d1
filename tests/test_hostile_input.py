"""Bad arguments to the public API: a typed error naming the argument, nothing changed.

Each row of a table is one bad argument to ``Engine.open`` or to a method of an open
engine holding a small tree. The call must raise ``InvalidArgumentError`` (a subclass
of ``InvalidInputError``) whose ``argument`` is the bad one, and afterwards the cache's
catalog rows and shard files are what they were (for ``open``: every file of the
directory, byte for byte, and a missing directory is not created).

Then the two ways to hand an engine something that is not its own: a ``Prefix`` built
with another block size than the layout's, and a ``Match`` from another engine.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import BT, make_layout, seg_tensors, snap_tensors, store_tokens, tokens_for

from prefixstore.base import errors as E
from prefixstore.base.keys import Prefix
from prefixstore.engine.api import Engine

CAP = 16 << 20
L = make_layout(ranks=2)
A, B = tokens_for(1, 4), tokens_for(2, 3)
PA = Prefix.from_tokens(A, BT)


def files_hash(root: str) -> dict[str, str]:
    """Every file under ``root`` -> sha256 (catalog, WAL, LOCK and shards alike)."""
    out = {}
    for p in sorted(Path(root).rglob("*")):
        if p.is_file():
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def contents(eng: Engine) -> tuple[Any, ...]:
    """What the engine holds: node and file rows, journal, shard bytes, pins."""
    rows = tuple(
        tuple(eng.catalog.query(f"SELECT * FROM {t} ORDER BY 1, 2"))
        for t in ("nodes", "files", "journal")
    )
    shards = {k: v for k, v in files_hash(eng.root).items() if k.startswith("rank")}
    return rows, shards, dict(eng.holds.pins), eng.account.charged


@pytest.fixture
def eng(tmp_path):
    with Engine.open(str(tmp_path / "cache"), L, CAP) as e:
        assert store_tokens(e, A[: 2 * BT]).status == "stored"
        assert store_tokens(e, A).status == "stored"
        assert store_tokens(e, B).status == "stored"
        yield e


# ---------------------------------------------------------------------- Engine.open

NAN = math.nan
OPEN_CASES: list[tuple[str, dict[str, Any]]] = [
    ("capacity_bytes", {"capacity_bytes": "abc"}),
    ("capacity_bytes", {"capacity_bytes": NAN}),
    ("capacity_bytes", {"capacity_bytes": 1.5}),
    ("capacity_bytes", {"capacity_bytes": 0}),
    ("capacity_bytes", {"capacity_bytes": -1}),
    ("capacity_bytes", {"capacity_bytes": True}),
    ("capacity_bytes", {"capacity_bytes": None}),
    ("synchronous", {"synchronous": "OFF"}),
    ("synchronous", {"synchronous": 2}),
    ("policy", {"policy": "bogus"}),
    ("policy", {"policy": None}),
    ("inflight_wait_s", {"inflight_wait_s": -1}),
    ("inflight_wait_s", {"inflight_wait_s": NAN}),
    ("inflight_wait_s", {"inflight_wait_s": math.inf}),
    ("inflight_wait_s", {"inflight_wait_s": "1"}),
    ("high_watermark", {"high_watermark": 1.5}),
    ("high_watermark", {"high_watermark": NAN}),
    ("low_watermark", {"low_watermark": 0}),
    ("low_watermark", {"low_watermark": 0.9, "high_watermark": 0.5}),
    ("create", {"create": "no"}),
    ("backing", {"backing": "tape"}),
    ("ram_bytes", {"backing": "composite", "ram_bytes": -5}),
    ("ram_bytes", {"backing": "composite", "ram_bytes": "x"}),
    ("executor", {"executor": "tpu"}),
    ("bandwidth", {"bandwidth": -1}),
    ("bandwidth", {"bandwidth": NAN}),
    ("bandwidth", {"bandwidth": "fast"}),
    ("cost", {"cost": "cheap"}),
    ("admission", {"admission": 5}),
    ("compaction", {"compaction": "yes"}),
    ("ranks", {"ranks": "01"}),
    ("no_such_option", {"no_such_option": 1}),
    ("layout", {"layout": "bfloat16"}),
    ("path", {"path": 5}),
    ("path", {"path": None}),
]


def _open(root: str, kw: dict[str, Any]) -> Engine:
    kw = dict(kw)
    path = kw.pop("path", root)
    layout = kw.pop("layout", L)
    capacity = kw.pop("capacity_bytes", CAP)
    return Engine.open(path, layout, capacity, **kw)


@pytest.mark.parametrize(("argument", "kw"), OPEN_CASES, ids=[f"{a}={list(k.values())[-1]!r}" for a, k in OPEN_CASES])
def test_open_refuses_bad_argument(tmp_path, argument, kw):
    root = str(tmp_path / "cache")
    with Engine.open(root, L, CAP) as eng:
        assert store_tokens(eng, A).status == "stored"
    before = files_hash(root)
    with pytest.raises(E.InvalidArgumentError) as err:
        _open(root, kw).close()
    assert err.value.argument == argument, err.value
    assert argument in str(err.value)
    assert files_hash(root) == before  # the catalog was not even opened

    fresh = str(tmp_path / "fresh")
    with pytest.raises(E.InvalidArgumentError):
        _open(fresh, kw).close()
    assert not os.path.exists(fresh)  # nothing created either

    with Engine.open(root, L, CAP) as eng:  # the cache is intact
        m = eng.lookup(PA)
        assert m.hit and m.blocks == len(PA)
        r = eng.restore(m)
        assert r is not None and torch.equal(r.segments[1]["v"], seg_tensors(L, A)[1]["v"])


def test_open_accepts_the_documented_forms(tmp_path):
    """What the table refuses is not what callers use: these still open."""
    root = str(tmp_path / "cache")
    with Engine.open(Path(root), L, CAP, synchronous="normal", policy="lru", inflight_wait_s=0,
                     high_watermark=0.9, low_watermark=0.5, create=True, bandwidth=1e9) as eng:
        assert store_tokens(eng, A).ok
    with Engine.open(root, L, CAP + 1, executor="cpu", compaction=False, admission=None) as eng:
        assert eng.lookup(PA).hit


# ---------------------------------------------------------------------- methods


def _meta(t: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    return [{k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in d.items()} for d in t]


C = tokens_for(3, 2)
PC = Prefix.from_tokens(C, BT)
SEGS, SNAP = seg_tensors(L, C), snap_tensors(L, C)

METHOD_CASES: list[tuple[str, str, Callable[[Engine], Any]]] = [
    ("pin(None)", "match", lambda e: e.pin(None)),
    ("unpin(None)", "match", lambda e: e.unpin(None)),
    ("restore(None)", "match", lambda e: e.restore(None)),
    ("pinned(None)", "match", lambda e: e.pinned(None).__enter__()),
    ("restore(prefix)", "match", lambda e: e.restore(PA)),
    ("evict(nan)", "nbytes", lambda e: e.evict(math.nan)),
    ("evict(1.5)", "nbytes", lambda e: e.evict(1.5)),
    ("evict('x')", "nbytes", lambda e: e.evict("x")),
    ("evict(-1)", "nbytes", lambda e: e.evict(-1)),
    ("evict(both)", "nbytes", lambda e: e.evict(10, prefix=PA)),
    ("evict(prefix='x')", "prefix", lambda e: e.evict(prefix="x")),
    ("lookup(total_tokens='x')", "total_tokens", lambda e: e.lookup(PA, total_tokens="x")),
    ("lookup(total_tokens=-5)", "total_tokens", lambda e: e.lookup(PA, total_tokens=-5)),
    ("lookup(total_tokens=nan)", "total_tokens", lambda e: e.lookup(PA, total_tokens=math.nan)),
    ("lookup(gpu_blocks=-1)", "gpu_blocks", lambda e: e.lookup(PA, gpu_blocks=-1)),
    ("lookup(gpu_blocks=1.0)", "gpu_blocks", lambda e: e.lookup(PA, gpu_blocks=1.0)),
    ("lookup(gpu_blocks=9)", "gpu_blocks", lambda e: e.lookup(PA, gpu_blocks=9)),
    ("lookup(tokens)", "prefix", lambda e: e.lookup(A)),
    ("store(meta segments)", "segments", lambda e: e.store(PC, _meta(SEGS), SNAP)),
    ("store(meta snapshot)", "snapshot", lambda e: e.store(PC, SEGS, _meta(SNAP))),
    ("store(segments=5)", "segments", lambda e: e.store(PC, 5, SNAP)),
    ("store(segments=[5, 5])", "segments", lambda e: e.store(PC, [5, 5], SNAP)),
    ("store(tokens_from='0')", "tokens_from", lambda e: e.store(PC, SEGS, SNAP, tokens_from="0")),
    ("store(tokens_from=-4)", "tokens_from", lambda e: e.store(PC, SEGS, SNAP, tokens_from=-4)),
    ("store(tokens_from=end)", "tokens_from", lambda e: e.store(PC, SEGS, SNAP, tokens_from=len(C))),
    ("store(valid=5)", "valid", lambda e: e.store(PC, SEGS, SNAP, valid=5)),
    ("store(tokens)", "prefix", lambda e: e.store(C, SEGS, SNAP)),
    ("store(empty)", "prefix", lambda e: e.store(PC[:0], SEGS, SNAP)),
    ("store_async(meta segments)", "segments", lambda e: e.store_async(PC, _meta(SEGS), SNAP)),
    ("store_async(valid=5)", "valid", lambda e: e.store_async(PC, SEGS, SNAP, valid=5)),
    ("compact('x')", "policy", lambda e: e.compact("x")),
    ("audit(checksums='no')", "checksums", lambda e: e.audit(checksums="no")),
]


@pytest.mark.parametrize(("argument", "call"), [c[1:] for c in METHOD_CASES], ids=[c[0] for c in METHOD_CASES])
def test_method_refuses_bad_argument(eng, argument, call):
    m = eng.lookup(PA)
    assert eng.pin(m)  # a pin held across the bad call is neither lost nor doubled
    before = contents(eng)
    with pytest.raises(E.InvalidArgumentError) as err:
        call(eng)
    assert err.value.argument == argument, err.value
    assert argument in str(err.value)
    assert contents(eng) == before
    eng.unpin(m)
    assert eng.audit().ok
    r = eng.restore(eng.lookup(PA))
    assert r is not None and torch.equal(r.segments[0]["k"], seg_tensors(L, A)[0]["k"])
    assert eng.store(PC, SEGS, SNAP).status == "stored"  # still usable


def test_existing_typed_errors_still_raised(eng):
    """Shape, alignment and rank errors keep their own types."""
    with pytest.raises(E.ShapeError):
        eng.store(PC, [{"k": SEGS[0]["k"]}, SEGS[1]], SNAP)
    with pytest.raises(E.UnalignedError):
        eng.store(PC, SEGS, SNAP, tokens_from=1)
    with pytest.raises(E.RankError):
        eng.store(PC, SEGS[:1], SNAP)
    with pytest.raises(E.DtypeError):
        eng.store(PC, [{k: v.float() for k, v in d.items()} for d in SEGS], SNAP)


# ---------------------------------------------------------------------- a Prefix's block size


def test_prefix_knows_its_block_size():
    p = Prefix.from_tokens(A, 8)
    assert p.block_tokens == 8 and p[:1].block_tokens == 8
    assert Prefix.from_ids([1, 2]).block_tokens is None
    assert Prefix.from_ids([1, 2], 16).block_tokens == 16
    assert Prefix.from_tokens(A, 8) != Prefix(Prefix.from_tokens(A, 8).digests)  # same digests, unknown size
    for bad in (0, -4, 2.0, "4", True):
        with pytest.raises(E.InvalidArgumentError) as err:
            Prefix.from_tokens(A, bad)
        assert err.value.argument == "block_tokens"


def test_prefix_of_another_block_size_is_refused(eng):
    wrong = Prefix.from_tokens(C, 2 * BT)  # the case: 32-token blocks on a 16-token cache
    seg = seg_tensors(L, C)
    before = contents(eng)
    for call in (lambda: eng.store(wrong, seg, SNAP), lambda: eng.lookup(wrong),
                 lambda: eng.evict(prefix=wrong), lambda: eng.store_async(wrong, seg, SNAP)):
        with pytest.raises(E.BlockSizeMismatchError) as err:
            call()
        assert err.value.argument == "prefix" and f"block_tokens={2 * BT}" in str(err.value)
    assert contents(eng) == before
    assert eng.store(PC, seg, SNAP).status == "stored"
    assert eng.lookup(PC).blocks == len(PC)
    # A Prefix without a recorded block size (trace ids) is taken in the engine's blocks.
    ids = Prefix.from_ids(range(3))
    assert eng.store(ids, seg_tensors(L, tokens_for(5, 3)), snap_tensors(L, tokens_for(5, 3))).status == "stored"
    assert eng.lookup(Prefix.from_ids(range(3), BT)).hit


# ---------------------------------------------------------------------- a Match from elsewhere


def test_match_from_another_engine_is_refused(tmp_path):
    """Two caches holding the same tree shape (so node ids and generations coincide)
    with different bytes: A's Match given to B is refused, not served from B."""
    ea = Engine.open(str(tmp_path / "a"), L, CAP)
    eb = Engine.open(str(tmp_path / "b"), L, CAP)
    try:
        assert store_tokens(ea, A).status == "stored"
        assert store_tokens(eb, A, salt=7).status == "stored"  # same prefix, other bytes
        ma, mb = ea.lookup(PA), eb.lookup(PA)
        assert ma.hit and ma.path == mb.path  # ids and generations coincide
        before = contents(eb)
        for call in (eb.restore, eb.pin, eb.unpin, lambda m: eb.pinned(m).__enter__()):
            with pytest.raises(E.ForeignMatchError) as err:
                call(ma)
            assert err.value.argument == "match"
        assert contents(eb) == before
        ra, rb = ea.restore(ma), eb.restore(mb)
        assert torch.equal(ra.segments[0]["k"], seg_tensors(L, A)[0]["k"])
        assert torch.equal(rb.segments[0]["k"], seg_tensors(L, A, salt=7)[0]["k"])
    finally:
        ea.close()
        eb.close()


def test_match_from_an_earlier_open_is_refused(tmp_path):
    """A Match belongs to the engine that made it: after a reopen of the same
    directory it is another engine's (a new lookup is needed)."""
    root = str(tmp_path / "c")
    with Engine.open(root, L, CAP) as eng:
        assert store_tokens(eng, A).status == "stored"
        old = eng.lookup(PA)
    with Engine.open(root, L, CAP) as eng:
        with pytest.raises(E.ForeignMatchError):
            eng.restore(old)
        assert eng.restore(eng.lookup(PA)) is not None


def test_hand_made_match_is_refused(eng):
    """A Match copied field by field (without this engine's identity) is refused."""
    import attrs

    m = eng.lookup(PA)
    forged = attrs.evolve(m, cache=None)
    with pytest.raises(E.ForeignMatchError):
        eng.restore(forged)
    assert eng.restore(m) is not None
