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
import time
from typing import Any

from prefixstore.base.errors import InvalidInputError
from prefixstore.engine.workdir import ensure_dir, work_dir
from prefixstore.replay.compare import compare
from prefixstore.replay.engine_replay import ReplayConfig, replay
from prefixstore.replay.report import Series, format_compare, format_report, plot_runs
from prefixstore.replay.seed import SeedConfig, run_seed
from prefixstore.replay.trace import load_trace
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


# ---------------------------------------------------------------------- trace replay


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("trace replay (TRACE given)")
    g.add_argument("--capacity", default="10%",
                   help="tier size in modeled bytes ('64GiB') or a share of the trace's unique bytes "
                        "('10%%', the default)")
    g.add_argument("--limit", type=int, default=None, metavar="N", help="replay only the first N requests")
    g.add_argument("--concurrency", type=int, default=1, metavar="N",
                   help="sessions serving requests at once (threads, 1..256; default 1)")
    g.add_argument("--compare", action="store_true",
                   help="replay every registered policy on the engine, simulate each, and add the offline "
                        "optimum")
    g.add_argument("--checkpoint-every", type=int, default=8, metavar="K",
                   help="also checkpoint every K blocks inside a request (default 8; 0: only at its last "
                        "full block)")
    g.add_argument("--no-retention", action="store_true",
                   help="prefixstore without the ported retention and admission (the engine's plain policy)")
    g.add_argument("--bandwidth", type=float, default=20e9, metavar="B/S",
                   help="modeled restore bandwidth in bytes/s (default 20e9: a host-RAM tier)")
    g.add_argument("--synchronous", choices=("NORMAL", "FULL"), default="NORMAL",
                   help="the catalog's SQLite synchronous setting (default NORMAL)")
    g.add_argument("--plots", default=None, metavar="PLOTDIR",
                   help="write hit_ratio.png, capacity.png and latency.png there")
    g.add_argument("--keep", action="store_true",
                   help="keep the temp cache directory (trace or --scenario, without DIR)")
    g.add_argument("--quiet", action="store_true", help="no progress display on stderr")
    g.add_argument("--instances", type=int, default=1, metavar="N",
                   help="engine instances served round-robin, each with --capacity of its own (DIR/iK; "
                        "default 1)")
    g.add_argument("--remote", default=None, metavar="URL",
                   help="a shared remote tier every instance uses: redis://host:port/db, rediss://..., "
                        "redis+cluster://host:port,..., mooncake://host:port?metadata=...")
    g.add_argument("--remote-namespace", default="replay", metavar="NAME",
                   help="the remote tier's key namespace (default 'replay')")


class Progress:
    """A one-line progress display on stderr (a line every 10%% when not a terminal)."""

    def __init__(self, stream=None) -> None:
        self.stream = sys.stderr if stream is None else stream  # the stderr of now, not of import time
        self.tty = self.stream.isatty()
        self.last_decile = -1

    def __call__(self, s: dict[str, Any]) -> None:
        done, total = s["done"], s["total"]
        ratio = s["hit_blocks"] / s["blocks"] if s["blocks"] else 0.0
        rate = done / s["elapsed_s"] if s["elapsed_s"] > 0 else 0.0
        line = (
            f"[{s['policy']}] {done:,}/{total:,} requests  hit ratio {ratio:.3f}  "
            f"tier {s['charged_bytes_modeled'] / (1 << 30):,.0f}/{s['capacity_bytes_modeled'] / (1 << 30):,.0f} GiB  "
            f"{rate:,.0f} req/s  {s['elapsed_s']:.0f} s"
        )
        if self.tty:
            self.stream.write("\r\x1b[K" + line + ("\n" if s.get("final") else ""))
            self.stream.flush()
            return
        decile = done * 10 // max(total, 1)
        if decile != self.last_decile or s.get("final"):
            self.last_decile = decile
            if not s.get("final") or decile != 10:
                print(line, file=self.stream, flush=True)


def run_trace(args: argparse.Namespace) -> int:
    """Replay ``args.trace`` (one policy, or ``--compare``); exit 0 when every run
    audited clean and restored only the stored bytes, 1 otherwise, 2 on bad input."""
    if args.trace is None:
        print("replay: give a TRACE or --scenario NAME (see --help)", file=sys.stderr)
        return 2
    if args.plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("replay: --plots needs matplotlib: install the plots extra "
                  "(pip install 'prefixstore[plots]')", file=sys.stderr)
            return 2
        ensure_dir("--plots", args.plots)  # before the replay, not after it
    try:
        cfg = ReplayConfig(
            policy=args.policy, capacity=args.capacity, concurrency=args.concurrency,
            checkpoint_every=args.checkpoint_every, retention=not args.no_retention,
            bandwidth_bytes_per_s=args.bandwidth, synchronous=args.synchronous,
            instances=args.instances, remote=args.remote, remote_namespace=args.remote_namespace,
        )
        t0 = time.perf_counter()
        requests = load_trace(args.trace, args.limit)
        progress = None if args.quiet else Progress()
        if args.compare:
            comp = compare(requests, cfg, args.dir, progress=progress)
            results = comp.results
            runs = [Series(k, comp.timelines[k], r.get("capacity_bytes_modeled", 0)) for k, r in results.items()]
        else:
            rep = replay(requests, cfg, args.dir, progress=progress, keep=True if args.keep else None)
            results = {cfg.policy: rep.summary}
            runs = [Series(cfg.policy, rep.timeline, rep.summary["capacity_bytes_modeled"])]
        wall = time.perf_counter() - t0
    except (InvalidInputError, OSError) as exc:
        print(f"replay: {exc}", file=sys.stderr)
        return 2
    plots = []
    if args.plots:
        title = f"{args.trace.rsplit('/', 1)[-1]} at {args.capacity}"
        plots = plot_runs(runs, args.plots, title=title)
    engine_runs = [r for r in results.values() if r.get("engine")]
    ok = all(r["audit_ok"] and not r["wrong_bytes"] for r in engine_runs)
    if args.json:
        out: Any = results if args.compare else next(iter(results.values()))
        print(json.dumps(out, sort_keys=True, default=str))
    else:
        if args.compare:
            print(f"{len(requests):,} requests of {args.trace} at {args.capacity}: "
                  f"{engine_runs[0]['capacity_blocks']:,} blocks of {engine_runs[0]['unique_blocks']:,} unique")
            print(format_compare(results))
            print(f"audits {'clean' if ok else 'FAILED'}; wall {wall:.1f} s")
        else:
            print(format_report(results[cfg.policy]))
        for path in plots:
            print(f"plot: {path}")
    return 0 if ok else 1
