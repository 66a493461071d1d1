"""The debug flag of the invariant checks (read where engines and ranks are built)."""

from __future__ import annotations

import os

DEBUG_ENV = "PREFIXSTORE_DEBUG_INVARIANTS"


def debug_from_env() -> bool:
    """Whether ``PREFIXSTORE_DEBUG_INVARIANTS`` turns the invariant checks on."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")
