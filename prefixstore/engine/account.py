"""The space account: the bytes the cache charges against its capacity, the watermarks
that decide when a store evicts, and the disk's room (``gpu/diskroom.py``).

``charged`` is the sum of the sizes of every file row the catalog holds (live,
writing, garbage): a store charges its new files at its intent commit, an unlink
credits what it removed. It is read and changed under the engine lock.
"""

from __future__ import annotations

import attrs

from prefixstore.gpu.diskroom import DiskRoom


@attrs.define(slots=True, eq=False)
class Account:
    """Charged bytes against the capacity, the watermarks, the disk's room."""

    capacity: int
    high_watermark: float
    """Fraction of capacity: a store that would pass it evicts first ..."""
    low_watermark: float
    """... down to this fraction."""
    disk: DiskRoom
    charged: int = 0
    garbage_hint: bool = True
    """Loose garbage may exist (true at open, set again by a failed unlink)."""

    def fits(self, needed: int, limit: float) -> bool:
        """Whether ``needed`` more charged bytes stay within ``limit`` and the disk has room."""
        return self.charged + needed <= limit and not self.disk.shortfall(needed)
