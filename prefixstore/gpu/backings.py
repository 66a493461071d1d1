"""The backings' names, re-exported from the tier registry (``gpu/tiers/``).

``BACKINGS``: the registered ``backing=`` names (read live); the tiers themselves are
``gpu/tiers/disk.py``, ``memory.py``, ``composite.py`` and ``ram.py``.
"""

from prefixstore.gpu.tiers import META_KEY, NAMES
from prefixstore.gpu.tiers.composite import CompositeRank
from prefixstore.gpu.tiers.memory import MemoryRank
from prefixstore.gpu.tiers.ram import RamTier

BACKINGS = NAMES

__all__ = ["BACKINGS", "META_KEY", "CompositeRank", "MemoryRank", "RamTier"]
