"""A stranger on the rank network, for tests/test_multihost.py (not a test module).

    python tests/netns_stranger.py rank HOST PORT RANK OUT GLOO_HOST
    python tests/netns_stranger.py coordinator HOST PORT RANK OUT GLOO_HOST

It knows the protocol (the TCPStore keys, the pair groups, the frames) but not the
token. ``rank``: it registers as rank RANK in the coordinator's store and answers
every request with success, recording what it was sent. ``coordinator``: it waits for
rank RANK to register, accepts it in the coordinator's place, joins its pair and asks
it to write ``planted.st``, list its directory and remove ``victim.st``, recording the
replies. Each record is one JSON line in OUT; the last line is ``{"end": why}``.
"""

from __future__ import annotations

import json
import os
import sys
import time

from prefixstore.gpu.rank_server import keys
from prefixstore.gpu.wire import LinkError, open_pair, store_client


def record(out: str, **what) -> None:
    with open(out, "a") as f:
        f.write(json.dumps(what) + "\n")


def pose_as_rank(store, host: str, port: int, rank: int, out: str, gloo: str) -> str:
    k = int(store.add(keys(rank)["counter"], 1))
    kk = keys(rank, k)
    fake = {"rank": rank, "directory": "/stranger", "pid": os.getpid(), "incarnation": k, "host": "stranger"}
    store.set(kk["info"], json.dumps(fake))
    store.set(kk["latest"], str(k))
    while not store.check([kk["accept"]]):
        time.sleep(0.05)
    link = open_pair(host, port, kk["pair"], 1, timeout=20, gloo_host=gloo)
    while True:
        req, payload = link.recv(time.monotonic() + 20)
        record(out, got=req, payload_bytes=len(payload))
        link.send({**fake, "ok": True, "id": req.get("id"), "removed": True, "size": None, "entries": [],
                   "dest": "", "nonce": "0" * 32, "mac": "0" * 64}, b"", time.monotonic() + 20)


def pose_as_coordinator(store, host: str, port: int, rank: int, out: str, gloo: str) -> str:
    deadline = time.monotonic() + 30
    while not store.check([keys(rank)["latest"]]):
        if time.monotonic() > deadline:
            return "rank never registered"
        time.sleep(0.05)
    k = int(store.get(keys(rank)["latest"]))
    kk = keys(rank, k)
    record(out, registration=store.get(kk["info"]).decode())
    store.set(kk["accept"], "1")
    link = open_pair(host, port, kk["pair"], 0, timeout=20, gloo_host=gloo)
    for i, (req, payload) in enumerate([({"op": "write_shard", "name": "planted.st"}, b"x" * 100),
                                        ({"op": "listdir"}, b""), ({"op": "remove", "name": "victim.st"}, b""),
                                        ({"op": "info"}, b"")]):
        link.send({**req, "id": i + 1}, payload, time.monotonic() + 20)
        reply, body = link.recv(time.monotonic() + 20)
        record(out, sent=req["op"], reply=reply, body_bytes=len(body))
    return "done"


def main() -> None:
    mode, host, port, rank, out, gloo = sys.argv[1:7]
    store = store_client(host, int(port), 20)
    try:
        act = pose_as_rank if mode == "rank" else pose_as_coordinator
        why = act(store, host, int(port), int(rank), out, gloo)
    except (LinkError, RuntimeError) as exc:
        why = f"{type(exc).__name__}: {exc}"
    record(out, end=why)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
