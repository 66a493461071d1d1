"""A rank process: applies one rank's file effects in its own directory, on request.

The coordinator (the process running the Engine: catalog and journal) sends each
request over the pair group described in ``prefixstore.gpu.wire``; the rank applies
it with a ``LocalRank`` on its directory and answers. Requests (JSON header, payload
only where noted): ``write_shard`` (name; payload: the shard bytes), ``read_shard``
(name; the reply's payload holds the bytes), ``remove``, ``remove_temp``, ``size``
(name), ``quarantine`` (entry), ``sync_dir``, ``listdir``, ``info``, ``shutdown``.
A failed effect is answered with its errno, which the coordinator raises as the same
OSError. Names are plain entries of the rank directory: anything with a path
separator, ``.`` or ``..`` is refused (EINVAL), so a request never touches a file
outside it.

Lifecycle: lock the directory (one server per directory), connect to the
coordinator's TCPStore, register a new *incarnation* (a counter per rank; the store
holds the rank, the incarnation and a MAC of the directory, not its name), wait for
the coordinator to accept it, form the pair group, run the token handshake
(``prefixstore.gpu.rank_auth``: a peer that does not prove the shared token is sent
nothing and served nothing; the server registers again), serve. If the pair breaks
(the coordinator timed out on this rank and dropped it, or died) the server registers
again while the coordinator's store answers, and exits (status 1) once it does not.
``shutdown`` ends it with status 0.

Fault-testing options (``--kill-at`` / ``--stall-at``) SIGKILL or stall the process
at the Nth matching effect point, e.g. ``after:write:3``: the rank dies with the
temporary file of its third shard written.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import signal
import sys
import threading
import time
from typing import Any

from prefixstore.base.errors import (
    LockedError,
    NotRegularFileError,
    PrefixStoreError,
    RankAuthError,
)
from prefixstore.base.log import log
from prefixstore.gpu.fileio import FaultHook, FileSystem
from prefixstore.gpu.rank_auth import TOKEN_ENV, directory_tag, load_token, rank_handshake
from prefixstore.gpu.ranks import LocalRank
from prefixstore.gpu.wire import IDLE_TIMEOUT, Link, LinkError, first_line, open_pair, store_client

NAMESPACE = "prefixstore"
EXIT_SHUTDOWN = 0
EXIT_LOST = 1
_BAD_NAME = re.compile(r"[/\x00]")
POLL_S = 0.05


def keys(rank: int, incarnation: int | None = None) -> dict[str, str]:
    """TCPStore keys of a rank (and of one of its incarnations)."""
    base = f"{NAMESPACE}/rank{rank}"
    out = {"counter": f"{base}/incarnations", "latest": f"{base}/latest"}
    if incarnation is not None:
        inc = f"{base}/{incarnation}"
        out.update(info=f"{inc}/info", accept=f"{inc}/accept", pair=f"{inc}/pair/")
    return out


def parse_init_method(init_method: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` -> (host, port)."""
    m = re.fullmatch(r"tcp://(\[[^\]]+\]|[^:/]+):(\d+)/?", init_method.strip())
    if not m:
        raise ValueError(f"init method must look like tcp://HOST:PORT, got {init_method!r}")
    return m.group(1).strip("[]"), int(m.group(2))


class EffectTrap(FaultHook):
    """Kills (SIGKILL) or stalls this process at the ``n``-th ``when`` point of ``op``."""

    def __init__(self, spec: str, action: str) -> None:
        when, op, n = spec.split(":")
        if when not in ("before", "after") or action not in ("kill", "stall"):
            raise ValueError(f"bad trap {spec!r} / {action!r}")
        self.when, self.op, self.n, self.action = when, op, int(n), action
        self.seen = 0

    def _point(self, when: str, op: str) -> None:
        if when != self.when or op != self.op:
            return
        self.seen += 1
        if self.seen != self.n:
            return
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)

    def before(self, op: str, target: str, rank: int | None) -> None:
        self._point("before", op)

    def after(self, op: str, target: str, rank: int | None) -> None:
        self._point("after", op)


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not name or name in (".", "..") or _BAD_NAME.search(name):
        raise OSError(errno.EINVAL, f"not a plain entry name: {name!r}")
    return name


def handle(local: LocalRank, req: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
    """Apply one request; return the reply header (without id/ok) and payload."""
    op = req.get("op")
    if op == "write_shard":
        local.write_shard(check_name(req.get("name")), payload)
        return {}, b""
    if op == "read_shard":
        data = local.read_shard(check_name(req.get("name")))
        return {}, data
    if op == "remove":
        return {"removed": local.remove(check_name(req.get("name")))}, b""
    if op == "remove_temp":
        local.remove_temp(check_name(req.get("name")))
        return {}, b""
    if op == "size":
        return {"size": local.size(check_name(req.get("name")))}, b""
    if op == "quarantine":
        return {"dest": local.quarantine(check_name(req.get("entry")))}, b""
    if op == "sync_dir":
        local.sync_dir()
        return {}, b""
    if op == "listdir":
        return {"entries": local.listdir()}, b""
    raise OSError(errno.EOPNOTSUPP, f"unknown request {op!r}")


def _error_reply(exc: Exception) -> dict[str, Any]:
    if isinstance(exc, OSError) and exc.errno is not None:
        return {"ok": False, "errno": exc.errno, "strerror": exc.strerror or str(exc),
                "filename": os.path.basename(str(exc.filename)) if exc.filename else None,
                "not_regular": isinstance(exc, NotRegularFileError)}
    return {"ok": False, "errno": None, "strerror": f"{type(exc).__name__}: {exc}", "filename": None}


class RankServer:
    """Serves one rank directory to a coordinator (see the module docstring)."""

    def __init__(
        self,
        rank: int,
        directory: str,
        host: str,
        port: int,
        *,
        fs: FileSystem | None = None,
        hook: FaultHook | None = None,
        connect_timeout: float = 60.0,
        gloo_host: str | None = None,
        token: bytes | None = None,
        on_lost=None,
    ) -> None:
        self.token = token
        self.on_lost = on_lost
        self.refused = 0
        self.rank = rank
        self.directory = os.path.abspath(directory)
        self.host, self.port = host, port
        self.fs, self.hook = fs, hook
        self.connect_timeout = connect_timeout
        self.gloo_host = gloo_host
        self.incarnation = 0
        self.served = 0

    def serve(self) -> int:
        """Run until told to shut down (0) or the coordinator is gone (1)."""
        os.makedirs(self.directory, exist_ok=True)
        lock = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise LockedError(f"{self.directory} is served by another rank process") from None
            local = LocalRank(self.rank, self.directory, self.fs, self.hook)
            store = store_client(self.host, self.port, self.connect_timeout)
            if self.token is None:
                print(f"rank-server: rank {self.rank}: warning: no token (--token-file, --token-env, "
                      f"${TOKEN_ENV}): any process that reaches the coordinator's port can act as the "
                      "coordinator", flush=True)
            watch = CoordinatorWatch(store_client(self.host, self.port, self.connect_timeout),
                                     self.connect_timeout, self.on_lost)
            while True:
                link = self._register(store)
                if link is None:
                    return EXIT_LOST
                watch.guard(link)
                try:
                    if self._admitted(link) and self._session(link, local):
                        return EXIT_SHUTDOWN
                finally:
                    watch.guard(None)
                    link.close()
                if watch.lost or not _answers(store):
                    return EXIT_LOST
        finally:
            os.close(lock)

    def _register(self, store) -> Link | None:
        """Announce a new incarnation and form its pair once accepted; None: store gone."""
        while True:
            try:
                k = int(store.add(keys(self.rank)["counter"], 1))
                kk = keys(self.rank, k)
                store.set(kk["info"], json.dumps({"rank": self.rank, "incarnation": k,
                                                  "directory_tag": directory_tag(self.token, self.directory)}))
                store.set(kk["latest"], str(k))
                while not store.check([kk["accept"]]):
                    time.sleep(POLL_S)
            except RuntimeError:
                return None
            self.incarnation = k
            try:
                return open_pair(self.host, self.port, kk["pair"], 1, timeout=self.connect_timeout,
                                 gloo_host=self.gloo_host, op_timeout=IDLE_TIMEOUT)
            except LinkError:
                if not _answers(store):
                    return None  # else: the coordinator gave up on this incarnation; register again

    def _admitted(self, link: Link) -> bool:
        """The token handshake on a new pair: True when the peer proved it."""
        account = {"rank": self.rank, "directory": self.directory, "pid": os.getpid(),
                   "incarnation": self.incarnation, "host": os.uname().nodename}
        try:
            rank_handshake(link, self.token, self.rank, self.incarnation, self.connect_timeout, account)
            return True
        except (RankAuthError, LinkError) as exc:
            self.refused += 1
            print(f"rank-server: rank {self.rank}: refused a peer on incarnation {self.incarnation}: "
                  f"{first_line(exc)}", flush=True)
            return False

    def _session(self, link: Link, local: LocalRank) -> bool:
        """Serve requests on ``link``; True when told to shut down, False if it broke."""
        while True:
            try:
                req, payload = link.recv()
            except LinkError:
                return False
            rid = req.get("id")
            if req.get("op") == "info":
                reply, body = {"ok": True, "rank": self.rank, "directory": self.directory,
                               "pid": os.getpid(), "incarnation": self.incarnation}, b""
            elif req.get("op") == "shutdown":
                reply, body = {"ok": True}, b""
            else:
                try:
                    reply, body = handle(local, req, payload)
                    reply["ok"] = True
                except Exception as exc:  # every failure goes back to the coordinator
                    reply, body = _error_reply(exc), b""
            reply["id"] = rid
            self.served += 1
            try:
                link.send(reply, body)
            except LinkError:
                return False
            if req.get("op") == "shutdown":
                return True


class CoordinatorWatch:
    """Ends the service once the coordinator's store stops answering.

    A coordinator whose host vanished closes no connection, and a TCPStore client's
    requests to a silent peer never return (their timeout covers waiting for a key,
    not a peer that stopped answering), so a rank server would wait forever, idle on
    its pair or inside a store request. One thread asks the store (its own client)
    every ``timeout / 2`` s; another, when no answer came for ``timeout`` s, marks the
    coordinator ``lost``, closes the served pair and calls ``on_lost`` (a rank process
    exits with ``EXIT_LOST``; its supervisor restarts it for the next coordinator).
    """

    def __init__(self, client, timeout: float, on_lost=None) -> None:
        self.client = client
        self.timeout = timeout
        self.period = max(timeout / 2, 0.2)
        self.on_lost = on_lost
        self.lost = False
        self.last = time.monotonic()
        self._link: Link | None = None
        self._lock = threading.Lock()
        threading.Thread(target=self._probe, daemon=True, name="coordinator-probe").start()
        threading.Thread(target=self._judge, daemon=True, name="coordinator-watch").start()

    def guard(self, link: Link | None) -> None:
        with self._lock:
            self._link = link

    def _probe(self) -> None:
        while _answers(self.client):
            self.last = time.monotonic()
            time.sleep(self.period)

    def _judge(self) -> None:
        while time.monotonic() - self.last <= self.timeout:
            time.sleep(self.period / 2)
        with self._lock:
            self.lost = True
            if self._link is not None:
                self._link.close()
        log.warning("coordinator_lost", why=f"its store did not answer for {self.timeout:g} s")
        if self.on_lost is not None:
            self.on_lost()


def _answers(store) -> bool:
    try:
        store.check([f"{NAMESPACE}/ping"])
        return True
    except RuntimeError:
        return False



def add_arguments(p) -> None:
    """The rank server's options (shared by the CLI subcommand and ``python -m``)."""
    env = os.environ
    default_init = env.get("PREFIXSTORE_INIT_METHOD") or (
        f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}" if "MASTER_ADDR" in env and "MASTER_PORT" in env else None
    )
    p.add_argument("--rank", type=int, default=int(env["PREFIXSTORE_RANK"]) if "PREFIXSTORE_RANK" in env else None,
                   help="tensor-parallel rank this process serves (env PREFIXSTORE_RANK)")
    p.add_argument("--dir", required=True, help="this rank's data directory (created if missing)")
    p.add_argument("--init-method", default=default_init,
                   help="the coordinator's TCPStore, tcp://HOST:PORT (env PREFIXSTORE_INIT_METHOD, "
                        "else tcp://$MASTER_ADDR:$MASTER_PORT)")
    p.add_argument("--gloo-host", default=env.get("PREFIXSTORE_GLOO_HOST"),
                   help="address this process's gloo device listens on (env PREFIXSTORE_GLOO_HOST; "
                        "default: gloo's choice, see GLOO_SOCKET_IFNAME)")
    p.add_argument("--connect-timeout", type=float, default=60.0,
                   help="seconds to wait for the coordinator (default 60); also the bound on a "
                        "coordinator that stops answering while connected (then the server exits 1)")
    add_token_arguments(p)
    p.add_argument("--kill-at", metavar="WHEN:OP:N", help="fault testing: SIGKILL this process at "
                   "the Nth WHEN (before|after) point of OP (write, fsync, rename, fsync_dir, unlink, read)")
    p.add_argument("--stall-at", metavar="WHEN:OP:N", help="fault testing: hang there instead")


def add_token_arguments(p) -> None:
    """Where the token shared by the coordinator and its rank servers comes from."""
    p.add_argument("--token-file", metavar="PATH",
                   help="file holding the token shared with the coordinator (at least 16 bytes; "
                        "default: the variable named by --token-env)")
    p.add_argument("--token-env", metavar="VAR",
                   help=f"environment variable holding the token (default {TOKEN_ENV}; without any "
                        "token, only a coordinator without one is served)")


def exit_now(code: int) -> None:
    """End a rank process at once: its work is durable and its replies sent, and
    tearing down torch's distributed objects at interpreter exit can take seconds."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_lost(rank: int) -> None:
    print(f"rank-server: rank {rank}: coordinator gone (its store stopped answering)", flush=True)
    exit_now(EXIT_LOST)


def run(args) -> int:
    """Run a rank server from parsed options; its exit status."""
    if args.rank is None or args.rank < 0:
        print("rank-server: --rank (or PREFIXSTORE_RANK) is required", flush=True)
        return 2
    if not args.init_method:
        print("rank-server: --init-method (or MASTER_ADDR/MASTER_PORT) is required", flush=True)
        return 2
    try:
        host, port = parse_init_method(args.init_method)
    except ValueError as exc:
        print(f"rank-server: {exc}", flush=True)
        return 2
    try:
        token = load_token(args.token_file, args.token_env)
    except PrefixStoreError as exc:
        print(f"rank-server: {exc}", flush=True)
        return 2
    hook = None
    if args.kill_at:
        hook = EffectTrap(args.kill_at, "kill")
    elif args.stall_at:
        hook = EffectTrap(args.stall_at, "stall")
    server = RankServer(args.rank, args.dir, host, port, hook=hook,
                        connect_timeout=args.connect_timeout, gloo_host=args.gloo_host, token=token,
                        on_lost=lambda: _exit_lost(args.rank))
    try:
        code = server.serve()
    except (LinkError, LockedError) as exc:
        print(f"rank-server: rank {args.rank}: {first_line(exc)}", flush=True)
        return EXIT_LOST
    print(f"rank-server: rank {args.rank}: "
          f"{'shut down' if code == EXIT_SHUTDOWN else 'coordinator gone'} after {server.served} requests",
          flush=True)
    return code
