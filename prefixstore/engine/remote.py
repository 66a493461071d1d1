"""The shared remote tier (``gpu/remote``: any registered backend) seen from the engine.

Below the local tiers: a store's checkpoint goes to the remote after its local publish
(``prepare`` under the lock, ``send`` after it; write-behind by default); a lookup the
local tiers cannot answer in full asks the remote for the deepest checkpoint of the
chain (``extend``, one round trip; the path may build on the local hit), weighed by the
cost rule with the remote's measured bandwidth and latency; ``restore``
fetches, verifies every rank's blob through ``gpu/verify.py`` and keeps a local copy
through the normal store path when the policy admits it. Nothing here raises for a
network fault, nor touches the local catalog's invariants: the remote's state is an
audit note, never a violation. No credential is logged or stored (URLs are redacted).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from typing import TYPE_CHECKING, Any

import attrs
import torch

from prefixstore.base.errors import InvalidInputError
from prefixstore.base.keys import Prefix
from prefixstore.base.log import log
from prefixstore.engine import restore as local_restore
from prefixstore.engine import store
from prefixstore.engine.config import EngineConfig
from prefixstore.engine.index import Node
from prefixstore.engine.results import Match, Restored
from prefixstore.gpu import shards, verify
from prefixstore.gpu.executor import Staged
from prefixstore.gpu.remote import Manifest, RemoteCollector, RemoteHit, RemoteTier
from prefixstore.statemachine.cost import CostModel, choose

if TYPE_CHECKING:
    from prefixstore.engine.api import Engine

SOURCE = "remote"
"""``Match.source`` of a match the remote tier answers."""


@attrs.frozen(eq=False)
class RemoteRef:
    """What a remote Match restores: the checkpoint path, the request's prefix up to its
    end (for the local copy), and the local tiers' answer (restored instead on a miss)."""

    hit: RemoteHit
    prefix: Prefix
    local: Match


class Backfill:
    """The checkpoints this engine has sent to the remote, and one thread that sends the
    ancestors a new checkpoint builds on which were never sent (those of an earlier
    process, or made by a split): without them no other engine has a path to it."""

    def __init__(self) -> None:
        self.sent: set[tuple[bytes, int]] = set()  # (node key, generation)
        self.jobs: list[concurrent.futures.Future] = []
        self.lock = threading.Lock()
        self.pool = concurrent.futures.ThreadPoolExecutor(1, "prefixstore-remote-backfill")

    def submit(self, fn: Any, *args: Any) -> None:
        with self.lock:
            self.jobs = [j for j in self.jobs if not j.done()]
            with contextlib.suppress(RuntimeError):  # closing: nothing more is sent
                self.jobs.append(self.pool.submit(fn, *args))

    def finish(self, timeout: float) -> None:
        with self.lock:
            jobs = list(self.jobs)
        concurrent.futures.wait(jobs, timeout)
        self.pool.shutdown(wait=False, cancel_futures=True)


# -- open / close -------------------------------------------------------------------------------


def open_tier(eng: Engine, o: EngineConfig) -> None:
    """Set ``eng.remote``: the tier of ``o.remote`` (None without one), its collector in
    the engine's registry."""
    if o.remote is None:
        return
    tier = RemoteTier.for_layout(o.remote, eng.layout, o.remote_options)  # the backend of o.remote's scheme
    eng.counters.registry.register(RemoteCollector(tier.stats))
    eng.remote_backfill = Backfill()
    eng.remote = tier
    log.info("remote_opened", remote=tier.url.redacted(), write_behind=tier.config.write_behind)


def close_tier(eng: Engine, timeout: float) -> None:
    """Send what is being sent and flush queued writes, within ``timeout`` seconds in
    all, then disconnect (idempotent)."""
    tier, eng.remote = eng.remote, None
    if tier is None:
        return
    deadline = time.monotonic() + timeout
    eng.remote_backfill.finish(timeout)
    if not tier.close(max(0.0, deadline - time.monotonic())):
        log.warning("remote_unflushed", remote=tier.url.redacted(), left=tier.stats()["queue_depth"])


# -- store --------------------------------------------------------------------------------------


@attrs.frozen(eq=False)
class Offer:
    """A published checkpoint on its way to the remote: its bytes (copied, so the
    store's buffers may be reused), its manifest, and the ancestors never sent."""

    key: bytes
    manifest: Manifest
    blobs: list[bytes]
    ancestors: list[tuple[Node, dict]]


def prepare(eng: Engine, t: Any) -> Offer | None:
    """After a store's publish (``store.InFlight`` ``t``), lock held: what ``send``
    puts, each rank's shard bytes with the catalog's checksums. None when there is no
    remote, for a local copy of a remote checkpoint (not sent back), or on an error
    (logged: the local store stands whatever the remote does)."""
    tier = eng.remote
    if tier is None or getattr(eng._local, "from_remote", False):
        return None
    try:
        blobs = [bytes(d.buffer.mv()[: d.size]) if isinstance(d, Staged) else bytes(d) for d in t.datas]
        sums = [d.checksum() if isinstance(d, Staged) else shards.checksum(b)
                for d, b in zip(t.datas, blobs, strict=True)]
        m = tier.manifest_for(t.key, blobs, start=t.plan.start, end=t.end, generation=t.gen,
                              snapshot=eng.layout.has_snapshot, checksums=sums)
        eng.remote_backfill.sent.add((t.key, t.gen))
        unsent = unsent_ancestors(eng, t.plan.parent)
        rows = local_restore.file_rows(eng, unsent) if unsent else {}
        return Offer(t.key, m, blobs, [(x, rows[x.id]) for x in unsent])
    except Exception as exc:
        log.warning("remote_offer_failed", key=t.key.hex()[:12], reason=f"{type(exc).__name__}: {exc}")
        return None


def send(eng: Engine, offer: Offer | None) -> None:
    """Put a prepared checkpoint, outside the engine lock: a write-through put waits on
    the network (within its ``write_timeout``) while other calls go on; write-behind
    only queues it. The ancestors go through the backfill thread. Never raises."""
    tier = eng.remote
    if offer is None or tier is None:
        return
    try:
        tier.put(offer.key, offer.manifest, offer.blobs)
        if offer.ancestors:
            eng.remote_backfill.submit(send_nodes, eng, tier, offer.ancestors)
    except Exception as exc:
        log.warning("remote_offer_failed", key=offer.key.hex()[:12], reason=f"{type(exc).__name__}: {exc}")


def unsent_ancestors(eng: Engine, parent: Node | None) -> list[Node]:
    """The ready nodes of ``parent``'s path not sent to the remote (marked sent now). Lock held."""
    if parent is None:
        return []
    sent = eng.remote_backfill.sent
    out = [x for x in eng.index.path(parent) if x.ready and (x.key, x.generation) not in sent]
    sent.update((x.key, x.generation) for x in out)
    return out


def send_nodes(eng: Engine, tier: RemoteTier, nodes: list[tuple[Node, dict]]) -> None:
    """In the backfill thread: read and verify each node's shards from the local tiers
    and put them (a node evicted or replaced meanwhile fails its check: not sent)."""
    for x, rows in nodes:
        if set(rows) != set(range(eng.layout.ranks)):
            continue
        got = [verify.read(eng.ranks[r], *rows[r]) for r in range(eng.layout.ranks)]
        if not all(isinstance(g, verify.Shard) for g in got):
            continue
        blobs = [g.data for g in got]
        try:
            m = tier.manifest_for(x.key, blobs, start=x.start, end=x.end, generation=x.generation,
                                  snapshot=x.has_snapshot, checksums=[rows[r][2] for r in range(len(blobs))])
            tier.put(x.key, m, blobs)
        except Exception as exc:
            log.warning("remote_offer_failed", key=x.key.hex()[:12], reason=f"{type(exc).__name__}: {exc}")


# -- lookup -------------------------------------------------------------------------------------


def extend(eng: Engine, prefix: Prefix, local: Match, gpu_blocks: int, total_tokens: int | None) -> Match:
    """``local`` (the local tiers' answer), or a remote Match when the remote holds a
    deeper checkpoint of ``prefix`` beyond the GPU-resident blocks that the cost rule
    finds worth fetching. One round trip, within the tier's lookup budget."""
    tier = eng.remote
    n = len(prefix)
    held = local.blocks if local.outcome in ("hit", "gpu_resident") else gpu_blocks
    if tier is None or held >= n:
        return local
    reach = local.blocks if local.hit else gpu_blocks  # a remote path may build on these
    hit = tier.deepest(prefix.keys, have=gpu_blocks, reach=reach, need_snapshot=eng.layout.has_snapshot)
    if hit is None:
        return local
    if hit.blocks <= held:
        tier.touch(hit.path)  # in use here: keep its blobs as fresh as its manifests in the store
        return local
    tier.touch(hit.below)  # the remote's copy of the local part, read but not fetched
    bt = eng.layout.block_tokens
    nbytes = sum(m.nbytes for m in hit.path) + (local.nbytes if local_part(local, hit, gpu_blocks) else 0)
    total = total_tokens if total_tokens is not None else n * bt
    model = cost_model(eng, tier)
    decision = choose(model, [(hit.blocks * bt, nbytes, 1)], gpu_blocks * bt, total)
    est = decision.deciding
    if decision.chosen is None:
        eng.counters.inc("remote", "rejected_cost")
        return local
    return attrs.evolve(
        local, outcome="hit", blocks=hit.blocks, node_id=None, path=(), node_key=hit.manifest.prefix_key,
        nbytes=nbytes, transfer_s=est[1] if est else None, prefill_s=est[2] if est else None,
        source=SOURCE, remote=RemoteRef(hit, prefix[: hit.blocks], local),
    )


def local_part(local: Match, hit: RemoteHit, gpu_blocks: int) -> bool:
    """Whether the restore of ``hit`` reads its first blocks (from ``gpu_blocks`` to the
    start of the remote path) from the local tiers' ``local`` hit: the remote path
    starts past the GPU-resident blocks, where the local checkpoint reaches."""
    start = hit.path[0].start
    return start > gpu_blocks and local.hit and local.blocks >= start


def local_reads(match: Match) -> Match | None:
    """The local match whose nodes a restore of ``match`` reads: ``match`` itself, the
    local hit a remote path builds on, or None (a remote path that reads nothing local)."""
    ref = match.remote
    if ref is None:
        return match
    return ref.local if local_part(ref.local, ref.hit, match.gpu_blocks) else None


def cost_model(eng: Engine, tier: RemoteTier) -> CostModel | None:
    """The engine's cost model with the remote's calibration: its bandwidth measured as
    verified bytes over fetch seconds, its per-restore overhead the mean lookup seconds
    (the model's own values until the tier has measured any). None: no cost rule."""
    if eng.cost is None:
        return None
    s = tier.stats()
    bandwidth = s["bytes_in"] / s["fetch_seconds"] if s["bytes_in"] and s["fetch_seconds"] > 0 else None
    answered = s["lookups"] - s["skipped"]
    latency = s["lookup_seconds"] / answered if answered > 0 and s["lookup_seconds"] > 0 else None
    return attrs.evolve(
        eng.cost,
        bandwidth_bytes_per_s=bandwidth or eng.cost.bandwidth_bytes_per_s,
        restore_overhead_s=latency if latency is not None else eng.cost.restore_overhead_s,
        restore_s_per_node=0.0,  # the whole path is one round trip
    )


# -- restore ------------------------------------------------------------------------------------


def restore(eng: Engine, match: Match) -> Restored | None:
    """Fetch and verify every rank's blob of ``match``'s remote path; the tensors. A path
    that starts past the GPU-resident blocks builds on the local tiers' hit: those first
    blocks are restored locally (a miss if that fails meanwhile). On a remote miss (the
    server is down or slow, a blob is absent or does not verify) the local tiers'
    shallower hit is restored instead (its ``Restored.match`` says so), else None.
    A verified remote restore is also stored locally when the policy admits it."""
    tier, ref = eng.remote, match.remote
    got = tier.fetch_path(ref.hit.path) if tier is not None else []
    decoded = decode_path(eng, tier, ref.hit.path, got) if len(got) == len(ref.hit.path) else None
    if decoded is None:
        eng.counters.inc("remote", "missed")
        return local_restore.restore(eng, ref.local) if ref.local.hit else None
    segments, snaps = assemble(eng, ref.hit.path, decoded, match.gpu_blocks)
    if ref.hit.path[0].start > match.gpu_blocks:  # the path builds on the local hit
        below = local_restore.restore(eng, ref.local) if local_reads(match) is not None else None
        if below is None:
            eng.counters.inc("remote", "missed")
            return None
        segments = join_below(eng, below, ref.hit.path[0].start - match.gpu_blocks, segments)
        eng.counters.inc("remote", "joined_local")
    eng.counters.inc("remote", "restored")
    keep_local(eng, ref.prefix, segments, snaps, match.gpu_tokens)
    return Restored(match, segments, snaps, match.gpu_tokens, match.tokens,
                    sum(len(m.blobs) for m in ref.hit.path))


def decode_path(eng: Engine, tier: RemoteTier, path: tuple[Manifest, ...],
                blobs: list[list[bytes]]) -> list[list[verify.Shard]] | None:
    """Each manifest's per-rank shards, checked by ``verify.check`` (size, checksum and
    the header naming this checkpoint, span and rank); None if any fails (a verify
    failure of the tier, counted)."""
    L = eng.layout
    out: list[list[verify.Shard]] = []
    for m, datas in zip(path, blobs, strict=True):
        meta = shards.meta(m.prefix_key, m.generation, m.start, m.end, m.snapshot)
        row = []
        for r, (ref, data) in enumerate(zip(m.blobs, datas, strict=True)):
            header = verify.Header(L, (m.end - m.start) * L.block_tokens, m.snapshot, {**meta, "rank": str(r)})
            got = verify.check(data, ref.size, ref.checksum, header, ref.key)
            if isinstance(got, verify.Damage):
                tier.refused(m, r, got.why)
                return None
            row.append(got)
        out.append(row)
    return out


def assemble(eng: Engine, path: tuple[Manifest, ...], decoded: list[list[verify.Shard]], gpu_blocks: int):
    """Per rank: the segment rows from ``gpu_blocks`` to the path's end (copies, one
    tensor per name), and the last checkpoint's snapshot."""
    L = eng.layout
    segments, snaps = [], []
    for r in range(L.ranks):
        parts: dict[str, list[torch.Tensor]] = {}
        for m, row in zip(path, decoded, strict=True):
            skip = max(0, gpu_blocks - m.start) * L.block_tokens
            for name, t in row[r].segments.items():
                parts.setdefault(name, []).append(t[skip:])
        segments.append({name: torch.cat(ts) for name, ts in parts.items()})
        snaps.append({name: t.clone() for name, t in decoded[-1][r].snapshot.items()})
    return segments, snaps


def join_below(eng: Engine, below: Restored, blocks: int, segments: list) -> list:
    """Per rank: the first ``blocks`` blocks of the locally restored ``below`` followed
    by the remote ``segments``."""
    rows = blocks * eng.layout.block_tokens
    return [{name: torch.cat([below.segments[r][name][:rows], t]) for name, t in seg.items()}
            for r, seg in enumerate(segments)]


def keep_local(eng: Engine, prefix: Prefix, segments: list, snaps: list, tokens_from: int) -> None:
    """Store a restored remote checkpoint locally through the normal store path (its
    admission, space and policy decide); not sent back to the remote."""
    if eng.read_only is not None:
        return
    eng._local.from_remote = True
    try:
        res = store.store(eng, prefix, segments, snaps if eng.layout.has_snapshot else None, tokens_from)
        if res.ok:
            eng.counters.inc("remote", "kept_local")
    except InvalidInputError:  # the local plan needs rows below the GPU-resident part
        pass
    finally:
        eng._local.from_remote = False


# -- stats / audit ------------------------------------------------------------------------------


def stats(eng: Engine) -> dict[str, Any] | None:
    """The remote's counters and gauges with its redacted URL; None without one."""
    tier = eng.remote
    if tier is None:
        return None
    return {"url": tier.url.redacted(), **tier.stats()}


def note(eng: Engine, report: Any) -> None:
    """The remote's state as an audit note (never a violation: the local invariants do
    not depend on it)."""
    s = stats(eng)
    if s is None:
        return
    report.notes.append(
        f"remote tier {s['url']}: {'up' if s['up'] else 'down (reconnecting)'}, "
        f"{int(s['queue_depth'])} checkpoint(s) queued, {int(s['hits'])} hit(s), {int(s['misses'])} miss(es), "
        f"{int(s['verify_failures'])} verify failure(s), {int(s['dropped'])} dropped write(s)"
    )
