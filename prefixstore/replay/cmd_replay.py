"""Replay a workload against the engine.

    prefixstore replay --scenario seed [DIR] [--policy NAME] [--json]

``--scenario seed`` replays the seed scenario (``prefixstore.replay.seed``) on the real
engine with real, scaled files in DIR (new or empty; default a temp dir): a
conversation growing to 855k tokens beside a ~170k-token classifier transcript called
once per turn, in a tier that cannot hold everything. It prints the classifier's
restore ratio after its first call, its modeled call latencies (median, p99) and the
engine's counters; ``--json`` prints one JSON object instead. ``--policy leaf-lru``
runs the pre-fix eviction (only leaves, by recency) for comparison. Without DIR the
files go to a new temporary directory, named in the report and removed at the end
unless --keep is given.

Positional arguments are ``[TRACE] [DIR]``: with ``--scenario`` the only one is DIR;
without it, TRACE names a request trace (Mooncake JSONL) to replay.

Exit status: 0 when the run audited clean and every restore returned the stored
bytes, 1 otherwise, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys

from prefixstore.base.errors import InvalidInputError
from prefixstore.engine.workdir import work_dir
from prefixstore.statemachine.policy import DEFAULT, registered

NAME = "replay"
HELP = "replay a workload (e.g. --scenario seed) on the engine and report hit ratios and latency"
SCENARIOS = ("seed",)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "trace",
        nargs="?",
        default=None,
        metavar="TRACE",
        help="a request trace to replay (omit with --scenario)",
    )
    p.add_argument(
        "dir",
        nargs="?",
        default=None,
        metavar="DIR",
        help="cache directory, new or empty (default: a new temp dir)",
    )
    p.add_argument(
        "--scenario",
        choices=SCENARIOS,
        default=None,
        help="replay a built-in scenario instead of a trace",
    )
    p.add_argument(
        "--policy",
        choices=registered(),
        default=DEFAULT,
        help=f"eviction policy, one registered (default {DEFAULT}; leaf-lru is the pre-fix behaviour)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    from prefixstore.replay.trace_cmd import add_trace_arguments

    add_trace_arguments(p)


def run(args: argparse.Namespace) -> int:
    if args.scenario is not None:
        if args.trace is not None and args.dir is not None:
            print("replay: --scenario takes only DIR, not a trace", file=sys.stderr)
            return 2
        root = args.dir if args.dir is not None else args.trace
        with work_dir("replay", root, args.keep, prefix="seed") as work:
            return run_scenario(args.scenario, work, args.policy, args.json)
    return run_trace(args)


def run_scenario(name: str, root: str, policy: str, as_json: bool) -> int:
    from prefixstore.replay.seed import SeedConfig, run_seed

    assert name == "seed", name
    try:
        res = run_seed(root, policy, SeedConfig())
    except InvalidInputError as exc:
        print(f"replay: {exc}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(res, sort_keys=True))
    else:
        print(format_seed(res))
    return 0 if res["audit_ok"] and not res["wrong_bytes"] else 1


def run_trace(args: argparse.Namespace) -> int:
    """Replay a request trace (the trace replayer plugs in here)."""
    if args.trace is None:
        print("replay: give a TRACE or --scenario NAME (see --help)", file=sys.stderr)
        return 2
    from prefixstore.replay.trace_cmd import run_trace as run_trace_replay

    return run_trace_replay(args)


def _gib(nbytes: float) -> str:
    return f"{nbytes / (1 << 30):.1f} GiB"


def format_seed(r: dict) -> str:
    """The seed scenario's results as a short human-readable report."""
    calls = r["classifier_calls"] - 1
    lines = [
        f"seed scenario, policy {r['policy']}: a {r['conversation_tokens']:,}-token conversation "
        f"in {r['conversation_turns']} turns beside a {r['classifier_tokens']:,}-token classifier "
        f"transcript; tier {_gib(r['capacity_bytes_modeled'])} (files scaled: tokens /"
        f"{r['token_scale']}, bytes /{r['byte_scale']}) in {r['directory']}",
        f"classifier: {r['classifier_restores_after_first']} of {calls} calls after the first "
        f"restored (restore ratio {r['classifier_restore_ratio']:.3f}); modeled latency "
        f"p50 {r['classifier_latency_s_p50']:.2f} s, p99 {r['classifier_latency_s_p99']:.2f} s "
        f"(a miss costs {r['classifier_miss_s']:.2f} s)",
        f"conversation: {r['conversation_restore_hits']} of {r['conversation_restores']} restores "
        f"after preemption hit; modeled turn latency p50 {r['conversation_latency_s_p50']:.2f} s",
        f"tier: {_gib(r['charged_bytes_modeled'])} charged, {_gib(r['snapshot_bytes_used_modeled'])} "
        f"of it snapshots, {r['nodes']} nodes; audit {'clean' if r['audit_ok'] else 'FAILED'}; "
        f"restored bytes {'all verified' if not r['wrong_bytes'] else 'WRONG: ' + str(r['wrong_bytes'])}",
        "counters (bytes are file bytes: modeled / byte_scale):",
    ]
    for k, v in sorted(r["counters"].items()):
        lines.append(f"  {k:34} {v:.2f}" if isinstance(v, float) else f"  {k:34} {v}")
    return "\n".join(lines)
