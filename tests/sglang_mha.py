"""KV restores through the SGLang backend into SGLang's real ``MHATokenToKVPoolHost`` (not a test module).

``python tests/sglang_mha.py OUT.json DIR`` builds, in this process, a real
``MHATokenToKVPool`` on the CPU and over it a real ``MHATokenToKVPoolHost`` per host
layout (``layer_first``, ``page_first``, ``page_first_direct``, ``page_head``), with the
arguments ``tests/sglang_real.py`` passes (``pin_memory=False``: pinning needs
``cudaHostRegister``; the ``torchvision`` stand-in of ``sglang_real``: nothing else
stands in for anything). The backend comes from SGLang's ``StorageBackendFactory``
(``sglang_driver.Rank``). Each case stores pages with ``batch_set_v1`` and reads them
back with ``batch_get_v1`` into host slots, every other slot first filled with
``SENTINEL`` bytes, and writes what came of it to OUT.json: the hits, what the hits got
wrong (``problems``), what each ``Engine.restore`` was given as ``into`` (a tensor,
``Pieces`` over the pool's own memory, or nothing), whether the adapter's staging buffer
was allocated, the engine's staging-pool and host-copy counters, and whether a page went
through ``set_from_flat_data_page``. Then the damaged cases run again under two planted
bugs: the fuzz registry's ``skip-read-checksum`` and the adapter counting the pages of a
restore that missed as read (``planted_restore_pages``).

Run in a process of its own (``tests/test_sglang_in_place.py`` does): SGLang's host pool
module imports its model configs and thousands of modules with them, sets environment
variables and needs the ``torchvision`` stand-in, none of which may leak into the test run.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import sglang_real  # noqa: E402

sglang_real.stand_in_for_torchvision()

import sglang_driver as drv  # noqa: E402
import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402

from prefixstore.adapters import sglang as adapter  # noqa: E402
from prefixstore.base.keys import Prefix  # noqa: E402
from prefixstore.engine.api import Engine  # noqa: E402
from prefixstore.fuzz import plants  # noqa: E402

PAGE, LAYERS, HEADS, DIM = 4, 3, 4, 512  # layer_first: 16 KiB pieces, over MIN_PIECE_BYTES
SMALL = {"heads": 2, "dim": 8}  # 128-byte pieces: staged (MIN_PIECE_BYTES)
DEVICE_TOKENS = 256
SENTINEL = 0x5A
LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]


def host_pool(layout: str, device_tokens: int = DEVICE_TOKENS, page: int = PAGE, layers: int = LAYERS,
              heads: int = HEADS, dim: int = DIM) -> MHATokenToKVPoolHost:
    """SGLang's real MHA host pool over a real CPU device pool (``sglang_real.Scheduler``'s arguments)."""
    kv = MHATokenToKVPool(size=device_tokens, page_size=page, dtype=torch.bfloat16, head_num=heads,
                          head_dim=dim, layer_num=layers, device="cpu", enable_memory_saver=False)
    info = kv.get_device_pool_infos()[0].buffer_info
    return MHATokenToKVPoolHost(info, 2.0, 0, page, layout, pin_memory=False, device_capacity_tokens=kv.size,
                                start_layer=kv.start_layer, end_layer=kv.end_layer,
                                write_back_staging=kv.hicache_write_back_staging)


def flat(host, slot: int) -> torch.Tensor:
    return host.get_data_page(slot, flat=True).view(torch.uint8).clone()


def expected(host, key: str) -> torch.Tensor:
    return sglang_real.page_data(host, key, 0).view(torch.uint8)


def indices(host, slots: list[int]) -> torch.Tensor:
    return torch.tensor([s + t for s in slots for t in range(host.page_size)], dtype=torch.int64)


def store(rk: drv.Rank, prefix: list[str], keys: list[str], slots: list[int]) -> None:
    for k, s in zip(keys, slots, strict=True):
        rk.kv.set_from_flat_data_page(s, sglang_real.page_data(rk.kv, k, 0))
    ok = rk.backend.batch_set_v1(keys, indices(rk.kv, slots), HiCacheStorageExtraInfo(prefix_keys=prefix))
    assert all(ok), ok


def get_into(rk: drv.Rank, keys: list[str], slots: list[int]) -> list[bool]:
    rk.kv.kv_buffer.view(torch.uint8).fill_(SENTINEL)
    return rk.backend.batch_get_v1(keys, indices(rk.kv, slots), HiCacheStorageExtraInfo(prefix_keys=[]))


def problems(host, keys: list[str], slots: list[int], hits: list[bool]) -> list[str]:
    """A hit whose bytes are not the page's, a hit after a miss, a slot outside the call's written."""
    out = []
    for i, (k, s, hit) in enumerate(zip(keys, slots, hits, strict=True)):
        if hit and not torch.equal(flat(host, s), expected(host, k)):
            out.append(f"page {i}: a hit with other bytes")
        if hit and i and not hits[i - 1]:
            out.append(f"page {i}: a hit after a miss")
    dest = set(slots)
    for s in range(0, host.size - host.page_size + 1, host.page_size):
        if s not in dest and not bool((flat(host, s) == SENTINEL).all()):
            out.append(f"slot {s}: outside the destinations, written")
    return out


def damage(root: str, keys: list[str]) -> None:
    """Flip a byte inside the checkpoint that ends at the last of ``keys``."""
    digest = Prefix([adapter.page_digest(k) for k in keys]).keys[-1].hex()
    kv_dir = os.path.join(root, "tp0of1", "kv", "rank0")
    (name,) = [n for n in os.listdir(kv_dir) if n.startswith(digest)]
    path = os.path.join(kv_dir, name)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    data[-3] ^= 0xFF
    with open(path, "wb") as f:
        f.write(bytes(data))


class Watch:
    """What each ``Engine.restore`` got as ``into`` and whether a page took the generic path."""

    def __init__(self, host) -> None:
        self.host, self.into, self.generic = host, [], 0
        real, watch = Engine.restore, self

        def restore(eng, match, *, into=None):
            watch.into.append(watch.describe(into))
            return real(eng, match, into=into)

        Engine.restore = restore
        real_set = host.set_from_flat_data_page

        def set_page(index, data):
            watch.generic += 1
            return real_set(index, data)

        host.set_from_flat_data_page = set_page
        self.undo = lambda: (setattr(Engine, "restore", real), setattr(host, "set_from_flat_data_page", real_set))

    def describe(self, into: Any) -> dict[str, Any]:
        if into is None:
            return {"kind": "none"}
        page = into["page"]
        pool = self.host.kv_buffer.untyped_storage().data_ptr()
        if type(page).__name__ == "Pieces":  # prefixstore.base.destination.Pieces (by name: main has none)
            return {"kind": "pieces", "spans": len(page.spans),
                    "pool_memory": page.memory.untyped_storage().data_ptr() == pool}
        return {"kind": "tensor", "pool_memory": page.untyped_storage().data_ptr() == pool}


def case(root: str, layout: str, name: str) -> dict[str, Any]:
    host = host_pool(layout, **(SMALL if name == "small" else {}))
    rk = drv.Rank(root, kv=host)
    try:
        keys = drv.page_keys(7, 12)
        store_at = [4 * s for s in range(80, 92)]
        if name == "damaged":
            store(rk, [], keys[:5], store_at[:5])  # a checkpoint of pages 0..5
            store(rk, keys[:5], keys[5:], store_at[5:])  # its child: pages 5..12, damaged below
            damage(root, keys)
        else:
            store(rk, [], keys, store_at)
        slots = {"consecutive": [4 * (8 + i) for i in range(12)], "small": [4 * (8 + i) for i in range(12)],
                 "scattered": [4 * s for s in (40, 3, 17, 18, 19, 60, 2, 33, 34, 9, 50, 61)],
                 "damaged": [4 * s for s in range(60, 0, -5)][:12]}[name]
        pool = rk.backend.pool(adapter.KV)
        pool0 = dict(pool.engine.stats()["transfers"]["staging_pool"])
        watch = Watch(host)
        try:
            hits = get_into(rk, keys, slots)
        finally:
            watch.undo()
        copies = pool.engine.stats()["transfers"]["copies"]
        pool1 = pool.engine.stats()["transfers"]["staging_pool"]
        return {"hits": hits, "problems": problems(host, keys, slots, hits), "into": watch.into,
                "generic_pages": watch.generic, "adapter_staging": pool.slots._staging is not None,
                "engine_staged": (pool1["allocs"] - pool0["allocs"]) + (pool1["reuses"] - pool0["reuses"]),
                "host_copy_bytes": copies["host_copy_bytes"], "in_place": pool.slots.in_place,
                "damaged_nodes": rk.backend.engine_stats()["kv"]["nodes_damaged"]}
    finally:
        rk.close()


def planted_restore_pages() -> None:
    """The planted adapter bug: pages of a restore that missed reported as read."""
    real = adapter._Pool.restore_pages

    def planted(self, m, base, indices):
        got = real(self, m, base, indices)
        return got if got is not None else min(m.blocks - base, len(indices))

    adapter._Pool.restore_pages = planted


def main(out: str, root: str) -> None:
    """Every layout's cases; then the damaged ones again under each plant: the fuzz
    registry's ``skip-read-checksum`` (the engine's reads trust the file's own checksum),
    and the adapter counting a missed restore's pages as read."""
    results = {}
    for label, name in [(f"{layout}/{name}", name) for layout in LAYOUTS
                        for name in ("consecutive", "scattered", "damaged", "small")]:
        results[label] = run_case(root, label, name)
    with plants.get("skip-read-checksum").active():
        for layout in LAYOUTS:
            results[f"skip-read-checksum/{layout}"] = run_case(root, f"skip-read-checksum/{layout}/damaged", "damaged")
    planted_restore_pages()
    for layout in LAYOUTS:
        results[f"counts-a-miss/{layout}"] = run_case(root, f"counts-a-miss/{layout}/damaged", "damaged")
    with open(out, "w") as f:
        json.dump(results, f)


def run_case(root: str, label: str, name: str) -> dict[str, Any]:
    d = os.path.join(root, label.replace("/", "-"))
    os.makedirs(d)
    layout = next(x for x in label.split("/") if x in LAYOUTS)
    return case(d, layout, name)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
