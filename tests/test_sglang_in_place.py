"""The SGLang adapter restores KV pages where they sit in the host pool: straight into
the slots (``Engine.restore(into=...)``) when they lie end to end, else through a
staging buffer and one numpy memcpy per page; never through ``set_from_flat_data_page``
(torch's copy) when the pool's pages are views of its memory. A page is a hit only
after its restore verified; slots outside a call's destinations are never written."""

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
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo  # noqa: E402

from prefixstore.adapters import sglang as adapter  # noqa: E402
from prefixstore.base.keys import Prefix  # noqa: E402
from prefixstore.engine.api import Engine  # noqa: E402

SENTINEL = 0x5A


class LayerFirstPool(drv.HostPool):
    """SGLang's MHA ``layer_first`` host layout: ``(k/v, layers, slots, heads, dim)``,
    so one page is 2 x layers pieces of memory, none next to the next page's."""

    def __init__(self, slots: int, page_size: int, layers: int = 3, heads: int = 2, dim: int = 8) -> None:
        self.page_size, self.layout, self.dtype, self.size = page_size, "layer_first", torch.bfloat16, slots
        self.token_shape = (2, layers, heads, dim)  # page_data's shape: only its element count matters here
        self.kv_buffer = torch.zeros((2, layers, slots, heads, dim), dtype=self.dtype)

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, :, int(index): int(index) + self.page_size]
        return page.flatten() if flat else page

    def set_from_flat_data_page(self, index, data_page: torch.Tensor) -> None:
        i, (two, layers, _, heads, dim) = int(index), self.kv_buffer.shape
        self.kv_buffer[:, :, i: i + self.page_size] = data_page.reshape(two, layers, self.page_size, heads, dim)


class CopiedPagesPool(drv.HostPool):
    """A pool whose pages are built anew on every call (as SGLang's Mamba pool's are)."""

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        page = torch.cat([super().get_data_page(index, flat=True)])
        return page if flat else page.view(self.page_size, *self.token_shape)


def pools():
    return {"page_first": drv.kv_pool(256), "layer_first": LayerFirstPool(256, drv.PAGE)}


def flat(pool, index) -> torch.Tensor:
    return pool.get_data_page(index, flat=True).view(torch.uint8).clone()


def expected(pool, key) -> torch.Tensor:
    return drv.page_data(pool, key, 0).flatten().view(torch.uint8)


def store(rk: drv.Rank, prefix: list[str], keys: list[str]) -> None:
    assert drv.write_back(rk, prefix, keys) == len(keys)


def get_into(rk: drv.Rank, prefix: list[str], keys: list[str], slots: list[int]) -> list[bool]:
    """``batch_get_v1`` of ``keys`` into the pages at host ``slots`` (page starts); every
    other slot filled with SENTINEL bytes first."""
    buf = rk.kv.kv_buffer.view(torch.uint8)
    buf.fill_(SENTINEL)
    idx = torch.tensor([s + t for s in slots for t in range(rk.kv.page_size)], dtype=torch.int64)
    return rk.backend.batch_get_v1(keys, idx, HiCacheStorageExtraInfo(prefix_keys=prefix))


def problems(rk: drv.Rank, keys: list[str], slots: list[int], hits: list[bool]) -> list[str]:
    """What a call's outcome got wrong: a hit whose bytes are not the page's, a page
    after a miss reported hit, or a slot outside the destinations that was written."""
    out = []
    for i, (k, s, hit) in enumerate(zip(keys, slots, hits, strict=True)):
        if hit and not torch.equal(flat(rk.kv, s), expected(rk.kv, k)):
            out.append(f"page {i}: a hit with other bytes")
        if hit and i and not hits[i - 1]:
            out.append(f"page {i}: a hit after a miss")
    page = rk.kv.page_size
    dest = {s + t for s in slots for t in range(page)}
    for s in range(0, rk.kv.size, page):
        if s not in dest and not bool((flat(rk.kv, s) == SENTINEL).all()):
            out.append(f"slot {s}: outside the destinations, written")
    return out


def damage(tmp_path, keys: list[str]) -> None:
    """Flip a byte inside the checkpoint that ends at the last of ``keys``."""
    digest = Prefix([adapter.page_digest(k) for k in keys]).keys[-1].hex()
    kv_dir = tmp_path / "tp0of1" / "kv" / "rank0"
    (shard,) = [p for p in kv_dir.iterdir() if p.name.startswith(digest)]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))


def refuse_torch_copy(monkeypatch, pool) -> None:
    def refused(*a, **k):
        raise AssertionError("a restored page went through set_from_flat_data_page")

    monkeypatch.setattr(pool, "set_from_flat_data_page", refused)


def test_end_to_end_slots_are_the_restores_into_tensor(tmp_path, monkeypatch):
    rk = drv.Rank(str(tmp_path), kv=drv.kv_pool(256))
    seen = []
    real = Engine.restore

    def spy(self, match, *, into=None):
        seen.append(None if into is None else into["page"].data_ptr())
        return real(self, match, into=into)

    try:
        keys = drv.page_keys(1, 8)
        store(rk, [], keys)
        monkeypatch.setattr(Engine, "restore", spy)
        refuse_torch_copy(monkeypatch, rk.kv)
        slots = [64 + 4 * i for i in range(8)]
        hits = get_into(rk, [], keys, slots)
        assert hits == [True] * 8
        assert problems(rk, keys, slots, hits) == []
        assert seen == [rk.kv.get_data_page(64, flat=False).data_ptr()]  # read into the slots themselves
    finally:
        rk.close()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_scattered_slots_get_exactly_their_pages_by_memcpy(tmp_path, monkeypatch, layout):
    rk = drv.Rank(str(tmp_path), kv=pools()[layout])
    try:
        keys = drv.page_keys(2, 12)
        store(rk, [], keys)
        refuse_torch_copy(monkeypatch, rk.kv)
        slots = [4 * s for s in (40, 3, 17, 18, 19, 60, 2, 33, 34, 9, 50, 61)]
        hits = get_into(rk, [], keys, slots)
        assert hits == [True] * 12
        assert problems(rk, keys, slots, hits) == []
        moved = slots[6:] + slots[:6]
        again = get_into(rk, [], keys, moved)  # the staging buffer reused
        assert again == [True] * 12
        assert problems(rk, keys, moved, again) == []
    finally:
        rk.close()


def _damaged_fetch(tmp_path, layout: str, contiguous: bool):
    rk = drv.Rank(str(tmp_path), kv=pools()[layout])
    keys = drv.page_keys(3, 12)
    store(rk, [], keys[:5])  # a checkpoint of pages 0..5
    store(rk, keys[:5], keys[5:])  # its child: pages 5..12
    damage(tmp_path, keys)
    slots = [4 * (8 + i) for i in range(12)] if contiguous else [4 * s for s in range(60, 0, -5)][:12]
    return rk, keys, slots, get_into(rk, [], keys, slots)


@pytest.mark.parametrize(("layout", "contiguous"), [("page_first", True), ("page_first", False),
                                                    ("layer_first", False)])
def test_a_damaged_shard_restored_in_place_is_a_miss_and_the_rest_is_intact(tmp_path, layout, contiguous):
    rk, keys, slots, hits = _damaged_fetch(tmp_path, layout, contiguous)
    try:
        assert hits == [True] * 5 + [False] * 7  # the intact parent is served, the damaged child is not
        assert problems(rk, keys, slots, hits) == []
        assert rk.backend.engine_stats()["kv"]["nodes_damaged"] == 1
    finally:
        rk.close()


@pytest.mark.parametrize("contiguous", [True, False])
def test_the_checks_above_catch_an_adapter_that_counts_a_failed_restore(tmp_path, monkeypatch, contiguous):
    """A planted adapter bug (pages of a restore that missed reported as hits) is what
    ``problems`` reports, for the in-place and the staged path alike."""
    real = adapter._Pool.restore_pages

    def planted(self, m, base, indices):
        got = real(self, m, base, indices)
        return got if got is not None else min(m.blocks - base, len(indices))

    monkeypatch.setattr(adapter._Pool, "restore_pages", planted)
    rk, keys, slots, hits = _damaged_fetch(tmp_path, "page_first", contiguous)
    try:
        assert hits == [True] * 12
        assert any("a hit with other bytes" in p for p in problems(rk, keys, slots, hits))
    finally:
        rk.close()


def test_only_pools_whose_pages_are_views_of_their_memory_are_written_in_place():
    from prefixstore.adapters.sglang_pages import views_pool_memory

    for pool in pools().values():
        n = pool.get_dummy_flat_data_page().numel() * 2
        assert views_pool_memory(pool, n)
        assert not views_pool_memory(pool, n + 2)  # a page of another size: not this pool's pages
    copied = CopiedPagesPool(64, drv.PAGE, (2, 2, 2, 8))
    assert not views_pool_memory(copied, copied.get_dummy_flat_data_page().numel() * 2)


def test_a_pool_of_copied_pages_still_round_trips(tmp_path):
    rk = drv.Rank(str(tmp_path), kv=CopiedPagesPool(256, drv.PAGE, (2, 2, 2, 8)))
    try:
        assert not rk.backend.pool(adapter.KV).slots.in_place
        keys = drv.page_keys(4, 6)
        store(rk, [], keys)
        slots = [4 * s for s in (9, 1, 30, 31, 2, 50)]
        hits = get_into(rk, [], keys, slots)
        assert hits == [True] * 6
        assert problems(rk, keys, slots, hits) == []
    finally:
        rk.close()
