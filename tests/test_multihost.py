"""Rank servers on separate "hosts": Linux network namespaces on one private bridge
(``tests/netns_hosts.py``), the coordinator (this test's engine) in a namespace of its
own, each rank server a process on its host with its own directory.
"""

from __future__ import annotations

import os
import socket
import subprocess

import pytest
from conftest import assert_restores, make_layout, store_tokens, tokens_for
from netns_hosts import NetnsHosts, netns_leftovers, require_netns

from prefixstore.engine.api import Engine
from prefixstore.gpu.distributed import RankGroup

CAP = 16 << 20


@pytest.fixture
def hosts(tmp_path):
    require_netns()
    h = NetnsHosts(4, str(tmp_path))
    try:
        yield h
    finally:
        h.close()
        assert not netns_leftovers(h)


def group_in(hosts: NetnsHosts, **opts) -> RankGroup:
    return RankGroup(hosts.coord_ip, 0, gloo_host=hosts.coord_ip, **{"op_timeout": 10, "connect_timeout": 20, **opts})


def test_fixture_builds_hosts_and_removes_everything(tmp_path):
    require_netns()
    before = subprocess.run(["ip", "link", "show"], capture_output=True, text=True).stdout
    h = NetnsHosts(2, str(tmp_path))
    try:
        names = netns_leftovers(h)
        assert set(names) == {h.switch, h.coord_ns, *h.host_ns, *h.stranger_nss}
        with h.coordinator():
            group = group_in(h)
            try:
                procs = [h.start_rank(r, group.init_method) for r in range(2)]
                remotes = group.connect(range(2), timeout=60)
                for r, rr in enumerate(remotes):
                    rr.write_shard("a.st", bytes([r]) * 1000)
                    assert rr.read_shard("a.st") == bytes([r]) * 1000
                    assert rr.directory == h.rank_dir(r) and rr.pid != os.getpid()
                    assert h.pids(h.host_ns[r])  # the rank server runs in its host's namespace
                # the coordinator's store is reachable inside the bridge network only
                with socket.create_connection((h.coord_ip, group.port), timeout=5):
                    pass
            finally:
                group.close()
        for p in procs:
            assert p.wait(20) == 0, h.logs()
        # the test's own namespace has no route into the private network
        with pytest.raises(OSError):
            socket.create_connection((h.coord_ip, group.port), timeout=2)
        h.start_rank(0, f"tcp://{h.coord_ip}:1")  # left running: close() kills it
    finally:
        h.close()
    assert not netns_leftovers(h)
    assert subprocess.run(["ip", "link", "show"], capture_output=True, text=True).stdout == before
    assert all(p.poll() is not None for p in h.procs)


def test_four_hosts_store_and_restore(hosts):
    with hosts.coordinator():
        group = group_in(hosts)
        try:
            for r in range(4):
                hosts.start_rank(r, group.init_method)
            remotes = group.connect(range(4), timeout=60)
            a = tokens_for(1, 6)
            with Engine.open(str(hosts.base) + "/cache", make_layout(ranks=4), CAP, ranks=remotes) as eng:
                assert store_tokens(eng, a).status == "stored"
                assert_restores(eng, a, blocks=6)
                rep = eng.audit()
                assert rep.ok, rep.to_dict()
        finally:
            group.close()
