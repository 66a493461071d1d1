"""Which model a cache belongs to: the ``identity`` option of ``Engine.open``.

An identity is a small mapping of field names to strings that together name what the
cache's rows mean: the model and its revision or a fingerprint of its weights, the
config fields that change the cache, the dtype, the tensor-parallel size and rank, the
page size... (each adapter decides its fields). It is recorded in the catalog's ``meta``
table (key ``identity``, sorted JSON) and compared on every open that gives one:

- the cache records another identity: ``IdentityMismatchError`` naming every field
  that differs, nothing touched;
- the cache records none (created without one, or before identities existed): an
  empty cache (no node row) records the given identity; one holding nodes is refused
  (``IdentityMismatchError``: its rows could be any model's), since adopting them would
  serve them as this model's. Open it without ``identity`` to use it as it is, or
  start a new directory;
- an open without ``identity`` checks nothing: the CLI's ``catalog``, ``audit`` and
  repair read any cache, and so does a caller that does not say which model it runs.

A read-only open compares the same way and records nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from prefixstore.base.errors import CatalogCorruptError, IdentityMismatchError, InvalidArgumentError

if TYPE_CHECKING:
    from prefixstore.engine.catalog import Catalog

META_KEY = "identity"
MAX_FIELDS = 256
MAX_VALUE = 1024
FIELD = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def check_option(argument: str, value: Any) -> None:
    """``identity``: None or a non-empty mapping of field names ([A-Za-z0-9_.-], at most
    64 characters) to strings of at most 1024 characters, at most 256 fields."""
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(argument, f"must be a mapping of str to str or None, got {type(value).__name__}")
    if not value or len(value) > MAX_FIELDS:
        raise InvalidArgumentError(argument, f"must hold 1 to {MAX_FIELDS} fields, got {len(value)}")
    for name, text in value.items():
        if not isinstance(name, str) or not FIELD.fullmatch(name):
            raise InvalidArgumentError(argument, f"field name {name!r} must be 1-64 characters of [A-Za-z0-9_.-]")
        if not isinstance(text, str) or len(text) > MAX_VALUE:
            raise InvalidArgumentError(
                argument, f"field {name!r} must be a str of at most {MAX_VALUE} characters, got {text!r:.80}"
            )


def frozen(value: Any) -> dict[str, str] | None:
    """The option's value as a sorted copy (the caller's mapping may change later)."""
    if value is None or not isinstance(value, Mapping):
        return value
    return dict(sorted(value.items()))


def encode(identity: Mapping[str, str]) -> str:
    return json.dumps(dict(identity), sort_keys=True, separators=(",", ":"))


def decode(text: str) -> dict[str, str]:
    """A recorded identity; a row that is not one is a tampered catalog."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise CatalogCorruptError(f"the catalog's identity row is not a mapping of str to str: {text[:80]!r}")
    return value


def differences(recorded: Mapping[str, str], given: Mapping[str, str]) -> list[str]:
    """One phrase per field that differs: ``dtype 'bfloat16' vs 'float16'``,
    ``revision only in the cache``, ``weights only given``."""
    out = []
    for name in sorted(set(recorded) | set(given)):
        if name not in given:
            out.append(f"{name} only in the cache ({recorded[name]!r})")
        elif name not in recorded:
            out.append(f"{name} only given ({given[name]!r})")
        elif recorded[name] != given[name]:
            out.append(f"{name} {recorded[name]!r} vs {given[name]!r}")
    return out


def recorded(catalog: Catalog) -> dict[str, str] | None:
    """The identity the cache's catalog records, or None."""
    text = catalog.meta(META_KEY)
    return None if text is None else decode(text)


def check(catalog: Catalog, root: str, given: Mapping[str, str] | None) -> None:
    """At open, after the layout check: compare the ``identity`` option ``given`` with
    the catalog's (see the module docstring); record it in an empty cache that has none."""
    if given is None:
        return
    cat = catalog
    have = recorded(cat)
    if have is None:
        if cat.node_rows():
            raise IdentityMismatchError(
                f"{root} records no model identity but holds checkpoints (created without "
                "one): they could be any model's. Open it without identity to use it as it is, "
                "or use a new directory", [f"{name} only given ({given[name]!r})" for name in given],
            )
        if cat.read_only is None:
            with cat.txn("identity") as c:
                cat.set_meta(c, META_KEY, encode(given))
        return
    diff = differences(have, given)
    if diff:
        raise IdentityMismatchError(
            f"{root} belongs to another model (cache vs given: {'; '.join(diff)})", diff
        )
