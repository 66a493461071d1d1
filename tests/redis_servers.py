"""Real redis-server processes for tests: free loopback ports, temporary directories, no
persistence, always stopped (also when a test fails).

Use the fixtures by importing them into a test module:
``from redis_servers import redis_server_fixture  # noqa: F401`` gives ``redis_server``
(and ``redis_cluster_fixture`` gives ``redis_cluster``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import redis

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
START_TIMEOUT = 10.0


def wait_stopped(pid: int, timeout: float = 10.0) -> None:
    """Wait until process ``pid`` is stopped (``T`` in ``/proc/PID/stat``)."""
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "T":
        if time.monotonic() > deadline:
            raise RuntimeError(f"process {pid} did not stop")
        time.sleep(0.001)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port(cluster_bus: bool = False) -> int:
    """A free loopback port; with ``cluster_bus``, one whose bus port (+10000) is free too."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not cluster_bus or (port + 10000 < 65536 and _bindable(port + 10000)):
            return port


def make_certificate(directory: Path) -> None:
    """A self-signed certificate for 127.0.0.1: ``cert.pem`` (also the CA) and ``key.pem``."""
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(directory / "key.pem"), "-out", str(directory / "cert.pem"),
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )


class RedisServer:
    """One ``redis-server`` on 127.0.0.1 in ``directory``; ``extra`` are more config args."""

    def __init__(
        self, directory: Path, *extra: str, password: str | None = None, tls: bool = False
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.extra = list(extra)
        self.password = password
        self.tls = tls
        if tls:
            make_certificate(self.directory)
        self.cluster_bus = "--cluster-enabled" in extra
        self.port = free_port(self.cluster_bus)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    @property
    def ca_file(self) -> str:
        return str(self.directory / "cert.pem")

    def args(self) -> list[str]:
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.directory), "--save", "", "--appendonly", "no",
                "--logfile", str(self.directory / "redis.log"), "--daemonize", "no",
                *self.extra]
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls:
            d = self.directory
            args[1:3] = ["--port", "0", "--tls-port", str(self.port)]
            args += ["--tls-cert-file", str(d / "cert.pem"), "--tls-key-file", str(d / "key.pem"),
                     "--tls-ca-cert-file", str(d / "cert.pem"), "--tls-auth-clients", "no"]
        return args

    def start(self, tries: int = 3) -> RedisServer:
        """Start it and wait until it answers; a port taken meanwhile is replaced by another
        (except on a restart, which keeps the port)."""
        self.proc = subprocess.Popen(self.args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                if self.client().ping():
                    return self
            except redis.RedisError:
                pass
            if self.proc.poll() is not None and tries > 1:
                self.port = free_port(self.cluster_bus)
                return self.start(tries - 1)
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = (self.directory / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server on port {self.port} did not start:\n{log}")
            time.sleep(0.02)

    def client(self, **kw) -> redis.Redis:
        if self.tls:
            kw.update(ssl=True, ssl_ca_certs=self.ca_file)
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                           socket_timeout=5, **kw)

    def stop(self) -> None:
        """Kill the server (SIGKILL, after a SIGCONT in case it was stopped)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> RedisServer:
        """Kill it and start an empty one on the same port."""
        self.stop()
        return self.start(tries=1)

    def pause(self) -> None:
        """SIGSTOP: the server hangs (connections are accepted, nothing answers), once
        this returns (the signal is delivered asynchronously)."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        wait_stopped(self.proc.pid)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)


class RedisClusterNodes:
    """``n`` cluster-enabled masters on loopback, joined by ``redis-cli --cluster create``."""

    def __init__(self, directory: Path, n: int = 3) -> None:
        self.nodes = [
            RedisServer(Path(directory) / f"node{i}", "--cluster-enabled", "yes",
                        "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "1000",
                        "--cluster-require-full-coverage", "no")
            for i in range(n)
        ]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.nodes)

    def start(self) -> RedisClusterNodes:
        for s in self.nodes:
            s.start()
        addrs = [f"127.0.0.1:{s.port}" for s in self.nodes]
        subprocess.run([REDIS_CLI, "--cluster", "create", *addrs, "--cluster-replicas", "0",
                        "--cluster-yes"], check=True, capture_output=True, timeout=60)
        deadline = time.monotonic() + START_TIMEOUT
        while not all(s.client().cluster("info")["cluster_state"] == "ok" for s in self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not reach cluster_state:ok")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        for s in self.nodes:
            s.stop()


def need_redis() -> None:
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.fail("redis-server and redis-cli must be installed (apt-get install redis-server)")


@pytest.fixture(name="redis_server")
def redis_server_fixture(tmp_path):
    """A fresh, empty redis-server, killed after the test."""
    need_redis()
    server = RedisServer(tmp_path / "redis")
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(name="redis_cluster")
def redis_cluster_fixture(tmp_path):
    """A fresh 3-master Redis Cluster, killed after the test."""
    need_redis()
    cluster = RedisClusterNodes(tmp_path / "cluster")
    try:
        yield cluster.start()
    finally:
        cluster.stop()


class HostileRedis:
    """A RESP server on loopback that answers a client's handshake (``HELLO`` with
    ``hello``, ``CLIENT``, ``PING``, ``SCRIPT``...) like Redis, and every read (``EVALSHA``, ``EVAL``, ``GET``, ``MGET``,
    ``GETRANGE``) with ``header`` (say ``$4000000000\\r\\n``), then ``flood`` bytes as fast
    as the client takes them, then one byte per ``interval`` seconds until the client
    closes the connection. ``closed`` is set (and ``closed_at`` holds ``time.monotonic()``)
    when a connection that got the header is closed by the client; ``sent`` counts the
    bytes sent after headers."""

    HELLO = b"%1\r\n+proto\r\n:3\r\n"  # redis-py asks for RESP3

    def __init__(self, header: bytes, flood: int = 0, interval: float = 0.02, hello: bytes = HELLO) -> None:
        self.header, self.flood, self.interval, self.hello = header, flood, interval, hello
        self.sent = 0
        self.closed = threading.Event()
        self.closed_at: float | None = None
        self._stop = threading.Event()
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self._stop.set()
        self._threads[0].join(10)
        for conn in self._conns:  # wake every connection's thread
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for t in self._threads[1:]:
            t.join(10)
        self._listener.close()

    def __enter__(self) -> HostileRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            self._conns.append(conn)
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            reader = conn.makefile("rb")
            try:
                while not self._stop.is_set():
                    command = _read_command(reader)
                    if command is None:
                        return
                    if command[0].upper() in (b"EVALSHA", b"EVAL", b"GET", b"MGET", b"GETRANGE"):
                        self._hostile(conn)
                        return
                    name = command[0].upper()
                    conn.sendall(self.hello if name == b"HELLO" else b"+PONG\r\n" if name == b"PING" else b"+OK\r\n")
            except OSError:
                return

    def _hostile(self, conn: socket.socket) -> None:
        conn.sendall(self.header)
        chunk = bytes(1 << 16)
        try:
            while self.sent < self.flood and not self._stop.is_set():
                n = conn.send(chunk[: self.flood - self.sent])
                self.sent += n
            conn.settimeout(self.interval)
            while not self._stop.is_set():
                conn.sendall(b"x")
                self.sent += 1
                try:
                    if conn.recv(1) == b"":
                        break  # the client closed the connection
                except TimeoutError:
                    continue
        except OSError:
            pass  # reset by the client
        if not self._stop.is_set():
            self.closed_at = time.monotonic()
            self.closed.set()


def _read_command(reader) -> list[bytes] | None:
    """One RESP array of bulk strings from a client (None at EOF)."""
    line = reader.readline()
    if not line:
        return None
    count = int(line[1:])
    parts = []
    for _ in range(count):
        size = int(reader.readline()[1:])
        parts.append(reader.read(size + 2)[:-2])
    return parts
