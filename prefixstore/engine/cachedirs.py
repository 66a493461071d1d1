"""The cache's own directories: ``rankR/`` and ``lost+found/`` are real directories.

The engine writes, reads and unlinks shards in them, so one that is a symlink would
lead those effects out of the cache (or onto another rank's files). A cache's own
directory that is a symlink, or not a directory, is refused before anything is
touched. Rank directories kept elsewhere are named explicitly instead
(``Engine.open(..., ranks=[LocalRank(r, path), ...])``, ``prefixstore audit --rank-dir``):
a named path may be a symlink; ``LocalRank`` resolves it once.

A rank directory that is missing while the catalog records shards on its rank is
usually one kept elsewhere and not named: ``missing_rank_dirs`` finds them, so that
repair refuses rather than marking every node damaged.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Sequence

from prefixstore.base.errors import UnsafeDirectoryError
from prefixstore.gpu.ranks import rank_dir_name

LOST_FOUND = "lost+found"


def own_dir_problems(root: str, ranks: int) -> list[str]:
    """Why ``lost+found/`` and ``rank0/`` .. ``rank{ranks-1}/`` of ``root`` are not real
    directories (a missing one is fine: it is created)."""
    out = []
    for name in [rank_dir_name(r) for r in range(ranks)] + [LOST_FOUND]:
        path = os.path.join(root, name)
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(mode):
            out.append(f"{name}/ is a symlink (to {os.readlink(path)!r})")
        elif not stat.S_ISDIR(mode):
            out.append(f"{name} is not a directory")
    return out


def check_own_dirs(root: str, ranks: int) -> None:
    """Raise UnsafeDirectoryError when ``own_dir_problems`` finds any."""
    problems = own_dir_problems(root, ranks)
    if problems:
        raise UnsafeDirectoryError(
            f"{root}: {'; '.join(problems)}: a cache's own directories must be real directories inside it "
            "(name rank directories kept elsewhere explicitly: ranks=[LocalRank(...)] or --rank-dir); "
            "nothing was changed"
        )


def missing_rank_dirs(dirs: Sequence[str], files: Iterable[Sequence]) -> list[tuple[int, str, int]]:
    """``(rank, directory, live shards)`` for each directory in ``dirs`` (one per rank)
    that does not exist while catalog file rows (``structure.FILE_COLUMNS``) record live
    shards on its rank."""
    live: dict[int, int] = {}
    for f in files:
        if f[6] == "live":
            live[f[0]] = live.get(f[0], 0) + 1
    return [(r, d, live[r]) for r, d in enumerate(dirs) if live.get(r) and not os.path.lexists(d)]
