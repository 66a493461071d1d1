"""``new_match`` (the request path's Match constructor) builds the same frozen Match
as ``Match(...)``: equal, same hash and repr, and immutable."""

from __future__ import annotations

import attrs
import pytest

from prefixstore.engine.results import Match, new_match

ARGS = ("hit", 10, 512, 1, 5, 7, ((1, 1), (2, 3)), 100, 0.5, 0.25, "cache-a", b"key")


def test_new_match_equals_the_public_constructor() -> None:
    fast, slow = new_match(*ARGS), Match(*ARGS)
    assert type(fast) is Match
    assert fast == slow and hash(fast) == hash(slow) and repr(fast) == repr(slow)
    assert attrs.asdict(fast) == attrs.asdict(slow)
    assert fast != new_match(*ARGS[:4], 4, *ARGS[5:])
    assert new_match("miss", 3, 512, 0, cache="c") == Match("miss", 3, 512, 0, cache="c")
    assert attrs.evolve(fast, blocks=2) == Match(*ARGS[:4], 2, *ARGS[5:])


def test_new_match_is_immutable() -> None:
    m = new_match(*ARGS)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        m.blocks = 1  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        del m.path
    with pytest.raises(AttributeError):
        m.extra = 1  # type: ignore[attr-defined]
    assert m.blocks == 5 and m.path == ((1, 1), (2, 3)) and m.tokens == 5 * 512
