"""Moved to ``prefixstore.base.keys``; this re-export goes when every import names the new path."""

from prefixstore.base.keys import (
    DIGEST_SIZE,
    ROOT,
    Prefix,
    chain,
    chain_all,
)

__all__ = [
    "DIGEST_SIZE",
    "Prefix",
    "ROOT",
    "chain",
    "chain_all",
]
