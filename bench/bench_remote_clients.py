"""Latency of one get and one set of a 4 KiB and a 4 MiB value on loopback: the Mooncake
Store client layer (``gpu/remote/mooncake_client.py``, a master and one storage node)
against the Redis one (``gpu/remote/clients.py``, one redis-server), and Mooncake's own
client called directly, in one run.

    python3 bench/bench_remote_clients.py [--rounds N] [--out bench/results]

Each round times, for each store in turn, ``--ops`` sets of fresh keys then as many gets
of them (one key per call, as a tier's fetch of one blob); the medians over all rounds
and the Mooncake / Redis ratio are reported. Alternating the stores round by round keeps
the machine's load from favouring one. Writes ``remote_clients.json`` and
``remote_clients.md``. Needs ``redis-server`` and Mooncake (``tests/`` starts both).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from mooncake_servers import MooncakeStore  # noqa: E402 - the tests' real servers
from redis_servers import RedisServer  # noqa: E402

from prefixstore.gpu.remote import clients, mooncake_urls  # noqa: E402
from prefixstore.gpu.remote.config import RemoteConfig  # noqa: E402
from prefixstore.gpu.remote.mooncake_client import MooncakeClient, MooncakeOptions  # noqa: E402
from prefixstore.gpu.remote.urls import parse  # noqa: E402

SIZES = {"4 KiB": 4 << 10, "4 MiB": 4 << 20}
BUDGET = 10.0


class RedisSide:
    name = "redis"

    def __init__(self, url: str) -> None:
        self.client = clients.connect(parse(url), RemoteConfig(), BUDGET)

    def set(self, key: str, value: bytes) -> None:
        clients.set_many(self.client, [(key, value)], None)

    def get(self, key: str, size: int) -> bytes:
        return clients.get_many(self.client, [key])[0]


class MooncakeSide:
    name = "mooncake"

    def __init__(self, url: str) -> None:
        self.client = MooncakeClient(url, MooncakeOptions())
        self.client.connect(BUDGET)

    def set(self, key: str, value: bytes) -> None:
        self.client.set_many([(key, value)], BUDGET)

    def get(self, key: str, size: int) -> bytes:
        return self.client.get_many([key], size, BUDGET)[0]


class RawMooncakeSide:
    """Mooncake's own client called on the caller's thread, the same calls the layer makes
    (what the layer's threads, budgets and checks cost is the difference)."""

    name = "mooncake-raw"

    def __init__(self, url: str) -> None:
        from mooncake.store import MooncakeDistributedStore  # noqa: PLC0415 - after the layer set MC_*

        u = mooncake_urls.parse(url)
        self.store = MooncakeDistributedStore()
        rc = self.store.setup({"local_hostname": u.local_hostname, "metadata_server": u.metadata,
                               "global_segment_size": 0, "local_buffer_size": 0, "protocol": "tcp",
                               "rdma_devices": "", "master_server_addr": u.master})
        if rc != 0:
            raise RuntimeError(f"setup returned {rc}")

    def set(self, key: str, value: bytes) -> None:
        ptr = ctypes.cast(ctypes.c_char_p(value), ctypes.c_void_p).value
        if self.store.batch_put_from([key], [ptr], [len(value)]) != [0]:
            raise RuntimeError("put failed")

    def get(self, key: str, size: int) -> bytes:
        buf = bytearray(size)
        ptr = ctypes.addressof((ctypes.c_char * size).from_buffer(buf))
        (n,) = self.store.batch_get_into([key], [ptr], [size])
        return bytes(memoryview(buf)[:n])


def measure(sides: list, rounds: int, ops: dict[str, int]) -> dict[str, dict[str, list[float]]]:
    """Seconds per call: ``{side: {"set 4 KiB": [...], "get 4 KiB": [...], ...}}``."""
    out: dict[str, dict[str, list[float]]] = {s.name: {} for s in sides}
    for r in range(rounds):
        for label, size in SIZES.items():
            value = os.urandom(size)
            for side in sides if r % 2 == 0 else sides[::-1]:
                keys = [f"bench:{side.name}:{label}:{r}:{i}" for i in range(ops[label])]
                sets = []
                for k in keys:
                    t0 = time.perf_counter()
                    side.set(k, value)
                    sets.append(time.perf_counter() - t0)
                gets = []
                for k in keys:
                    t0 = time.perf_counter()
                    got = side.get(k, size)
                    gets.append(time.perf_counter() - t0)
                    if got != value:
                        raise RuntimeError(f"{side.name} returned other bytes for {k}")
                out[side.name].setdefault(f"set {label}", []).extend(sets)
                out[side.name].setdefault(f"get {label}", []).extend(gets)
    return out


def table(rows: list[dict], meta: dict) -> str:
    lines = [f"# Remote clients on loopback ({meta['rounds']} rounds, {meta['ops']} calls per size a round)", "",
             "| call | Redis median ms | Mooncake median ms | Mooncake / Redis | Mooncake raw median ms "
             "| Redis p90 ms | Mooncake p90 ms |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['call']} | {r['redis_ms']:.3f} | {r['mooncake_ms']:.3f} | {r['ratio']:.2f} | "
                     f"{r['raw_ms']:.3f} | {r['redis_p90_ms']:.3f} | {r['mooncake_p90_ms']:.3f} |")
    return "\n".join(lines + ["", meta["note"], ""])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--ops", type=int, default=50, help="calls of 4 KiB per round (4 MiB: a fifth)")
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args()
    ops = {"4 KiB": args.ops, "4 MiB": max(1, args.ops // 5)}
    with tempfile.TemporaryDirectory(prefix="bench-remote-") as tmp:
        redis_server = RedisServer(Path(tmp) / "redis").start()
        store = MooncakeStore(Path(tmp) / "mooncake", segment="512MB").start()
        try:
            sides = [RedisSide(redis_server.url), MooncakeSide(store.url), RawMooncakeSide(store.url)]
            seconds = measure(sides, args.rounds, ops)
            sides[1].client.close()
            sides[2].store.close()
        finally:
            store.stop()
            redis_server.stop()
    rows = []
    for call in seconds["redis"]:
        red, moon, raw = (seconds[n][call] for n in ("redis", "mooncake", "mooncake-raw"))
        rows.append({"call": call, "redis_ms": statistics.median(red) * 1e3,
                     "mooncake_ms": statistics.median(moon) * 1e3,
                     "raw_ms": statistics.median(raw) * 1e3,
                     "ratio": statistics.median(moon) / statistics.median(red),
                     "redis_p90_ms": statistics.quantiles(red, n=10)[-1] * 1e3,
                     "mooncake_p90_ms": statistics.quantiles(moon, n=10)[-1] * 1e3})
    meta = {"rounds": args.rounds, "ops": ops, "cpus": os.cpu_count(),
            "load_avg": os.getloadavg(),
            "note": ("One key per call. Mooncake: TCP transport, the client lends no memory (a storage "
                     "node holds the values), each call on a worker thread within its budget; raw: "
                     "Mooncake's client called directly on the caller's thread with the same calls "
                     "(batch_put_from / batch_get_into and one copy out). Redis: redis-py on one "
                     "connection. Same machine, same run, the stores' order alternated per round.")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "remote_clients.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    (out / "remote_clients.md").write_text(table(rows, meta))
    print(table(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
