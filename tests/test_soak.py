"""The SIGKILL soak, CI-sized: 240 kills (120 on 1 rank, 120 on 4 ranks) of a working
engine process, each followed by a read-only audit and, every other time, recovery,
a full audit and a bit-exact restore of every acknowledged store. Zero violations and
zero lost acknowledged stores; and a planted bug (a rank that acknowledges a write
before doing it) is reported. The soak runs in its own process (it forks children)."""

from __future__ import annotations

import json
import subprocess
import sys


def _soak(tmp_path, *args: str) -> dict:
    cmd = [sys.executable, "-m", "prefixstore.fuzz.soak", "--dir", str(tmp_path), "--json", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    assert lines, proc.stderr[-3000:]
    return {"rc": proc.returncode, **json.loads(lines[-1])}


def test_240_sigkills_lose_no_acknowledged_store(tmp_path, capsys):
    # a slow disk (2 ms per effect) makes random kills land inside transactions on any machine
    st = _soak(tmp_path, "--kills", "240", "--max-delay", "0.2", "--seed", "11", "--effect-delay-ms", "2")
    with capsys.disabled():
        print(f"\nsoak: {st['kills']} SIGKILLs {st['kills_by_ranks']} in {st['seconds']} s; "
              f"unfinished transactions at kill: {st['unfinished_at_kill']} {st['unfinished_kinds']}; "
              f"acknowledged stores {st['acked_stores']}, checks {st['acked_checks']}, restores verified "
              f"{st['restores_verified']}; lost {st['lost']}; violations {len(st['violations'])}")
    assert st["violations"] == [] and st["lost"] == 0 and st["rc"] == 0
    assert st["kills"] >= 200 and set(st["kills_by_ranks"]) == {"1", "4"}
    assert st["acked_stores"] > 200 and st["restores_verified"] > 200
    assert st["unfinished_at_kill"] > 10  # kills did land inside transactions
    assert st["rolled_back"] + st["rolled_forward"] > 0


def test_soak_reports_a_write_acknowledged_before_it_happens(tmp_path):
    st = _soak(tmp_path, "--kills", "16", "--ranks", "1", "--plant", "lazy-write", "--seed", "3")
    assert st["rc"] == 1 and st["violations"]
    assert any("missing" in v or "restores only" in v or "damaged" in v for v in st["violations"])
