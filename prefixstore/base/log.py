"""The library's own structured log: to stderr, WARNING and above unless
``PREFIXSTORE_LOG_LEVEL`` says otherwise (e.g. INFO for every restore decision).

An embedding server can rebind ``prefixstore.base.log.log``.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

_LEVEL = getattr(logging, os.environ.get("PREFIXSTORE_LOG_LEVEL", "WARNING").upper(), logging.WARNING)
log = structlog.wrap_logger(
    structlog.PrintLogger(file=sys.stderr),
    wrapper_class=structlog.make_filtering_bound_logger(_LEVEL),
    processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso"),
                structlog.processors.KeyValueRenderer(key_order=["event"])],
    logger_name="prefixstore",
    cache_logger_on_first_use=True,
)

__all__ = ["log"]
