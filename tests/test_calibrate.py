"""gpu/calibrate.py on its own: the bandwidth option, given a stored value, without an engine."""

from __future__ import annotations

import json
import os

import pytest

from prefixstore.base.errors import InvalidInputError
from prefixstore.gpu import calibrate
from prefixstore.gpu.executor import CpuExecutor


def _resolve(bandwidth, stored, root, kind="disk"):
    return calibrate.resolve(bandwidth, stored, executor=CpuExecutor(), backing_kind=kind, root=str(root))


def _no_probe(*a, **k):
    raise AssertionError("probed")


def test_measure_probes_once_then_uses_the_stored_value(tmp_path, monkeypatch):
    got = _resolve("measure", None, tmp_path)
    assert got.value["source"] == "measured" and got.value["bytes_per_s"] > 0
    assert got.value["read_bytes_per_s"] > 0 and os.listdir(tmp_path) == []  # probe file removed
    stored = json.loads(got.to_store)
    assert stored == {k: v for k, v in got.value.items() if k != "source"}

    monkeypatch.setattr(calibrate, "probe", _no_probe)
    again = _resolve("measure", got.to_store, tmp_path)
    assert again.value == {**stored, "source": "cached"} and again.to_store is None


def test_a_stored_value_for_another_backing_or_unreadable_is_measured_anew(tmp_path):
    first = _resolve("measure", None, tmp_path)
    other = _resolve("measure", first.to_store, tmp_path, kind="memory")
    assert other.value["source"] == "measured" and other.value["read_bytes_per_s"] is None
    assert json.loads(other.to_store)["key"].startswith("memory|")
    for bad in ("not json", "[]", json.dumps({"bytes_per_s": -1}), json.dumps({"bytes_per_s": "x"})):
        assert _resolve("measure", bad, tmp_path).value["source"] == "measured"
    assert _resolve("remeasure", first.to_store, tmp_path).value["source"] == "measured"


def test_configured_none_and_bad_values(tmp_path, monkeypatch):
    monkeypatch.setattr(calibrate, "probe", _no_probe)
    assert _resolve(None, "ignored", tmp_path) == calibrate.Calibration(None)
    got = _resolve(2e9, None, tmp_path)
    assert got.value == {"source": "configured", "bytes_per_s": 2e9} and got.to_store is None
    for bad in (-1, 0, float("nan"), float("inf"), "fast", True, [1]):
        with pytest.raises(InvalidInputError, match="bandwidth"):
            _resolve(bad, None, tmp_path)
