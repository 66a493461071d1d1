"""Fuzz the engine: seeded runs of stores (sync and async), restores, evictions, pins,
crashes, power loss, lost commits, per-rank I/O errors, full disks and bit rot, with
every invariant checked after every step and every recovery.

With --rank-servers N the highest N ranks of every run are served by rank server
processes on loopback, which the campaign SIGKILLs, powers off (what they had not
made durable is lost), stops (SIGSTOP) and restarts (with --netns, as root, each on
a host of its own, a network namespace, whose link it also cuts); with --remote redis a real
redis-server sits behind the remote tier, and the campaign kills it (it comes back
empty), stops it, flushes it (FLUSHALL) and alters blobs in it. The checks stay:
never wrong bytes, every acknowledged store restorable unless evicted (a remote miss
is fine), the audit clean once every rank server is back.

One seed replays a whole campaign. The first failure of each kind is shrunk to a short
op list and saved as a JSON reproducer under --out (--all-reproducers: every failure);
`prefixstore fuzz --replay FILE` replays it. Interrupted (Ctrl-C), it prints the
summary of what ran. It needs no extra (the Hypothesis machines in `stateful.py`
need the `fuzz` extra).
Exit status: 0 clean, 1 a violation was found (or replayed), 2 bad arguments (a
--workdir that is not a directory or cannot be created, one that is missing is
created), 130 interrupted without a violation.

Examples:
  prefixstore fuzz --minutes 30 --json > campaign.json
  prefixstore fuzz --steps 2000 --seed 7 --ranks 2
  prefixstore fuzz --plant skip-dir-fsync --steps 5000
  prefixstore fuzz --rank-servers 2 --ranks 2 --remote redis --minutes 10
  prefixstore fuzz --plant remote-trusts-blob --steps 2000
  prefixstore fuzz --replay fuzz-failures/fuzz-0-run3-lost.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from prefixstore.base.errors import InvalidArgumentError
from prefixstore.base.log import stderr_logger, using
from prefixstore.engine.workdir import ensure_dir
from prefixstore.fuzz import netns, plants
from prefixstore.fuzz.campaign import load_reproducer, replay_in_tmp, run_campaign

NAME = "fuzz"
HELP = "fuzz the engine under crashes, power loss and I/O faults (campaign runner)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=float, help="run for this long")
    budget.add_argument("--steps", type=int, help="run this many ops (default: the profile's)")
    p.add_argument("--seed", type=int, default=0, help="campaign seed (default 0)")
    p.add_argument("--ranks", type=int, choices=[1, 2, 4], help="fix the rank count (default: drawn per run)")
    p.add_argument("--profile", choices=["dev", "ci", "campaign"], default=None,
                   help="run length, fault and crash rates (default: campaign with --minutes, else dev)")
    p.add_argument("--rank-servers", type=int, default=0, metavar="N",
                   help="serve the highest N ranks of each run (at most all) by rank server processes "
                        "that the campaign kills, powers off, stops and restarts (default 0)")
    p.add_argument("--remote", choices=["redis"], default="",
                   help="put a real redis-server behind the remote tier; the campaign kills, stops, "
                        "flushes it and alters its blobs")
    p.add_argument("--netns", action="store_true",
                   help="with --rank-servers: each rank server on a host of its own (a network namespace "
                        "on a private bridge; root and ip), whose link the campaign cuts and restores")
    p.add_argument("--plant", metavar="NAME", help="fuzz a deliberately broken engine (see --list-plants)")
    p.add_argument("--list-plants", action="store_true", help="name the planted bugs and exit")
    p.add_argument("--replay", metavar="FILE", help="replay a saved reproducer")
    p.add_argument("--out", default="fuzz-failures", help="where reproducers go (default ./fuzz-failures)")
    p.add_argument("--all-reproducers", action="store_true",
                   help="shrink and save every failure (default: the first of each kind)")
    p.add_argument("--workdir", help="where run directories go (default /dev/shm or the temp dir)")
    p.add_argument("--stop-after", type=int, metavar="N", help="stop after N violations")
    p.add_argument("--shrink-seconds", type=float, help="time to shrink each failure (0: do not)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.add_argument("--verbose", action="store_true", help="keep the engine's warnings on stderr")


def run(args: argparse.Namespace) -> int:
    if args.list_plants:
        for pl in plants.PLANTS.values():
            if args.json:
                continue
            print(f"{pl.name:24} {pl.summary}\n{'':24} found by: {pl.found_by}")
        if args.json:
            print(json.dumps([{"name": pl.name, "summary": pl.summary, "found_by": pl.found_by,
                               "config": pl.config} for pl in plants.PLANTS.values()]))
        return 0
    if args.rank_servers < 0:
        raise InvalidArgumentError("--rank-servers", f"must be 0 or more, got {args.rank_servers}")
    if args.netns:
        if not args.rank_servers:
            raise InvalidArgumentError("--netns", "needs --rank-servers N")
        why = netns.unavailable()
        if why is not None:
            raise InvalidArgumentError("--netns", why)
    if args.workdir is not None:
        ensure_dir("--workdir", args.workdir)  # created now: a bad one is exit 2, not a violation's 1
    if os.path.lexists(args.out) and not os.path.isdir(args.out):
        raise InvalidArgumentError(f"--out {args.out}", "not a directory")
    plant = None
    if args.plant:
        try:
            plant = plants.get(args.plant)
        except KeyError as exc:
            print(exc.args[0], file=sys.stderr)
            return 2
    with _engine_logs(args.verbose):
        if args.replay:
            return _replay(args)
        return _campaign(args, plant)


def _campaign(args: argparse.Namespace, plant: Any) -> int:
    profile = args.profile or ("campaign" if args.minutes else "dev")
    show = _Progress(enabled=not args.quiet)
    res = run_campaign(
        args.seed, steps=args.steps, minutes=args.minutes, ranks=args.ranks, plant=plant,
        profile=profile, out=args.out, workdir=args.workdir, stop_after=args.stop_after,
        shrink_s=args.shrink_seconds, progress=show, watchdog_s=300,
        reproducers_per_kind=None if args.all_reproducers else 1,
        rank_servers=args.rank_servers, remote=args.remote, netns=args.netns,
    )
    show.done()
    d = res.to_dict()
    if args.json:
        print(json.dumps(d))
    else:
        _print_summary(d)
    if res.violations:
        return 1
    return 130 if res.interrupted else 0


def _replay(args: argparse.Namespace) -> int:
    try:
        cfg, ops, plant, doc = load_reproducer(args.replay)
    except (OSError, ValueError, KeyError) as exc:
        print(f"cannot load {args.replay}: {exc}", file=sys.stderr)
        return 2
    v, n = replay_in_tmp(ops, cfg, plant, args.workdir)
    out = {
        "replayed": args.replay, "ops": len(ops), "applied": n, "config": cfg.to_dict(),
        "plant": None if plant is None else plant.name, "expected": doc.get("violation"),
        "violation": None if v is None else {"kind": v.kind, "detail": v.detail, "step": n},
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(f"replayed {args.replay}: {len(ops)} ops, config {cfg.to_dict()}")
        if v is None:
            print("  no violation: the failure does not reproduce")
        else:
            print(f"  violation at op {n}: [{v.kind}] {v.detail}")
    return 0 if v is None else 1


def _print_summary(d: dict[str, Any]) -> None:
    print(f"fuzz campaign seed {d['seed']} ({d['profile']}{', plant ' + d['plant'] if d['plant'] else ''}): "
          f"{d['steps']} steps in {d['runs']} runs, {d['elapsed_s']} s"
          f"{' (INTERRUPTED)' if d.get('interrupted') else ''}")
    print(f"  crashes {d['crashes']} (power losses {d['power_losses']}, during recovery "
          f"{d['recovery_crashes']}), recoveries {d['recoveries']}, faults {d['faults_total']}")
    for k, v in d["faults"].items():
        print(f"    {k:24} {v}")
    if not d["violations"]:
        print("  no violation")
    for v in d["violations"]:
        print(f"  VIOLATION [{v['kind']}] {v['detail']}")
        shrunk = "not shrunk" if v.get("repeat") else f"shrunk to {v.get('shrunk_ops')} ops"
        print(f"    run {v['run']} step {v['step']}, {shrunk}")
        if v.get("replay"):
            print(f"    replay: {v['replay']}")
        elif v.get("repeat"):
            print("    not saved: a reproducer of this kind was saved already (--all-reproducers)")


class _Progress:
    """One status line on stderr, rewritten in place on a terminal, else every 10 s."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.last = 0.0
        self.t0 = time.monotonic()

    def __call__(self, res: Any) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.last < (0.5 if self.tty else 10.0):
            return
        self.last = now
        c = res.counts
        line = (f"[{now - self.t0:7.1f}s] steps {res.steps} runs {res.runs} crashes {c['crashes']} "
                f"power {c['power_losses']} recoveries {c['recoveries']} "
                f"faults {sum(res.faults.values())} violations {len(res.violations)}")
        print(("\r" + line + "  ") if self.tty else line, end="" if self.tty else "\n",
              file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.enabled and self.tty:
            print(file=sys.stderr)


@contextlib.contextmanager
def _engine_logs(verbose: bool) -> Iterator[None]:
    """Silence the engine's warnings (damage found, etc.: expected under fuzzing)."""
    if verbose:
        yield
        return
    with using(stderr_logger(logging.CRITICAL)):
        yield
