"""The library's log: one object every module logs through, its target swappable."""

from __future__ import annotations

import os
from pathlib import Path

from conftest import store_tokens, tokens_for

from prefixstore.base import log as plog
from prefixstore.base.keys import Prefix
from prefixstore.engine.api import Engine

CAP = 1 << 30


class Collector:
    """A logger double keeping (level, event, fields) of every call."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict]] = []

    def __getattr__(self, level: str):
        def emit(event: str, **kv: object) -> None:
            self.lines.append((level, event, kv))
        return emit

    def warnings(self) -> list[tuple[str, object]]:
        return [(e, kv.get("key")) for lvl, e, kv in self.lines if lvl == "warning"]


def damage(cache_dir: str, node) -> None:
    """Empty the node's shard of its current generation."""
    Path(os.path.join(cache_dir, "rank0", f"{node.key.hex()}-g{node.generation}.st")).write_bytes(b"")


def test_a_swapped_log_receives_the_warnings_of_modules_imported_before(cache_dir, layout):
    toks = tokens_for(3, 4)
    outer, inner = Collector(), Collector()
    with plog.using(outer), Engine.open(cache_dir, layout, CAP) as eng:
        store_tokens(eng, toks)
        node = eng.index.nodes[eng.index.by_key[Prefix.from_tokens(toks, 4).keys[-1]]]
        damage(cache_dir, node)
        with plog.using(inner):
            assert eng.restore(eng.lookup(Prefix.from_tokens(toks, 4))) is None
        assert inner.warnings() == [("node_damaged", node.key.hex()[:12])]
        assert outer.warnings() == []
        # after the block the previous target is back
        assert store_tokens(eng, toks).status == "refilled"
        damage(cache_dir, node)
        assert eng.restore(eng.lookup(Prefix.from_tokens(toks, 4))) is None
        assert outer.warnings() == [("node_damaged", node.key.hex()[:12])]
        assert len(inner.warnings()) == 1


def test_use_returns_the_target_it_replaces():
    first = Collector()
    before = plog.use(first)
    try:
        assert plog.use(Collector()) is first
    finally:
        plog.use(before)
    assert plog.log.target is before
