"""A coordinator process on a namespace host, for tests/test_multihost.py (not a test module).

    python tests/netns_coordinator.py ROOT HOST RANKS TOKEN_FILE [audit]

Hosts a RankGroup at HOST (printed as ``PORT n``), waits for RANKS rank servers,
opens the engine at ROOT with them, acknowledges two stores (printed as ``ACKED``),
then idles until killed. With ``audit``: prints the engine's audit instead
(``AUDIT {json}``) and exits.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conftest import make_layout, store_tokens, tokens_for  # noqa: E402

from prefixstore.engine.api import Engine  # noqa: E402
from prefixstore.gpu.distributed import RankGroup  # noqa: E402
from prefixstore.gpu.rank_auth import load_token  # noqa: E402

ACKED = [(31, 4), (32, 3)]


def main() -> None:
    root, host, ranks, token_file = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    group = RankGroup(host, 0, gloo_host=host, op_timeout=5, connect_timeout=20, token=load_token(token_file))
    print(f"PORT {group.port}", flush=True)
    eng = Engine.open(root, make_layout(ranks=ranks), 16 << 20, ranks=group.connect(range(ranks), timeout=60))
    if sys.argv[5:] == ["audit"]:
        print("AUDIT " + json.dumps(eng.audit().to_dict()), flush=True)
        os._exit(0)
    for seed, blocks in ACKED:
        assert store_tokens(eng, tokens_for(seed, blocks)).status == "stored"
    print("ACKED", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
