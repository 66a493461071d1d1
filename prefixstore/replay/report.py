"""Reports of trace replays: text tables and PNG plots (matplotlib, the ``plots`` extra).

Plots (``plot_runs``), one PNG each, every run of a comparison overlaid:

- ``hit_ratio.png``: block hit ratio per minute of trace time, and cumulative;
- ``capacity.png``: charged bytes (modeled) against the capacity, over trace time;
- ``latency.png``: the modeled time-to-first-token distribution (CDF, log scale).

A run is a ``Series``: a name, the per-request records and (for engine runs)
capacity samples; a simulated run (e.g. the offline optimum) has no samples.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import attrs

from prefixstore.replay.engine_replay import Timeline, percentile


@attrs.define
class Series:
    """One run to plot."""

    name: str
    timeline: Timeline
    capacity_bytes_modeled: int = 0


def _gib(nbytes: float) -> str:
    return f"{nbytes / (1 << 30):,.0f} GiB"


def format_report(s: dict[str, Any]) -> str:
    """One replay's summary as a short human-readable report."""
    lines = [
        f"replay of {s['requests']:,} requests, policy {s['policy']}"
        f"{' (ported retention + admission)' if s.get('retention') else ''}, "
        f"{s['concurrency']} session(s), checkpoints "
        f"{'every {} blocks and '.format(s['checkpoint_every']) if s['checkpoint_every'] else ''}"
        "at the last full block",
        f"tier: {_gib(s['capacity_bytes_modeled'])} modeled ({s['capacity']}; "
        f"{s['capacity_blocks']:,} blocks of {s['unique_blocks']:,} unique; files scaled 1/{s['byte_scale']}: "
        f"{s['capacity_bytes_files'] / (1 << 20):,.1f} MiB) in {s['directory']}",
        f"hit ratio: blocks {s['hit_ratio_blocks']:.4f} ({s['blocks_hit']:,} of {s['blocks_total']:,}), "
        f"tokens {s['hit_ratio_tokens']:.4f} ({s['tokens_hit']:,} of {s['tokens_total']:,})",
        f"prefill: {s['prefill_s_saved']:,.1f} s saved of {s['prefill_s_total']:,.1f} s (modeled); "
        f"time to first token p50 {s['ttft_s_p50']:.3f} s, p99 {s['ttft_s_p99']:.3f} s, mean {s['ttft_s_mean']:.3f} s",
        f"restores: {s['restores']:,} verified ({s['wrong_bytes']} wrong), {s['restores_stale']} stale; "
        f"stores: {', '.join(f'{k} {v:,}' for k, v in s['stores'].items())}",
        f"end: {s['nodes']:,} nodes, {_gib(s['charged_bytes_modeled'])} charged; audit "
        f"{'clean' if s['audit_ok'] else 'FAILED: ' + repr(s['audit_violations'][:3])}; "
        f"wall {s['wall_s']:.1f} s ({s['requests_per_s']:.0f} requests/s)",
    ]
    if "admission" in s:
        a = s["admission"]
        lines.append(
            f"admission: reuse-hit fraction {a['reuse_hit_fraction']:.3f}, gate "
            f"{'closed' if a['gated'] else 'open'}, window {a['window_blocks']} blocks, "
            f"{s['admission_limited']:,} requests limited, {a['refused']} stores refused; "
            f"retention {a['retention_blocks']:,.0f} block touches"
        )
    counters = s.get("counters", {})
    keep = ("evictions.", "skips.", "replaces.", "lookups.", "retries.", "faults.")
    shown = {k: v for k, v in sorted(counters.items()) if k.startswith(keep)}
    if shown:
        lines.append("counters: " + ", ".join(f"{k} {v:g}" for k, v in shown.items()))
    return "\n".join(lines)


COMPARE_COLUMNS = (
    ("hit_ratio_blocks", "hit blocks", "{:.4f}"),
    ("hit_ratio_tokens", "hit tokens", "{:.4f}"),
    ("of_optimal", "/ optimum", "{:.3f}"),
    ("sim_hit_ratio_blocks", "sim blocks", "{:.4f}"),
    ("prefill_s_saved", "prefill s saved", "{:,.0f}"),
    ("ttft_s_p50", "TTFT p50 s", "{:.3f}"),
    ("ttft_s_p99", "TTFT p99 s", "{:.3f}"),
    ("wall_s", "wall s", "{:.1f}"),
)


def format_compare(results: dict[str, dict[str, Any]]) -> str:
    """One table, a row per policy (``optimal`` last)."""
    head = ["policy", *(c[1] for c in COMPARE_COLUMNS)]
    rows = [head]
    for name, r in results.items():
        if not isinstance(r, dict) or "hit_ratio_blocks" not in r:
            continue
        row = [name]
        for key, _, fmt in COMPARE_COLUMNS:
            v = r.get(key)
            row.append("-" if v is None else fmt.format(v))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    out = []
    for j, r in enumerate(rows):
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))))
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def _minutes(tl: Timeline) -> list[float]:
    return [t / 60000.0 for t in tl.timestamps_ms]


def _binned_ratio(tl: Timeline, bin_ms: int = 60_000) -> tuple[list[float], list[float]]:
    hits: dict[int, int] = {}
    refs: dict[int, int] = {}
    for ts, b, h in zip(tl.timestamps_ms, tl.blocks, tl.hit_blocks, strict=True):
        k = ts // bin_ms
        hits[k] = hits.get(k, 0) + h
        refs[k] = refs.get(k, 0) + b
    keys = sorted(refs)
    return [(k + 0.5) * bin_ms / 60000.0 for k in keys], [hits[k] / refs[k] for k in keys]


def _cumulative(tl: Timeline) -> list[float]:
    out, h, b = [], 0, 0
    for hb, bb in zip(tl.hit_blocks, tl.blocks, strict=True):
        h += hb
        b += bb
        out.append(h / b if b else 0.0)
    return out


def plot_runs(runs: Sequence[Series], outdir: str, *, title: str = "") -> list[str]:
    """Write hit_ratio.png, capacity.png and latency.png to ``outdir``; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(outdir, exist_ok=True)
    paths = []
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, run in enumerate(runs):
        c = colors[i % len(colors)]
        x, y = _binned_ratio(run.timeline)
        ax.plot(x, y, color=c, alpha=0.35, linewidth=1)
        ax.plot(_minutes(run.timeline), _cumulative(run.timeline), color=c, linewidth=2,
                label=f"{run.name} (cumulative {_cumulative(run.timeline)[-1]:.3f})")
    ax.set_xlabel("trace time (minutes)")
    ax.set_ylabel("block hit ratio (thin: per minute)")
    ax.set_ylim(0, 1)
    ax.set_title(title or "hit ratio over time")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    paths.append(_save(fig, outdir, "hit_ratio.png"))

    fig, ax = plt.subplots(figsize=(9, 4.5))
    cap = 0
    for i, run in enumerate(runs):
        if not run.timeline.samples:
            continue
        tl = run.timeline
        x = [tl.timestamps_ms[min(d, len(tl.timestamps_ms)) - 1] / 60000.0 for d, _, _ in tl.samples]
        ax.plot(x, [c / (1 << 30) for _, c, _ in tl.samples], color=colors[i % len(colors)], label=run.name)
        cap = max(cap, run.capacity_bytes_modeled)
    if cap:
        ax.axhline(cap / (1 << 30), color="black", linestyle="--", linewidth=1, label="capacity")
    ax.set_xlabel("trace time (minutes)")
    ax.set_ylabel("charged GiB (modeled)")
    ax.set_ylim(bottom=0)
    ax.set_title((title + ": " if title else "") + "tier usage over time")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    paths.append(_save(fig, outdir, "capacity.png"))

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, run in enumerate(runs):
        v = sorted(max(t, 1e-4) for t in run.timeline.ttft_s)
        n = len(v)
        ax.plot(v, [(j + 1) / n for j in range(n)], color=colors[i % len(colors)],
                label=f"{run.name} (p50 {percentile(v, 50):.2f} s, p99 {percentile(v, 99):.2f} s)")
    ax.set_xscale("log")
    ax.set_xlabel("modeled time to first token (s)")
    ax.set_ylabel("share of requests")
    ax.set_title((title + ": " if title else "") + "latency distribution")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3, which="both")
    paths.append(_save(fig, outdir, "latency.png"))
    return paths


def _save(fig, outdir: str, name: str) -> str:
    import matplotlib.pyplot as plt

    path = os.path.join(outdir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
