"""A cache belongs to one model: the ``identity`` given when it is created is recorded
in the catalog, and an open under another identity is refused, naming what differs."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_restores, make_layout, store_tokens, tokens_for

from prefixstore.base.errors import CatalogCorruptError, IdentityMismatchError, InvalidArgumentError
from prefixstore.engine.api import Engine
from prefixstore.engine.catalog import CATALOG_NAME
from prefixstore.engine.config import EngineConfig

CAP = 1 << 20
LLAMA = {"model": "tiny-llama", "revision": "abc123", "dtype": "bfloat16"}


def _open(root: Path, **opts):
    return Engine.open(root, make_layout(), CAP, **opts)


def test_a_cache_refuses_another_models_identity_naming_the_fields(tmp_path: Path) -> None:
    tokens = tokens_for(1, 3)
    with _open(tmp_path, identity=LLAMA) as eng:
        assert store_tokens(eng, tokens).status == "stored"
    other = {**LLAMA, "revision": "def456", "tp_rank": "1"}
    del other["dtype"]
    with pytest.raises(IdentityMismatchError) as info:
        _open(tmp_path, identity=other)
    assert info.value.differences == [
        "dtype only in the cache ('bfloat16')",
        "revision 'abc123' vs 'def456'",
        "tp_rank only given ('1')",
    ]
    assert "belongs to another model" in str(info.value)
    # nothing was touched: the same identity (fields in any order) restores the checkpoint
    with _open(tmp_path, identity=dict(reversed(list(LLAMA.items())))) as eng:
        assert_restores(eng, tokens)
    with _open(tmp_path) as eng:  # no identity given: nothing is checked
        assert_restores(eng, tokens)


def test_the_identity_is_recorded_in_the_catalog_meta(tmp_path: Path) -> None:
    with _open(tmp_path, identity=LLAMA):
        pass
    out = subprocess.run(
        [sys.executable, "-m", "prefixstore.cli", "catalog", str(tmp_path)],
        capture_output=True, text=True, check=True,
    ).stdout
    assert '{"dtype":"bfloat16","model":"tiny-llama","revision":"abc123"}' in out


def test_a_cache_without_identity_records_one_only_while_empty(tmp_path: Path) -> None:
    empty, full = tmp_path / "empty", tmp_path / "full"
    with _open(empty):
        pass
    with _open(empty, identity=LLAMA):
        pass  # an empty cache holds nothing another model could have written: recorded
    with pytest.raises(IdentityMismatchError):
        _open(empty, identity={**LLAMA, "model": "other"})
    with _open(full) as eng:
        store_tokens(eng, tokens_for(2, 2))
    with pytest.raises(IdentityMismatchError, match="records no model identity but holds checkpoints"):
        _open(full, identity=LLAMA)
    with _open(full, identity=None) as eng:  # opens as before
        assert len(eng.index) == 1


@pytest.mark.parametrize(
    "bad",
    [
        "tiny-llama",
        {},
        {"model": 3},
        {"": "x"},
        {"has space": "x"},
        {"model": "x" * 1025},
        {f"f{i}": "x" for i in range(257)},
    ],
)
def test_a_bad_identity_is_refused_before_anything_is_touched(tmp_path: Path, bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match="^identity: "):
        _open(tmp_path / "c", identity=bad)
    assert not (tmp_path / "c").exists()
    with pytest.raises(InvalidArgumentError, match="^identity: "):
        EngineConfig(identity=bad)


def test_the_option_is_copied_when_given(tmp_path: Path) -> None:
    given = dict(LLAMA)
    cfg = EngineConfig(identity=given)
    given["model"] = "changed later"
    with Engine.open(tmp_path, make_layout(), CAP, config=cfg):
        pass
    with _open(tmp_path, identity=LLAMA):
        pass


def test_a_tampered_identity_row_is_refused(tmp_path: Path) -> None:
    with _open(tmp_path, identity=LLAMA):
        pass
    with sqlite3.connect(tmp_path / CATALOG_NAME) as conn:
        conn.execute("UPDATE meta SET value='[1, 2]' WHERE key='identity'")
    with pytest.raises(CatalogCorruptError, match="identity row"):
        _open(tmp_path, identity=LLAMA)
