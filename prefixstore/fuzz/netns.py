"""Hosts as Linux network namespaces for a fuzz run (root, ``ip``): one private bridge
in a *switch* namespace, the coordinator in a namespace of its own, one namespace per
served rank, each joined to the bridge by a veth pair (``eth0`` inside, ``cN`` / ``hN``
on the switch). Nothing is added to the namespace the fuzzer starts in, so deleting
the namespaces removes every link. Traffic stays on 10.X.Y.0/24, private to the bridge.

``enter()`` moves the calling thread into the coordinator's namespace (threads and
processes it starts afterwards stay there), ``leave()`` brings it back; a rank
server joins its host's namespace itself (``join``) before it opens any socket.
``set_link(rank, up)`` plugs the host's cable in or pulls it out.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import subprocess

from prefixstore.base.errors import InvalidArgumentError

CLONE_NEWNET = 0x40000000
_LIBC = ctypes.CDLL(None, use_errno=True)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], capture_output=True, text=True, check=True, timeout=30)


def join(path: str) -> None:
    """Move the calling thread into the network namespace at ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        join_fd(fd, path)
    finally:
        os.close(fd)


def join_fd(fd: int, what: str = "network namespace") -> None:
    """Move the calling thread into the network namespace open at ``fd``."""
    if _LIBC.setns(fd, CLONE_NEWNET) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), what)


def add_namespace(name: str, made: list[str]) -> None:
    """Add network namespace ``name`` (recorded in ``made`` for the teardown) with its
    loopback up."""
    _ip("netns", "add", name)
    made.append(name)
    _ip("-n", name, "link", "set", "lo", "up")


def attach(switch: str, ns: str, port: str, addr: str) -> None:
    """Join namespace ``ns`` to the bridge ``br0`` of namespace ``switch`` by a veth pair
    (``port`` on the switch, ``eth0`` with ``addr``/24 inside ``ns``), both ends up."""
    _ip("-n", switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
    _ip("-n", switch, "link", "set", port, "master", "br0")
    _ip("-n", switch, "link", "set", port, "up")
    _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
    _ip("-n", ns, "link", "set", "eth0", "up")


def unavailable() -> str | None:
    """Why namespaces cannot be built here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"psfz{os.getpid()}{secrets.token_hex(2)}"
    try:
        _ip("netns", "add", name)
        _ip("netns", "del", name)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"ip netns unavailable: {exc}"
    return None


class Network:
    """The namespaces of one fuzz run (see the module docstring)."""

    def __init__(self, ranks: list[int]) -> None:
        why = unavailable()
        if why is not None:
            raise InvalidArgumentError("--netns", why)
        tag = f"psfz{os.getpid()}x{secrets.token_hex(2)}"
        self.switch = f"{tag}-sw"
        self.coord_ns = f"{tag}-c"
        self.host_ns = {r: f"{tag}-h{r}" for r in ranks}
        net = f"10.{secrets.randbelow(200) + 20}.{secrets.randbelow(250)}"
        self.coord_ip = f"{net}.1"
        self.host_ip = {r: f"{net}.{10 + r}" for r in ranks}
        self._made: list[str] = []
        self._home: int | None = None
        try:
            self._netns(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            self._netns(self.coord_ns)
            self._attach(self.coord_ns, "c0", self.coord_ip)
            for r, ns in self.host_ns.items():
                self._netns(ns)
                self._attach(ns, f"h{r}", self.host_ip[r])
        except BaseException:
            self.close()
            raise

    def _netns(self, name: str) -> None:
        add_namespace(name, self._made)

    def _attach(self, ns: str, port: str, addr: str) -> None:
        attach(self.switch, ns, port, addr)

    def host_path(self, rank: int) -> str:
        return f"/run/netns/{self.host_ns[rank]}"

    def enter(self) -> None:
        """This thread into the coordinator's namespace (until ``leave``)."""
        if self._home is None:
            self._home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
            join(f"/run/netns/{self.coord_ns}")

    def leave(self) -> None:
        if self._home is not None:
            home, self._home = self._home, None
            try:
                join_fd(home, "the original network namespace")
            finally:
                os.close(home)

    def set_link(self, rank: int, up: bool) -> None:
        """Host ``rank``'s switch port up or down."""
        _ip("-n", self.switch, "link", "set", f"h{rank}", "up" if up else "down")

    def close(self) -> None:
        """Back to the original namespace; every namespace (and so every link) deleted."""
        try:
            self.leave()
        finally:
            for ns in reversed(self._made):
                with contextlib.suppress(subprocess.SubprocessError, OSError):
                    _ip("netns", "del", ns)
            self._made.clear()
