"""Check every invariant of a cache directory without changing a byte.

Exit status: 0 when every invariant holds, 1 when any is violated, 2 when the
directory cannot be read as a cache (not a cache, newer schema, unreadable).
The catalog is opened read-only, so a running engine is not disturbed.
"""

from __future__ import annotations

import argparse
import json
import sys

from prefixstore.engine.audit import audit_dir
from prefixstore.engine.errors import PrefixStoreError

NAME = "audit"
HELP = "check a cache directory's invariants (read-only by default)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="the cache directory")
    p.add_argument("--json", action="store_true", help="print one JSON object (ok, violations, ...)")
    p.add_argument("--quick", action="store_true", help="skip reading shards for checksums")
    p.add_argument("--rank-dir", action="append", default=None, metavar="PATH",
                   help="rank directory (repeat once per rank, in order); default DIR/rankN")


def run(args: argparse.Namespace) -> int:
    try:
        rep = audit_dir(args.dir, rank_dirs=args.rank_dir, checksums=not args.quick)
    except (PrefixStoreError, OSError) as exc:
        if args.json:
            print(json.dumps({"ok": False, "error": str(exc), "violations": []}))
        else:
            print(f"cannot audit {args.dir}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rep.to_dict(), indent=None))
    else:
        print_report(rep, args.dir)
    return 0 if rep.ok else 1


def print_report(rep, where: str) -> None:
    a = rep.accounting
    print(f"audit of {where}: {'CLEAN' if rep.ok else 'VIOLATIONS FOUND'}")
    print(f"  nodes: {rep.nodes}   shards verified: {rep.files_checked}")
    print(
        f"  accounting: charged {a.get('charged', 0)} of capacity {a.get('capacity', 0)} "
        f"(live {a.get('live', 0)}, damaged {a.get('damaged', 0)}, garbage {a.get('garbage', 0)}, "
        f"writing {a.get('writing', 0)}); on disk {a.get('on_disk', 0)}"
    )
    if rep.journal:
        print(f"  unfinished transactions: {len(rep.journal)}")
        for j in rep.journal:
            print(f"    txn {j['txn']}: {j['kind']} in {j['state']} -> recovery would {j['recovery']}")
    else:
        print("  journal: no unfinished transaction")
    by_inv: dict[int, list[str]] = {}
    for v in rep.violations:
        by_inv.setdefault(v.invariant, []).append(v.detail)
    for inv in (1, 2, 3, 4, 5, 6, 7, 8):
        found = by_inv.get(inv, [])
        print(f"  invariant {inv}: {'ok' if not found else f'{len(found)} violation(s)'}")
        for d in found[:20]:
            print(f"    - {d}")
        if len(found) > 20:
            print(f"    ... and {len(found) - 20} more")
