"""Real redis-server processes for tests: free loopback ports, temporary directories, no
persistence, always stopped (also when a test fails).

Use the fixtures by importing them into a test module:
``from redis_servers import redis_server_fixture  # noqa: F401`` gives ``redis_server``
(and ``redis_cluster_fixture`` gives ``redis_cluster``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
START_TIMEOUT = 10.0


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
        """SIGSTOP: the server hangs (connections are accepted, nothing answers)."""
        os.kill(self.proc.pid, signal.SIGSTOP)

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


def _need_redis() -> None:
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.fail("redis-server and redis-cli must be installed (apt-get install redis-server)")


@pytest.fixture(name="redis_server")
def redis_server_fixture(tmp_path):
    """A fresh, empty redis-server, killed after the test."""
    _need_redis()
    server = RedisServer(tmp_path / "redis")
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(name="redis_cluster")
def redis_cluster_fixture(tmp_path):
    """A fresh 3-master Redis Cluster, killed after the test."""
    _need_redis()
    cluster = RedisClusterNodes(tmp_path / "cluster")
    try:
        yield cluster.start()
    finally:
        cluster.stop()
