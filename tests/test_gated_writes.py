"""Which stores write beside their intent's log sync (``staging.gated``): ranks whose
``write_shard`` is ``LocalRank``'s own declare ``WRITES_GATED``; one overridden by a
subclass or patched in by a fault harness does not (the gated write would go around
it), and a store below ``GATED_MIN_BYTES`` keeps the order sync, then write."""

from __future__ import annotations

import os

import attrs
import pytest

from prefixstore.engine import staging
from prefixstore.gpu.ranks import LocalRank
from prefixstore.gpu.tier import Capability, has
from prefixstore.gpu.tiers.disk import DeclaredRank


@attrs.define
class FakeTiers:
    ranks: list


def writer(ranks) -> staging.Writer:
    return staging.Writer(FakeTiers(ranks), None, None)  # type: ignore[arg-type]


class OwnWrite(LocalRank):
    def write_shard(self, name: str, data: bytes) -> None:
        super().write_shard(name, data)


def test_only_ranks_writing_by_local_ranks_own_write_are_gated(tmp_path, monkeypatch):
    plain = LocalRank(0, str(tmp_path / "a"))
    sub = OwnWrite(1, str(tmp_path / "b"))
    assert has(plain, Capability.WRITES_GATED)
    assert not has(sub, Capability.WRITES_GATED)
    assert not has(DeclaredRank(plain), Capability.WRITES_GATED)
    big = staging.GATED_MIN_BYTES
    assert staging.gated(writer([plain]), big)
    assert not staging.gated(writer([plain]), big - 1)
    assert not staging.gated(writer([plain, sub]), big)
    monkeypatch.setattr(LocalRank, "write_shard", lambda self, name, data: None)
    assert not has(plain, Capability.WRITES_GATED)  # asked again each time, not cached
    assert not staging.gated(writer([plain]), big)


def test_a_gated_write_renames_only_after_its_gate(tmp_path):
    rank = LocalRank(0, str(tmp_path / "r"))
    seen = []
    rank.write_shard_gated("x.st", b"abc", lambda: seen.append(sorted(os.listdir(rank.directory))))
    assert seen == [["x.st.tmp"]] and sorted(os.listdir(rank.directory)) == ["x.st"]

    def closed() -> None:
        raise OSError(5, "closed")

    with pytest.raises(OSError, match="closed"):
        rank.write_shard_gated("y.st", b"abc", closed)
    assert sorted(os.listdir(rank.directory)) == ["x.st"]  # the temporary removed, nothing renamed
