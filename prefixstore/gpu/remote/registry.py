"""The remote store registry: a backend by the scheme of its URL.

``register(backend)`` adds a ``protocol.Backend``; ``backend_for(url)`` finds the one a
URL (text, or one a backend parsed) belongs to; ``parse`` and ``check`` are what
``EngineConfig`` validates ``remote`` and ``remote_options`` with, and ``open_store`` is
what the tier builds its store with. Adding a remote tier is one module defining its
``Backend`` plus its ``register`` call in ``gpu/remote/__init__.py``; nothing else names
a backend.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from prefixstore.base.errors import InvalidArgumentError, InvalidInputError
from prefixstore.gpu.remote.config import RemoteConfig
from prefixstore.gpu.remote.protocol import Backend, RemoteStore

BACKENDS: dict[str, Backend] = {}
"""Each registered backend by its name."""


def register(backend: Backend) -> None:
    """Make ``backend`` serve its URL schemes; InvalidInputError if its name or a scheme is taken."""
    if not isinstance(backend, Backend):
        raise InvalidInputError(f"a remote backend must be a Backend, got {type(backend).__name__}")
    if backend.name in BACKENDS:
        raise InvalidInputError(f"a remote backend named {backend.name!r} is already registered")
    taken = [s for s in backend.schemes if s in _by_scheme()]
    if taken or not backend.schemes or any(s != s.lower() or not s for s in backend.schemes):
        raise InvalidInputError(f"remote backend {backend.name!r}: schemes must be new, lower-case "
                                f"and not empty (taken: {taken})")
    BACKENDS[backend.name] = backend


def unregister(name: str) -> None:
    """Remove the backend called ``name`` (missing is success)."""
    BACKENDS.pop(name, None)


def _by_scheme() -> dict[str, Backend]:
    return {s: b for b in BACKENDS.values() for s in b.schemes}


class _Schemes(Sequence[str]):
    """The registered schemes, read live."""

    def __getitem__(self, i):  # type: ignore[override]
        return tuple(_by_scheme())[i]

    def __len__(self) -> int:
        return len(_by_scheme())

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(_by_scheme()))

    def __repr__(self) -> str:
        return repr(tuple(_by_scheme()))


SCHEMES: Sequence[str] = _Schemes()


def backend_for(url: object) -> Backend:
    """The backend of ``url``: a URL string (by its scheme) or a URL a backend parsed;
    InvalidArgumentError naming ``remote`` (never quoting the URL) otherwise."""
    if isinstance(url, str):
        scheme, sep, _ = url.partition("://")
        found = _by_scheme().get(scheme.lower()) if sep else None
        if found is None:
            raise InvalidArgumentError(
                "remote", f"scheme must be one of {', '.join(s + '://' for s in SCHEMES)}")
        return found
    for b in BACKENDS.values():
        if isinstance(url, b.url_type):
            return b
    raise InvalidArgumentError("remote", f"must be a remote tier URL string, got {type(url).__name__}")


def parse(url: object) -> Any:
    """``url`` parsed by its backend (a parsed URL is returned as it is)."""
    b = backend_for(url)
    return url if isinstance(url, b.url_type) else b.parse(url)


def check(url: object, config: RemoteConfig | None) -> None:
    """Refuse ``config`` (InvalidArgumentError naming the option) where ``url``'s backend
    cannot honour it."""
    if config is not None:
        backend_for(url).check(config)


def open_store(url: object, config: RemoteConfig) -> tuple[Any, RemoteStore]:
    """``url`` parsed and its backend's store (not connected yet), ``config`` checked."""
    b = backend_for(url)
    parsed = url if isinstance(url, b.url_type) else b.parse(url)
    b.check(config)
    return parsed, b.open(parsed, config)
