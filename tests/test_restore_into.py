"""Restores read each shard once, into its final place: the caller's tensors
(``restore(match, into=...)``) or the outputs the engine allocates, verified as the
bytes land (every byte of the file hashed, the header checked); bad ``into`` tensors
are refused with a typed error before anything is read or written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import BT, make_layout, seg_tensors, snap_tensors, store_tokens, tokens_for

from prefixstore.base.destination import Pieces
from prefixstore.base.errors import DtypeError, InvalidInputError, ShapeError
from prefixstore.base.keys import Prefix
from prefixstore.engine.api import Engine
from prefixstore.fuzz.faultfs import flip_bit
from prefixstore.gpu import shards, verify
from prefixstore.gpu.ranks import LocalRank

CAP = 16 << 20
SENTINEL = -7.0


def outputs(L, rows: int, fill: float = SENTINEL) -> list[dict[str, torch.Tensor]]:
    return [{s.name: torch.full((rows, *s.shape), fill, dtype=s.torch_dtype) for s in L.segments}
            for _ in range(L.ranks)]


def shard_paths(root: str) -> list[str]:
    return sorted(os.path.join(dp, f) for dp, _, fs in os.walk(root) for f in fs if f.endswith(".st"))


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("snapshot", [False, True])
def test_restore_into_fills_the_callers_tensors_and_returns_them(tmp_path, ranks, snapshot):
    L = make_layout(ranks=ranks, snapshot=snapshot)
    toks = tokens_for(1, 8)
    with Engine.open(str(tmp_path / "c"), L, CAP) as eng:
        assert store_tokens(eng, toks[: 3 * BT]).ok and store_tokens(eng, toks).ok  # two nodes
        for gpu_blocks in (0, 2, 3, 5):  # rows the GPU holds are not restored
            m = eng.lookup(Prefix.from_tokens(toks, BT), gpu_blocks=gpu_blocks)
            into = outputs(L, m.tokens - m.gpu_tokens)
            r = eng.restore(m, into=into)
            assert r is not None
            want = seg_tensors(L, toks)
            for k in range(ranks):
                for name, t in into[k].items():
                    assert r.segments[k][name] is t
                    assert torch.equal(t, want[k][name][m.gpu_tokens : m.tokens]), (gpu_blocks, k, name)
            if snapshot:
                ws = snap_tensors(L, toks)
                assert all(torch.equal(r.snapshot[k]["state"], ws[k]["state"]) for k in range(ranks))


def test_a_restore_reads_each_shard_once_into_its_output_without_staging(tmp_path):
    """No staging buffer and no host copy: the file's bytes land in the output."""
    L = make_layout(ranks=2)
    toks = tokens_for(2, 6)
    with Engine.open(str(tmp_path / "c"), L, CAP) as eng:
        assert store_tokens(eng, toks[: 2 * BT]).ok and store_tokens(eng, toks).ok
        m = eng.lookup(Prefix.from_tokens(toks, BT))
        pool0 = eng.stats()["transfers"]["staging_pool"]
        c0 = eng.stats()["transfers"]["copies"]
        for into in (None, outputs(L, m.tokens)):
            r = eng.restore(m, into=into)
            want = seg_tensors(L, toks)
            assert all(torch.equal(r.segments[k][n], want[k][n]) for k in range(2) for n in ("k", "v"))
        pool1 = eng.stats()["transfers"]["staging_pool"]
        c1 = eng.stats()["transfers"]["copies"]
        assert (pool1["allocs"], pool1["reuses"]) == (pool0["allocs"], pool0["reuses"])  # nothing staged
        assert c1["host_copy_bytes"] == c0["host_copy_bytes"] == 0
        files = sum(s for (s,) in eng.catalog.query("SELECT size FROM files WHERE status='live'"))
        assert c1["tier_read_bytes"] - c0["tier_read_bytes"] == 2 * files  # each file read once a restore


@pytest.mark.parametrize("bad", ["shape", "dtype", "rows", "ranks", "names", "strided", "overlap", "not tensors"])
def test_bad_into_is_a_typed_error_and_nothing_is_written_or_read(tmp_path, bad):
    L = make_layout(ranks=2, snapshot=False)
    toks = tokens_for(3, 4)
    with Engine.open(str(tmp_path / "c"), L, CAP) as eng:
        assert store_tokens(eng, toks).ok
        m = eng.lookup(Prefix.from_tokens(toks, BT))
        into = outputs(L, m.tokens)
        expect: type[Exception] = ShapeError
        if bad == "shape":
            into[1]["v"] = torch.full((m.tokens, 3, 2), SENTINEL, dtype=torch.bfloat16)
        elif bad == "dtype":
            into[0]["k"] = torch.full((m.tokens, 2, 3), SENTINEL, dtype=torch.float32)
            expect = DtypeError
        elif bad == "rows":
            into[0]["k"] = torch.full((m.tokens + BT, 2, 3), SENTINEL, dtype=torch.bfloat16)
        elif bad == "ranks":
            into = into[:1]
            expect = InvalidInputError
        elif bad == "names":
            into[1]["w"] = into[1].pop("v")
        elif bad == "strided":
            into[0]["v"] = torch.full((m.tokens, 3, 2), SENTINEL, dtype=torch.bfloat16).transpose(1, 2)
        elif bad == "overlap":
            into[1]["k"] = into[0]["k"]
            expect = InvalidInputError
        else:
            into = [["k", "v"], ["k", "v"]]
            expect = InvalidInputError
        c0 = eng.stats()["transfers"]["copies"]["tier_read_bytes"]
        with pytest.raises(expect):
            eng.restore(m, into=into)
        assert eng.stats()["transfers"]["copies"]["tier_read_bytes"] == c0  # nothing read
        for per in into:
            for t in per.values() if isinstance(per, dict) else ():
                assert bool((t.float() == SENTINEL).all())  # nothing written
        assert eng.restore(m) is not None  # the engine is unharmed


def one_shard(tmp_path, seed: int):
    """A cache in ``tmp_path/c`` holding one stored request of 4 blocks (no snapshot):
    its layout, tokens, root and the one shard file."""
    L = make_layout(snapshot=False)
    toks = tokens_for(seed, 4)
    root = str(tmp_path / "c")
    with Engine.open(root, L, CAP) as eng:
        assert store_tokens(eng, toks).ok
    (path,) = shard_paths(root)
    return L, toks, root, path


@pytest.mark.parametrize("where", ["header", "restored rows", "rows the GPU holds", "last byte"])
def test_a_damaged_byte_anywhere_in_the_file_is_a_miss_even_where_nothing_is_kept(tmp_path, where):
    """Bytes the restore does not keep (rows the GPU holds) are hashed too."""
    L, toks, root, path = one_shard(tmp_path, 4)
    data = Path(path).read_bytes()
    start = 8 + int.from_bytes(data[:8], "little")
    row = L.payload_bytes(1, False)  # bytes per token row
    offset = {"header": 20, "restored rows": start + 3 * BT * (row // 2),
              "rows the GPU holds": start + 1, "last byte": len(data) - 1}[where]
    flip_bit(path, offset)
    with Engine.open(root, L, CAP) as eng:
        m = eng.lookup(Prefix.from_tokens(toks, BT), gpu_blocks=2)
        assert m.hit
        assert eng.restore(m, into=outputs(L, m.tokens - m.gpu_tokens)) is None
        assert eng.counters.snapshot().get("lookups.damaged_on_restore") == 1


def test_a_placed_read_judges_a_shard_as_the_staged_read_does(tmp_path):
    """``verify.read_placed`` and ``verify.read`` (staged) give the same outcome and
    the same reason for each kind of damage."""
    L = make_layout(snapshot=False)
    toks = tokens_for(5, 2)
    root = str(tmp_path / "c")
    with Engine.open(root, L, CAP) as eng:
        assert store_tokens(eng, toks).ok
        (name, size, ck), = eng.catalog.query("SELECT name, size, checksum FROM files")
        node = eng.index.nodes[next(iter(eng.index.nodes))]
        meta = {**shards.meta(node.key, node.generation, node.start, node.end, False), "rank": "0"}
        pool = eng.executor.pool
    path = os.path.join(root, "rank0", name)
    good = Path(path).read_bytes()
    head = verify.Header(L, 2 * BT, False, meta)
    other = verify.Header(L, 2 * BT, False, {**meta, "generation": "9"})
    rank = LocalRank(0, os.path.join(root, "rank0"))

    def outcomes(header: verify.Header, checksum: str, size_: int = size) -> tuple:
        out = torch.empty(2 * BT, 2, 3, dtype=torch.bfloat16)
        place = {"seg.k": (0, memoryview(out.view(torch.uint8).reshape(-1).numpy()))}
        placed = verify.read_placed(rank, name, size_, checksum, header, place)
        staged = verify.read(rank, name, size_, checksum, pool=pool, header=header)
        if isinstance(staged, verify.Shard):
            staged.buffer.release()
        return (type(placed).__name__, getattr(placed, "why", None)), (type(staged).__name__, getattr(staged, "why", None))

    cases = {"good": (head, ck, size), "other header": (other, ck, size), "wrong size": (head, ck, size + 8),
             "wrong checksum": (head, "0" * 32, size)}
    for label, (h, c, s) in cases.items():
        placed, staged = outcomes(h, c, s)
        assert placed == staged, label
        assert placed[0] == ("Shard" if label == "good" else "Damage"), (label, placed)
    with open(path, "wb") as f:  # a header that is not JSON, its checksum made to agree
        f.write(good[:8] + b"x" + good[9:])
    bad_ck = shards.checksum(Path(path).read_bytes())
    placed, staged = outcomes(head, bad_ck)
    assert placed == staged and placed[0] == "Damage" and "not JSON" in placed[1]
    os.unlink(path)
    assert outcomes(head, ck) == (("Damage", f"shard {name} missing"),) * 2


def _into_variants(L, rows: int) -> dict[str, object]:
    """``into`` values: the common ones, unusual ones the full checks accept, bad ones."""
    good = outputs(L, rows)
    other = outputs(L, rows)
    v: dict[str, object] = {"list": good, "tuple": tuple(good),
                            "param": [{n: torch.nn.Parameter(t, requires_grad=False) for n, t in d.items()} for d in good]}
    v["overlap"] = [dict(good[0]), {**good[1], "k": good[0]["k"]}]
    v["dtype"] = [dict(good[0]), {**good[1], "v": other[1]["v"].float()}]
    v["rows"] = [dict(good[0]), {**good[1], "v": torch.zeros((rows + 1, *other[1]["v"].shape[1:]), dtype=torch.bfloat16)}]
    v["strided"] = [dict(good[0]), {**good[1], "v": other[1]["v"].transpose(1, 2)}]
    v["0-dim"] = [dict(good[0]), {**good[1], "v": torch.tensor(1.0, dtype=torch.bfloat16)}]
    v["meta"] = [dict(good[0]), {**good[1], "v": torch.empty(other[1]["v"].shape, dtype=torch.bfloat16, device="meta")}]
    v["extra"] = [dict(good[0]), {**good[1], "w": other[1]["v"]}]
    v["one rank"] = good[:1]
    v["not tensors"] = [["k", "v"], ["k", "v"]]
    return v


def test_the_common_into_check_agrees_with_the_full_checks(tmp_path):
    """``validate.into``'s one-pass check of the common case accepts only what the full
    checks accept, with the same result; anything else goes to them (and their error)."""
    from prefixstore.engine import validate

    L = make_layout(ranks=2, snapshot=False)
    toks = tokens_for(3, 4)
    with Engine.open(str(tmp_path / "c"), L, CAP) as eng:
        assert store_tokens(eng, toks).ok
        m = eng.lookup(Prefix.from_tokens(toks, BT))
        rows = m.tokens - m.gpu_tokens
        dev = eng.executor.device
        taken = set()
        for name, value in _into_variants(L, rows).items():
            fast = validate._into_common(L, dev, rows, value)
            try:
                full = validate.into(L, dev, m, value)
            except (ShapeError, DtypeError, InvalidInputError):
                full = None
                assert fast is None, name  # the one-pass check never takes what the full checks refuse
            if fast is not None:
                taken.add(name)
                assert full is not None and len(fast) == len(full), name
                assert all(fast[r].keys() == full[r].keys() and all(fast[r][k] is full[r][k] for k in fast[r])
                           for r in range(len(fast))), name
        assert taken == {"list"}  # the common case takes the one pass; the rest the full checks
        good = outputs(L, rows)
        assert validate.into(L, dev, m, good) == [dict(t) for t in good]


# ------------------------------------------------------------------ into= Pieces

def scattered(L, rows: int, seed: int) -> tuple[list[dict[str, Pieces]], list[dict[str, torch.Tensor]]]:
    """Per rank and segment, ``Pieces`` over one buffer of SENTINEL: the segment's elements
    in spans of 1 to 7 elements, in shuffled places with gaps between them; and the buffers."""
    g = torch.Generator().manual_seed(seed)
    into, memories = [], []
    for _ in range(L.ranks):
        d, m = {}, {}
        for s in L.segments:
            n = rows * int(torch.tensor(s.shape).prod())
            sizes = []
            while sum(sizes) < n:
                sizes.append(min(int(torch.randint(1, 8, (1,), generator=g)), n - sum(sizes)))
            slots = torch.randperm(len(sizes), generator=g).tolist()  # span k goes to slot slots[k]
            memory = m[s.name] = torch.full((8 * len(sizes),), SENTINEL, dtype=s.torch_dtype)
            d[s.name] = Pieces(memory, [(8 * slots[k], sizes[k]) for k in range(len(sizes))])
        into.append(d)
        memories.append(m)
    return into, memories


def gathered(p: Pieces) -> torch.Tensor:
    return torch.cat([p.memory[o : o + n] for o, n in p.spans.tolist()])


@pytest.mark.parametrize("backing", ["disk", "memory"])  # read in place / uploaded from a tier's buffer
@pytest.mark.parametrize("ranks", [1, 2])
def test_restore_into_pieces_fills_each_span_in_order_and_nothing_else(tmp_path, backing, ranks):
    L = make_layout(ranks=ranks, snapshot=True)
    toks = tokens_for(11, 8)
    with Engine.open(str(tmp_path / "c"), L, CAP, backing=backing) as eng:
        assert store_tokens(eng, toks[: 3 * BT]).ok and store_tokens(eng, toks).ok  # two nodes
        want = seg_tensors(L, toks)
        for gpu_blocks in (0, 2, 5):
            m = eng.lookup(Prefix.from_tokens(toks, BT), gpu_blocks=gpu_blocks)
            rows = m.tokens - m.gpu_tokens
            into, memories = scattered(L, rows, gpu_blocks)
            r = eng.restore(m, into=into)
            assert r is not None
            for k in range(ranks):
                for name, p in into[k].items():
                    assert r.segments[k][name] is p
                    assert torch.equal(gathered(p), want[k][name][m.gpu_tokens : m.tokens].reshape(-1)), (gpu_blocks, k)
                    covered = torch.zeros(len(memories[k][name]), dtype=torch.bool)
                    for o, n in p.spans.tolist():
                        covered[o : o + n] = True
                    assert bool((memories[k][name][~covered].float() == SENTINEL).all())  # the gaps untouched
            ws = snap_tensors(L, toks)
            assert all(torch.equal(r.snapshot[k]["state"], ws[k]["state"]) for k in range(ranks))


@pytest.mark.parametrize("backing", ["disk", "memory"])
def test_pieces_of_one_span_inside_a_larger_buffer(tmp_path, backing):
    """One span that starts inside its memory: the rows land from that element on."""
    L = make_layout(ranks=1, snapshot=False)
    toks = tokens_for(15, 4)
    with Engine.open(str(tmp_path / "c"), L, CAP, backing=backing) as eng:
        assert store_tokens(eng, toks).ok
        m = eng.lookup(Prefix.from_tokens(toks, BT), gpu_blocks=1)
        n = (m.tokens - m.gpu_tokens) * 6
        into = {s.name: Pieces(torch.full((n + 10,), SENTINEL, dtype=torch.bfloat16), [(7, n)]) for s in L.segments}
        assert eng.restore(m, into=into) is not None
        want = seg_tensors(L, toks)[0]
        for name, p in into.items():
            assert torch.equal(p.memory[7 : 7 + n], want[name][m.gpu_tokens : m.tokens].reshape(-1))
            assert bool((p.memory[:7].float() == SENTINEL).all()) and bool((p.memory[7 + n :].float() == SENTINEL).all())


def test_pieces_in_place_read_nothing_through_a_staging_buffer(tmp_path):
    L = make_layout(ranks=1, snapshot=False)
    toks = tokens_for(12, 6)
    with Engine.open(str(tmp_path / "c"), L, CAP) as eng:
        assert store_tokens(eng, toks).ok
        m = eng.lookup(Prefix.from_tokens(toks, BT))
        pool0 = eng.stats()["transfers"]["staging_pool"]
        into, _ = scattered(L, m.tokens, 3)
        assert eng.restore(m, into=into) is not None
        pool1 = eng.stats()["transfers"]["staging_pool"]
        assert (pool1["allocs"], pool1["reuses"]) == (pool0["allocs"], pool0["reuses"])
        assert eng.stats()["transfers"]["copies"]["host_copy_bytes"] == 0


def test_a_damaged_shard_restored_into_pieces_is_a_miss(tmp_path):
    L, toks, root, path = one_shard(tmp_path, 13)
    flip_bit(path, os.path.getsize(path) - 1)
    with Engine.open(root, L, CAP) as eng:
        m = eng.lookup(Prefix.from_tokens(toks, BT))
        into, _ = scattered(L, m.tokens, 4)
        assert eng.restore(m, into=into) is None
        assert eng.counters.snapshot().get("lookups.damaged_on_restore") == 1


BAD_PIECES = ["too few", "too many", "dtype", "meta memory", "strided memory", "outside", "negative",
              "overlap", "overlaps a tensor", "not a tensor"]


@pytest.mark.parametrize("bad", BAD_PIECES)
def test_bad_pieces_are_a_typed_error_and_nothing_is_written_or_read(tmp_path, bad):
    L = make_layout(ranks=2, snapshot=False)
    toks = tokens_for(14, 4)
    with Engine.open(str(tmp_path / "c"), L, CAP) as eng:
        assert store_tokens(eng, toks).ok
        m = eng.lookup(Prefix.from_tokens(toks, BT))
        into, memories = scattered(L, m.tokens, 5)
        n = m.tokens * 6
        p = into[1]["v"]
        mem = p.memory
        expect: type[Exception] = ShapeError
        if bad == "too few":
            into[1]["v"] = Pieces(mem, [*p.spans.tolist()[:-1], (p.spans[-1, 0], p.spans[-1, 1] - 1)])
        elif bad == "too many":
            into[1]["v"] = Pieces(torch.cat([mem, mem]), [*p.spans.tolist(), (len(mem), 1)])
        elif bad == "dtype":
            into[1]["v"] = Pieces(torch.full((len(mem),), SENTINEL, dtype=torch.float32), p.spans)
            expect = DtypeError
        elif bad == "meta memory":
            into[1]["v"] = Pieces(torch.empty(len(mem), dtype=torch.bfloat16, device="meta"), p.spans)
            expect = InvalidInputError
        elif bad == "strided memory":
            into[1]["v"] = Pieces(torch.full((2 * len(mem),), SENTINEL, dtype=torch.bfloat16)[::2], p.spans)
        elif bad == "outside":
            into[1]["v"] = Pieces(mem, [*p.spans.tolist()[:-1], (len(mem) - 1, p.spans[-1, 1] + 1)])
        elif bad == "negative":
            into[1]["v"] = Pieces(mem, [(-1, 1), (0, n - 1)])
        elif bad == "overlap":
            into[1]["v"] = Pieces(mem, [(0, n // 2), (n // 2 - 1, n - n // 2)])
            expect = InvalidInputError
        elif bad == "overlaps a tensor":  # a piece inside rank 0's plain tensor
            into[0]["k"] = torch.full((m.tokens, 2, 3), SENTINEL, dtype=torch.bfloat16)
            into[1]["v"] = Pieces(into[0]["k"].reshape(-1), [(0, n)])
            expect = InvalidInputError
        else:
            into[1]["v"] = Pieces(["not a tensor"], p.spans)
            expect = InvalidInputError
        c0 = eng.stats()["transfers"]["copies"]["tier_read_bytes"]
        with pytest.raises(expect):
            eng.restore(m, into=into)
        assert eng.stats()["transfers"]["copies"]["tier_read_bytes"] == c0  # nothing read
        for per in memories:
            assert all(bool((t.float() == SENTINEL).all()) for t in per.values())  # nothing written
        for per in into:
            for x in per.values():
                t = x.memory if isinstance(x, Pieces) else x
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    assert bool((t.float() == SENTINEL).all())
        assert eng.restore(m) is not None  # the engine is unharmed


@pytest.mark.parametrize("spans", [[(0, 1, 2)], [[0.5, 1]], "ab", 3])
def test_pieces_spans_that_are_not_integer_pairs_are_refused_when_built(spans):
    with pytest.raises(InvalidInputError):
        Pieces(torch.zeros(4), spans)


def test_pieces_of_views_are_their_spans_of_one_storage():
    buf = torch.arange(40, dtype=torch.float32).reshape(2, 20)
    p = Pieces.of([buf[1, 4:9], buf[0, 0:3]])
    assert p.memory.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    assert p.spans.tolist() == [[24, 5], [0, 3]]
    assert torch.equal(gathered(p), torch.cat([buf[1, 4:9], buf[0, 0:3]]))
    with pytest.raises(InvalidInputError):
        Pieces.of([buf[0, :3], torch.zeros(3)])  # another storage
    with pytest.raises(InvalidInputError):
        Pieces.of([buf[:, 0]])  # not contiguous
