"""``prefixstore fiu``: the arguments and report of the run under libfiu. The run itself,
and the description ``--help`` shows, is :mod:`prefixstore.fuzz.fiu`."""

from __future__ import annotations

import argparse
import json
import sys

from prefixstore.engine.workdir import work_dir
from prefixstore.fuzz import fiu as fiu_run
from prefixstore.fuzz.fiu import PLANTS, POINTS, fiu_available, run_under_fiu, summary

NAME = "fiu"
HELP = "run a workload under libfiu (real ENOSPC/EIO from libc); audit after"
DESCRIPTION = fiu_run.__doc__


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default=None, help="cache directory (default: a new temp dir)")
    p.add_argument("--target", choices=sorted(POINTS), default="all", help="which libc calls fail")
    p.add_argument("--ops", type=int, default=400, help="operations while armed (default 400)")
    p.add_argument("--p", type=float, default=0.05, help="failure probability per call (default 0.05)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true",
                   help="keep the temporary work directory (without --dir) instead of removing it")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plant", choices=sorted(PLANTS), default=None,
                   help="run against a deliberately broken engine (the check must fail)")


def run(args: argparse.Namespace) -> int:
    if not fiu_available():
        print("fiu-run is not installed (apt-get install fiu-utils)", file=sys.stderr)
        return 2
    with work_dir("fiu", args.dir, args.keep, option="--dir") as root:
        return _run(args, root)


def _run(args: argparse.Namespace, root: str) -> int:
    res = run_under_fiu(root, target=args.target, ops=args.ops, probability=args.p, seed=args.seed,
                        plant=args.plant)
    if args.json:
        print(json.dumps(res.to_dict()))
    else:
        print("\n".join(summary(res)))
    return 0 if res.ok else 1
