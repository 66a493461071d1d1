"""Which nodes a read-only engine holds out: those an unfinished transaction touches."""

from __future__ import annotations

from prefixstore.engine.readonly import touched

K1, K2, K3 = b"\x01" * 16, b"\x02" * 16, b"\x03" * 16
KEYS = {K1: 1, K2: 2, K3: 3}


def test_a_store_touches_the_row_it_refills_or_publishes_not_its_parent():
    journal = [(7, "store", "INTENT", {"key": K2.hex(), "node": None, "parent": 1}),
               (8, "store", "PUBLISHED", {"key": "ff" * 16, "node": 3, "parent": 2})]
    assert touched(journal, [], KEYS) == {2, 3}


def test_an_evict_or_replace_touches_every_row_it_removes_or_writes():
    journal = [(1, "evict", "INTENT", {"nodes": [4, 5]}),
               (2, "compact", "INTENT", {"old": [1], "parent": 2, "new": [{"key": K3.hex()}]})]
    assert touched(journal, [], KEYS) == {1, 3, 4, 5}


def test_file_rows_held_by_a_transaction_name_their_nodes_and_junk_is_ignored():
    journal = [(1, "store", "INTENT", {"key": "not hex", "node": True, "nodes": "x", "new": [3]}),
               (2, "evict", "INTENT", ["not", "a", "dict"]), (3, "compact", "INTENT", {"new": 5})]
    assert touched(journal, [6, None, 6], KEYS) == {6}
