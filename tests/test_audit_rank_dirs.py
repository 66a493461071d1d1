"""`prefixstore audit` of a cache whose rank directories are kept elsewhere.

Without ``--rank-dir`` the rank directories are not where the cache expects them:
``--repair`` refuses (exit 2, one line naming the missing directories and
``--rank-dir``) and changes nothing; the plain audit says what it cannot see. With
``--rank-dir`` both work and every node is kept.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from conftest import assert_restores, make_layout, store_tokens, tokens_for

from prefixstore.cli import main as cli_main
from prefixstore.engine.api import Engine
from prefixstore.gpu.ranks import LocalRank

CAP = 16 << 20
L = make_layout(ranks=2)
A, B = tokens_for(21, 3), tokens_for(22, 2)


def listing(top: Path) -> dict[str, str]:
    """Every entry under ``top`` with its file digest (catalog bytes included)."""
    out = {}
    for d, dirs, files in os.walk(top):
        for name in dirs:
            out[os.path.join(d, name)] = "dir"
        for name in files:
            p = os.path.join(d, name)
            out[p] = hashlib.sha256(Path(p).read_bytes()).hexdigest()
    return out


@pytest.mark.parametrize("moved", [(0, 1), (1,)])
def test_repair_refuses_rank_directories_it_cannot_see_and_changes_nothing(tmp_path, moved, capsys):
    root = tmp_path / "cache"
    with Engine.open(str(root), L, CAP) as eng:
        assert store_tokens(eng, A).ok and store_tokens(eng, B).ok
    elsewhere = tmp_path / "ranks"
    elsewhere.mkdir()
    for r in moved:
        os.rename(root / f"rank{r}", elsewhere / f"rank{r}")
    before = listing(tmp_path)
    catalog = (root / "catalog.sqlite").read_bytes()

    capsys.readouterr()
    assert cli_main(["audit", str(root), "--repair"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for r in moved:
        assert str(root / f"rank{r}") in lines[0]
    assert "--rank-dir" in lines[0] and "nothing was changed" in lines[0]
    assert (root / "catalog.sqlite").read_bytes() == catalog
    assert listing(tmp_path) == before

    # the plain audit says which directories it cannot see, and how to name them
    assert cli_main(["audit", str(root)]) == 1
    out = capsys.readouterr().out
    for r in moved:
        assert f"rank directory {root / f'rank{r}'} is missing, yet the catalog records" in out
    assert "--rank-dir" in out
    assert listing(tmp_path) == before

    # named explicitly, the ranks kept elsewhere are audited, repaired (nothing to do) and served
    dirs = [str((elsewhere if r in moved else root) / f"rank{r}") for r in range(L.ranks)]
    named = [a for d in dirs for a in ("--rank-dir", d)]
    assert cli_main(["audit", str(root), *named]) == 0
    assert cli_main(["audit", str(root), "--repair", *named]) == 0
    assert "nothing to change" in capsys.readouterr().out
    with Engine.open(str(root), L, CAP, ranks=[LocalRank(r, d) for r, d in enumerate(dirs)]) as eng:
        assert_restores(eng, A)
        assert_restores(eng, B)
