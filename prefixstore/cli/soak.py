"""``prefixstore soak``: the soak's arguments and report. The soak itself, and the
description ``--help`` shows, is :mod:`prefixstore.fuzz.soak`."""

from __future__ import annotations

import argparse
import json
from collections import Counter

from prefixstore.engine.workdir import work_dir
from prefixstore.fuzz import soak as soak_run
from prefixstore.fuzz.soak import PLANTS, soak

NAME = "soak"
HELP = "SIGKILL a working engine many times; audit and check acknowledged stores after each"
DESCRIPTION = soak_run.__doc__


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default=None, help="work directory (default: a new temp dir)")
    p.add_argument("--kills", type=int, default=200, help="SIGKILLs in all, split over --ranks (default 200)")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 4], help="rank counts (default 1 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-delay", type=float, default=0.25, help="longest life of a child, seconds")
    p.add_argument("--effect-delay-ms", type=float, default=0.0,
                   help="model a slow disk: sleep this long after every effect in the child, so "
                        "more kills land inside transactions (default 0)")
    p.add_argument("--keep", action="store_true",
                   help="keep the temporary work directory (without --dir) instead of removing it")
    p.add_argument("--min-acked", type=int, default=0,
                   help="after the kills, keep killing (the --ranks in turn) until this many stores "
                        "were acknowledged in all, within --max-seconds (default 0)")
    p.add_argument("--max-seconds", type=float, default=600.0,
                   help="time budget for the rounds past --kills, from the start (default 600)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--plant", choices=sorted(PLANTS), default=None,
                   help="run against a deliberately broken engine (the soak must report it)")


def run(args: argparse.Namespace) -> int:
    with work_dir("soak", args.dir, args.keep, option="--dir") as root:
        return _run(args, root)


def _run(args: argparse.Namespace, root: str) -> int:
    st = soak(root, kills=args.kills, ranks=tuple(args.ranks), seed=args.seed,
              max_delay=args.max_delay, progress=not args.json, plant=args.plant,
              effect_delay=args.effect_delay_ms / 1000, min_acked=args.min_acked,
              max_seconds=args.max_seconds)
    lost_or_bad = st.lost or st.violations
    if args.json:
        print(json.dumps(st.to_dict()))
    else:
        print(f"soak in {root}: {st.kills} SIGKILLs {dict(st.kills_by_ranks)} in {st.seconds} s"
              f" ({st.extra_kills} past --kills to reach --min-acked)")
        print(f"  kills that left an unfinished transaction: {st.unfinished_at_kill} "
              f"{dict(Counter(st.unfinished_kinds))}")
        print(f"  recoveries by the checker: {st.recoveries} (rolled back {st.rolled_back}, "
              f"forward {st.rolled_forward}); the others by the next child")
        print(f"  acknowledged stores: {st.acked_stores} {dict(st.acked_by_ranks)}"
              f"{'' if st.target_met else ' (below --min-acked: --max-seconds ran out)'}; "
              f"acknowledged checkpoints checked: {st.acked_checks}; evictions announced: "
              f"{st.evictions_announced}")
        print(f"  restores verified bit-identical after recovery: {st.restores_verified}")
        print(f"  lost acknowledged stores: {st.lost}; violations: {len(st.violations)}")
        for v in st.violations[:20]:
            print(f"    - {v}")
    return 1 if lost_or_bad else 0
