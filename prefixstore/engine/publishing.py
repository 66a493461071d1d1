"""Publishes that share one catalog transaction: stores whose files are written and
that wait for the engine lock at the same time publish in one commit.

A store queues its publish (``Job``: its statements, and its in-memory side) without
the engine lock, then takes the lock; whoever takes it first commits every publish
queued by then (``commit``): one SQLite transaction, each job's statements inside a
savepoint of their own, so a job that raises fails alone. After the commit, still
under the lock, each job's in-memory side runs; the others find their job done when
they get the lock. The transaction is a grouped commit (``Catalog.txn(grouped=True)``):
its stores are acknowledged once ``Catalog.sync`` made it durable.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from typing import Any

import attrs

from prefixstore.engine.catalog import Catalog
from prefixstore.engine.guard import CallGuard


@attrs.define(slots=True, eq=False)
class Job:
    """One store's publish: ``write(c)`` inside the shared transaction, then
    ``apply(out)`` with what it returned (engine lock held); ``result`` or ``error``
    once ``done``; ``seq`` the commit that holds it."""

    write: Callable[[Any], Any]
    apply: Callable[[Any], Any]
    done: bool = False
    result: Any = None
    error: BaseException | None = None
    seq: int = 0


@attrs.define(slots=True, eq=False)
class Publishing:
    """The publishes queued for the next shared commit (its own small lock)."""

    lock: threading.Lock = attrs.field(factory=threading.Lock)
    queued: list[Job] = attrs.field(factory=list)
    commits: int = 0
    jobs: int = 0
    """Commits run and jobs they published: ``jobs / commits`` publishes per commit."""


def commit(pb: Publishing, guard: CallGuard, catalog: Catalog, label: str, job: Job) -> Any:
    """Publish ``job`` in the next shared commit (led by whoever takes the engine lock
    first); its ``apply``'s result, or its error raised."""
    with pb.lock:
        pb.queued.append(job)
    with guard.lock:
        if not job.done:
            run(pb, catalog, label)
    if job.error is not None:
        raise job.error
    return job.result


def run(pb: Publishing, catalog: Catalog, label: str) -> None:
    """Commit every queued job in one transaction, then apply each. Lock held."""
    with pb.lock:
        jobs, pb.queued = pb.queued, []
    written: list[tuple[Job, Any]] = []
    try:
        with catalog.txn(label, grouped=True) as c:
            for job in jobs:
                c.execute("SAVEPOINT job")
                try:
                    out = job.write(c)
                except sqlite3.Error:  # the catalog itself: typed and made sticky by txn
                    raise
                except Exception as exc:  # this job's statements only: the others go on
                    c.execute("ROLLBACK TO job")
                    job.error = exc
                else:
                    written.append((job, out))
                c.execute("RELEASE job")
    except BaseException as exc:  # the commit itself: none of them published
        for job in jobs:
            job.done, job.error = True, job.error or exc
        return
    seq = catalog.wal.written
    pb.commits += 1
    pb.jobs += len(written)
    for job, out in written:
        job.seq = seq
        try:
            job.result = job.apply(out)
        except BaseException as exc:
            job.error = exc
    for job in jobs:
        job.done = True
