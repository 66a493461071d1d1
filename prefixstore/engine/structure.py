"""Structural consistency of catalog rows (pure: rows in, problems out).

Shared by the auditor (reports), recovery (refuses a catalog that contradicts
itself, so a tampered row is never indexed or served) and repair (fixes what it
can). Checks, by invariant of DESIGN.md section 4:

- 2: every node's parent exists, ``child.start == parent.end`` (0 for a root child),
  no parent cycle, the digests cover the node's span, the key is the chained hash of
  its blocks, no block is claimed by two nodes;
- 1/3: every file row names a shard file (no path, the shard pattern) on a rank of
  the layout; a live row belongs to an existing node and is that node's current
  generation's shard (named after its key and generation); a row that names a node's
  current shard is that node's live row (``misowned`` otherwise: recovery re-attaches
  it, since a shard's name, not one row's status, says whose bytes the file holds).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

import attrs

from prefixstore.base.keys import DIGEST_SIZE, ROOT, chain_all

SHARD_RE = re.compile(r"^[0-9a-f]{32}-g[0-9]+\.st$")

# Positions in a node row tuple as selected by NODE_COLUMNS.
NODE_COLUMNS = "id, key, parent, start_block, end_block, digests, has_snapshot, state, generation"
FILE_COLUMNS = "rank, name, node, generation, size, checksum, status, txn"
ID, KEY, PARENT, START, END, DIGESTS, HAS_SNAP, STATE, GEN = range(9)


# File-row problems recovery refuses to open with (the others it repairs, or finds as damage).
REFUSED_FILE_KINDS = frozenset({"bad_name", "bad_rank", "live_orphan"})


@attrs.frozen
class Problem:
    """One structural contradiction; ``node`` / ``file`` say which row it is about."""

    invariant: int
    kind: str
    detail: str
    node: int | None = None
    file: tuple[int, str] | None = None


def node_chain(row: Sequence, parent_key: bytes) -> list[bytes] | None:
    """Chained keys of a node row's blocks after ``parent_key`` (None if digests are malformed)."""
    digests = bytes(row[DIGESTS])
    blocks = row[END] - row[START]
    if blocks <= 0 or len(digests) != DIGEST_SIZE * blocks:
        return None
    return chain_all(parent_key, [digests[i : i + DIGEST_SIZE] for i in range(0, len(digests), DIGEST_SIZE)])


def node_problems(nodes: Mapping[int, Sequence]) -> list[Problem]:
    """Invariant-2 problems, at most one per node; a node below a bad one is not re-blamed."""
    out: list[Problem] = []
    good_keys: dict[int, bytes] = {}
    bad: set[int] = set()
    claimed: dict[bytes, int] = {}

    def visit(nid: int, trail: tuple[int, ...]) -> bytes | None:
        if nid in good_keys:
            return good_keys[nid]
        if nid in bad:
            return None
        row = nodes[nid]
        parent = row[PARENT]
        problem = None
        pkey: bytes | None = ROOT
        if nid in trail:
            problem = Problem(2, "cycle", f"node {nid} is in a parent cycle", nid)
        elif parent is None:
            if row[START] != 0:
                problem = Problem(2, "bad_start", f"root child {nid} starts at block {row[START]}, not 0", nid)
        elif parent not in nodes:
            problem = Problem(2, "missing_parent", f"node {nid} has missing parent {parent}", nid)
        else:
            pkey = visit(parent, (*trail, nid))
            if pkey is None:
                bad.add(nid)  # below a bad node: reported through its ancestor
                return None
            if row[START] != nodes[parent][END]:
                problem = Problem(2, "bad_start", f"node {nid} starts at block {row[START]} but parent "
                                  f"{parent} ends at {nodes[parent][END]}", nid)
        if problem is None:
            chain = node_chain(row, pkey)
            if chain is None:
                problem = Problem(2, "digests", f"node {nid} holds {len(bytes(row[DIGESTS])) / DIGEST_SIZE:g} "
                                  f"digests for blocks {row[START]}..{row[END]}", nid)
            elif chain[-1] != bytes(row[KEY]):
                problem = Problem(2, "chain", f"node {nid}'s key is not the chained hash of its blocks", nid)
            else:
                for k in chain:
                    if k in claimed:
                        problem = Problem(2, "dup_block", f"block {k.hex()[:12]} claimed by nodes "
                                          f"{claimed[k]} and {nid}", nid)
                        break
                if problem is None:
                    for k in chain:
                        claimed[k] = nid
        if problem is not None:
            if nid not in bad:
                out.append(problem)
                bad.add(nid)
            return None
        good_keys[nid] = bytes(row[KEY])
        return good_keys[nid]

    for nid in sorted(nodes, key=lambda i: (nodes[i][END], i)):
        visit(nid, ())
    return out


def current_shards(nodes: Mapping[int, Sequence]) -> dict[str, int]:
    """``{shard name: node id}`` of every node's current generation (the same name on every rank)."""
    return {f"{bytes(row[KEY]).hex()}-g{row[GEN]}.st": nid for nid, row in nodes.items()}


def misowned(owner: int, nodes: Mapping[int, Sequence], row: Sequence) -> bool:
    """Whether file ``row``, which names node ``owner``'s current shard, is not recorded as its live file."""
    _rank, _name, node, gen, _size, _ck, status, txn = row
    return status != "live" or node != owner or txn is not None or gen != nodes[owner][GEN]


def reattached(nodes: Mapping[int, Sequence], files: Iterable[Sequence]) -> list[tuple]:
    """``files`` with every misowned row recorded as the live file of the node whose shard it names."""
    current = current_shards(nodes)
    out = []
    for f in files:
        owner = current.get(f[1]) if isinstance(f[1], str) else None
        if owner is not None and misowned(owner, nodes, f):
            f = (f[0], f[1], owner, nodes[owner][GEN], f[4], f[5], "live", None)
        out.append(tuple(f))
    return out


def stale_generations(nodes: Mapping[int, Sequence], files: Iterable[Sequence], ranks: int) -> dict[int, int]:
    """``{node: generation}`` for nodes whose recorded generation names no file row while
    their live rows, one on every rank, are all the shards of one other generation of
    their key: the node row's generation is what is wrong, not its files."""
    files = list(files)
    names = {f[1] for f in files}
    live: dict[int, dict[int, list[tuple[str, int]]]] = {}
    for rank, name, node, gen, _size, _ck, status, _txn in files:
        if status == "live" and node in nodes:
            live.setdefault(node, {}).setdefault(rank, []).append((name, gen))
    out: dict[int, int] = {}
    for nid, row in nodes.items():
        key = bytes(row[KEY]).hex()
        per = live.get(nid, {})
        if f"{key}-g{row[GEN]}.st" in names or set(per) != set(range(ranks)):
            continue
        found = {x for v in per.values() for x in v}
        if any(len(v) != 1 for v in per.values()) or len(found) != 1:
            continue
        ((name, gen),) = found
        if isinstance(gen, int) and gen > 0 and gen != row[GEN] and name == f"{key}-g{gen}.st":
            out[nid] = gen
    return out


def file_problems(nodes: Mapping[int, Sequence], files: Iterable[Sequence], ranks: int) -> list[Problem]:
    """Problems of file rows (columns FILE_COLUMNS) that no audit of the disk can excuse."""
    out: list[Problem] = []
    live_on: dict[tuple[int, int], str] = {}
    current = current_shards(nodes)
    for row in files:
        rank, name, node, gen, _size, _ck, status, txn = row
        where = (rank, name)
        if not isinstance(name, str) or not SHARD_RE.match(name):
            out.append(Problem(3, "bad_name", f"file row rank{rank}/{name!r} is not a shard name", file=where))
            continue
        if not isinstance(rank, int) or not 0 <= rank < ranks:
            out.append(Problem(3, "bad_rank", f"file row {name} is on rank {rank!r}, layout has {ranks}",
                               file=where))
            continue
        owner = current.get(name)
        if owner is not None and misowned(owner, nodes, row):
            out.append(Problem(1, "misowned", f"file row rank{rank}/{name} (status {status}, node {node}, "
                               f"transaction {txn}, generation {gen}) names node {owner}'s current shard but "
                               "is not recorded as its live file", node=owner, file=where))
            node, status, gen = owner, "live", nodes[owner][GEN]
        if status != "live":
            continue
        if node is None or node not in nodes:
            out.append(Problem(3, "live_orphan", f"live file rank{rank}/{name} belongs to missing node {node}",
                               file=where))
            continue
        want = f"{bytes(nodes[node][KEY]).hex()}-g{nodes[node][GEN]}.st"
        if name != want or gen != nodes[node][GEN]:
            out.append(Problem(1, "live_name", f"node {node} rank {rank}: live file {name} (generation {gen}) "
                               f"is not its generation's shard {want}", node=node, file=where))
        elif (node, rank) in live_on:
            out.append(Problem(1, "live_twice", f"node {node} has two live files on rank {rank}: "
                               f"{live_on[(node, rank)]} and {name}", node=node, file=where))
        live_on[(node, rank)] = name
    return out


def subtree(nodes: Mapping[int, Sequence], roots: Iterable[int]) -> list[int]:
    """``roots`` and every node below them, leaves first (cycles tolerated)."""
    children: dict[int, list[int]] = {}
    for nid, row in nodes.items():
        if row[PARENT] is not None:
            children.setdefault(row[PARENT], []).append(nid)
    order: list[int] = []
    seen: set[int] = set()
    todo = list(roots)
    while todo:
        n = todo.pop()
        if n in seen or n not in nodes:
            continue
        seen.add(n)
        order.append(n)
        todo.extend(children.get(n, []))
    order.reverse()
    return order
