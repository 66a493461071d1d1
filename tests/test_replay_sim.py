"""Trace parsing, capacity specs, the block-tree simulator, its policies and the optimum."""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from prefixstore.base.errors import InvalidInputError
from prefixstore.replay.optimal import belady, belady_hits, exact_optimum, next_uses
from prefixstore.replay.sim import (
    POLICIES,
    CompiledTrace,
    LeafLRU,
    Policy,
    PrefixStorePolicy,
    compile_trace,
    default_prefill_s,
    evaluate,
    simulate,
)
from prefixstore.replay.trace import (
    CapacitySpecError,
    Request,
    TraceFormatError,
    load_trace,
    parse_capacity,
    parse_request,
    unique_blocks,
    unique_bytes,
)

TRACE = (
    Path(__file__).resolve().parents[1].parent
    / "shared"
    / "traces"
    / "mooncake_conversation_trace.jsonl"
)
BT = 512


def full(*chains: Sequence[int]) -> CompiledTrace:
    """A trace of id chains whose inputs fill every block (no partial last block)."""
    return compile_trace([list(c) for c in chains])


def req(ids: Sequence[int], input_length: int | None = None, ts: int = 0) -> Request:
    return Request(ts, input_length if input_length is not None else len(ids) * BT, 1, tuple(ids))


# ----------------------------------------------------------------------------------
# Trace parsing


def line(**kw: object) -> str:
    rec: dict[str, object] = {
        "timestamp": 0,
        "input_length": 1000,
        "output_length": 5,
        "hash_ids": [0, 1],
    }
    rec.update(kw)
    return json.dumps({k: v for k, v in rec.items() if v is not ...})


def test_parse_good_lines(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(
        line(timestamp=0, input_length=1024, hash_ids=[0, 1])
        + "\n\n   \n"
        + line(timestamp=3000, input_length=1025, hash_ids=[0, 1, 7], extra="ignored")
        + "\n"
        + line(timestamp=6000.0, input_length=1, hash_ids=[9])  # no trailing newline
    )
    reqs = load_trace(p)
    assert reqs == [
        Request(0, 1024, 5, (0, 1)),
        Request(3000, 1025, 5, (0, 1, 7)),
        Request(6000, 1, 5, (9,)),
    ]
    assert isinstance(reqs[2].timestamp_ms, int)
    assert reqs[1].blocks == 3
    assert load_trace(p, limit=2) == reqs[:2]
    assert load_trace(p, limit=0) == []
    assert load_trace(p, limit=10) == reqs
    with pytest.raises(InvalidInputError):
        load_trace(p, limit=-1)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('"x"', "JSON object"),
        (line(timestamp=...), "missing field 'timestamp'"),
        (line(input_length=...), "missing field 'input_length'"),
        (line(output_length=...), "missing field 'output_length'"),
        (line(hash_ids=...), "missing field 'hash_ids'"),
        (line(timestamp=-1), "'timestamp' must be >= 0"),
        (line(timestamp="0"), "'timestamp' must be an integer"),
        (line(timestamp=1.5), "'timestamp' must be an integer"),
        (line(input_length=0, hash_ids=[]), "'input_length' must be >= 1"),
        (line(input_length=True), "'input_length' must be an integer"),
        (line(output_length=-3), "'output_length' must be >= 0"),
        (line(hash_ids=[]), "non-empty list"),
        (line(hash_ids="0,1"), "non-empty list"),
        (line(hash_ids=[0, -1]), "hash_ids[1]"),
        (line(hash_ids=[0, 1.0]), "hash_ids[1]"),
        (line(hash_ids=[0, None]), "hash_ids[1]"),
        (line(hash_ids=[0, True]), "hash_ids[1]"),
        (line(input_length=1025, hash_ids=[0, 1]), "expected ceil(1025/512) = 3"),
        (line(input_length=100, hash_ids=[0, 1]), "expected ceil(100/512) = 1"),
    ],
)
def test_parse_malformed_line(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(TraceFormatError, match=None) as info:
        parse_request(text, 7)
    assert needle in str(info.value)
    assert info.value.lineno == 7
    # Through a file: the error names the path and the line number (blank lines count).
    p = tmp_path / "bad.jsonl"
    p.write_text(line() + "\n\n" + text + "\n" + line() + "\n")
    with pytest.raises(TraceFormatError) as info2:
        load_trace(p)
    assert info2.value.lineno == 3
    assert str(info2.value).startswith(f"{p}:3: ")
    # A limit that stops before the bad line reads fine.
    assert len(load_trace(p, limit=1)) == 1


def test_parse_non_utf8_and_unchecked_block_count(tmp_path: Path) -> None:
    p = tmp_path / "bin.jsonl"
    p.write_bytes(line().encode() + b"\n" + b'{"timestamp": \xff\xfe}\n')
    with pytest.raises(TraceFormatError, match="UTF-8") as info:
        load_trace(p)
    assert info.value.lineno == 2
    r = parse_request(line(input_length=5000, hash_ids=[1]), check_block_count=False)
    assert r.hash_ids == (1,)
    assert parse_request(line(input_length=64, hash_ids=[0, 1]), block_tokens=32).blocks == 2


def test_unique_blocks_are_chain_positions() -> None:
    reqs = [req([0, 1, 2]), req([0, 1, 3]), req([5, 1])]  # id 1 under two parents
    # nodes: 0, 0/1, 0/1/2, 0/1/3, 5, 5/1
    assert unique_blocks(reqs) == 6
    assert unique_bytes(reqs, 10) == 60
    assert compile_trace(reqs).n_nodes == 6


# ----------------------------------------------------------------------------------
# Capacity specs


@pytest.mark.parametrize(
    ("spec", "total", "want"),
    [
        ("64GiB", None, 64 * 2**30),
        ("64 gib", None, 64 * 2**30),
        ("1.5KiB", None, 1536),
        ("2MiB", None, 2 * 2**20),
        ("3TiB", None, 3 * 2**40),
        ("1GB", None, 10**9),
        ("1.5 MB", None, 1_500_000),
        ("2k", None, 2048),
        ("2G", None, 2 * 2**30),
        (" 4096 ", None, 4096),
        ("4096B", None, 4096),
        ("0", None, 0),
        (4096, None, 4096),
        (0, None, 0),
        ("10%", 1000, 100),
        ("5%", 182790 * 7, 182790 * 7 * 5 // 100),
        ("12.5%", 80, 10),
        ("150%", 10, 15),
        ("0.1%", 999, 0),
        ("10%", 0, 0),
    ],
)
def test_parse_capacity(spec: str | int, total: int | None, want: int) -> None:
    assert parse_capacity(spec, total) == want


@pytest.mark.parametrize(
    ("spec", "total"),
    [
        ("", None),
        ("abc", None),
        ("-5", None),
        ("5XB", None),
        ("5 G i B", None),
        ("%", 100),
        ("10%", None),
        ("10%", -1),
        ("1e9", None),
        ("GiB", None),
        ("1.2.3", None),
        (True, None),
        (-1, None),
        (1.5, None),
        (None, None),
    ],
)
def test_parse_capacity_rejects_junk(spec: object, total: int | None) -> None:
    with pytest.raises(CapacitySpecError):
        parse_capacity(spec, total)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------
# Simulator accounting on hand-made traces


def test_leaf_lru_by_hand() -> None:
    # capacity 4 blocks. r0 stores 1,2,3; r1 hits 1,2 and stores 4; r2 hits 1 and
    # evicts leaf 3 (leaves 3@r0, 4@r1) for 5; r3 hits 1,2 and evicts leaf 4 for 3.
    reqs = [req([1, 2, 3]), req([1, 2, 4]), req([1, 5]), req([1, 2, 3], input_length=1300)]
    r = simulate(reqs, 4, "leaf-lru", block_bytes=1, check=True)
    assert r.hits == (0, 2, 1, 2)
    assert (r.blocks_hit, r.blocks_total) == (5, 11)
    assert (r.stored, r.evicted, r.skipped_admission, r.skipped_no_room) == (6, 2, 0, 0)
    assert r.tokens_total == 2 * 1536 + 1024 + 1300
    assert r.tokens_hit == 1024 + 512 + 1024
    assert r.hit_ratio_blocks == pytest.approx(5 / 11)
    assert r.hit_ratio_tokens == pytest.approx(2560 / 5396)
    assert r.prefill_s_saved == pytest.approx(2 * default_prefill_s(1024) + default_prefill_s(512))
    assert r.prefill_s_total == pytest.approx(
        2 * default_prefill_s(1536) + default_prefill_s(1024) + default_prefill_s(1300)
    )
    # The same cache, one block larger, keeps everything: r3 is a full hit capped at 1300 tokens.
    r5 = simulate(reqs, 5, "leaf-lru", block_bytes=1)
    assert r5.hits == (0, 2, 1, 3)
    assert r5.tokens_hit == 1024 + 512 + 1300


def test_token_cap_and_custom_prefill_curve() -> None:
    reqs = [req([1, 2], input_length=700), req([1, 2], input_length=700)]
    r = simulate(reqs, 10, "leaf-lru", block_bytes=1, prefill_s=float)
    assert r.hits == (0, 2)
    assert r.tokens_hit == 700  # capped at input_length, not 2 * 512
    assert r.prefill_s_saved == 700.0 and r.prefill_s_total == 1400.0
    assert default_prefill_s(0) == 0.0
    assert default_prefill_s(1000) == pytest.approx(5e-5 * 1000 + 1e-10 * 1000**2)


def test_plain_lru_drops_descendants_leaf_lru_keeps_prefix() -> None:
    # capacity 3: r1's block 4 needs room. LRU's oldest block is the root 1 (touched
    # root to leaf), so 1, 2, 3 all go; leaf-lru evicts only the leaf 3. r2 = [1, 2].
    trace = full([1, 2, 3], [4], [1, 2])
    lru = simulate(trace, 3, "lru", block_bytes=1, check=True)
    assert lru.hits == (0, 0, 0)
    assert lru.evicted == 3  # the whole subtree; r2 then fits beside 4
    leaf = simulate(trace, 3, "leaf-lru", block_bytes=1, check=True)
    assert leaf.hits == (0, 0, 2)
    assert leaf.evicted == 1


def test_request_longer_than_capacity_is_stored_up_to_capacity() -> None:
    trace = full([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [9])
    r = simulate(trace, 3, "leaf-lru", block_bytes=1, check=True)
    # r0 stores 1,2,3 then finds only its own (pinned) path: 4 and 5 are skipped.
    assert r.hits == (0, 3, 0)
    assert r.skipped_no_room == 2 + 2 + 0
    assert r.stored == 3 + 1  # r2's 9 replaces leaf 3; r1 stored nothing new
    assert simulate(trace, 0, "leaf-lru", block_bytes=1).hits == (0, 0, 0)
    for name in POLICIES:
        simulate(trace, 3, name, block_bytes=1, check=True)


def test_capacity_in_bytes_rounds_down_to_blocks() -> None:
    trace = full([1, 2], [1, 2])
    assert simulate(trace, 2 * 100 - 1, "leaf-lru", block_bytes=100).hits == (0, 1)
    r = simulate(trace, 200, "leaf-lru", block_bytes=100)
    assert r.hits == (0, 2) and r.capacity_blocks == 2
    with pytest.raises(InvalidInputError):
        simulate(trace, 10, "leaf-lru", block_bytes=0)
    with pytest.raises(InvalidInputError):
        simulate(trace, -1, "leaf-lru", block_bytes=1)
    with pytest.raises(InvalidInputError):
        simulate(trace, 10, "no-such-policy", block_bytes=1)


def test_prefixstore_skips_partial_last_block() -> None:
    reqs = [req([1, 2, 3], input_length=1300), req([1, 2, 3], input_length=1300)]
    r = simulate(reqs, 10, "prefixstore", block_bytes=1, check=True)
    assert r.hits == (0, 2)
    assert r.skipped_admission == 2  # block 3, twice
    assert r.tokens_hit == 1024
    aligned = [req([1, 2, 3]), req([1, 2, 3])]
    assert simulate(aligned, 10, "prefixstore", block_bytes=1).hits == (0, 3)


def test_prefixstore_keeps_reused_blocks_longer_than_recency_alone() -> None:
    # capacity 3. [1,2] is used twice, then 3 arrives (more recent), then 4 needs room:
    # leaf-lru evicts leaf 2 (oldest), prefixstore evicts 3 (seen once; 2 earned a
    # retention bonus of R * log2(2)), so the next [1, 2] is a full hit.
    trace = full([1, 2], [1, 2], [3], [4], [1, 2])
    assert simulate(trace, 3, "leaf-lru", block_bytes=1).hits == (0, 2, 0, 0, 1)
    ps = simulate(trace, 3, "prefixstore", block_bytes=1, check=True)
    assert ps.hits == (0, 2, 0, 0, 2)
    theta0 = simulate(trace, 3, PrefixStorePolicy(theta=0), block_bytes=1)
    assert theta0.hits == (0, 2, 0, 0, 1)


def test_prefixstore_ghost_remembers_evicted_blocks() -> None:
    # capacity 2. 1 is evicted by 3, comes back (a miss; the ghost restores its count,
    # now 2) and is stored again; 4 evicts 3; then 5 needs room: leaf-lru evicts 1
    # (older than 4), prefixstore evicts 4 (seen once), so the last [1] hits.
    trace = full([1], [2], [3], [1], [4], [5], [1])
    assert simulate(trace, 2, "leaf-lru", block_bytes=1).hits == (0,) * 7
    ps = simulate(trace, 2, "prefixstore", block_bytes=1, check=True)
    assert ps.hits == (0,) * 6 + (1,)
    # A ghost of one key still remembers 1 here; the degenerate size runs.
    simulate(trace, 2, PrefixStorePolicy(ghost_factor=0), block_bytes=1, check=True)


def test_prefixstore_admission_window() -> None:
    # Window 1: once the cache is full, a never-seen block 1+ places past the hit is
    # skipped (reason 'admission'); blocks seen before are always admitted.
    trace = full([1, 2, 3], [4, 5, 6], [4, 5, 6])
    r = simulate(trace, 3, PrefixStorePolicy(admit_window=1), block_bytes=1, check=True)
    # r0 fills the cache (the window applies only when full). r1 evicts 3 for 4, then
    # skips 5 and 6. r2 hits 4; 5 is in the window, 6 was seen: both stored.
    assert r.skipped_admission == 2
    assert r.hits == (0, 0, 1)
    assert simulate(trace, 3, "prefixstore", block_bytes=1).hits == (0, 0, 3)
    with pytest.raises(InvalidInputError):
        PrefixStorePolicy(admit_window=-1)
    with pytest.raises(InvalidInputError):
        PrefixStorePolicy(gate_alpha=0)
    with pytest.raises(InvalidInputError):
        PrefixStorePolicy(retention_alpha=0)


def test_prefixstore_auto_admission_gate() -> None:
    # gate_alpha=1: F becomes 1 on a hit and 0 on a returning miss. capacity 3, window
    # max(1, 0.001 * 3) = 1. r2's block 3 comes back from the ghost: F = 0, so r3 (full
    # cache) stores only its first new block. r4 hits 5 and 6, 7 return: admitted.
    trace = full([1, 2, 3], [4], [1, 2, 3], [5, 6, 7], [5, 6, 7])
    pol = PrefixStorePolicy(gate_alpha=1.0)
    r = simulate(trace, 3, pol, block_bytes=1, check=True)
    assert r.hits == (0, 0, 2, 0, 1)
    assert r.skipped_admission == 2
    assert pol.reuse_hit_fraction == 0.0
    off = simulate(trace, 3, PrefixStorePolicy(auto_admission=False), block_bytes=1)
    assert off.hits == (0, 0, 2, 0, 3) and off.skipped_admission == 0
    # The default (slow) gate stays open on a trace this short.
    assert simulate(trace, 3, "prefixstore", block_bytes=1).skipped_admission == 0


class FIFO(Policy):
    """A plug-in policy: evict the oldest inserted leaf."""

    name = "fifo-leaf"

    def bind(self, state):  # type: ignore[no-untyped-def]
        super().bind(state)
        self.order: list[int] = []

    def on_insert(self, node: int) -> None:
        self.order.append(node)

    def choose_victim(self) -> int | None:
        for node in self.order:
            if self.state.is_leaf(node) and not self.state.is_pinned(node):
                return node
        return None

    def on_evict(self, node: int) -> None:
        self.order.remove(node)


class Stubborn(Policy):
    """Offers the request's own pinned leaf: the simulator must refuse it."""

    name = "stubborn"

    def bind(self, state):  # type: ignore[no-untyped-def]
        super().bind(state)
        self.last: int | None = None

    def on_insert(self, node: int) -> None:
        self.last = node

    def choose_victim(self) -> int | None:
        return self.last


def test_plugin_policies() -> None:
    trace = full([1, 2], [1, 3], [1, 2], [4])
    fifo = simulate(trace, 3, FIFO(), block_bytes=1, check=True)
    # r2 hits 1, 2; r3: FIFO leaf order 2 (inserted first), 3 -> 2 goes.
    assert fifo.hits == (0, 1, 2, 0)
    assert fifo.policy == "fifo-leaf"
    stub = simulate(full([1, 2, 3], [1, 2, 3]), 2, Stubborn(), block_bytes=1, check=True)
    assert stub.hits == (0, 2) and stub.skipped_no_room == 1 + 1


def test_random_traces_keep_the_tree_whole() -> None:
    rng = random.Random(11)
    for _ in range(20):
        chains = random_chains(rng, n_requests=40, max_new=4)
        trace = compile_trace(chains)
        for cap in (1, 3, 8):
            for name in POLICIES:
                simulate(trace, cap, name, block_bytes=1, check=True)
            for pol in (PrefixStorePolicy(admit_window=1), PrefixStorePolicy(gate_alpha=0.5)):
                simulate(trace, cap, pol, block_bytes=1, check=True)


# ----------------------------------------------------------------------------------
# The optimum


def brute_force_max_hits(trace: CompiledTrace, capacity: int) -> int:
    """Every choice sequence, block by block: for each missing block of a request,
    stop storing, or store it (evicting any unpinned leaf first when full)."""
    parent = trace.parent
    paths = trace.paths

    def leaves(cache: frozenset[int]) -> list[int]:
        inner = {parent[x] for x in cache}
        return [x for x in cache if x not in inner]

    @functools.cache
    def serve(r: int, cache: frozenset[int]) -> int:
        if r == len(paths):
            return 0
        path = paths[r]
        h = 0
        while h < len(path) and path[h] in cache:
            h += 1
        return h + store(r, h, cache)

    @functools.cache
    def store(r: int, i: int, cache: frozenset[int]) -> int:
        path = paths[r]
        best = serve(r + 1, cache)  # stop storing here
        if i == len(path):
            return best
        node = path[i]
        assert parent[node] < 0 or parent[node] in cache
        if len(cache) < capacity:
            best = max(best, store(r, i + 1, cache | {node}))
        else:
            pinned = set(path[:i])
            for v in leaves(cache):
                if v not in pinned:
                    best = max(best, store(r, i + 1, (cache - {v}) | {node}))
        return best

    return serve(0, frozenset())


def random_chains(rng: random.Random, n_requests: int, max_new: int) -> list[list[int]]:
    """Requests that extend a random prefix of an earlier request by fresh ids."""
    chains: list[list[int]] = []
    fresh = 0
    for _ in range(n_requests):
        if chains and rng.random() < 0.75:
            base = rng.choice(chains)
            prefix = base[: rng.randint(1, len(base))]
        else:
            prefix = []
        new = []
        for _ in range(rng.randint(0 if prefix else 1, max_new)):
            fresh += 1
            new.append(fresh)
        chains.append(prefix + new)
    return chains


HAND_MADE = [
    # (chains, capacity, optimal block hits)
    ([[1, 2], [3], [1, 2]], 2, 2),  # bypass 3: LRU would lose [1, 2]
    ([[1, 2, 3], [1, 4], [1, 2, 3], [1, 4]], 3, 1 + 3 + 1),  # keep 1,2,3; bypass 4
    ([[1], [2], [3], [1], [2], [3]], 2, 2),
    ([[1, 2], [1, 3], [1, 2], [1, 3]], 2, 1 + 2 + 1),
]


@pytest.mark.parametrize(("chains", "cap", "want"), HAND_MADE)
def test_optimum_hand_made(chains: list[list[int]], cap: int, want: int) -> None:
    trace = compile_trace(chains)
    assert sum(belady_hits(trace, cap)[0]) == want
    assert exact_optimum(trace, cap) == want
    assert brute_force_max_hits(trace, cap) == want


def test_optimum_matches_brute_force_on_random_small_traces() -> None:
    rng = random.Random(20240607)
    cases = beaten = 0
    for _ in range(200):
        chains = random_chains(rng, n_requests=rng.randint(4, 8), max_new=3)
        trace = compile_trace(chains)
        for cap in range(0, 5):
            want = brute_force_max_hits(trace, cap)
            got = belady(trace, cap, block_bytes=1)
            assert got.blocks_hit == want, (chains, cap)
            assert exact_optimum(trace, cap) == want, (chains, cap)
            online = max(simulate(trace, cap, n, block_bytes=1).blocks_hit for n in POLICIES)
            assert online <= want
            beaten += online < want
            cases += 1
    assert cases == 1000
    assert beaten >= 50  # the traces are hard enough that future knowledge matters


def test_optimum_with_repeated_ids_under_different_parents() -> None:
    chains = [[7, 7, 7], [7, 8], [8, 7], [7, 7], [8, 7, 7], [7, 8]]
    trace = compile_trace(chains)
    for cap in range(0, 5):
        assert sum(belady_hits(trace, cap)[0]) == brute_force_max_hits(trace, cap)


def test_optimum_dominates_online_policies_on_larger_random_traces() -> None:
    rng = random.Random(5)
    for _ in range(5):
        trace = compile_trace(random_chains(rng, n_requests=300, max_new=6))
        for cap in (5, 20, 60):
            opt = belady(trace, cap, block_bytes=1)
            assert opt.policy == "optimal"
            for name in POLICIES:
                assert simulate(trace, cap, name, block_bytes=1).blocks_hit <= opt.blocks_hit
            assert simulate(trace, cap, "optimal", block_bytes=1).hits == opt.hits


def test_next_uses_and_exact_optimum_limits() -> None:
    trace = full([1, 2], [1, 3], [1, 2])
    # flattened: r0 = (0, 1), r1 = (2, 3), r2 = (4, 5); never = 7 + depth
    assert next_uses(trace) == [[2, 5], [4, 7 + 1], [7 + 0, 7 + 1]]
    big = compile_trace(random_chains(random.Random(1), n_requests=30, max_new=4))
    with pytest.raises(InvalidInputError):
        exact_optimum(big, 6, max_states=50)
    with pytest.raises(InvalidInputError):
        belady_hits(trace, -1)
    with pytest.raises(InvalidInputError):
        exact_optimum(trace, -1)


# ----------------------------------------------------------------------------------
# The real trace


@pytest.fixture(scope="module")
def mooncake() -> CompiledTrace:
    if not TRACE.exists():
        pytest.skip(f"Mooncake trace not found at {TRACE} (expected shared/ beside the repo)")
    return compile_trace(load_trace(TRACE))


def test_mooncake_trace_shape(mooncake: CompiledTrace) -> None:
    assert mooncake.n_requests == 12_031
    assert mooncake.n_nodes == 182_790
    assert mooncake.n_refs == 288_500
    # An unbounded cache hits every block seen before: 36.6% (the trace README).
    r = simulate(mooncake, mooncake.n_nodes, "leaf-lru", block_bytes=1)
    assert r.blocks_hit == 288_500 - 182_790
    assert round(r.hit_ratio_tokens, 3) == 0.374


def test_mooncake_policy_order_at_10_percent(mooncake: CompiledTrace) -> None:
    bb = 1 << 20
    cap = parse_capacity("10%", mooncake.unique_bytes(bb))
    res = {name: simulate(mooncake, cap, name, block_bytes=bb) for name in (*POLICIES, "optimal")}
    opt, ps, leaf, lru = res["optimal"], res["prefixstore"], res["leaf-lru"], res["lru"]
    assert opt.blocks_hit >= ps.blocks_hit >= max(leaf.blocks_hit, lru.blocks_hit)
    assert opt.tokens_hit >= ps.tokens_hit >= leaf.tokens_hit
    # Measured: optimal 0.366, prefixstore 0.297, leaf-lru 0.279, lru 0.278.
    assert ps.hit_ratio_blocks >= leaf.hit_ratio_blocks + 0.01
    assert ps.prefill_s_saved > leaf.prefill_s_saved > 0
    assert ps.blocks_hit >= 0.78 * opt.blocks_hit


def test_evaluate_runs_each_policy_at_each_fraction() -> None:
    trace = full([1, 2], [1, 2], [3], [1, 2])
    rows = evaluate(trace, (0.5, 1.0), ("leaf-lru", PrefixStorePolicy, "optimal"), block_bytes=1)
    assert [(f, r.policy, r.capacity_blocks) for f, r in rows] == [
        (0.5, "leaf-lru", 1),
        (0.5, "prefixstore", 1),
        (0.5, "optimal", 1),
        (1.0, "leaf-lru", 3),
        (1.0, "prefixstore", 3),
        (1.0, "optimal", 3),
    ]
    assert [r.blocks_hit for _, r in rows[3:]] == [4, 4, 4]
    with pytest.raises(InvalidInputError):
        evaluate(trace, (-0.1,))


def test_policies_are_fresh_per_run() -> None:
    trace = full([1, 2], [1, 2])
    pol = LeafLRU()
    assert simulate(trace, 2, pol, block_bytes=1).hits == (0, 2)
    assert simulate(trace, 2, LeafLRU(), block_bytes=1).hits == (0, 2)
