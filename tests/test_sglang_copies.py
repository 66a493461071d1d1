"""The SGLang adapter's own copies of page bytes are plain memcpys (numpy), never
torch's intra-op ops, whose thread pool made a 256 KiB copy take milliseconds on a
busy host."""

from __future__ import annotations

import torch
from sglang_driver import Rank, fetch, page_data, page_keys, query, write_back

from prefixstore.adapters.sglang import gather


def test_gather_puts_the_pages_bytes_end_to_end():
    pages = [torch.arange(i, i + 64 * (i + 1), dtype=torch.int64).remainder(251).to(torch.uint8) for i in range(3)]
    out = gather(pages)
    assert out.dtype == torch.uint8 and out.numel() == sum(p.numel() for p in pages)
    assert out.numpy().tobytes() == b"".join(p.numpy().tobytes() for p in pages)
    assert all(out.data_ptr() != p.data_ptr() for p in pages)  # a new tensor: the pages may be reused


def test_a_write_back_makes_no_torch_concatenation(tmp_path, monkeypatch):
    rk = Rank(str(tmp_path / "c"))
    try:
        keys = page_keys(1, 12)

        def refused(*a, **k):
            raise AssertionError("torch.cat on the write-back path")

        monkeypatch.setattr(torch, "cat", refused)
        assert write_back(rk, [], keys) == len(keys)
        monkeypatch.undo()
        pages, _ = query(rk, [], keys)
        assert pages == len(keys)
        got, rows, _ = fetch(rk, [], keys, pages)
        assert got == len(keys)
        assert all(torch.equal(rows[i], page_data(rk.kv, k, 0)) for i, k in enumerate(keys))
    finally:
        rk.close()
