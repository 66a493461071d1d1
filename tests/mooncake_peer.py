"""A second process using a Mooncake Store (for tests/test_mooncake_client.py).

    python mooncake_peer.py URL

Reads commands from stdin, one a line, and answers each on stdout:
``put PREFIX SEED N`` stores N values made from SEED under PREFIX0..PREFIX<N-1> and
answers ``stored``; ``check PREFIX SEED N`` answers ``same`` if those keys hold exactly
those values, else ``differ <what it read>``; ``quit`` closes the client.
"""

from __future__ import annotations

import random
import sys

from prefixstore.gpu.remote.mooncake_client import MooncakeClient, MooncakeOptions

BUDGET = 10.0


def values(seed: int, n: int) -> list[bytes]:
    """N values from ``seed``: sizes from 1 byte to a little over 1 MiB, random bytes."""
    rng = random.Random(seed)
    return [rng.randbytes(rng.choice([1, 4096, 65537, (1 << 20) + 3])) for _ in range(n)]


def main(url: str) -> int:
    client = MooncakeClient(url, MooncakeOptions(rpc_timeout=5.0))
    client.connect(BUDGET)
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "quit":
            break
        prefix, seed, n = args[0], int(args[1]), int(args[2])
        want = values(seed, n)
        keys = [f"{prefix}{i}" for i in range(n)]
        if cmd == "put":
            client.set_many(list(zip(keys, want, strict=True)), BUDGET)
            print("stored", flush=True)
        elif cmd == "check":
            got = client.get_many(keys, [len(v) for v in want], BUDGET)
            same = got == want
            seen = [len(g) if isinstance(g, bytes) else type(g).__name__ for g in got]
            print("same" if same else f"differ {seen}", flush=True)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
