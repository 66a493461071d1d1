"""Check every invariant of a cache directory (DESIGN.md section 4), or repair it.

Without --repair nothing is written: the catalog is read beside a running engine
with a read-only connection, or (no engine) opened immutable, or (no engine, a
write-ahead log left by a crash) copied with its log to a private temporary
directory; shards are read without updating access times.

The report gives, per invariant, what was checked and every violation; each
unfinished transaction with what recovery would do with it; what else opening an
engine would change (garbage, orphans, foreign files, nodes it would mark damaged);
each rank directory's files; and the accounting (charged, live, damaged, garbage, on
disk).

--repair (no engine may hold the directory): drops the schema objects the engine did
not create (triggers, views, indexes, tables; an altered engine table is recreated with
every row), fixes contradictory catalog rows, runs recovery, verifies every ready
node's shards and marks those that fail damaged, reclaims garbage and orphans, prints
every change, then audits again. Intact nodes are never removed.

A catalog that is missing, empty (0 bytes) or never initialized while the directory
holds shards (which an engine refuses to open) is rebuilt by --repair from the shards'
own headers: key, generation, span, rank and snapshot flag, the node's block digests
and parent key, and (on root nodes) the layout. Every shard that verifies is adopted
with its ancestry; one that does not, a superseded generation and any foreign entry
move to lost+found/, and the old catalog files to lost+found/catalog-N/; nothing is
unlinked. What headers do not hold: the capacity (--capacity, else the bytes of the
shards adopted, so nothing is evicted; the next Engine.open records its own), recency
(taken from the files' modification times), and the backing and calibration rows
(written again by the next open). Shards written before they carried their digests
cannot be placed (they go to lost+found/). --rebuild does the same for a catalog that
still reads (e.g. an engine table replaced by a view, which --repair cannot restore
without losing rows; it says so).

--ranks tcp://HOST:PORT reads every rank through its rank server (no rank directory
is read here); with --repair the rank servers also do every unlink, quarantine (into
lost+found/ beside their directory) and fsync the repair decides, and the report is
the same; a catalog lost on this host is rebuilt from the shards' headers read
through the rank servers with --repair --rebuild (--rank-count when the catalog no
longer says how many ranks). A repair needs every rank: one that does not serve is
refused with nothing changed.

Exit status: 0 when every invariant holds (after repair, with --repair), 1 when any
is violated, 3 when none is found but a rank could not be reached through its rank
server (--ranks: its files were not checked, so the cache has not been shown sound;
the rank is named on stderr, and in the report's ranks and notes), 2 when the
directory cannot be read as a cache (not a cache, newer schema, unreadable, a catalog
lost beside shards without --repair, or locked by an engine for --repair; for
--repair also a rank or lost+found directory that is a symlink, a rank directory
holding cataloged shards that is missing (name rank directories kept elsewhere with
--rank-dir), a foreign schema object --repair cannot drop without losing rows, or a
lost catalog no shard names the layout of).
"""

from __future__ import annotations

import argparse
import json
import sys

from prefixstore.base.errors import PrefixStoreError
from prefixstore.base.layout import Layout
from prefixstore.engine.audit import TITLES, AuditReport, audit_dir, read_catalog
from prefixstore.engine.repair import RepairReport, repair
from prefixstore.gpu.distributed import RankGroup, RemoteRank
from prefixstore.gpu.rank_auth import load_token
from prefixstore.gpu.rank_server import add_token_arguments, parse_init_method

EXIT_UNCHECKED = 3
"""No violation found, but a rank could not be reached: not shown sound."""
NAME = "audit"
HELP = "check a cache directory's invariants (read-only), or --repair it"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="the cache directory")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (ok, violations [{invariant, detail}], invariants, "
                        "journal, recovery, ranks, accounting; with --repair also repair)")
    p.add_argument("--quick", action="store_true", help="skip reading shards for checksums and headers")
    p.add_argument("--rank-dir", action="append", default=None, metavar="PATH",
                   help="rank directory (repeat once per rank, in order); default DIR/rankN")
    p.add_argument("--ranks", metavar="tcp://HOST:PORT",
                   help="read every rank through its rank server: host the rank servers' TCPStore at "
                        "HOST:PORT (their --init-method), wait for each rank of the layout, and read its "
                        "listing, sizes and shards over the network (no rank directory is read locally; a "
                        "rank that does not come within --rank-timeout is reported unavailable, not checked, and "
                        "an audit that finds no violation then exits 3; "
                        "the cache at rest: no engine may be serving these rank servers); with --repair, "
                        "every listing, read, unlink, quarantine and fsync the repair decides is done by the "
                        "rank servers, a catalog rebuilt from the shards' headers included (--rank-count)")
    p.add_argument("--rank-count", type=int, default=None, metavar="N",
                   help="with --ranks: how many ranks to wait for (default: the catalog's layout; give it "
                        "when the catalog is lost and --repair rebuilds it from the shards' headers)")
    p.add_argument("--rank-timeout", type=float, default=60.0, metavar="S",
                   help="with --ranks: seconds to wait for each rank server, and for each request (default 60)")
    add_token_arguments(p)
    p.add_argument("--repair", action="store_true",
                   help="drop foreign schema objects, recover, invalidate damaged nodes, reclaim garbage and "
                        "orphans, print the changes; a missing, empty or uninitialized catalog beside shards "
                        "is rebuilt from the shards' own headers (nothing is unlinked: what does not verify "
                        "goes to lost+found/)")
    p.add_argument("--rebuild", action="store_true",
                   help="with --repair: rebuild the catalog from the shards' headers even though it reads "
                        "(the old one goes to lost+found/catalog-N/)")
    p.add_argument("--capacity", type=int, default=None, metavar="BYTES",
                   help="with --repair: the capacity to record (default: the catalog's; for a rebuilt catalog "
                        "without one, the bytes of the shards adopted, so nothing is evicted)")


def run(args: argparse.Namespace) -> int:
    if (args.rebuild or args.capacity is not None) and not args.repair:
        print("--rebuild and --capacity need --repair", file=sys.stderr)
        return 2
    if args.capacity is not None and args.capacity <= 0:
        print(f"--capacity must be a positive number of bytes, got {args.capacity}", file=sys.stderr)
        return 2
    if args.ranks and args.rank_dir:
        print("--ranks reads the ranks through their rank servers: not with --rank-dir", file=sys.stderr)
        return 2
    if args.rank_count is not None and (not args.ranks or args.rank_count <= 0):
        print("--rank-count needs --ranks and a positive number of ranks", file=sys.stderr)
        return 2
    try:
        if args.ranks:
            fixed, rep = audit_remote(args)
        elif args.repair:
            fixed, rep = repair(args.dir, rank_dirs=args.rank_dir, rebuild_catalog=args.rebuild,
                                capacity=args.capacity)
        else:
            fixed, rep = None, audit_dir(args.dir, rank_dirs=args.rank_dir, checksums=not args.quick)
    except (PrefixStoreError, OSError) as exc:
        if args.json:
            print(json.dumps({"ok": False, "error": str(exc), "violations": []}))
        else:
            print(f"cannot {'repair' if args.repair else 'audit'} {args.dir}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = rep.to_dict()
        if fixed is not None:
            out["repair"] = fixed.to_dict()
        print(json.dumps(out))
    else:
        if fixed is not None:
            lines = fixed.lines()
            print(f"repair of {args.dir}: {len(lines)} change(s)" if lines else f"repair of {args.dir}: nothing to change")
            for line in lines:
                print(f"  - {line}")
        print_report(rep, args.dir)
    if not rep.ok:
        return 1
    if rep.unreachable:
        for r, why in sorted(rep.unreachable.items()):
            print(f"audit of {args.dir}: rank {r} could not be reached, its files were not checked: {why}",
                  file=sys.stderr)
        return EXIT_UNCHECKED
    return 0


def audit_remote(args: argparse.Namespace) -> tuple[RepairReport | None, AuditReport]:
    """The audit (or with ``--repair`` the repair, then the audit) with every rank read
    and changed through its rank server (``--ranks``)."""
    host, port = parse_init_method(args.ranks)
    ranks = args.rank_count if args.rank_count is not None else \
        Layout.from_json(read_catalog(args.dir).meta.get("layout", "")).ranks
    group = RankGroup(host, port, token=load_token(args.token_file, args.token_env),
                      op_timeout=args.rank_timeout, connect_timeout=args.rank_timeout,
                      gloo_host=None if host in ("0.0.0.0", "::") else host)
    remotes: list[RemoteRank] = []
    try:
        # a repair needs every rank (else RankUnavailableError, nothing written); the audit
        # reports a rank that does not come as unavailable
        remotes = group.connect(range(ranks), missing_ok=not args.repair)
        if args.repair:
            return repair(args.dir, ranks=remotes, capacity=args.capacity, rebuild_catalog=args.rebuild)
        return None, audit_dir(args.dir, rank_dirs=remotes, checksums=not args.quick)
    finally:
        for rr in remotes:
            rr.close()  # the rank servers stay up for the engine (they exit 1 once this store is gone)


def print_report(rep: AuditReport, where: str) -> None:
    a = rep.accounting
    n = len(rep.violations)
    down = rep.unreachable
    verdict = f"{n} VIOLATION(S)" if not rep.ok else "CLEAN" if not down else \
        f"NOT SHOWN SOUND: no violation found, but rank(s) {', '.join(map(str, sorted(down)))} not checked"
    print(f"audit of {where}: {verdict}")
    print(f"  catalog: {rep.source}; {rep.nodes} nodes ({len(rep.damaged_nodes)} damaged), "
          f"{rep.files_checked} shards checked")
    for r in rep.ranks:
        extra = " (missing)" if r.get("missing") else ""
        unknown = f", unknown: {', '.join(r['unknown'][:5])}" if r["unknown"] else ""
        print(f"  rank {r['rank']} {r['dir']}{extra}: {r['files']} entries, {r['bytes']} bytes{unknown}")
    found = rep.by_invariant()
    for inv in sorted(found):
        got = found[inv]
        status = f"{len(got)} VIOLATION(S)" if got else rep.status(inv)
        checked = rep.checked.get(inv, "")
        if status == "not checked":
            status, checked = checked, ""
        print(f"  invariant {inv} ({TITLES.get(inv, '?')}): {status}")
        if checked:
            print(f"      checked: {checked}")
        for d in got[:20]:
            print(f"      - {d}")
        if len(got) > 20:
            print(f"      ... and {len(got) - 20} more")
    if rep.journal:
        live = any(j.get("in_flight") for j in rep.journal)
        print(f"  journal: {len(rep.journal)} unfinished transaction(s)"
              + (" in flight (the running engine's work, not violations)" if live else ""))
        for j in rep.journal:
            then = "if the engine died now: " if j.get("in_flight") else ""
            print(f"    txn {j['txn']}: {j['kind']} in {j['state']} -> {then}{j['recovery']}: {j.get('action', '')}")
    else:
        print("  journal: no unfinished transaction")
    print(
        f"  accounting: charged {a.get('charged', 0)} of capacity {a.get('capacity', 0)} "
        f"(live {a.get('live', 0)}, damaged {a.get('damaged', 0)}, garbage {a.get('garbage', 0)}, "
        f"writing {a.get('writing', 0)}); on disk {a.get('on_disk', 0)}"
    )
    if rep.recovery:
        print("  opening an engine would:")
        for line in rep.recovery:
            print(f"    - {line}")
    else:
        print("  opening an engine would change nothing beyond the journal")
    for note in rep.notes:
        print(f"  note: {note}")
