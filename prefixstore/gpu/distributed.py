"""Rank processes over torch.distributed: the coordinator's side (``RemoteRank``).

Topology. The coordinator is the process that runs the Engine (catalog and journal).
It hosts a ``TCPStore`` (the same rendezvous a ``tcp://HOST:PORT`` init method
uses, so it works across hosts) and, for each tensor-parallel rank served by another
process, forms a two-member gloo process group with it (coordinator rank 0, rank
process rank 1). Requests travel as point-to-point uint8 tensors with a JSON header
(``prefixstore.gpu.wire``; nothing is pickled). ``RemoteRank`` implements the
``RankIO`` protocol, so ``Engine.open(..., ranks=[...])`` takes it like a
``LocalRank``; any mix works (e.g. rank 0 local, ranks 1..N-1 remote).

Why one group per rank rather than one world group: a gloo group cannot admit a
restarted member, and an error on one pair poisons a world group's collectives.
With a group per rank (and per incarnation of that rank process), a rank that dies
is replaced by a new incarnation without disturbing the others, and the survivors
keep serving.

Failure detection (the choice, documented). gloo's ``recv`` has no per-call timeout
of its own, but ``Work.wait(timeout)`` does, and a process that dies closes its
sockets, which gloo reports at once. So every request has a deadline:
``op_timeout`` plus its bytes over ``min_bandwidth``. A dead rank process is seen
immediately (connection closed); a host that vanished without closing its
connections (power loss, partition) or a hung rank is seen when the deadline passes.
Either way the pair is closed, the call raises ``RankUnavailableError`` (an
``OSError``, so a store rolls back, an unlink leaves charged garbage, a restore
misses), and every later call to that rank raises it at once, never hangs, until the
rank process registers again (restarted, or the same process after the coordinator
dropped it): the next call then connects to the new incarnation. No heartbeat
thread is needed: between requests nothing waits on the rank, and ``available`` asks
the store (not the rank) whether a new incarnation is there.

A remote effect that failed comes back with its errno and is raised as the same
``OSError`` subclass (a missing file is ``FileNotFoundError``, a shard path that is
not a regular file ``NotRegularFileError``), so the engine's rules (missing or not
regular = damaged, other errors = transient) apply unchanged.

Each new pair passes a mutual token handshake before any request
(``prefixstore.gpu.rank_auth``; ``RankGroup(token=...)``): a process that registered
as a rank without the token is refused with ``RankAuthError`` and sent nothing.

``python -m prefixstore.gpu.distributed`` (or ``prefixstore rank-server``) runs a rank
process; see ``prefixstore.gpu.rank_server``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import errno
import json
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist

from prefixstore.base.errors import NotRegularFileError, RankAuthError, RankUnavailableError
from prefixstore.base.log import log
from prefixstore.gpu import rank_server
from prefixstore.gpu.rank_auth import coordinator_handshake, directory_tag
from prefixstore.gpu.rank_server import keys, parse_init_method
from prefixstore.gpu.wire import Link, LinkError, first_line, open_pair


class RankGroup:
    """The coordinator's end: hosts the TCPStore and connects rank processes.

    ``host``/``port``: where rank processes reach the store (``port=0`` picks a free
    one; read ``init_method``). ``op_timeout`` + bytes / ``min_bandwidth`` bounds
    every request; ``connect_timeout`` bounds forming a pair. ``gloo_host``: the
    address the coordinator's gloo devices listen on (None: gloo's default). ``token``:
    the secret shared with the rank servers (``rank_auth.load_token``); a rank process
    that does not prove it is refused (``RankAuthError``) and sent nothing.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        op_timeout: float = 60.0,
        connect_timeout: float = 60.0,
        min_bandwidth: float = 50e6,
        gloo_host: str | None = None,
        token: bytes | None = None,
    ) -> None:
        self.token = token
        self.store = dist.TCPStore(
            host, port, None, True, datetime.timedelta(seconds=connect_timeout), wait_for_workers=False
        )
        self.host = host
        self.port = int(self.store.port)
        self.op_timeout = op_timeout
        self.connect_timeout = connect_timeout
        self.min_bandwidth = min_bandwidth
        self.gloo_host = gloo_host
        self.remotes: dict[int, RemoteRank] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_init_method(cls, init_method: str, **opts: Any) -> RankGroup:
        """A group hosting its store at ``tcp://HOST:PORT``."""
        host, port = parse_init_method(init_method)
        return cls(host, port, **opts)

    @property
    def init_method(self) -> str:
        """What to pass rank processes as ``--init-method``."""
        return f"tcp://{self.host}:{self.port}"

    def latest(self, rank: int) -> int:
        """The newest incarnation rank ``rank`` registered (0: none yet)."""
        k = keys(rank)["latest"]
        if self.store is None:
            raise RankUnavailableError(errno.EHOSTDOWN, "the rank group is closed")
        try:
            with self._lock:
                if not self.store.check([k]):
                    return 0
                return int(self.store.get(k))
        except RuntimeError as exc:
            raise RankUnavailableError(errno.EHOSTDOWN, f"rank store unusable: {first_line(exc)}") from None

    def store_op(self, fn, *args):
        with self._lock:
            return fn(*args)

    def remote(self, rank: int) -> RemoteRank:
        """The ``RemoteRank`` of ``rank`` (created, not connected, on first use)."""
        if rank not in self.remotes:
            self.remotes[rank] = RemoteRank(self, rank)
        return self.remotes[rank]

    def connect(self, ranks: Iterable[int], *, timeout: float | None = None,
                missing_ok: bool = False) -> list[RemoteRank]:
        """Wait for each rank process to register and connect it; in the given order.

        ``missing_ok``: a rank that does not connect within the timeout is returned
        unconnected (``available`` False until it registers) instead of raising, so
        ``Engine.open`` opens degraded without it (``engine/degraded.py``); the wait
        is one deadline for all the ranks then."""
        wait = self.connect_timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        out = []
        for r in ranks:
            rr = self.remote(r)
            try:
                rr.reconnect(timeout=max(0.0, deadline - time.monotonic()) if missing_ok else wait)
            except RankUnavailableError:
                if not missing_ok:
                    raise
            out.append(rr)
        return out

    def close(self) -> None:
        """Tell every connected rank process to exit, then stop the store."""
        for rr in self.remotes.values():
            rr.shutdown_server()
        self.store = None

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RemoteRank:
    """``RankIO`` for a rank served by a rank process (see the module docstring)."""

    def __init__(self, group: RankGroup, rank: int) -> None:
        self.group = group
        self.rank = rank
        self.directory = ""
        self.pid: int | None = None
        self.node: str | None = None
        self.incarnation = 0
        self._rejected = 0
        self._link: Link | None = None
        self._why = "not connected yet"
        self._seq = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        state = "connected" if self._link is not None else f"unavailable: {self._why}"
        return f"RemoteRank({self.rank}, incarnation {self.incarnation}, {state})"

    # -- liveness -----------------------------------------------------------------

    @property
    def available(self) -> bool:
        """Connected, or a new incarnation is waiting (the next call connects it)."""
        if self._link is not None:
            return True
        try:
            return self.group.latest(self.rank) > max(self.incarnation, self._rejected)
        except OSError:
            return False

    def reconnect(self, *, timeout: float) -> None:
        """Wait up to ``timeout`` s for a new incarnation of the rank process; connect it.

        An incarnation that fails to connect (a process that died after registering,
        one refused for its token or directory) is passed over: a newer one may still
        register before the deadline; past it the last failure is raised."""
        deadline = time.monotonic() + timeout
        failed: RankUnavailableError | None = None
        while True:
            with self._lock:
                if self._link is not None:
                    return
                k = self.group.latest(self.rank)
                if k > max(self.incarnation, self._rejected):
                    try:
                        self._connect(k)
                        return
                    except RankUnavailableError as exc:
                        failed = exc
            if time.monotonic() >= deadline:
                raise failed or RankUnavailableError(
                    errno.ETIMEDOUT, f"rank {self.rank}: no rank process registered within {timeout} s"
                )
            time.sleep(rank_server.POLL_S)

    def close(self) -> None:
        """Drop the connection (the rank process registers again and waits)."""
        with self._lock:
            self._drop("closed by the coordinator", failure=False)

    def shutdown_server(self) -> None:
        """Ask the rank process to exit (best effort), then drop the connection."""
        with self._lock:
            if self._link is not None:
                with contextlib.suppress(OSError):
                    self._request("shutdown", {}, b"")
            self._drop("shut down", failure=False)

    @property
    def location(self) -> str:
        """``rank-server@HOST:DIRECTORY`` (what the audit names this rank's files by)."""
        return f"rank-server@{self.node or '?'}:{self.directory}"

    def info(self) -> dict[str, Any]:
        """The rank process's own account: rank, directory, pid, incarnation."""
        return self._call("info")[0]

    # -- RankIO -------------------------------------------------------------------

    def write_shard(self, name: str, data: bytes) -> None:
        self._call("write_shard", {"name": name}, data)

    def read_shard(self, name: str) -> bytes:
        return self._call("read_shard", {"name": name})[1]

    def remove(self, name: str) -> bool:
        return bool(self._call("remove", {"name": name})[0]["removed"])

    def remove_temp(self, name: str) -> None:
        self._call("remove_temp", {"name": name})

    def quarantine(self, entry: str) -> str:
        return str(self._call("quarantine", {"entry": entry})[0]["dest"])

    def sync_dir(self) -> None:
        self._call("sync_dir")

    def size(self, name: str) -> int | None:
        got = self._call("size", {"name": name})[0]["size"]
        return None if got is None else int(got)

    def listdir(self) -> list[str]:
        return [str(e) for e in self._call("listdir")[0]["entries"]]

    # -- internal -----------------------------------------------------------------

    def _call(self, op: str, fields: dict[str, Any] | None = None, payload: bytes = b"") -> tuple[dict, bytes]:
        with self._lock:
            if self._link is None:
                k = self.group.latest(self.rank)
                if k <= max(self.incarnation, self._rejected):
                    raise RankUnavailableError(errno.EHOSTDOWN, f"rank {self.rank} is unavailable ({self._why})")
                self._connect(k)
            return self._request(op, fields or {}, payload)

    def _request(self, op: str, fields: dict[str, Any], payload: bytes) -> tuple[dict, bytes]:
        link = self._link
        assert link is not None
        g = self.group
        self._seq += 1
        req = {"op": op, "id": self._seq, **fields}
        spb = 1.0 / g.min_bandwidth
        deadline = time.monotonic() + g.op_timeout + len(payload) * spb
        try:
            link.send(req, payload, deadline)
            reply, body = link.recv(deadline, spb)
        except LinkError as exc:
            why = f"{op} {fields.get('name', '')}: {exc}".replace("  ", " ")
            self._drop(why)
            code = errno.ETIMEDOUT if "timed out" in str(exc).lower() else errno.EHOSTDOWN
            raise RankUnavailableError(code, f"rank {self.rank}: {why}") from None
        if reply.get("id") != req["id"]:
            self._drop(f"reply {reply.get('id')} to request {req['id']}")
            raise RankUnavailableError(errno.EPROTO, f"rank {self.rank}: {self._why}")
        if not reply.get("ok"):
            raise _remote_error(self.rank, op, reply)
        return reply, body

    def _connect(self, k: int) -> None:
        """Connect incarnation ``k`` (caller holds the lock); raises RankUnavailableError.

        The pair must pass the token handshake (``prefixstore.gpu.rank_auth``) before
        anything else is sent; the rank's directory comes from its authenticated answer.
        """
        kk = keys(self.rank, k)
        try:
            reg = json.loads(self.group.store_op(self.group.store.get, kk["info"]))
        except (RuntimeError, ValueError) as exc:
            self._rejected = k
            raise RankUnavailableError(errno.EHOSTDOWN, f"rank {self.rank}: bad registration: {exc}") from None
        if not isinstance(reg, dict) or reg.get("rank") != self.rank:
            self._rejected = k
            self._why = f"incarnation {k} registered as rank {reg.get('rank') if isinstance(reg, dict) else reg!r}"
            raise RankUnavailableError(errno.EHOSTDOWN, f"rank {self.rank}: {self._why}")
        if self.directory and reg.get("directory_tag") != directory_tag(self.group.token, self.directory):
            self._rejected = k
            self._why = (f"incarnation {k} serves rank {self.rank} at another directory (or holds another "
                         f"token), expected rank {self.rank} at {self.directory}")
            raise RankUnavailableError(errno.EHOSTDOWN, f"rank {self.rank}: {self._why}")
        link = None
        try:
            self.group.store_op(self.group.store.set, kk["accept"], "1")
            link = open_pair(
                self.group.host, self.group.port, kk["pair"], 0, timeout=self.group.connect_timeout,
                # the group's default timeout bounds forming the pair; every request
                # after it passes its own deadline
                gloo_host=self.group.gloo_host, op_timeout=datetime.timedelta(seconds=self.group.connect_timeout),
            )
            info = coordinator_handshake(link, self.group.token, self.rank, k, self.group.connect_timeout)
        except RankAuthError as exc:
            link.close()
            self._rejected = k
            self._why = f"incarnation {k}: {exc.strerror}"
            log.warning("rank_refused", rank=self.rank, incarnation=k, why=self._why)
            raise RankAuthError(f"rank {self.rank}: {self._why}") from None
        except (LinkError, RuntimeError) as exc:
            if link is not None:
                link.close()
            self._rejected = k
            self._why = f"incarnation {k} did not connect: {first_line(exc)}"
            raise RankUnavailableError(errno.EHOSTDOWN, f"rank {self.rank}: {self._why}") from None
        if self.directory and info.get("directory") != self.directory:
            link.close()
            self._rejected = k
            self._why = (f"incarnation {k} serves rank {self.rank} at {info.get('directory')}, "
                         f"expected rank {self.rank} at {self.directory}")
            raise RankUnavailableError(errno.EHOSTDOWN, f"rank {self.rank}: {self._why}")
        self._link = link
        self.incarnation = k
        self.directory, self.pid, self.node = str(info["directory"]), info.get("pid"), info.get("host")
        self._why = ""
        log.info("rank_connected", rank=self.rank, incarnation=k, pid=self.pid, directory=self.directory)

    def _drop(self, why: str, *, failure: bool = True) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None
            (log.warning if failure else log.info)(
                "rank_unavailable", rank=self.rank, incarnation=self.incarnation, why=why
            )
        self._why = why


def _remote_error(rank: int, op: str, reply: dict[str, Any]) -> OSError:
    """The OSError a rank process reported (same errno, so the same subclass)."""
    code = reply.get("errno")
    msg = str(reply.get("strerror") or "error")
    if isinstance(code, int):
        kind = NotRegularFileError if reply.get("not_regular") else OSError
        return kind(code, msg, reply.get("filename")) if reply.get("filename") else kind(code, msg)
    return OSError(errno.EIO, f"rank {rank}: {msg} (in {op})")


def main(argv: list[str] | None = None) -> int:
    """``python -m prefixstore.gpu.distributed``: run a rank process."""
    p = argparse.ArgumentParser(prog="python -m prefixstore.gpu.distributed",
                                description=rank_server.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    rank_server.add_arguments(p)
    return rank_server.run(p.parse_args(argv))


if __name__ == "__main__":
    rank_server.exit_now(main())
