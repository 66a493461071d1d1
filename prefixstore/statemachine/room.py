"""Whether eviction can make the disk room a write needs, decided before the first
victim. Pure: the caller measures the file systems and what eviction could free."""

from __future__ import annotations

NO_SPACE = "no_space"
"""Refusal reason: the bytes are lacking (capacity or disk) even after evicting what can go."""
NO_INODES = "no_inodes"
"""Refusal reason: the file system lacks inodes (files) even after evicting what can go."""


def disk_refusal(short_bytes: int, short_files: int, freeable_bytes: int, freeable_files: int) -> str | None:
    """Why a write that lacks ``short_bytes`` / ``short_files`` on disk cannot go ahead
    when eviction could free at most ``freeable_bytes`` / ``freeable_files``; None
    when evicting can make the room (then evicting is worth starting)."""
    if short_files > freeable_files:
        return NO_INODES
    if short_bytes > freeable_bytes:
        return NO_SPACE
    return None
