"""32 concurrent callers: stores, lookups and restores from many threads at once."""

from __future__ import annotations

import threading

from conftest import assert_restores, make_layout, store_tokens, tokens_for

from prefixstore.engine.api import Engine


def test_32_threads_store_lookup_restore(cache_dir):
    L = make_layout(ranks=2)
    shared = tokens_for(1000, 2)
    convs = [shared + tokens_for(2000 + i, 6) for i in range(32)]
    errors: list[BaseException] = []
    acked: list[list[int]] = []
    lock = threading.Lock()
    with Engine.open(cache_dir, L, 64 << 20) as eng:
        barrier = threading.Barrier(32)

        def worker(i: int) -> None:
            try:
                barrier.wait()
                toks = convs[i]
                for b in (2, 4, 6, 8):
                    r = store_tokens(eng, toks[: b * 4])
                    assert r.status in ("stored", "duplicate"), r
                    if r.ok:
                        with lock:
                            acked.append(toks[: b * 4])
                    if r.ok:
                        assert_restores(eng, toks[: b * 4])
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[:3]
        assert len(acked) == 32 * 4
        for toks in acked:
            assert_restores(eng, toks, blocks=len(toks) // 4)
        rep = eng.audit()
        assert rep.ok, rep.to_dict()
    with Engine.open(cache_dir, L, 64 << 20) as eng:
        for toks in acked:
            assert_restores(eng, toks, blocks=len(toks) // 4)
