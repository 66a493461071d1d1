"""Transition tables declared as data, validated when they are defined.

A ``Machine`` is immutable. Each transition ``(state, event) -> (next, outputs)``
names the outputs the driver runs *after* the commit that reached ``next``
(Automat: inputs select a transition, outputs act). A table also declares which
states are *published* (recovery drives them forward; the others are undone) and
which events recovery and abort feed (``recovery=True`` / ``abort=True`` on a
transition); ``recovery(state)`` and ``abort(state)`` are derived from that.

Defining one checks that there are no duplicate edges, that every state is
reachable from the initial state, that final states have no outgoing edge, that
every other state can reach a final state, that the edges into a non-final state
agree on its outputs (recovery re-runs them), that every non-final state has
exactly one recovery event and at most one abort event, that no final state is
reached both from a published and an unpublished state, and that recovery ends a
published state in a final state only published states lead to (and any other
state in one they do not). Feeding an event a
state cannot handle raises IllegalTransitionError naming the transaction kind, the
state and the event (h11-style).

Outputs end their state themselves: ``outcomes`` declares, for every output that runs
in a non-final state, the event it fires when it succeeds and the one it fires when it
fails (``Outcome(ok=..., failed=...)``); both must be events of that state, and ``ok``
its recovery event (recovery re-runs the output). A transition may also name the row
event its commit feeds the rows the transaction owns (``owned``, an event of the FILE
row table). A row table is ``targeted``: each event leads to one state from every state
that takes it, so the event alone names the value a row takes (``target(event)``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs

from prefixstore.base.errors import IllegalTransitionError


class MachineDefinitionError(Exception):
    """A transition table is malformed (raised at import time)."""


@attrs.frozen
class Transition:
    """One edge: ``src --event--> dst``, then ``outputs`` run after its commit."""

    src: str
    event: str
    dst: str
    outputs: tuple[str, ...] = ()
    recovery: bool = False
    abort: bool = False
    owned: str | None = None
    """The row event its commit feeds every file row the transaction owns (or None)."""


def T(src: str, event: str, dst: str, *outputs: str, recovery: bool = False, abort: bool = False,
      owned: str | None = None) -> Transition:
    """A transition, written as one table line."""
    return Transition(src, event, dst, tuple(outputs), recovery, abort, owned)


@attrs.frozen
class Outcome:
    """The events an output fires to end the state it runs in: ``ok`` when its work
    is done, ``failed`` when some of it stays undone."""

    ok: str
    failed: str


@attrs.frozen
class Step:
    """What ending a state takes (recovery or abort): ``fire`` the event now (its
    outputs follow), or, when ``fire`` is None, re-run the state's own ``outputs``,
    which fire ``event`` (or its failure sibling) themselves."""

    event: str
    direction: str  # 'forward' (the state is published) or 'back'
    fire: str | None
    outputs: tuple[str, ...]


class Machine:
    """An immutable transition table: ``state -> event -> Transition``."""

    __slots__ = ("_table", "entry", "finals", "initial", "initial_outputs", "name", "outcomes", "published",
                 "states", "targeted")

    def __init__(
        self,
        name: str,
        initial: str,
        finals: Iterable[str],
        edges: Iterable[Transition | tuple[str, str, str]],
        *,
        published: Iterable[str] = (),
        initial_outputs: Iterable[str] = (),
        outcomes: Mapping[str, Outcome] | None = None,
        targeted: bool = False,
    ) -> None:
        self.name = name
        self.initial = initial
        self.finals = frozenset(finals)
        self.published = frozenset(published)
        self.initial_outputs = tuple(initial_outputs)
        self.outcomes = dict(outcomes or {})
        self.targeted = targeted
        table: dict[str, dict[str, Transition]] = {}
        for e in edges:
            t = e if isinstance(e, Transition) else Transition(*e)
            row = table.setdefault(t.src, {})
            if t.event in row:
                raise MachineDefinitionError(f"{name}: duplicate edge {t.src} --{t.event}-->")
            row[t.event] = t
        self._table = table
        self.states = frozenset({initial, *self.finals, *table, *(t.dst for t in self.transitions())})
        self.entry = self._entry_outputs()
        self._validate()

    # ------------------------------------------------------------------ definition checks

    def _entry_outputs(self) -> dict[str, tuple[str, ...]]:
        entry: dict[str, tuple[str, ...]] = {self.initial: self.initial_outputs}
        for t in self.transitions():
            if t.dst in self.finals:
                continue
            if entry.setdefault(t.dst, t.outputs) != t.outputs:
                raise MachineDefinitionError(
                    f"{self.name}: edges into {t.dst} disagree on its outputs ({entry[t.dst]} vs {t.outputs})")
        return entry

    def _validate(self) -> None:
        if bad := self.published - self.states:
            raise MachineDefinitionError(f"{self.name}: published states {sorted(bad)} are not states")
        for f in self.finals:
            if self._table.get(f):
                raise MachineDefinitionError(f"{self.name}: final state {f} has outgoing edges")
        if missing := self.states - self._reachable_from(self.initial):
            raise MachineDefinitionError(f"{self.name}: unreachable states {sorted(missing)}")
        for s in self.states - self.finals:
            if not self._table.get(s):
                raise MachineDefinitionError(f"{self.name}: non-final state {s} has no way out")
            if not (self._reachable_from(s) & self.finals):
                raise MachineDefinitionError(f"{self.name}: state {s} cannot reach a final state")
        if self.targeted:
            for event in {t.event for t in self.transitions()}:
                if len(dsts := {t.dst for t in self.transitions() if t.event == event}) != 1:
                    raise MachineDefinitionError(
                        f"{self.name}: event {event} leads to {sorted(dsts)}; a row table's event names one state")
        if not any(t.recovery for t in self.transitions()):
            return  # a bare table (tests of the checks): no recovery declared
        for s in self.states - self.finals:
            rec = [t for t in self._table[s].values() if t.recovery]
            if len(rec) != 1:
                raise MachineDefinitionError(f"{self.name}: state {s} needs exactly one recovery event")
            if sum(t.abort for t in self._table[s].values()) > 1:
                raise MachineDefinitionError(f"{self.name}: state {s} has several abort events")
        undone = {t.dst for t in self.transitions() if t.src not in self.published and t.dst in self.finals}
        if both := undone & self.committed_finals():
            raise MachineDefinitionError(
                f"{self.name}: final states {sorted(both)} are reached from published and unpublished states")
        for s in self.states - self.finals:
            end = self.recovered(s)
            if (s in self.published) != (end in self.committed_finals()):
                raise MachineDefinitionError(f"{self.name}: recovery from {s} ends in {end}, the wrong way")
        self._validate_outcomes()

    def _validate_outcomes(self) -> None:
        """Every output run in a non-final state declares the events it ends it with;
        both are events of that state, ``ok`` its recovery event."""
        running = {o: s for s in self.states - self.finals for o in self.entry.get(s, ())}
        if extra := set(self.outcomes) - set(running):
            raise MachineDefinitionError(f"{self.name}: outcomes for {sorted(extra)}, which run in no unfinished state")
        for output, s in sorted(running.items()):
            oc = self.outcomes.get(output)
            if oc is None:
                raise MachineDefinitionError(f"{self.name}: output {output} (run in {s}) declares no outcome events")
            if missing := {oc.ok, oc.failed} - self.events(s):
                raise MachineDefinitionError(
                    f"{self.name}: output {output} fires {sorted(missing)}, which {s} cannot take")
            if oc.ok != self.recovery_event(s):
                raise MachineDefinitionError(
                    f"{self.name}: output {output} ends {s} with {oc.ok}, but recovery of {s} feeds "
                    f"{self.recovery_event(s)}")

    def _reachable_from(self, start: str) -> set[str]:
        seen, todo = {start}, [start]
        while todo:
            for t in self._table.get(todo.pop(), {}).values():
                if t.dst not in seen:
                    seen.add(t.dst)
                    todo.append(t.dst)
        return seen

    # ------------------------------------------------------------------ queries

    def transition(self, state: str, event: str) -> Transition:
        """The edge ``event`` takes in ``state``; raises IllegalTransitionError."""
        try:
            return self._table[state][event]
        except KeyError:
            raise IllegalTransitionError(
                f"{self.name}: can't handle event {event!r} in state {state!r}"
            ) from None

    def next(self, state: str, event: str) -> str:
        """The state after ``event`` in ``state``; raises IllegalTransitionError."""
        return self.transition(state, event).dst

    def outputs(self, state: str, event: str) -> tuple[str, ...]:
        """The outputs ``event`` runs in ``state`` (after the commit of the next state)."""
        return self.transition(state, event).outputs

    def sources(self, event: str) -> frozenset[str]:
        """The states that accept ``event`` (e.g. for an SQL ``WHERE status IN (...)``)."""
        return frozenset(s for s, row in self._table.items() if event in row)

    def target(self, event: str) -> str:
        """The state ``event`` leads to (a ``targeted`` table: the same from every
        source); IllegalTransitionError when no state takes it."""
        dsts = {row[event].dst for row in self._table.values() if event in row}
        if len(dsts) != 1:
            raise IllegalTransitionError(f"{self.name}: event {event!r} leads to {sorted(dsts) or 'no state'}")
        return dsts.pop()

    def outcome(self, output: str) -> Outcome:
        """The events ``output`` ends its state with (``ok`` / ``failed``)."""
        try:
            return self.outcomes[output]
        except KeyError:
            raise IllegalTransitionError(f"{self.name}: output {output!r} declares no outcome events") from None

    def runs_in(self, output: str) -> frozenset[str]:
        """The unfinished states whose entry runs ``output``."""
        return frozenset(s for s, outs in self.entry.items() if output in outs and s not in self.finals)

    def events(self, state: str) -> frozenset[str]:
        """Events ``state`` accepts."""
        return frozenset(self._table.get(state, {}))

    def is_final(self, state: str) -> bool:
        return state in self.finals

    def is_published(self, state: str) -> bool:
        return state in self.published

    def transitions(self) -> list[Transition]:
        return [t for row in self._table.values() for t in row.values()]

    def edges(self) -> list[tuple[str, str, str]]:
        return sorted((t.src, t.event, t.dst) for t in self.transitions())

    def all_events(self) -> frozenset[str]:
        """Every event the table takes in some state."""
        return frozenset(t.event for t in self.transitions())

    def all_outputs(self) -> frozenset[str]:
        """Every output name the table uses (each needs a handler)."""
        return frozenset(self.initial_outputs).union(*(t.outputs for t in self.transitions()))

    def committed_finals(self) -> frozenset[str]:
        """Final states reached from a published state (the transaction took effect)."""
        return frozenset(t.dst for t in self.transitions() if t.src in self.published and t.dst in self.finals)

    def recovery_event(self, state: str) -> str:
        """The event recovery feeds ``state`` (its work, when it succeeds, fires it)."""
        for t in self._table.get(state, {}).values():
            if t.recovery:
                return t.event
        raise IllegalTransitionError(f"{self.name}: state {state!r} has no recovery event")

    def direction(self, state: str) -> str:
        """'forward' when ``state`` is published, else 'back'."""
        return "forward" if state in self.published else "back"

    def recovery(self, state: str) -> Step:
        """How recovery ends a transaction found in ``state``."""
        return self._step(state, self.recovery_event(state))

    def abort(self, state: str) -> Step:
        """How an unexpected error in the flow ends a transaction in ``state``: its
        abort event when it has one (e.g. INTENT --failed-->), else as recovery would."""
        for t in self._table.get(state, {}).values():
            if t.abort:
                return self._step(state, t.event)
        return self.recovery(state)

    def _step(self, state: str, event: str) -> Step:
        if self.entry.get(state):  # the state's own outputs do the work and fire the event
            return Step(event, self.direction(state), None, self.entry[state])
        return Step(event, self.direction(state), event, self.outputs(state, event))

    def recovered(self, state: str) -> str:
        """The final state following recovery events from ``state`` reaches."""
        at = state
        for _ in range(len(self.states)):
            if at in self.finals:
                return at
            at = self.next(at, self.recovery_event(at))
        raise MachineDefinitionError(f"{self.name}: recovery from {state} loops")

    def __repr__(self) -> str:
        return f"Machine({self.name}, {len(self.states)} states)"
