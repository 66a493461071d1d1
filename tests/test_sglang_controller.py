"""The SGLang backend under SGLang's real HiCache controller, on 1 and 2 ranks, in both
prefix-key modes, with --enable-metrics, against SGLang's own ``file`` backend.

Each rank is a process running ``tests/sglang_real.py`` (it says what it builds and the
two things that stand in for CUDA-only parts: a ``torchvision`` stand-in module and an
unpinned host buffer). The launch flags go through SGLang's own parser; the controller's
storage threads make every call to the backend; two ranks reduce their hits with the
controller's own MIN over a gloo group on loopback. The scenario (``scenario`` there):
sequence A backed up as a node of 100 pages and its child of 200 (two 128-page batches),
rank 0 also 300..340; sequence B only from page 50 (its parent never backed up); then
prefetches after a host-resident prefix, after B's unstored parent, and from the start.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip(
    "sglang.srt.mem_cache.storage.backend_factory",
    reason="sglang is not installed (pip install --no-deps sglang==0.5.23; .ci/run does)",
)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MODES = ["prefix_keys", "no_prefix_keys"]
pytestmark = pytest.mark.slow  # each rank process imports SGLang's scheduler stack (~30 s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(root, size: int) -> list[dict]:
    """Start ``size`` rank processes over ``root``; their results, rank by rank."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    # An earlier test's sglang or vllm import may have set this in our process: prometheus_client
    # would then keep the harness's metrics in files shared by every collector of the run.
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    port = free_port()
    procs = []
    for r in range(size):
        out = root / f"rank{r}.json"
        log = open(root / f"rank{r}.log", "w")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen([sys.executable, os.path.join(HERE, "sglang_real.py"), str(out),
                                        str(root / "cache"), str(r), str(size), str(port)],
                                       stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env), out, log))
    results = []
    try:
        for r, (proc, out, log) in enumerate(procs):
            rc = proc.wait(timeout=600)
            log.close()
            assert rc == 0, (root / f"rank{r}.log").read_text()[-3000:]
            results.append(json.loads(out.read_text()))
    finally:
        for proc, _, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    return results


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return run_ranks(tmp_path_factory.mktemp("one_rank"), 1)[0]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_ranks(tmp_path_factory.mktemp("two_ranks"), 2)


def prefixstore(result: dict, mode: str) -> dict:
    run = result[f"prefixstore-{mode}"]
    assert "attach_error" not in run and "error" not in run, run
    assert run["backend_type"] == "PrefixStoreHiCache"
    return run


def test_file_storage_path_beside_the_extra_config_attaches(one_rank):
    # with prefix keys the flags carry --file-storage-path, which SGLang adds to extra_config
    run = prefixstore(one_rank, "prefix_keys")
    assert run["acked_tokens"] == [400, 800, 160, 400]


@pytest.mark.parametrize("mode", MODES)
def test_enable_metrics_logs_the_backends_stats_through_sglangs_collector(one_rank, mode):
    m = prefixstore(one_rank, mode)["metrics"]
    assert "error" not in m, m  # log_storage_metrics asserts it is handed a StorageMetrics
    # one observation per KV call: backups 100 | 128 + 72 | 40 | 100 pages, and reads of
    # 128 + 112 (A after its host prefix), 100 (B), 128 + 128 + 84 (A from the start)
    assert (m["backup_pgs_count"], m["backup_pgs_sum"]) == (5, 440)
    assert (m["prefetch_pgs_count"], m["prefetch_pgs_sum"]) == (6, 680)
    assert m["backup_bandwidth_count"] == 5 and m["backup_bandwidth_sum"] > 0
    assert m["prefetch_bandwidth_count"] == 6 and m["prefetch_bandwidth_sum"] > 0


@pytest.mark.parametrize("mode", MODES)
def test_hits_match_sglangs_file_backend_page_for_page(one_rank, mode):
    ours, theirs = prefixstore(one_rank, mode), one_rank[f"file-{mode}"]
    assert "error" not in theirs and theirs["backend_type"] == "HiCacheFile"
    for request, pages in (("after_host_prefix", 240), ("unstored_parent", 100), ("from_start", 340)):
        assert theirs[request] == {"hit_pages": pages, "loaded_pages": pages, "wrong_pages": 0}
        assert ours[request] == theirs[request], request
    assert ours["acked_tokens"] == theirs["acked_tokens"]


@pytest.mark.parametrize("mode", MODES)
def test_a_restarted_backend_finds_what_was_stored(one_rank, mode):
    assert prefixstore(one_rank, mode)["after_restart"] == {"hit_pages": 240, "loaded_pages": 240, "wrong_pages": 0}


@pytest.mark.parametrize("mode", MODES)
def test_two_ranks_agree_on_the_pages_both_hold(two_ranks, mode):
    runs = [prefixstore(r, mode) for r in two_ranks]
    assert runs[0]["acked_tokens"] == [400, 800, 160, 400]  # rank 0 alone holds A's 300..340
    assert runs[1]["acked_tokens"] == [400, 800, 400]
    for run in runs:  # the controller's MIN: both ranks load exactly what both hold
        assert run["after_host_prefix"] == {"hit_pages": 200, "loaded_pages": 200, "wrong_pages": 0}
        assert run["from_start"] == {"hit_pages": 300, "loaded_pages": 300, "wrong_pages": 0}
        assert run["unstored_parent"] == {"hit_pages": 100, "loaded_pages": 100, "wrong_pages": 0}
        assert run["after_restart"] == run["after_host_prefix"]
        assert "error" not in run["metrics"] and run["metrics"]["prefetch_pgs_sum"] == 600
