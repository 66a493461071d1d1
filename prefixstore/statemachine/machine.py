"""Transition tables declared as data, validated when they are defined.

A ``Machine`` is immutable. Defining one checks (Automat-style) that there are no
duplicate edges, that every state is reachable from the initial state, that final
states have no outgoing edge, and that every other state can reach a final state.
Feeding an event a state cannot handle raises IllegalTransitionError naming the
transaction kind, the state and the event (h11-style).
"""

from __future__ import annotations

from collections.abc import Iterable

from prefixstore.engine.errors import IllegalTransitionError


class MachineDefinitionError(Exception):
    """A transition table is malformed (raised at import time)."""


class Machine:
    """An immutable transition table: ``state -> event -> next state``."""

    __slots__ = ("_table", "finals", "initial", "name", "states")

    def __init__(
        self,
        name: str,
        initial: str,
        finals: Iterable[str],
        edges: Iterable[tuple[str, str, str]],
    ) -> None:
        self.name = name
        self.initial = initial
        self.finals = frozenset(finals)
        table: dict[str, dict[str, str]] = {}
        for src, event, dst in edges:
            row = table.setdefault(src, {})
            if event in row:
                raise MachineDefinitionError(f"{name}: duplicate edge {src} --{event}-->")
            row[event] = dst
        self._table = {k: dict(v) for k, v in table.items()}
        self.states = frozenset({initial, *self.finals, *table, *(d for _, _, d in edges_of(table))})
        self._validate()

    def _validate(self) -> None:
        for f in self.finals:
            if self._table.get(f):
                raise MachineDefinitionError(f"{self.name}: final state {f} has outgoing edges")
        reach = self._reachable_from(self.initial)
        if missing := self.states - reach:
            raise MachineDefinitionError(f"{self.name}: unreachable states {sorted(missing)}")
        for s in self.states - self.finals:
            if not self._table.get(s):
                raise MachineDefinitionError(f"{self.name}: non-final state {s} has no way out")
            if not (self._reachable_from(s) & self.finals):
                raise MachineDefinitionError(f"{self.name}: state {s} cannot reach a final state")

    def _reachable_from(self, start: str) -> set[str]:
        seen, todo = {start}, [start]
        while todo:
            for dst in self._table.get(todo.pop(), {}).values():
                if dst not in seen:
                    seen.add(dst)
                    todo.append(dst)
        return seen

    def next(self, state: str, event: str) -> str:
        """The state after ``event`` in ``state``; raises IllegalTransitionError."""
        try:
            return self._table[state][event]
        except KeyError:
            raise IllegalTransitionError(
                f"{self.name}: can't handle event {event!r} in state {state!r}"
            ) from None

    def events(self, state: str) -> frozenset[str]:
        """Events ``state`` accepts."""
        return frozenset(self._table.get(state, {}))

    def is_final(self, state: str) -> bool:
        return state in self.finals

    def edges(self) -> list[tuple[str, str, str]]:
        return sorted(edges_of(self._table))

    def __repr__(self) -> str:
        return f"Machine({self.name}, {len(self.states)} states)"


def edges_of(table: dict[str, dict[str, str]]) -> Iterable[tuple[str, str, str]]:
    for src, row in table.items():
        for event, dst in row.items():
            yield src, event, dst
