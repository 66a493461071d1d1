"""A fuzz run's servers: the highest ``rank_servers`` ranks served by rank server
processes (``servers.RankHosts``) and, with ``remote="redis"``, a real ``redis-server``
behind the engine's remote tier; the faults the driver's cluster ops inject into them.

Ops (``Driver._op_<name>`` hands them here; each spec is JSON, as every fuzz op):

- ``rank_kill`` {rank, ops}: SIGKILL the rank's server; restarted after ``ops`` ops.
- ``rank_power`` {rank, ops, mode}: the rank's host loses power between two requests
  (what it had not made durable is dropped or garbled); restarted after ``ops`` ops.
- ``rank_stop`` {rank, ops}: SIGSTOP (the coordinator's calls time out at its
  ``op_timeout``); SIGCONT after ``ops`` ops.
- ``rank_cut`` {rank, ops}: with ``netns`` (each rank server on a host of its own,
  ``netns.py``), the host's link down; up again after ``ops`` ops.
- ``redis_kill`` {ops}: SIGKILL redis-server; an empty one at the same URL after ``ops``.
- ``redis_stop`` {ops}: SIGSTOP redis-server; SIGCONT after ``ops`` ops.
- ``redis_flush``: FLUSHALL.
- ``remote_damage`` {i, at, bit}: flip one bit of the data part of one blob in redis
  (an altered blob, as a faulty store or another writer could leave).

While an outage lasts (``quiet`` is False) the driver requires no restore and skips the
audit (a rank that is down cannot be read); when it ends the rank server is back and
connected, and the driver's next check audits everything through it. The remote tier
is never part of the model's requirements (a remote miss is fine), only its bytes are
checked: a restore, from wherever, returns the stored bytes or nothing.
"""

from __future__ import annotations

import contextlib
import os
import struct
from typing import Any

from prefixstore.base.errors import RankUnavailableError
from prefixstore.fuzz.netns import Network
from prefixstore.fuzz.servers import RankHosts, RedisProcess
from prefixstore.gpu.distributed import RankGroup, RemoteRank
from prefixstore.gpu.ranks import rank_dir_name

OP_TIMEOUT_S = 1.0
"""Each request to a rank server (the coordinator's bound on a hung host)."""
CONNECT_TIMEOUT_S = 20.0
REMOTE_OPTIONS = {"lookup_timeout": 0.3, "restore_timeout": 0.6, "write_timeout": 0.6,
                  "reconnect_interval": 0.05, "namespace": "fuzz"}
REMOTES = ("redis",)


class Cluster:
    """The servers of one fuzz run (see the module docstring); ``close`` ends them."""

    def __init__(self, ranks: int, rank_servers: int, remote: str, root: str, *, seed: int = 0,
                 write_behind: bool = False, plant: Any = None, netns: bool = False) -> None:
        if not 0 <= rank_servers <= ranks:
            raise ValueError(f"rank_servers must be in 0..{ranks}, got {rank_servers}")
        if remote not in ("", *REMOTES):
            raise ValueError(f"unknown remote {remote!r}; known: {', '.join(REMOTES)}")
        self.ranks = ranks
        self.served = list(range(ranks - rank_servers, ranks))
        self.root = root
        self.write_behind = write_behind
        self.outages: list[list[Any]] = []  # [what, key, ops left]
        self.group: RankGroup | None = None
        self.hosts: RankHosts | None = None
        self.remotes: dict[int, RemoteRank] = {}
        self.redis: RedisProcess | None = None
        self.network: Network | None = None
        try:
            if self.served:
                token = os.urandom(32)
                host = "127.0.0.1"
                if netns:
                    self.network = Network(self.served)
                    self.network.enter()  # this thread, and what it starts, on the coordinator's host
                    host = self.network.coord_ip
                self.group = RankGroup(host, op_timeout=OP_TIMEOUT_S, connect_timeout=CONNECT_TIMEOUT_S,
                                       gloo_host=host, token=token)
                self.hosts = RankHosts(self.group.port, token, seed=seed,
                                       plant=plant.name if getattr(plant, "server_patch", None) else None,
                                       connect_timeout=CONNECT_TIMEOUT_S, network=self.network)
                for r in self.served:
                    self.hosts.start(r, self.directory(r))
                self.remotes = dict(zip(self.served, self.group.connect(self.served), strict=True))
            if remote == "redis":
                self.redis = RedisProcess().start()
        except BaseException:
            self.close()
            raise

    def directory(self, rank: int) -> str:
        """Where rank ``rank``'s server keeps its files (where a local rank would)."""
        return os.path.join(self.root, rank_dir_name(rank))

    # -- what the engine opens with ------------------------------------------------------

    def is_served(self, rank: int) -> bool:
        return rank in self.remotes

    def rank(self, rank: int) -> RemoteRank:
        return self.remotes[rank]

    def engine_options(self) -> dict[str, Any]:
        """``Engine.open``'s remote-tier options (none without redis)."""
        if self.redis is None:
            return {}
        return {"remote": self.redis.url, "remote_options": {**REMOTE_OPTIONS, "write_behind": self.write_behind}}

    @property
    def quiet(self) -> bool:
        """No outage in progress: every rank server is up and every check applies."""
        return not any(o[0].startswith("rank_") for o in self.outages)

    # -- faults --------------------------------------------------------------------------

    def apply(self, op: dict[str, Any], counts: Any, held: frozenset[bytes] = frozenset()) -> None:
        """Inject ``op``; ``held``: the checkpoints ready locally (``remote_damage``
        prefers a blob of another one: the next restore of it reads the remote)."""
        kind = op["op"]
        ops = max(1, int(op.get("ops", 1)))
        if kind.startswith("rank_"):
            if not self.served:
                return
            rank = self.served[int(op.get("rank", 0)) % len(self.served)]
            if self._down(rank):
                return  # one outage per rank at a time
            assert self.hosts is not None
            if kind == "rank_kill":
                self.hosts.kill(rank)
            elif kind == "rank_power":
                self.hosts.power_loss(rank, "garble" if op.get("mode") == "garble" else "drop")
            elif kind == "rank_stop":
                self.hosts.stop(rank)
            elif kind == "rank_cut":
                if self.network is None:
                    return
                self.network.set_link(rank, False)
            else:
                raise ValueError(f"unknown cluster op {kind!r}")
            self.outages.append([kind, rank, ops])
        elif kind.startswith(("redis_", "remote_")):
            if self.redis is None:
                return
            if kind == "redis_flush":
                if not self.redis.stopped and self.redis.alive:
                    self.redis.flushall()
            elif kind == "remote_damage":
                if self.redis.stopped or not self.redis.alive or not self._damage_blob(op, held):
                    return
            elif any(o[0].startswith("redis_") for o in self.outages):
                return
            elif kind == "redis_kill":
                self.redis.kill()
                self.outages.append([kind, None, ops])
            elif kind == "redis_stop":
                self.redis.stop()
                self.outages.append([kind, None, ops])
            else:
                raise ValueError(f"unknown cluster op {kind!r}")
        else:
            raise ValueError(f"unknown cluster op {kind!r}")
        counts[f"cluster.{kind}"] += 1

    def _down(self, rank: int) -> bool:
        return any(o[1] == rank for o in self.outages if o[0].startswith("rank_"))

    def _damage_blob(self, op: dict[str, Any], held: frozenset[bytes]) -> bool:
        assert self.redis is not None
        client = self.redis.client()
        keys = self.redis.blob_keys()
        mine = {b"{" + k.hex().encode() + b"}" for k in held}
        keys = [k for k in keys if k.split(b":")[3] not in mine] or keys
        if not keys:
            return False
        key = keys[int(op.get("i", 0)) % len(keys)]
        value = client.get(key)
        if not value or len(value) < 9:
            return False
        (hlen,) = struct.unpack("<Q", value[:8])
        lo = min(len(value) - 1, 8 + hlen)
        at = lo + int(float(op.get("at", 0.5)) * (len(value) - lo)) % max(1, len(value) - lo)
        data = bytearray(value)
        data[at] ^= 1 << (int(op.get("bit", 0)) % 8)
        client.set(key, bytes(data))
        return True

    def tick(self) -> None:
        """After an op: end the outages whose time is up."""
        for o in list(self.outages):
            o[2] -= 1
            if o[2] <= 0:
                self.outages.remove(o)
                self._end(o[0], o[1])

    def end_all(self) -> None:
        """End every outage now (before a clean close)."""
        for o in list(self.outages):
            self.outages.remove(o)
            self._end(o[0], o[1])

    def end_rank_outages(self) -> None:
        """Bring every rank server back now: opening the engine recovers every rank."""
        for o in [o for o in self.outages if o[0].startswith("rank_")]:
            self.outages.remove(o)
            self._end(o[0], o[1])

    def _end(self, kind: str, rank: int | None) -> None:
        if kind == "redis_kill":
            assert self.redis is not None
            self.redis.restart()
        elif kind == "redis_stop":
            assert self.redis is not None
            self.redis.cont()
        elif rank is not None:
            if kind == "rank_cut":
                assert self.network is not None
                self.network.set_link(rank, True)
            self.revive(rank, resumed=kind in ("rank_stop", "rank_cut"))

    def revive(self, rank: int, *, resumed: bool) -> None:
        """Rank ``rank``'s server up and connected: resumed after a stop (restarted if it
        gave up on the coordinator meanwhile), else restarted on its directory."""
        assert self.hosts is not None
        rr = self.remotes[rank]
        if resumed:
            if rank in self.hosts.stopped:
                self.hosts.cont(rank)
            with contextlib.suppress(RankUnavailableError):
                rr.reconnect(timeout=CONNECT_TIMEOUT_S)
                if self._answers(rr):
                    return
            self.hosts.kill(rank)
        rr.close()  # the dead process's pair, if still held
        self.hosts.start(rank, self.directory(rank))
        rr.reconnect(timeout=CONNECT_TIMEOUT_S)

    @staticmethod
    def _answers(rr: RemoteRank) -> bool:
        try:
            rr.info()
            return True
        except OSError:
            return False

    def close(self) -> None:
        """Stop every server (rank servers told to shut down, then killed; redis killed)."""
        try:
            if self.hosts is not None:
                for r in list(self.hosts.stopped):
                    self.hosts.cont(r)
            if self.group is not None:
                self.group.close()
        finally:
            if self.hosts is not None:
                self.hosts.close()
            if self.redis is not None:
                self.redis.close()
            if self.network is not None:
                self.network.close()
