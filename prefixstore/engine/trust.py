"""Whether a directory whose catalog holds no cache may be taken for a new one.

A catalog that is missing, empty (0 bytes), without a schema or without a recorded
layout describes no node. Opening it as a new cache is right only when the directory
holds nothing a cache leaves behind, since recovery then takes every shard for an
orphan. What an interrupted first open leaves before its schema commit is not data:
``LOCK``, the catalog's own files (``-wal``, ``-shm``, ``-journal``), the catalog's
reserve, and empty rank or ``lost+found/`` directories. Anything else (an entry in a
rank directory or in ``lost+found/``, any other file) is: the open is refused with
``CatalogLostError`` naming what was found (``NotACacheError`` when nothing found looks
like a cache's), and nothing is touched. ``prefixstore audit DIR --repair`` rebuilds
such a catalog from the shards' own headers (``engine/rebuild.py``).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from prefixstore.base.errors import CatalogLostError, NotACacheError
from prefixstore.engine.cachedirs import LOST_FOUND
from prefixstore.engine.dirlock import LOCK_NAME
from prefixstore.engine.schema import CATALOG_NAME
from prefixstore.gpu.diskroom import RESERVE_NAME
from prefixstore.gpu.ranks import LocalRank

FIRST_OPEN = frozenset({
    LOCK_NAME, CATALOG_NAME, f"{CATALOG_NAME}-wal", f"{CATALOG_NAME}-shm", f"{CATALOG_NAME}-journal",
    RESERVE_NAME, f"{RESERVE_NAME}.tmp",
})
"""What an open creates in the cache directory before (or without) writing its schema."""
RANK_DIR_RE = re.compile(r"^rank[0-9]+$")
SHARD_FILE_RE = re.compile(r"^[0-9a-f]{32}-g[0-9]+\.st(\.tmp)?$")


@attrs.define
class Findings:
    """What a directory holds: ``data`` (what a cache leaves: refuse), ``foreign``
    (other entries: refuse, not as a cache) and ``leftovers`` (what a first open leaves)."""

    data: list[str] = attrs.field(factory=list)
    foreign: list[str] = attrs.field(factory=list)
    leftovers: list[str] = attrs.field(factory=list)

    @property
    def new(self) -> bool:
        """Whether nothing would be lost by taking the directory for a new cache."""
        return not self.data and not self.foreign

    def text(self) -> str:
        return ", ".join(self.data + self.foreign + self.leftovers)


def _count(names: Iterable[str]) -> str:
    names = list(names)
    shards = sum(1 for n in names if SHARD_FILE_RE.match(n))
    other = len(names) - shards
    parts = [f"{shards} shard{'s' * (shards != 1)}"] if shards else []
    return ", ".join(parts + ([f"{other} other entr{'ies' if other != 1 else 'y'}"] if other else []))


def _own_dir(root: str, name: str, out: Findings) -> None:
    path = os.path.join(root, name)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        out.data.append(f"{name} (a symlink)")
    elif not stat.S_ISDIR(st.st_mode):
        out.data.append(f"{name} (not a directory)")
    else:
        entries = os.listdir(path)
        if entries:
            out.data.append(f"{_count(entries)} in {name}/")
        else:
            out.leftovers.append(f"{name}/ (empty)")


def findings(root: str, ranks: Sequence[Any] = ()) -> Findings:
    """What ``root`` (and each rank executor in ``ranks`` whose directory lies elsewhere)
    holds, described for a person; nothing is created or changed."""
    out = Findings()
    try:
        entries = sorted(os.listdir(root))
    except FileNotFoundError:
        entries = []
    for name in entries:
        if name in FIRST_OPEN:
            try:
                size = os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                continue
            if name != CATALOG_NAME:  # the catalog's own state is said first
                out.leftovers.append(name if name == LOCK_NAME or not size else f"{name} ({size} bytes)")
        elif RANK_DIR_RE.match(name) or name == LOST_FOUND:
            _own_dir(root, name, out)
        else:
            out.foreign.append(name)
    for r in ranks:
        where = getattr(r, "directory", None)
        if isinstance(where, str) and os.path.dirname(os.path.realpath(where)) == os.path.realpath(root):
            continue  # inside root: counted above
        listed = r.listdir()
        if listed:
            out.data.append(f"{_count(listed)} in {where or f'rank {r.rank}'}")
    return out


def refuse_unless_new(root: str, state: str, ranks: Sequence[Any] = ()) -> None:
    """Raise unless ``root`` may be taken for a new cache (see the module docstring);
    ``state`` says what the catalog is ("catalog.sqlite is missing", ...)."""
    found = findings(root, ranks)
    if found.new:
        return
    if not found.data:
        raise NotACacheError(f"{root} is not empty and holds no prefixstore catalog ({found.text()})")
    raise CatalogLostError(
        f"{root}: {state}, but the directory holds {found.text()}: this is not a new cache, and opening "
        f"it as one would delete its shards; nothing was changed. {repair_command(root, ranks)} "
        "rebuilds the catalog from the shards' own headers", state
    )


def repair_command(root: str, ranks: Sequence[Any] = ()) -> str:
    """How to rebuild the catalog of ``root`` whose ranks are ``ranks``, for a person:
    with ranks served by rank servers or kept outside ``root`` the directory does not
    show the cache by itself, so the ranks are named and the rebuild asked for."""
    if any(not isinstance(r, LocalRank) for r in ranks):
        return (f"`prefixstore audit {root} --ranks tcp://HOST:PORT --repair --rebuild --rank-count {len(ranks)}` "
                "(HOST:PORT: the rank servers' --init-method)")
    dirs = [r.directory for r in ranks]
    if any(os.path.dirname(os.path.realpath(d)) != os.path.realpath(root) for d in dirs):
        return f"`prefixstore audit --repair --rebuild {root} " + " ".join(f"--rank-dir {d}" for d in dirs) + "`"
    return f"`prefixstore audit --repair {root}`"


def check_new_cache(catalog: Any, root: str, ranks: Sequence[Any] = ()) -> None:
    """At open, before anything is written: a catalog that records no layout and holds
    no row (never initialized, or emptied) is a new cache only if the directory and the
    rank executors ``ranks`` hold nothing (``refuse_unless_new``)."""
    if catalog.read_only is None and catalog.meta("layout") is None and not catalog.holds_rows():
        refuse_unless_new(root, UNINITIALIZED, ranks)


UNINITIALIZED = f"{CATALOG_NAME} records no layout and no row (it was never initialized)"
