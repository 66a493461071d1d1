"""A coordinator that SIGKILLs itself at one effect of a multi-host store, for
tests/test_multihost_crash.py (not a test module).

    python tests/netns_crash_coordinator.py ROOT HOST RANKS TOKEN_FILE store|merge|recover [KILL_AT]

Hosts a RankGroup at HOST (printed as ``PORT n``), waits for RANKS rank servers, opens
the engine at ROOT with them and acknowledges ``ACKED`` (two stores). Then, with its
effect points armed, it stores ``TARGET`` (a child of the first acknowledged store;
``RESULT status`` once it returns) and ``FOLLOW_UP`` (``FOLLOW_UP status``). With
``merge`` it acknowledges ``CONV``'s checkpoints at blocks 3, 6, 9, 12 and ``OTHER``
instead, retires the snapshots at 3, 6 and 9, and runs a compaction pass armed: one
compact-replace merging the chain into one row (``RESULT merges=n``). With ``recover``
the points are armed before the open: the recovery of what ROOT holds (``RESULT
recovered`` once the open returned). The coordinator's effects are its
catalog commits, the syncs of the catalog's log (group commit) and the requests that change a rank (``write_shard``, ``remove``,
``remove_temp``, ``quarantine``, ``sync_dir``), each a point before it is sent and one
after its answer came back. KILL_AT names one point as JSON ``[when, op, target, rank,
k]`` (its k-th occurrence, from 0: a point is named, not numbered, because the ranks
are written in parallel and their points interleave differently from run to run); the
process SIGKILLs itself there. Without KILL_AT it runs to the end and prints ``POINTS
[...]`` (when, op, target, rank of each, in the order seen) and ``ACKED_AT n`` (points
before the result of TARGET's store).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conftest import BT, FOLLOW_UP, make_layout, node_at, store_tokens, tokens_for  # noqa: E402

from prefixstore.engine import replace  # noqa: E402
from prefixstore.engine.api import Engine  # noqa: E402
from prefixstore.fuzz.faultfs import CountingHook  # noqa: E402
from prefixstore.gpu.distributed import RankGroup, RemoteRank  # noqa: E402
from prefixstore.gpu.rank_auth import load_token  # noqa: E402
from prefixstore.statemachine.compaction import CompactionPolicy  # noqa: E402

CAP = 16 << 20
A = tokens_for(51, 6)
ACKED = [(A[:8], 2), (tokens_for(52, 3), 3)]
TARGET = A
CONV, OTHER = tokens_for(53, 12), tokens_for(54, 4)
CHECKPOINTS = (3, 6, 9, 12)
RANK_EFFECTS = ("write_shard", "remove", "remove_temp", "quarantine", "sync_dir")


class KillAt(CountingHook):
    """Records effect points while ``armed``; SIGKILLs this process at the point
    ``spec`` names (None: never)."""

    def __init__(self, spec: list | None) -> None:
        super().__init__()
        self.spec = None if spec is None else (tuple(spec[:4]), spec[4])
        self.armed = False
        self._lock = threading.Lock()

    def _point(self, when: str, op: str, target: str, rank: int | None) -> None:
        if not self.armed:
            return
        with self._lock:
            point = (when, op, target, rank)
            if self.spec is not None and self.spec == (point, self.points.count(point)):
                print(f"KILLED AT {json.dumps([*point, self.spec[1]])}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            super()._point(when, op, target, rank)


def hook_rank_requests(hook: KillAt) -> None:
    """Report each request that changes a rank to ``hook``, before and after it."""
    for op in RANK_EFFECTS:
        def wrap(real, op=op):
            @functools.wraps(real)
            def call(self, *args):
                target = str(args[0]) if args else ""
                hook.before(op, target, self.rank)
                out = real(self, *args)
                hook.after(op, target, self.rank)
                return out
            return call
        setattr(RemoteRank, op, wrap(getattr(RemoteRank, op)))


def store(eng: Engine, hook: KillAt) -> int:
    for t, _ in ACKED:
        assert store_tokens(eng, t).status == "stored"
    print("ACKED", flush=True)
    hook.armed = True
    res = store_tokens(eng, TARGET)
    print(f"RESULT {res.status}", flush=True)
    acked_at = hook.count
    print(f"FOLLOW_UP {store_tokens(eng, FOLLOW_UP).status}", flush=True)
    return acked_at


def merge(eng: Engine, hook: KillAt) -> int:
    for b in CHECKPOINTS:
        assert store_tokens(eng, CONV[: b * BT]).status == "stored"
    assert store_tokens(eng, OTHER).status == "stored"
    with eng.guard.lock:
        for b in CHECKPOINTS[:-1]:
            assert replace.retire_snapshot(eng.flows.replacing, node_at(eng, CONV[: b * BT]))
    print("ACKED", flush=True)
    hook.armed = True
    print(f"RESULT merges={eng.compact(CompactionPolicy()).merges}", flush=True)
    return hook.count


def recovered(eng: Engine, hook: KillAt) -> int:
    print("RESULT recovered", flush=True)
    return hook.count


def main() -> None:
    root, host, ranks, token_file, scenario = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
    hook = KillAt(json.loads(sys.argv[6]) if sys.argv[6:] else None)
    hook_rank_requests(hook)
    group = RankGroup(host, 0, gloo_host=host, op_timeout=10, connect_timeout=20, token=load_token(token_file))
    print(f"PORT {group.port}", flush=True)
    hook.armed = scenario == "recover"
    eng = Engine.open(root, make_layout(ranks=ranks), CAP, hook=hook, ranks=group.connect(range(ranks), timeout=60))
    acked_at = {"store": store, "merge": merge, "recover": recovered}[scenario](eng, hook)
    hook.armed = False
    print("POINTS " + json.dumps(hook.points), flush=True)
    print(f"ACKED_AT {acked_at}", flush=True)
    eng.close()
    group.close()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
