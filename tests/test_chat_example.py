"""examples/chat.py --model NAME runs a hybrid and a sliding-window model end to end:
each later turn restores the conversation so far and prefills only the new tokens."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
TURN = re.compile(r"turn (\d+): prompt +(\d+) tokens \| restored +(\d+) \| prefilled +(\d+)")


@pytest.mark.parametrize(("model", "layers"), [("zamba2", "recurrent states"), ("gemma2", "sliding(24)")])
def test_chat_restores_each_turn(model: str, layers: str, tmp_path: Path) -> None:
    cmd = [sys.executable, "examples/chat.py", "--model", model, "--turns", "3", "--ranks", "2",
           "--reply-tokens", "20", "--dir", str(tmp_path)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's prefixstore
    out = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=True
    )
    assert layers in out.stdout
    turns = [tuple(map(int, m)) for m in TURN.findall(out.stdout)]
    assert [t[0] for t in turns] == [0, 1, 2]
    assert turns[0][2] == 0  # nothing stored yet
    for _, prompt, restored, prefilled in turns[1:]:
        assert restored > 0 and restored + prefilled == prompt
