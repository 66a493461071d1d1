"""``prefixstore replay TRACE [DIR]``: the trace half of the replay command.

``cmd_replay`` owns the command; it adds these options (``add_trace_arguments``) and
hands a trace replay to ``run_trace``. See ``engine_replay`` for what a replay does.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from prefixstore.base.errors import InvalidInputError
from prefixstore.engine.workdir import ensure_dir


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("trace replay (TRACE given)")
    g.add_argument("--capacity", default="10%",
                   help="tier size in modeled bytes ('64GiB') or a share of the trace's unique bytes "
                        "('10%%', the default)")
    g.add_argument("--limit", type=int, default=None, metavar="N", help="replay only the first N requests")
    g.add_argument("--concurrency", type=int, default=1, metavar="N",
                   help="sessions serving requests at once (threads, 1..256; default 1)")
    g.add_argument("--compare", action="store_true",
                   help="replay prefixstore, leaf-lru and lru on the engine and add the offline optimum")
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
    from prefixstore.replay.compare import compare
    from prefixstore.replay.engine_replay import ReplayConfig, replay
    from prefixstore.replay.report import Series, format_compare, format_report, plot_runs
    from prefixstore.replay.trace import load_trace

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
