"""The Mooncake conversation trace served round-robin by 4 engine instances (a load balancer
without prefix-aware routing), each with a local tier of 2.5% of the trace's unique bytes:
without, then with a shared Redis tier holding 10% (``maxmemory``, ``allkeys-lru``); and one
instance holding 10% locally for reference, and the shared Redis without a bound (what
sharing could give at most). Token hit ratio and modeled prefill seconds saved.

    python3 bench/bench_remote_replay.py [--limit N] [--out bench/results]

Writes ``remote_replay.json`` and ``remote_replay.md``. ``--limit`` replays the first N
requests (default 2000: about 2 minutes on one core for the four runs; 0: the whole
trace); every share is of the replayed requests' unique bytes. Needs ``redis-server``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from prefixstore.replay.engine_replay import ReplayConfig, capacity_of, replay
from prefixstore.replay.trace import load_trace

HERE = Path(__file__).resolve().parent
TRACE = HERE.parent.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
KEYS = ("hit_ratio_tokens", "prefill_s_saved", "prefill_s_total", "restores", "restores_remote",
        "wrong_bytes", "audit_ok", "wall_s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Redis:
    """A throwaway redis-server on loopback holding at most ``nbytes`` of data beyond its
    empty footprint (0: no bound), evicting by LRU."""

    def __init__(self, directory: str, nbytes: int) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
             "--dir", directory, "--save", "", "--appendonly", "no", "--maxmemory-policy", "allkeys-lru"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        if nbytes:
            client.config_set("maxmemory", client.info("memory")["used_memory"] + nbytes)
        self.client = client

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> dict[str, Any]:
        info = {**self.client.info("memory"), **self.client.info("stats")}
        self.proc.kill()
        self.proc.wait(10)
        return {k: info[k] for k in ("used_memory", "maxmemory", "evicted_keys")}


def run(requests, label: str, **cfg: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    rep = replay(requests, ReplayConfig(**cfg), None, keep=False)
    out = {k: rep.summary[k] for k in KEYS}
    out["remote"] = rep.summary["remote"]
    print(f"{label}: {out['hit_ratio_tokens']:.4f} token hit ratio, {out['prefill_s_saved']:.1f} s saved "
          f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return {"label": label, **cfg, **out}


def table(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"Mooncake conversation trace, first {meta['requests']:,} requests ({meta['unique_bytes_files']:,} "
        f"unique file bytes), round-robin over the instances; shares are of those unique bytes.",
        "",
        "| setup | token hit ratio | prefill s saved (modeled) | restores (from the remote) | bytes from Redis "
        "| wrong bytes | audit |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        fetched = (r["remote"] or {}).get("bytes_in", 0)
        lines.append(f"| {r['label']} | {r['hit_ratio_tokens']:.4f} | {r['prefill_s_saved']:,.1f} of "
                     f"{r['prefill_s_total']:,.1f} | {r['restores']:,} ({r['restores_remote']:,}) | {fetched:,} | "
                     f"{r['wrong_bytes']} | {'clean' if r['audit_ok'] else 'FAILED'} |")
    if meta.get("redis"):
        lines += ["", f"Redis: maxmemory {meta['redis']['maxmemory']:,} bytes, {meta['redis']['evicted_keys']:,} "
                      "keys evicted."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=2000)
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args()
    requests = load_trace(str(TRACE), args.limit or None)
    unique = capacity_of(ReplayConfig(capacity="100%"), requests)["capacity_bytes_files"]
    rows = [run(requests, "4 instances, 2.5% local each", instances=4, capacity="2.5%")]
    with tempfile.TemporaryDirectory() as d:
        server = Redis(d, unique // 10)
        try:
            rows.append(run(requests, "4 instances, 2.5% local each + shared Redis 10%", instances=4,
                            capacity="2.5%", remote=server.url))
        finally:
            info = server.stop()
        server = Redis(d, 0)
        try:
            rows.append(run(requests, "4 instances, 2.5% local each + shared Redis, unbounded (upper bound)",
                            instances=4, capacity="2.5%", remote=server.url))
        finally:
            server.stop()
    rows.append(run(requests, "1 instance, 10% local (reference)", instances=1, capacity="10%"))
    meta = {"trace": TRACE.name, "requests": len(requests), "unique_bytes_files": unique, "redis": info}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "remote_replay.json").write_text(json.dumps({"meta": meta, "runs": rows}, indent=2, default=str))
    (out / "remote_replay.md").write_text(table(rows, meta))
    print(table(rows, meta))
    return 0 if all(r["audit_ok"] and not r["wrong_bytes"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
