"""Hosts as Linux network namespaces, for multi-host tests (not a test module).

``NetnsHosts(n, base)`` builds a private network: a *switch* namespace holding a bridge,
one namespace for the coordinator and one per host, each joined to the bridge by a veth
pair (``eth0`` inside, ``cN`` / ``hN`` on the switch). Nothing is added to the namespace
the tests run in: every link lives in one of these namespaces, so deleting them removes
every link. Names carry this process's pid and a random tag, so parallel runs don't clash.

- ``with hosts.coordinator():`` runs the block with this thread in the coordinator's
  namespace (``setns``); sockets and threads created inside stay there, so a
  ``RankGroup`` made inside listens at ``hosts.coord_ip`` only.
- ``start_rank(r, init_method, ...)`` runs one rank server process on host ``r`` with
  its own directory (``hosts.rank_dir(r)``); ``spawn(ns, argv)`` any process in a
  namespace (e.g. a stranger, see ``stranger_ns``).
- Faults: ``kill_host(r)`` SIGKILLs every process in host ``r``'s namespace,
  ``set_link(r, up)``, ``shape(r, ...)`` (netem where the kernel has it, else a tbf
  rate limit; see ``HAS_NETEM``), ``flap(r, ...)`` (the link down a share of each period:
  burst loss), ``partition(r, seconds)`` (down, then up again).
- ``close()`` kills every process in every namespace and deletes the namespaces; the
  fixture ``netns_hosts`` calls it also on failure (and ``atexit`` does, if the test
  process is interrupted).

Traffic goes only to addresses inside these namespaces (10.X.Y.0/24, private to the
bridge: the namespace the tests run in has no route to it).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from prefixstore.fuzz import netns

_LIVE: set[NetnsHosts] = set()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be built here (None: they can)."""
    name = f"psprobe{os.getpid()}{secrets.token_hex(2)}"
    try:
        got = _ip("netns", "add", name, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"ip netns unavailable: {exc}"
    if got.returncode != 0:
        return f"ip netns unavailable: {got.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


def _probe_netem() -> bool:
    name = f"psprobe{os.getpid()}{secrets.token_hex(2)}"
    if _ip("netns", "add", name, check=False).returncode != 0:
        return False
    try:
        got = subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root",
                              "netem", "delay", "1ms"], capture_output=True, timeout=30)
        return got.returncode == 0
    finally:
        _ip("netns", "del", name, check=False)


HAS_NETEM = _probe_netem()
"""Whether this kernel has ``sch_netem`` (some VM kernels ship without it)."""


class NetnsHosts:
    """N hosts and a coordinator on one private bridge (see the module docstring)."""

    def __init__(self, n: int, base: str, *, strangers: int = 1) -> None:
        self.n = n
        self.base = str(base)
        tag = f"ps{os.getpid()}x{secrets.token_hex(3)}"
        self.switch = f"{tag}-sw"
        self.coord_ns = f"{tag}-c"
        self.host_ns = [f"{tag}-h{r}" for r in range(n)]
        self.stranger_nss = [f"{tag}-s{i}" for i in range(strangers)]
        net = f"10.{secrets.randbelow(200) + 20}.{secrets.randbelow(250)}"
        self.coord_ip = f"{net}.1"
        self.host_ip = [f"{net}.{10 + r}" for r in range(n)]
        self.stranger_ips = [f"{net}.{200 + i}" for i in range(strangers)]
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []
        self._lock = threading.Lock()
        _LIVE.add(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # -- building -------------------------------------------------------------------

    def _netns(self, name: str) -> None:
        netns.add_namespace(name, self._made)

    def _attach(self, ns: str, port: str, addr: str) -> None:
        netns.attach(self.switch, ns, port, addr)

    def _build(self) -> None:
        self._netns(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        self._netns(self.coord_ns)
        self._attach(self.coord_ns, "c0", self.coord_ip)
        for r, ns in enumerate(self.host_ns):
            self._netns(ns)
            self._attach(ns, f"h{r}", self.host_ip[r])
            os.makedirs(self.rank_dir(r), exist_ok=True)
        for i, ns in enumerate(self.stranger_nss):
            self._netns(ns)
            self._attach(ns, f"s{i}", self.stranger_ips[i])

    @property
    def stranger_ns(self) -> str:
        return self.stranger_nss[0]

    @property
    def hosts_dir(self) -> str:
        """Where the hosts' own disks are (``blind`` processes do not see it)."""
        return os.path.join(self.base, "hosts")

    def rank_dir(self, r: int) -> str:
        return os.path.join(self.hosts_dir, f"host{r}", f"rank{r}")

    # -- processes ------------------------------------------------------------------

    @contextlib.contextmanager
    def coordinator(self, ns: str | None = None) -> Iterator[None]:
        """Run the block with this thread in the coordinator's namespace (or ``ns``)."""
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            netns.join(f"/run/netns/{ns or self.coord_ns}")
            try:
                yield
            finally:
                netns.join_fd(home, "the original network namespace")
        finally:
            os.close(home)

    def spawn(self, ns: str, argv: list[str], log_name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Run ``argv`` in namespace ``ns``, output to ``base/log_name``."""
        log = open(os.path.join(self.base, log_name), "ab")  # noqa: SIM115 - handed to the child
        try:
            env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR", **(env or {})}
            p = subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdout=log, stderr=subprocess.STDOUT,
                                 env=env, start_new_session=True)
        finally:
            log.close()
        with self._lock:
            self.procs.append(p)
        return p

    def spawn_blind(self, ns: str, argv: list[str], log_name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """``spawn`` with ``hosts_dir`` hidden (an empty tmpfs over it in a mount namespace
        of its own): a coordinator that sees no rank's disk, as on separate hosts."""
        return self.spawn(ns, ["unshare", "-m", "--propagation", "private", "sh", "-c",
                               'mount -t tmpfs blind "$0" && exec "$@"', self.hosts_dir, *argv], log_name, env)

    def start_rank(self, r: int, init_method: str, *extra: str, connect_timeout: float = 30,
                   token_file: str | None = None) -> subprocess.Popen:
        """One rank server on host ``r`` serving ``rank_dir(r)`` (``token_file``: its token)."""
        if token_file:
            extra = ("--token-file", token_file, *extra)
        argv = [sys.executable, "-m", "prefixstore.gpu.distributed", "--rank", str(r), "--dir", self.rank_dir(r),
                "--init-method", init_method, "--gloo-host", self.host_ip[r],
                "--connect-timeout", str(connect_timeout), *extra]
        return self.spawn(self.host_ns[r], argv, f"rank{r}.log")

    def logs(self) -> str:
        out = []
        for name in sorted(os.listdir(self.base)):
            if name.endswith(".log"):
                with open(os.path.join(self.base, name), errors="replace") as f:
                    out.append(f"--- {name}\n{f.read()[-3000:]}")
        return "\n".join(out)

    # -- faults ---------------------------------------------------------------------

    def pids(self, ns: str) -> list[int]:
        got = _ip("netns", "pids", ns, check=False)
        return [int(p) for p in got.stdout.split()]

    def kill_ns(self, ns: str) -> None:
        """SIGKILL every process in namespace ``ns`` (until none is left)."""
        for _ in range(50):
            pids = self.pids(ns)
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)

    def kill_host(self, r: int) -> None:
        self.kill_ns(self.host_ns[r])
        self._reap()

    def set_link(self, r: int, up: bool) -> None:
        """Host ``r``'s switch port up or down (its cable plugged in or pulled)."""
        self.set_link_ns(self.switch, f"h{r}", up)

    def set_link_ns(self, ns: str, dev: str, up: bool) -> None:
        """Link ``dev`` of namespace ``ns`` up or down (the coordinator's port: ``c0``)."""
        _ip("-n", ns, "link", "set", dev, "up" if up else "down")

    def shape(self, r: int, *, delay_ms: int = 200, loss_pct: int = 30, rate: str = "2mbit") -> str:
        """Slow (and, with netem, lossy) host ``r``'s link, both directions; what was applied."""
        for ns, dev in ((self.host_ns[r], "eth0"), (self.switch, f"h{r}")):
            if HAS_NETEM:
                cmd = ["netem", "delay", f"{delay_ms}ms", "loss", f"{loss_pct}%"]
            else:
                cmd = ["tbf", "rate", rate, "burst", "16kb", "latency", f"{max(delay_ms, 50)}ms"]
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", *cmd],
                           check=True, capture_output=True, timeout=30)
        return " ".join(cmd)

    def unshape(self, r: int) -> None:
        for ns, dev in ((self.host_ns[r], "eth0"), (self.switch, f"h{r}")):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                           capture_output=True, timeout=30)

    def flap(self, r: int, seconds: float, *, period: float = 1.0, down_share: float = 0.3) -> threading.Thread:
        """A thread that takes host ``r``'s link down ``down_share`` of each ``period`` for
        ``seconds`` (burst loss, where netem's random loss is not available); started."""
        def run() -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                self.set_link(r, False)
                time.sleep(period * down_share)
                self.set_link(r, True)
                time.sleep(period * (1 - down_share))
            self.set_link(r, True)

        t = threading.Thread(target=run, daemon=True, name=f"flap-h{r}")
        t.start()
        return t

    def partition(self, r: int, seconds: float) -> threading.Thread:
        """Host ``r`` cut off now, reconnected after ``seconds`` (a thread, started)."""
        self.set_link(r, False)

        def heal() -> None:
            time.sleep(seconds)
            self.set_link(r, True)

        t = threading.Thread(target=heal, daemon=True, name=f"heal-h{r}")
        t.start()
        return t

    # -- teardown -------------------------------------------------------------------

    def _reap(self) -> None:
        with self._lock:
            for p in self.procs:
                if p.poll() is None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        p.wait(0.2)

    def close(self) -> None:
        """Kill every process in every namespace, delete the namespaces (and so the links)."""
        for ns in reversed(self._made):
            self.kill_ns(ns)
        with self._lock:
            for p in self.procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(10)
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made.clear()
        _LIVE.discard(self)

    def __enter__(self) -> NetnsHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@atexit.register
def _close_all() -> None:
    for h in list(_LIVE):
        h.close()


def require_netns() -> None:
    """Skip the test when network namespaces cannot be built (a CI run fails instead)."""
    why = netns_unavailable()
    if why:
        pytest.skip(why)


def netns_leftovers(tag_of: NetnsHosts) -> list[str]:
    """Namespaces of ``tag_of`` still listed by ``ip netns list``."""
    prefix = tag_of.switch.removesuffix("-sw")
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    return [line.split()[0] for line in listed if line.strip().startswith(prefix)]
