"""The library's own structured log: to stderr, WARNING and above unless
``PREFIXSTORE_LOG_LEVEL`` says otherwise (e.g. INFO for every restore decision).

Every module logs through the one ``log`` object, whose target an embedding server
swaps with :func:`use` (or for a block with :func:`using`): every module, including
those already imported, logs to the new target from then on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

import structlog

_LEVEL = getattr(logging, os.environ.get("PREFIXSTORE_LOG_LEVEL", "WARNING").upper(), logging.WARNING)


def stderr_logger(level: int = _LEVEL) -> Any:
    """A structlog logger printing ``key=value`` lines at ``level`` and above to stderr."""
    return structlog.wrap_logger(
        structlog.PrintLogger(file=sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(level),
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso"),
                    structlog.processors.KeyValueRenderer(key_order=["event"])],
        logger_name="prefixstore",
        cache_logger_on_first_use=True,
    )


class Log:
    """Forwards every call (``log.warning(event, **kv)``, ...) to its current target."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def __getattr__(self, name: str) -> Any:
        return getattr(self.target, name)

    def enabled(self, level: int) -> bool:
        """Whether the target emits events at ``level`` (a ``logging`` level); True when
        it cannot say (no ``is_enabled_for``). Lets a hot path skip building an event
        the target would drop."""
        fn = getattr(self.target, "is_enabled_for", None)
        return True if fn is None else bool(fn(level))


log = Log(stderr_logger())


def use(target: Any) -> Any:
    """Make ``target`` (any object with structlog's ``debug`` ... ``error`` methods) the
    library's log; returns the one it replaces."""
    previous, log.target = log.target, target
    return previous


@contextlib.contextmanager
def using(target: Any) -> Iterator[Any]:
    """``target`` is the library's log inside the block, the previous one after it."""
    previous = use(target)
    try:
        yield target
    finally:
        use(previous)


__all__ = ["Log", "log", "stderr_logger", "use", "using"]
