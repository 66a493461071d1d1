"""A coordinator process for tests/test_rank_processes.py (not a test module).

    python tests/rank_coordinator.py ROOT RANKS KILL_BEFORE_COMMIT

Hosts a RankGroup on a free port (printed as ``PORT n``), waits for RANKS rank
processes, opens the engine at ROOT with them, acknowledges two stores (printed as
``ACKED``), then starts a third store and SIGKILLs itself just before the catalog
commit named KILL_BEFORE_COMMIT (e.g. ``store.publish``): every rank has then made
its shard durable, and only recovery can tell what to do with those files.
"""

from __future__ import annotations

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conftest import make_layout, store_tokens, tokens_for  # noqa: E402

from prefixstore.engine.api import Engine  # noqa: E402
from prefixstore.gpu.distributed import RankGroup  # noqa: E402
from prefixstore.gpu.fileio import FaultHook  # noqa: E402

CAP = 16 << 20


class KillBeforeCommit(FaultHook):
    def __init__(self, label: str) -> None:
        self.label, self.armed = label, False

    def before(self, op: str, target: str, rank: int | None) -> None:
        if self.armed and op == "commit" and target == self.label:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    root, ranks, label = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    group = RankGroup(op_timeout=20, connect_timeout=30, gloo_host="127.0.0.1")
    print(f"PORT {group.port}", flush=True)
    remotes = group.connect(range(ranks), timeout=60)
    hook = KillBeforeCommit(label)
    eng = Engine.open(root, make_layout(ranks=ranks), CAP, hook=hook, ranks=remotes)
    a = tokens_for(21, 6)
    for t in (a[:8], tokens_for(22, 3)):
        assert store_tokens(eng, t).status == "stored"
    print("ACKED", flush=True)
    hook.armed = True
    store_tokens(eng, a)
    print("NOT KILLED", flush=True)
    sys.exit(3)


if __name__ == "__main__":
    main()
