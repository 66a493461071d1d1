"""The SGLang adapter restores KV pages where they sit in the host pool: straight into
the slots (``Engine.restore(into=...)``): one tensor when they lie end to end, else
``Pieces`` over the pool's memory (SGLang's real MHA pools, whose pages are 2 or 2 x
layers pieces, included: ``tests/sglang_mha.py``), and through a staging buffer and one
numpy memcpy per page only when the pieces cannot be proved; never through
``set_from_flat_data_page`` (torch's copy) when the pool's pages are views of its
memory. A page is a hit only after its restore verified; slots outside a call's
destinations are never written."""

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
from prefixstore.adapters import sglang_pages  # noqa: E402
from prefixstore.adapters.sglang_pages import PageSlots  # noqa: E402
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


@pytest.fixture
def any_piece(monkeypatch):
    """Pieces of any size are read in place (the doubles' pages are 128-byte pieces, under
    ``MIN_PIECE_BYTES``)."""
    monkeypatch.setattr(sglang_pages, "MIN_PIECE_BYTES", 0)


def staged_only(monkeypatch) -> None:
    """Every restore through the pool's staging buffer (as for pages that cannot be proved
    to be pieces of the pool's memory)."""
    monkeypatch.setattr(PageSlots, "destination", lambda self, indices: None)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("path", ["in place", "staged"])
def test_scattered_slots_get_exactly_their_pages(tmp_path, monkeypatch, any_piece, layout, path):
    """In place: Pieces over the pool's memory, no staging buffer; staged: one memcpy per
    page from the staging buffer, reused by the next call."""
    rk = drv.Rank(str(tmp_path), kv=pools()[layout])
    seen = []
    real = Engine.restore

    def spy(self, match, *, into=None):
        seen.append(type(into["page"]).__name__)
        return real(self, match, into=into)

    try:
        keys = drv.page_keys(2, 12)
        store(rk, [], keys)
        refuse_torch_copy(monkeypatch, rk.kv)
        monkeypatch.setattr(Engine, "restore", spy)
        if path == "staged":
            staged_only(monkeypatch)
        slots = [4 * s for s in (40, 3, 17, 18, 19, 60, 2, 33, 34, 9, 50, 61)]
        hits = get_into(rk, [], keys, slots)
        assert hits == [True] * 12
        assert problems(rk, keys, slots, hits) == []
        staging = rk.backend.pool(adapter.KV).slots._staging
        moved = slots[6:] + slots[:6]
        again = get_into(rk, [], keys, moved)
        assert again == [True] * 12
        assert problems(rk, keys, moved, again) == []
        if path == "in place":
            assert seen == ["Pieces", "Pieces"] and staging is None
        else:
            assert seen == ["Tensor", "Tensor"] and staging is not None
            assert rk.backend.pool(adapter.KV).slots._staging is staging  # reused
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


@pytest.mark.parametrize(("layout", "contiguous", "staged"), [("page_first", True, False), ("page_first", False, False),
                                                              ("layer_first", False, False), ("layer_first", False, True)])
def test_a_damaged_shard_restored_in_place_is_a_miss_and_the_rest_is_intact(tmp_path, monkeypatch, any_piece,
                                                                            layout, contiguous, staged):
    if staged:
        staged_only(monkeypatch)
    rk, keys, slots, hits = _damaged_fetch(tmp_path, layout, contiguous)
    try:
        assert hits == [True] * 5 + [False] * 7  # the intact parent is served, the damaged child is not
        assert problems(rk, keys, slots, hits) == []
        assert rk.backend.engine_stats()["kv"]["nodes_damaged"] == 1
    finally:
        rk.close()


@pytest.mark.parametrize("path", ["one tensor", "pieces", "staged"])
def test_the_checks_above_catch_an_adapter_that_counts_a_failed_restore(tmp_path, monkeypatch, any_piece, path):
    """A planted adapter bug (pages of a restore that missed reported as hits) is what
    ``problems`` reports, on every path: one tensor over consecutive slots, Pieces over
    scattered ones, the staging buffer."""
    real = adapter._Pool.restore_pages

    def planted(self, m, base, indices):
        got = real(self, m, base, indices)
        return got if got is not None else min(m.blocks - base, len(indices))

    monkeypatch.setattr(adapter._Pool, "restore_pages", planted)
    if path == "staged":
        staged_only(monkeypatch)
    rk, keys, slots, hits = _damaged_fetch(tmp_path, "page_first", path == "one tensor")
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


# ------------------------------------------------- SGLang's real MHATokenToKVPoolHost, in place

HERE = os.path.dirname(os.path.abspath(__file__))
REAL_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """``tests/sglang_mha.py``'s cases over SGLang's real MHA host pools, in a process of
    its own (SGLang's host pool module imports thousands of modules and sets environment
    variables; it also needs the torchvision stand-in)."""
    import json
    import subprocess

    root = tmp_path_factory.mktemp("mha")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(HERE),
                                                                     os.environ.get("PYTHONPATH")]))}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    out = root / "out.json"
    proc = subprocess.run([sys.executable, os.path.join(HERE, "sglang_mha.py"), str(out), str(root)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


# (layout, spans a call of 12 pages is in): layer_first 2 x 3 layers per page, none next to the
# next page's; the other layouts K and V halves, 2 per page
REAL_SPANS = {"layer_first": 72, "page_first": 24, "page_first_direct": 24, "page_head": 24}


@pytest.mark.slow
@pytest.mark.parametrize("layout", REAL_LAYOUTS)
@pytest.mark.parametrize("slots", ["consecutive", "scattered"])
def test_real_mha_pools_are_restored_in_place_bit_for_bit(real, layout, slots):
    got = real[f"{layout}/{slots}"]
    assert got["in_place"]
    assert got["hits"] == [True] * 12
    assert got["problems"] == []  # every page bit for bit, every other slot untouched
    # one restore, into Pieces over the pool's own kv_buffer: no staging buffer, no copy
    assert got["into"] == [{"kind": "pieces", "spans": REAL_SPANS[layout], "pool_memory": True}]
    assert not got["adapter_staging"] and got["engine_staged"] == 0 and got["host_copy_bytes"] == 0
    assert got["generic_pages"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("layout", REAL_LAYOUTS)
def test_real_mha_pools_of_small_pieces_are_staged_bit_for_bit(real, layout):
    """Pieces averaging under MIN_PIECE_BYTES (128 bytes in layer_first here, 384 in the
    others) cost more than the memcpy they save: such a pool is staged, its pages exact."""
    got = real[f"{layout}/small"]
    assert got["hits"] == [True] * 12 and got["problems"] == []
    assert got["into"] == [{"kind": "tensor", "pool_memory": False}] and got["adapter_staging"]
    assert got["generic_pages"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("layout", REAL_LAYOUTS)
def test_a_damaged_shard_restored_into_a_real_mha_pool_is_a_miss_and_the_rest_is_intact(real, layout):
    got = real[f"{layout}/damaged"]
    assert got["hits"] == [True] * 5 + [False] * 7  # the intact parent is served, the damaged child is not
    assert got["problems"] == []
    assert got["damaged_nodes"] == 1
    assert [x["kind"] for x in got["into"]] == ["pieces", "pieces"]  # the child, then the parent alone
    assert not got["adapter_staging"]


@pytest.mark.slow
@pytest.mark.parametrize("plant", ["skip-read-checksum", "counts-a-miss"])
@pytest.mark.parametrize("layout", REAL_LAYOUTS)
def test_the_checks_catch_a_planted_bug_on_the_real_pools_in_place_path(real, plant, layout):
    """The fuzz registry's ``skip-read-checksum`` and an adapter that counts a failed
    restore as a hit, on the Pieces path: both are what ``problems`` reports."""
    got = real[f"{plant}/{layout}"]
    assert got["into"][0]["kind"] == "pieces"
    assert got["hits"] == [True] * 12
    assert any("a hit with other bytes" in p for p in got["problems"])


def test_page_pieces_are_the_views_c_order_memory():
    from prefixstore.adapters.sglang_pages import page_pieces

    buf = torch.zeros((2, 3, 64, 2, 8), dtype=torch.bfloat16)  # layer_first: (k/v, layers, slots, heads, dim)
    v = buf[:, :, 8:12]
    piece, rel = page_pieces(v, v.numel() * 2)
    assert piece == 4 * 2 * 8 * 2
    want = [(kv * buf.stride(0) + layer * buf.stride(1)) * 2 for kv in range(2) for layer in range(3)]
    assert rel.tolist() == want  # C order: K's layers, then V's
    assert torch.equal(torch.cat([buf.view(torch.uint8).reshape(-1)[v.data_ptr() - buf.data_ptr() + r:][:piece]
                                  for r in want]), v.reshape(-1).view(torch.uint8))
    assert page_pieces(v, v.numel() * 2 + 2) is None  # not the page's size
    assert page_pieces(v, v.numel() * 2, max_pieces=5) is None  # too many pieces
    assert page_pieces(buf[0, 0, :4].expand(2, 4, 2, 8), 2 * 4 * 16 * 2) is None  # two pieces on one memory
    assert page_pieces(buf[0, 0, :4, :, ::2], 4 * 2 * 4 * 2) is not None  # one element a piece, still exact


def test_pages_in_small_pieces_are_staged(tmp_path, monkeypatch):
    """The layer_first double's pages are 6 pieces of 128 bytes: under MIN_PIECE_BYTES,
    so restored through the staging buffer, exactly."""
    rk = drv.Rank(str(tmp_path), kv=LayerFirstPool(256, drv.PAGE))
    try:
        keys = drv.page_keys(6, 4)
        store(rk, [], keys)
        refuse_torch_copy(monkeypatch, rk.kv)
        slots = [4 * s for s in (9, 10, 11, 12)]
        assert rk.backend.pool(adapter.KV).slots.destination(slots) is None
        hits = get_into(rk, [], keys, slots)
        assert hits == [True] * 4 and problems(rk, keys, slots, hits) == []
        assert rk.backend.pool(adapter.KV).slots._staging is not None
    finally:
        rk.close()


def test_pages_sharing_memory_are_staged_not_pieces(tmp_path, monkeypatch, any_piece):
    """Host indices naming one page twice (or overlapping pages): the pieces would share
    bytes, so the restore is staged and each slot gets its page."""
    rk = drv.Rank(str(tmp_path), kv=LayerFirstPool(256, drv.PAGE))
    seen = []
    real_restore = Engine.restore

    def spy(self, match, *, into=None):
        seen.append(None if into is None else type(into["page"]).__name__)
        return real_restore(self, match, into=into)

    try:
        keys = drv.page_keys(5, 3)
        store(rk, [], keys)
        monkeypatch.setattr(Engine, "restore", spy)
        assert get_into(rk, [], keys[:2], [40, 40]) == [True, True]
        assert torch.equal(flat(rk.kv, 40), expected(rk.kv, keys[1]))  # the last write wins, as a copy would
        assert seen == ["Tensor"]  # the staging buffer, not Pieces over the pool
        assert rk.backend.pool(adapter.KV).slots._staging is not None
    finally:
        rk.close()
