"""The real servers a fuzz run drives: rank servers in their own processes and a
``redis-server`` behind the remote tier, each killed, stopped and restarted on demand.

``RankHosts`` starts each rank server (``prefixstore.fuzz.rank_host``) through a
multiprocessing fork server that imported the rank server once, so that a restart costs
a fork rather than an interpreter and torch (the fuzzer restarts them often); its
arguments are plain numbers and strings. ``RedisProcess`` runs ``redis-server`` on a
free loopback port in a temporary directory, without persistence (a killed server comes
back empty, as DESIGN.md's remote tier allows).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from prefixstore.base.errors import InvalidArgumentError
from prefixstore.fuzz import rank_host

START_TIMEOUT_S = 20.0
_context: Any = None


def _fork_server() -> Any:
    """The multiprocessing context whose processes fork from a server that has the rank
    server imported (started on first use, shared by every run of this process)."""
    global _context
    if _context is None:
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # the servers' c10d warnings
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["prefixstore.fuzz.rank_host"])
        _context = ctx
    return _context


def wait_stopped(pid: int, timeout: float = 10.0) -> None:
    """Until process ``pid`` is stopped (``T`` in ``/proc/PID/stat``): a signal is
    delivered asynchronously."""
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in ("T", "t"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"process {pid} did not stop")
        time.sleep(0.001)


class RankHosts:
    """One rank server process per rank, for the coordinator's store on ``port``."""

    def __init__(self, port: int, token: bytes | None, *, plant: str | None = None,
                 connect_timeout: float = 20.0, seed: int = 0, network: Any = None) -> None:
        self.port = port
        self.network = network  # a netns.Network: each server in its host's namespace
        self.token = token
        self.plant = plant
        self.connect_timeout = connect_timeout
        self.seed = seed
        self.procs: dict[int, Any] = {}
        self.dirs: dict[int, str] = {}
        self.stopped: set[int] = set()
        self.starts = 0

    def start(self, rank: int, directory: str) -> None:
        """Start (or restart: the old process must be gone) rank ``rank``'s server."""
        old = self.procs.get(rank)
        if old is not None and old.is_alive():
            raise RuntimeError(f"rank {rank}'s server is still running")
        self.dirs[rank] = directory
        self.starts += 1
        proc = _fork_server().Process(
            target=rank_host.serve, name=f"fuzz-rank-{rank}", daemon=True,
            args=(rank, directory, self.port, self.token, self.plant, self.connect_timeout,
                  self.seed + self.starts, self._where(rank)))
        proc.start()
        self.procs[rank] = proc

    def _where(self, rank: int) -> tuple[str | None, str, str]:
        """(namespace to join, the server's address, the coordinator's)."""
        net = self.network
        if net is None:
            return (None, "127.0.0.1", "127.0.0.1")
        return (net.host_path(rank), net.host_ip[rank], net.coord_ip)

    def alive(self, rank: int) -> bool:
        p = self.procs.get(rank)
        return p is not None and p.is_alive()

    def kill(self, rank: int) -> None:
        """SIGKILL (a stopped one is killed too); returns once it is gone."""
        p = self.procs[rank]
        if p.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
        p.join(START_TIMEOUT_S)
        self.stopped.discard(rank)

    def power_loss(self, rank: int, mode: str) -> None:
        """Take the host's power away (drop or garble what was not durable); returns
        once the process is gone."""
        p = self.procs[rank]
        if rank in self.stopped:
            self.cont(rank)
        sig = signal.SIGUSR1 if mode == "drop" else signal.SIGUSR2
        if p.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, sig)
        p.join(START_TIMEOUT_S)
        if p.is_alive():  # it could not take the switch's lock in time: kill it
            self.kill(rank)

    def stop(self, rank: int) -> None:
        """SIGSTOP: the host hangs (its sockets stay open, nothing answers)."""
        p = self.procs[rank]
        os.kill(p.pid, signal.SIGSTOP)
        wait_stopped(p.pid)
        self.stopped.add(rank)

    def cont(self, rank: int) -> None:
        p = self.procs[rank]
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGCONT)
        self.stopped.discard(rank)

    def close(self) -> None:
        """Kill every server that is still running."""
        for rank in list(self.procs):
            self.kill(rank)
        self.procs.clear()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisProcess:
    """A ``redis-server`` on 127.0.0.1 in a temporary directory (see the module doc)."""

    def __init__(self, executable: str | None = None) -> None:
        exe = executable or shutil.which("redis-server")
        if exe is None:
            raise InvalidArgumentError("--remote redis", "redis-server is not installed (apt-get install redis-server)")
        self.exe = exe
        self.directory = tempfile.mkdtemp(prefix="prefixstore-fuzz-redis-")
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.stopped = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> Any:
        import redis  # the remote extra; only this mode needs it

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self, tries: int = 3) -> RedisProcess:
        """Start it, empty, and wait until it answers (a port taken meanwhile is replaced,
        unless ``tries`` is 1: a restart keeps the URL)."""
        import redis

        args = [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.directory,
                "--save", "", "--appendonly", "no", "--daemonize", "no",
                "--logfile", os.path.join(self.directory, "redis.log")]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.stopped = False
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            with contextlib.suppress(redis.RedisError):
                if self.client().ping():
                    return self
            if self.proc.poll() is not None:
                if tries > 1:
                    self.port = free_port()
                    return self.start(tries - 1)
                raise RuntimeError(f"redis-server on port {self.port} exited at start")
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not answer")
            time.sleep(0.02)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL (after a SIGCONT if it was stopped); what it held is gone."""
        if self.alive:
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)
        self.stopped = False

    def restart(self) -> None:
        """An empty server at the same URL."""
        self.kill()
        self.start(tries=1)

    def stop(self) -> None:
        """SIGSTOP: connections are accepted, nothing answers."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)
        wait_stopped(self.proc.pid)
        self.stopped = True

    def cont(self) -> None:
        if self.alive:
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGCONT)
        self.stopped = False

    def flushall(self) -> None:
        self.client().flushall()

    def blob_keys(self) -> list[bytes]:
        """Every blob key it holds (``...:b:<rank>:<checksum>``), sorted."""
        return sorted(k for k in self.client().scan_iter(match="ps:*:b:*", count=1000))

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.directory, ignore_errors=True)
