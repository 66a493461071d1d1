"""Every public call of the SGLang backend, handed bad input: a typed InvalidInputError
naming the argument, and nothing stored, changed or lost (a table of probes)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip(
    "sglang.srt.mem_cache.storage.backend_factory",
    reason="sglang is not installed (pip install --no-deps sglang==0.5.23; .ci/run does)",
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sglang_driver as drv  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)

from prefixstore.base.errors import InvalidInputError  # noqa: E402

STORED = drv.page_keys(40, 4)  # written before the probes; must read back unchanged after
NEW = drv.page_keys(41, 3)  # what the probes try to store; must stay absent
SLOTS = 4096  # the KV host pool's slots (drv.kv_pool)


def page(rk, key=NEW[0]):
    return drv.page_data(rk.kv, key, 0).flatten()


def info(prefix=()):
    return HiCacheStorageExtraInfo(prefix_keys=list(prefix))


def slots(n_pages, first=0):
    return torch.arange(first, first + n_pages * drv.PAGE, dtype=torch.int64)


def mamba(keys, indices, policy=PoolHitPolicy.TRAILING_PAGES, name=PoolName.MAMBA):
    return PoolTransfer(name=name, host_indices=indices, keys=keys, hit_policy=policy)


PROBES = [
    # legacy batch_set / set
    ("batch_set values None", lambda b, rk: b.batch_set(NEW, [None] * 3), r"values\[0\]"),
    ("batch_set fewer values", lambda b, rk: b.batch_set(NEW, [page(rk)] * 2), r"values: need one page per key"),
    ("batch_set half a page", lambda b, rk: b.batch_set(NEW[:1], [page(rk)[:128]]), r"values\[0\]: one page"),
    ("batch_set wrong dtype", lambda b, rk: b.batch_set(NEW[:1], [page(rk).float()]), r"values\[0\]: the pool's pages"),
    ("batch_set 2 pages + empty", lambda b, rk: b.batch_set(NEW[:2], [torch.cat([page(rk)] * 2), page(rk)[:0]]),
     r"values\[0\]: one page"),
    ("batch_set values a tensor", lambda b, rk: b.batch_set(NEW[:1], page(rk)), r"values: need a list"),
    ("batch_set keys a str", lambda b, rk: b.batch_set("abc", [page(rk)] * 3), r"keys: need a list"),
    ("batch_set key not a str", lambda b, rk: b.batch_set([NEW[0], 7], [page(rk)] * 2), r"keys\[1\]"),
    ("batch_set key twice", lambda b, rk: b.batch_set([NEW[0], NEW[0]], [page(rk)] * 2), r"keys: .*twice"),
    ("set value None", lambda b, rk: b.set(NEW[0], None), r"value: need a tensor"),
    ("set half a page", lambda b, rk: b.set(NEW[0], page(rk)[:128]), r"value: one page"),
    ("set key not a str", lambda b, rk: b.set(5, page(rk)), r"key: "),
    # legacy batch_get / get / exists
    ("batch_get fewer targets", lambda b, rk: b.batch_get(STORED, [page(rk)] * 3), r"target_locations: need one page"),
    ("batch_get target dtype", lambda b, rk: b.batch_get(STORED[:1], [page(rk).float()]),
     r"target_locations\[0\]: the pool's pages"),
    ("batch_get target size", lambda b, rk: b.batch_get(STORED[:1], [page(rk)[:10]]), r"target_locations\[0\]: one page"),
    ("batch_get target not a tensor", lambda b, rk: b.batch_get(STORED[:1], ["x"]), r"target_locations\[0\]"),
    ("batch_get keys a str", lambda b, rk: b.batch_get("abcd"), r"keys: need a list"),
    ("get target dtype", lambda b, rk: b.get(STORED[0], page(rk).float()), r"target_location: the pool's pages"),
    ("get key None", lambda b, rk: b.get(None), r"key: "),
    ("exists key None", lambda b, rk: b.exists(None), r"key: "),
    ("exists key bytes", lambda b, rk: b.exists(b"k"), r"key: "),
    # batch_exists
    ("batch_exists keys a str", lambda b, rk: b.batch_exists("abc"), r"keys: need a list"),
    ("batch_exists empty key", lambda b, rk: b.batch_exists([""]), r"keys\[0\]"),
    ("batch_exists extra_info a dict", lambda b, rk: b.batch_exists(STORED, {"prefix_keys": []}), r"extra_info: "),
    ("batch_exists prefix_keys ints", lambda b, rk: b.batch_exists(STORED, info([1, 2])),
     r"extra_info.prefix_keys\[0\]"),
    ("batch_exists prefix_keys a str", lambda b, rk: b.batch_exists(STORED, HiCacheStorageExtraInfo("abc")),
     r"extra_info.prefix_keys: need a list"),
    # batch_set_v1 / batch_get_v1
    ("batch_set_v1 index past the pool", lambda b, rk: b.batch_set_v1(NEW, slots(3, SLOTS - 8), info()),
     r"host_indices: .*slots 0..4095"),
    ("batch_set_v1 negative index", lambda b, rk: b.batch_set_v1(NEW, slots(3, -4), info()), r"host_indices"),
    ("batch_set_v1 float indices", lambda b, rk: b.batch_set_v1(NEW, slots(3).float(), info()),
     r"host_indices: need an integer tensor"),
    ("batch_set_v1 fewer indices", lambda b, rk: b.batch_set_v1(NEW, slots(2), info()), r"host_indices: .*needs 12"),
    ("batch_set_v1 indices a list", lambda b, rk: b.batch_set_v1(NEW, list(range(12)), info()),
     r"host_indices: need an integer tensor"),
    ("batch_set_v1 keys a str", lambda b, rk: b.batch_set_v1("abc", slots(3), info()), r"keys: need a list"),
    ("batch_set_v1 prefix overlaps keys", lambda b, rk: b.batch_set_v1(NEW, slots(3), info(NEW[:1])),
     r"extra_info.prefix_keys: .*both"),
    ("batch_get_v1 index past the pool", lambda b, rk: b.batch_get_v1(STORED, slots(4, SLOTS), info()),
     r"host_indices"),
    ("batch_get_v1 fewer indices", lambda b, rk: b.batch_get_v1(STORED, slots(3), info()), r"host_indices"),
    ("batch_get_v1 keys None", lambda b, rk: b.batch_get_v1(None, slots(4), info()), r"keys: need a list"),
    # v2
    ("batch_exists_v2 transfers a dict", lambda b, rk: b.batch_exists_v2(STORED, {"mamba": 1}, info()),
     r"pool_transfers: need a list"),
    ("batch_exists_v2 unknown pool", lambda b, rk: b.batch_exists_v2(STORED, [mamba(STORED[-1:], None, name="swa")],
                                                                     info()), r"pool_transfers\[0\].name"),
    ("batch_exists_v2 bad policy", lambda b, rk: b.batch_exists_v2(STORED, [mamba(STORED[-1:], None, policy="some")],
                                                                   info()), r"pool_transfers\[0\].hit_policy"),
    ("batch_exists_v2 keys a str", lambda b, rk: b.batch_exists_v2(STORED, [mamba("abc", None)], info()),
     r"pool_transfers\[0\].keys: need a list"),
    ("batch_set_v2 index past the pool", lambda b, rk: b.batch_set_v2([mamba(NEW[-1:], torch.tensor([64]))], info()),
     r"host_indices: pool 'mamba'"),
    ("batch_set_v2 keys a str", lambda b, rk: b.batch_set_v2([mamba("abc", torch.tensor([0, 1, 2]))], info()),
     r"transfers\[0\].keys: need a list"),
    ("batch_set_v2 transfers a dict", lambda b, rk: b.batch_set_v2({"mamba": 1}, info()), r"transfers: need a list"),
    ("batch_set_v2 good then bad", lambda b, rk: b.batch_set_v2(
        [mamba(NEW[-1:], torch.tensor([0])), mamba(NEW[:1], torch.tensor([0, 1]))], info()), r"host_indices"),
    ("batch_get_v2 fewer indices", lambda b, rk: b.batch_get_v2([mamba(STORED[-2:], torch.tensor([0]))], info()),
     r"host_indices: pool 'mamba' needs 2"),
    # registration
    ("register_mem_pool_host None", lambda b, rk: b.register_mem_pool_host(None), r"mem_pool_host: need a host pool"),
    ("register_mem_host_pool_v2 bad name", lambda b, rk: b.register_mem_host_pool_v2(rk.mamba, 3), r"host_pool_name"),
    ("register_mem_host_pool_v2 not a pool", lambda b, rk: b.register_mem_host_pool_v2(object(), PoolName.MAMBA),
     r"host_pool: need a host pool"),
]


def disk(root) -> dict[str, int]:
    """Every file under the cache and its size."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            if not f.startswith("catalog.sqlite"):  # the catalog's own files change with every read
                out[os.path.join(d, f)] = os.path.getsize(os.path.join(d, f))
    return out


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    root = tmp_path_factory.mktemp("probes")
    rk = drv.Rank(str(root), hybrid=True)
    assert drv.write_back(rk, [], STORED, state_at_end=True) == 4
    yield root, rk
    rk.close()


@pytest.mark.parametrize(("call", "match"), [p[1:] for p in PROBES], ids=[p[0] for p in PROBES])
def test_bad_input_is_a_typed_error_naming_the_argument_and_stores_nothing(stored, call, match):
    root, rk = stored
    before = disk(root), rk.backend.engine_stats()["kv"]["nodes"], rk.backend.engine_stats()["mamba"]["nodes"]
    with pytest.raises(InvalidInputError, match=match):
        call(rk.backend, rk)
    assert (disk(root), rk.backend.engine_stats()["kv"]["nodes"],
            rk.backend.engine_stats()["mamba"]["nodes"]) == before
    assert rk.backend.batch_exists(NEW) == 0 and not rk.backend.exists(NEW[-1])
    assert drv.query(rk, [], STORED) == (4, {4})
    got, rows, state = drv.fetch(rk, [], STORED, 4)
    assert got == 4 and all(torch.equal(r, drv.page_data(rk.kv, k, 0)) for r, k in zip(rows, STORED, strict=True))
    assert torch.equal(state, drv.page_data(rk.mamba, STORED[-1], 0))


def test_the_probe_table_covers_every_public_call():
    named = {p[0].split()[0] for p in PROBES}
    assert named >= {"batch_set", "set", "batch_get", "get", "exists", "batch_exists", "batch_set_v1",
                     "batch_get_v1", "batch_exists_v2", "batch_set_v2", "batch_get_v2",
                     "register_mem_pool_host", "register_mem_host_pool_v2"}
    assert len(PROBES) >= 43
