"""A real Mooncake Store for tests: ``mooncake_master`` (with its built-in HTTP metadata
server) and one ``mooncake_client`` storage process lending it memory, on free loopback
ports in a temporary directory, always killed (also when a test fails).

Use the fixture by importing it into a test module:
``from mooncake_servers import mooncake_store_fixture  # noqa: F401`` gives ``mooncake_store``.

Loopback only: the master's RPC and metrics servers bind 127.0.0.1 and every process
advertises 127.0.0.1 (``MC_TCP_BIND_ADDRESS``). Two listeners ignore their host setting
(Mooncake's own behaviour): the HTTP metadata server and the transfer engines' ports bind
all interfaces, while every connection made goes to 127.0.0.1.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from prefixstore.gpu.remote.mooncake_client import probe

REPO_TESTS = str(Path(__file__).resolve().parent)
START_TIMEOUT = 20.0
_SPEC = importlib.util.find_spec("mooncake")
PACKAGE_DIR = Path(next(iter(_SPEC.submodule_search_locations))) if _SPEC else None
MASTER = PACKAGE_DIR / "mooncake_master" if PACKAGE_DIR else None
STORE_NODE = PACKAGE_DIR / "mooncake_client" if PACKAGE_DIR else None
LEASE_MS = 1000
"""The master's read lease in these tests (Mooncake's default is 10 s)."""


def wait_stopped(pid: int, timeout: float = 10.0) -> None:
    """Wait until process ``pid`` is stopped (``T`` in ``/proc/PID/stat``)."""
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "T":
        if time.monotonic() > deadline:
            raise RuntimeError(f"process {pid} did not stop")
        time.sleep(0.001)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers_http(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            return s.recv(16).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _log_tail(directory: Path) -> str:
    logs = sorted(directory.glob("*.log"), key=lambda p: p.stat().st_mtime)
    return "".join(p.read_text(errors="replace")[-1500:] for p in logs[-2:])


class _Process:
    """One Mooncake process started with ``args`` in ``directory``, its output in ``name.log``."""

    def __init__(self, directory: Path, name: str) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.proc: subprocess.Popen | None = None

    def args(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def launch(self) -> None:
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_LOG_LEVEL": "WARNING"}
        with open(self.directory / f"{self.name}.log", "ab") as log:
            self.proc = subprocess.Popen(self.args(), cwd=self.directory, stdout=log,
                                         stderr=subprocess.STDOUT, env=env)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while not self.ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start:\n{_log_tail(self.directory)}")
            time.sleep(0.05)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL (after a SIGCONT, in case it was stopped), and reap it."""
        if self.alive:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


class MooncakeMaster(_Process):
    """``mooncake_master`` with its HTTP metadata server, on loopback ports of its own."""

    def __init__(self, directory: Path, *extra: str, lease_ms: int = LEASE_MS) -> None:
        super().__init__(directory, "master")
        self.extra = list(extra)
        self.lease_ms = lease_ms
        self.rpc_port = self.metadata_port = self.metrics_port = 0

    def args(self) -> list[str]:
        return [str(MASTER), "-rpc_address=127.0.0.1", f"-rpc_port={self.rpc_port}",
                "-enable_http_metadata_server=true", "-http_metadata_server_host=127.0.0.1",
                f"-http_metadata_server_port={self.metadata_port}", "-metrics_host=127.0.0.1",
                f"-metrics_port={self.metrics_port}", f"-default_kv_lease_ttl={self.lease_ms}",
                "-logtostderr=true", *self.extra]

    def ready(self) -> bool:
        return probe("127.0.0.1", self.rpc_port, 0.5) and _answers_http(self.metadata_port)

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    def start(self, tries: int = 3) -> MooncakeMaster:
        """Start it on free ports (others if one was taken meanwhile) and wait until both
        its RPC and metadata servers answer."""
        for attempt in range(tries):
            self.rpc_port, self.metadata_port, self.metrics_port = free_port(), free_port(), free_port()
            self.launch()
            try:
                self.wait_ready()
                return self
            except RuntimeError:
                self.kill()
                if attempt == tries - 1:
                    raise
        return self

    def restart(self) -> MooncakeMaster:
        """Kill it and start an empty one on the same ports (it forgets every object)."""
        self.kill()
        self.launch()
        self.wait_ready()
        return self

    def pause(self) -> None:
        """SIGSTOP: connections are still accepted, nothing answers (once this returns:
        a signal is delivered asynchronously, and a master thread running on another
        core would otherwise answer one more request)."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        wait_stopped(self.proc.pid)

    def resume(self) -> None:
        """SIGCONT (nothing if it is not running)."""
        if self.alive:
            os.kill(self.proc.pid, signal.SIGCONT)


class MooncakeStoreNode(_Process):
    """A ``mooncake_client`` process lending ``segment`` bytes of memory to the store."""

    def __init__(self, directory: Path, master: MooncakeMaster, segment: str = "256MB") -> None:
        super().__init__(directory, "store-node")
        self.master = master
        self.segment = segment
        self.port = 0

    def args(self) -> list[str]:
        return [str(STORE_NODE), "-host=127.0.0.1", f"-port={self.port}",
                f"-master_server_address=127.0.0.1:{self.master.rpc_port}",
                f"-metadata_server={self.master.metadata}", f"-global_segment_size={self.segment}",
                "-local_buffer_size=16MB", "-protocol=tcp", "-logtostderr=true"]

    def ready(self) -> bool:
        return _accepts(self.port)  # its service starts once its memory is mounted

    def start(self) -> MooncakeStoreNode:
        self.port = free_port()
        self.launch()
        self.wait_ready()
        return self


class MooncakeStore:
    """A master and one storage node: ``url`` is the ``mooncake://`` URL of the store."""

    def __init__(self, directory: Path, segment: str = "256MB", lease_ms: int = LEASE_MS) -> None:
        self.directory = Path(directory)
        self.master = MooncakeMaster(self.directory / "master", lease_ms=lease_ms)
        self.node = MooncakeStoreNode(self.directory / "node", self.master, segment)

    @property
    def url(self) -> str:
        return f"mooncake://127.0.0.1:{self.master.rpc_port}?metadata={self.master.metadata}"

    def start(self) -> MooncakeStore:
        self.master.start()
        self.node.start()
        return self

    def stop(self) -> None:
        self.node.kill()
        self.master.kill()

    def pause(self) -> None:
        """SIGSTOP the master."""
        self.master.pause()

    def resume(self) -> None:
        self.master.resume()

    def kill(self) -> None:
        """SIGKILL the master (the storage node stays)."""
        self.master.kill()

    def restart(self) -> MooncakeStore:
        """Kill the master and start an empty one on the same ports; the storage node
        mounts its memory on it again by itself."""
        self.master.restart()
        return self


def need_mooncake() -> None:
    if MASTER is None or not MASTER.exists() or not STORE_NODE.exists():
        pytest.fail("Mooncake must be installed: pip install --no-deps "
                    "mooncake-transfer-engine-non-cuda==0.3.13.post1 (and apt-get install libibverbs1)")


@pytest.fixture(name="mooncake_store")
def mooncake_store_fixture(tmp_path):
    """A fresh Mooncake Store (master + one 256 MB storage node), killed after the test."""
    need_mooncake()
    store = MooncakeStore(tmp_path / "mooncake")
    try:
        yield store.start()
    finally:
        store.stop()
