"""prefixstore beside the caches a user would pick instead, on the same checkpoints.

The same ``--ckpts`` checkpoints of ``--ckpt-mib`` MiB (bfloat16, pages of 256 tokens x
1 KiB = 256 KiB where a peer stores pages) stored and restored through each peer in
one run, on the same directory file system, in interleaved rounds (each round runs
every peer, in a rotated order, each on a fresh directory):

- ``raw``: one file per checkpoint, write + fsync; read back whole (the physical limit);
- ``prefixstore``: ``Engine.store`` / ``lookup`` + ``restore`` (FULL), and
  ``prefixstore-into``: the same restores into tensors allocated once (``into=``);
- ``prefixstore-sglang``: prefixstore's SGLang adapter (``PrefixStoreHiCache``, made by
  SGLang's own ``StorageBackendFactory``) driven by the calls SGLang's cache controller
  makes: ``batch_set_v1`` of each checkpoint's pages from a host pool, ``batch_exists``
  then ``batch_get_v1`` into host slots;
- ``sglang-file``: SGLang's own ``HiCacheFile`` backend through the controller's generic
  page path (``batch_set`` of host-pool pages; ``batch_get`` into dummy pages, then
  ``set_from_flat_data_page``);
- ``lmcache-disk`` / ``lmcache-cpu``: LMCache 0.5.6's ``LMCacheEngine`` with its
  ``local_disk`` (no CPU tier) or ``local_cpu`` backend, on CPU KV caches through a
  small CPU connector (``tests/lmcache_driver.CPUConnector``); a store waits until
  every chunk is in the backend.

Store and restore throughput are reported as ratios to raw's in the same round
(medians over rounds), restores with the page cache warm and cold (``posix_fadvise
(DONTNEED)`` on every file under the peer's directory). Every restore is checked
byte for byte, outside the timed part. **Durability** is measured, not read from documentation: a child
process stores the checkpoints through the peer under ``strace -f -e
trace=fsync,fdatasync`` and is SIGKILLed as soon as its last store returned; the
parent then opens the peer on the same directory and counts the checkpoints that come
back intact (what a SIGKILL leaves), and the fsyncs the child made on the peer's files
(without one, a power loss may take what the SIGKILL left).

    python bench/peers.py                 # 32 x 4 MiB, 3 rounds
    python bench/peers.py --quick         # 4 x 1 MiB, 1 round (a smoke run)

Writes ``bench/results/peers.json`` and ``.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))

import torch  # noqa: E402

from prefixstore import Layout, Prefix, TensorSpec  # noqa: E402
from prefixstore.engine.api import Engine  # noqa: E402

TOKEN_SHAPE = (8, 64)  # bfloat16: 1 KiB per token
PAGE = 256  # tokens per page: 256 KiB
TOKEN_BYTES = 1024


def drop_cache(root: str) -> None:
    for dp, _, fs in os.walk(root):
        for f in fs:
            with contextlib.suppress(OSError):
                fd = os.open(os.path.join(dp, f), os.O_RDONLY)
                try:
                    os.fdatasync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def checkpoints(n: int, mib: int) -> list[torch.Tensor]:
    tokens = mib * (1 << 20) // TOKEN_BYTES
    g = torch.Generator().manual_seed(7)
    return [torch.randn((tokens, *TOKEN_SHAPE), generator=g).to(torch.bfloat16) for _ in range(n)]


# ------------------------------------------------------------------------------ peers


class Raw:
    name, durable_claim = "raw", "write + fsync"

    def __init__(self, root: str, data: list[torch.Tensor]) -> None:
        self.root, self.data = root, data
        os.makedirs(root, exist_ok=True)

    def store(self, i: int) -> None:
        fd = os.open(os.path.join(self.root, f"{i}.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, self.data[i].view(torch.uint8).numpy())
            os.fsync(fd)
        finally:
            os.close(fd)

    def fetch(self, i: int) -> Any:
        try:
            with open(os.path.join(self.root, f"{i}.bin"), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def verify(self, i: int, got: Any) -> bool:
        return got == self.data[i].view(torch.uint8).numpy().tobytes()

    def close(self) -> None:
        pass


class PrefixStore:
    name = "prefixstore"

    def __init__(self, root: str, data: list[torch.Tensor], into: bool = False) -> None:
        self.data, self.into = data, into
        bt = PAGE
        self.layout = Layout(segments=[TensorSpec("kv", "bfloat16", TOKEN_SHAPE)], block_tokens=bt)
        self.eng = Engine.open(root, self.layout, 1 << 40)
        self.out = {"kv": torch.empty_like(data[0])} if into else None
        if into:
            self.name = "prefixstore-into"

    def prefix(self, i: int) -> Prefix:
        return Prefix.from_ids([i * 10**6 + j for j in range(self.data[i].shape[0] // PAGE)])

    def store(self, i: int) -> None:
        assert self.eng.store(self.prefix(i), {"kv": self.data[i]}).ok

    def fetch(self, i: int) -> Any:
        m = self.eng.lookup(self.prefix(i))
        if not m.hit or m.tokens != self.data[i].shape[0]:
            return None
        return self.eng.restore(m, into=self.out)

    def verify(self, i: int, got: Any) -> bool:
        return torch.equal(got.segments[0]["kv"], self.data[i])

    def close(self) -> None:
        self.eng.close()


def _page_keys(i: int, n: int) -> list[str]:
    import hashlib

    out, prev = [], f"ckpt{i}".encode()
    for j in range(n):
        prev = hashlib.sha256(prev + j.to_bytes(4, "little")).hexdigest().encode()
        out.append(prev.decode())
    return out


class _SGLangPeer:
    """A host pool holding every checkpoint's pages (the store side) and one
    checkpoint's worth of slots to restore into."""

    def __init__(self, data: list[torch.Tensor]) -> None:
        from sglang_driver import HostPool

        self.data = data
        self.tokens = data[0].shape[0]
        self.pages = self.tokens // PAGE
        self.pool = HostPool(len(data) * self.tokens + self.tokens, PAGE, TOKEN_SHAPE)
        for i, d in enumerate(data):
            self.pool.kv_buffer[i * self.tokens : (i + 1) * self.tokens] = d
        self.keys = [_page_keys(i, self.pages) for i in range(len(data))]
        self.dst = len(data) * self.tokens

    def slots(self, i: int | None) -> torch.Tensor:
        base = self.dst if i is None else i * self.tokens
        return torch.arange(base, base + self.tokens, dtype=torch.int64)

    def verify(self, i: int, got: Any) -> bool:
        rows = self.pool.kv_buffer[self.dst : self.dst + self.tokens]
        ok = torch.equal(rows, self.data[i])
        rows.zero_()
        return ok


class PrefixStoreSGLang(_SGLangPeer):
    name = "prefixstore-sglang"

    def __init__(self, root: str, data: list[torch.Tensor]) -> None:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
        from sglang_driver import config

        super().__init__(data)
        self.info = HiCacheStorageExtraInfo
        self.backend = StorageBackendFactory.create_backend(
            "dynamic", config(root, capacity_bytes=1 << 40), self.pool, engine_options={})
        self.backend.register_mem_pool_host(self.pool)
        self.backend.on_host_pools_registered()

    def store(self, i: int) -> None:
        ok = self.backend.batch_set_v1(self.keys[i], self.slots(i), self.info(prefix_keys=[]))
        assert all(ok), ok

    def fetch(self, i: int) -> Any:
        if self.backend.batch_exists(self.keys[i], self.info(prefix_keys=[])) != self.pages:
            return None
        ok = self.backend.batch_get_v1(self.keys[i], self.slots(None), self.info(prefix_keys=[]))
        return True if all(ok) else None

    def close(self) -> None:
        self.backend.close()


class SGLangFile(_SGLangPeer):
    name = "sglang-file"

    def __init__(self, root: str, data: list[torch.Tensor]) -> None:
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

        super().__init__(data)
        cfg = HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
            is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
            model_name="tiny", extra_config={"file_storage_path": root})
        self.backend = HiCacheFile(cfg)

    def store(self, i: int) -> None:  # the controller's _generic_page_set
        idx = self.slots(i)
        pages = [self.pool.get_data_page(idx[j * PAGE]) for j in range(self.pages)]
        assert self.backend.batch_set(self.keys[i], pages)

    def fetch(self, i: int) -> Any:  # batch_exists, then _generic_page_get
        if self.backend.batch_exists(self.keys[i]) != self.pages:
            return None
        dummy = [self.pool.get_dummy_flat_data_page() for _ in self.keys[i]]
        got = self.backend.batch_get(self.keys[i], dummy)
        if got is None or any(g is None for g in got):
            return None
        idx = self.slots(None)
        for j, page in enumerate(got):
            self.pool.set_from_flat_data_page(idx[j * PAGE], page)
        return True

    def close(self) -> None:
        pass


class LMCache:
    """LMCacheEngine on CPU KV caches (2 layers x [2, slots, 8 heads / 2, 64]): a
    checkpoint of ``tokens`` 1 KiB rows is ``tokens / 4`` LMCache tokens of 4 KiB."""

    LAYERS, HEADS, HEAD = 2, 8, 64

    def __init__(self, root: str, data: list[torch.Tensor], disk: bool) -> None:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache_driver import CPUConnector

        self.name = "lmcache-disk" if disk else "lmcache-cpu"
        self.builder = LMCacheEngineBuilder
        self.data = data
        n = data[0].numel() * 2 // (self.LAYERS * 2 * self.HEADS * self.HEAD * 2)  # LMCache tokens
        self.n, chunk = n, 256
        total = len(data) * n
        gib = len(data) * data[0].numel() * 2 / (1 << 30) * 1.5 + 0.1
        opts: dict[str, Any] = dict(chunk_size=chunk, save_unfull_chunk=True, remote_serde="naive",
                                    pre_caching_hash_algorithm="sha256_cbor_64bit")
        if disk:
            opts.update(local_cpu=False, max_local_cpu_size=gib, local_disk=f"file://{root}/",
                        max_local_disk_size=gib)
        else:
            opts.update(local_cpu=True, max_local_cpu_size=gib)
        cfg = LMCacheEngineConfig.from_defaults(**opts)
        meta = LMCacheMetadata(model_name="bench", world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=torch.bfloat16,
                               kv_shape=(self.LAYERS, 2, chunk, self.HEADS, self.HEAD), chunk_size=chunk)
        self.id = f"bench-{os.getpid()}-{time.monotonic_ns()}"
        self.engine = LMCacheEngineBuilder.get_or_create(
            self.id, cfg, meta, CPUConnector(self.LAYERS, self.HEADS, self.HEAD), lambda t, r: None, lambda o, r: o)
        self.engine.post_init()
        # the store side holds every checkpoint (slots i*n ..), the restore side one
        self.kv = [torch.zeros(2, total + n, self.HEADS, self.HEAD, dtype=torch.bfloat16) for _ in range(self.LAYERS)]
        for i, d in enumerate(data):
            flat = d.reshape(-1).view(self.LAYERS, 2, n, self.HEADS, self.HEAD)
            for layer in range(self.LAYERS):
                self.kv[layer][:, i * n : (i + 1) * n] = flat[layer]
        self.tokens = [list(range(i * 10**6, i * 10**6 + n)) for i in range(len(data))]

    def store(self, i: int) -> None:
        n = self.n
        t = torch.tensor(self.tokens[i])
        self.engine.store(t, kvcaches=self.kv, slot_mapping=torch.arange(i * n, (i + 1) * n))
        keys = [k for _s, _e, k in self.engine.token_database.process_tokens(t)]
        sm = self.engine.storage_manager
        deadline = time.monotonic() + 60
        while not all(sm.contains(k) for k in keys):  # its writes are asynchronous
            if time.monotonic() > deadline:
                raise TimeoutError("LMCache never finished storing")
            time.sleep(0.0005)

    def fetch(self, i: int) -> Any:
        n, base = self.n, len(self.data) * self.n
        got = self.engine.retrieve(torch.tensor(self.tokens[i]), kvcaches=self.kv,
                                   slot_mapping=torch.arange(base, base + n))
        return True if int(got.sum()) == n else None

    def verify(self, i: int, got: Any) -> bool:
        n, base = self.n, len(self.data) * self.n
        flat = self.data[i].reshape(-1).view(self.LAYERS, 2, n, self.HEADS, self.HEAD)
        ok = all(torch.equal(self.kv[layer][:, base : base + n], flat[layer]) for layer in range(self.LAYERS))
        for layer in range(self.LAYERS):
            self.kv[layer][:, base:].zero_()
        return ok

    def close(self) -> None:
        self.builder.destroy(self.id)


def make(name: str, root: str, data: list[torch.Tensor]) -> Any:
    if name == "raw":
        return Raw(root, data)
    if name == "prefixstore":
        return PrefixStore(root, data)
    if name == "prefixstore-into":
        return PrefixStore(root, data, into=True)
    if name == "prefixstore-sglang":
        return PrefixStoreSGLang(root, data)
    if name == "sglang-file":
        return SGLangFile(root, data)
    if name in ("lmcache-disk", "lmcache-cpu"):
        return LMCache(root, data, disk=name == "lmcache-disk")
    raise ValueError(name)


PEERS = ["raw", "prefixstore", "prefixstore-into", "prefixstore-sglang", "sglang-file", "lmcache-disk", "lmcache-cpu"]


# ------------------------------------------------------------------------------ rounds


def restores(peer: Any, n: int) -> tuple[float, int]:
    """Seconds spent restoring each checkpoint (the byte checks after each, untimed)
    and how many came back right."""
    total, ok = 0.0, 0
    for i in range(n):
        t = time.perf_counter()
        got = peer.fetch(i)
        total += time.perf_counter() - t
        ok += got is not None and peer.verify(i, got)
    return total, ok


def one_round(name: str, root: str, data: list[torch.Tensor]) -> dict[str, float]:
    peer = make(name, root, data)
    n = len(data)
    try:
        t = time.perf_counter()
        for i in range(n):
            peer.store(i)
        store_s = time.perf_counter() - t
        assert peer.fetch(0) is not None  # one untimed restore: first-call costs (imports, pools) out
        warm_s, ok = restores(peer, n)
        assert ok == n, f"{name}: {n - ok} warm restores were wrong or missing"
        drop_cache(root)
        cold_s, cold_ok = restores(peer, n)
    finally:
        peer.close()
    return {"store_s": store_s, "warm_s": warm_s, "cold_s": cold_s, "cold_hits": cold_ok}


def bench(peers: list[str], data: list[torch.Tensor], rounds: int, workdir: str) -> dict[str, Any]:
    times: dict[str, list[dict[str, float]]] = {p: [] for p in peers}
    for r in range(rounds):
        order = peers[r % len(peers):] + peers[: r % len(peers)]
        for name in order:
            root = tempfile.mkdtemp(dir=workdir, prefix=f"{name}-")
            try:
                times[name].append(one_round(name, root, data))
            finally:
                shutil.rmtree(root, ignore_errors=True)
            print(f"round {r} {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in times[name][-1].items()),
                  file=sys.stderr, flush=True)
    nbytes = sum(d.numel() * 2 for d in data)
    out: dict[str, Any] = {}
    for name in peers:
        row: dict[str, Any] = {}
        for k in ("store_s", "warm_s", "cold_s"):
            ratios = [raw[k] / mine[k] for raw, mine in zip(times["raw"], times[name], strict=True)]
            row[k.replace("_s", "_ratio")] = statistics.median(ratios)
            row[k.replace("_s", "_mb_s")] = nbytes / 1e6 / statistics.median(x[k] for x in times[name])
        row["cold_hits"] = min(x["cold_hits"] for x in times[name])
        out[name] = row
    return out


# ------------------------------------------------------------------------------ durability


def child(name: str, root: str, n: int, mib: int) -> None:
    """Store ``n`` checkpoints through ``name``, say so, and wait to be killed."""
    torch.set_num_threads(1)
    data = checkpoints(n, mib)
    peer = make(name, root, data)
    for i in range(n):
        peer.store(i)
    print("STORED", flush=True)
    time.sleep(600)


def durability(name: str, n: int, mib: int, workdir: str) -> dict[str, Any]:
    root = tempfile.mkdtemp(dir=workdir, prefix=f"kill-{name}-")
    trace = os.path.join(workdir, f"strace-{name}.txt")
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    cmd = ["strace", "-f", "-qq", "-e", "trace=fsync,fdatasync,sync_file_range,syncfs", "-o", trace,
           sys.executable, str(Path(__file__).resolve()), "--child", name, root, str(n), str(mib)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                            start_new_session=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        acked = line.strip() == "STORED"
        os.killpg(proc.pid, signal.SIGKILL)  # the peer process and strace at once
        proc.wait(30)
        with open(trace) as f:
            syncs = sum(1 for x in f if "sync" in x and "= 0" in x)
        data = checkpoints(n, mib)
        peer = make(name, root, data)
        try:
            survived = restores(peer, n)[1]
        finally:
            peer.close()
        return {"acked": acked, "survived_sigkill": survived, "of": n, "fsyncs": syncs,
                "power_loss_safe": syncs > 0}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(trace)


# ------------------------------------------------------------------------------ report


def markdown(res: dict[str, Any]) -> str:
    lines = [
        f"# prefixstore beside its peers ({'quick' if res['quick'] else 'full'} run)",
        "",
        f"{res['machine']}; load average {res['loadavg']} at the start, {res['loadavg_end']} at the end; "
        f"{res['ckpts']} x {res['ckpt_mib']} MiB bfloat16 checkpoints, {res['rounds']} interleaved rounds, "
        f"on `{res['fs']}`. Ratios are to raw file I/O in the same round (medians).",
        "",
        "| peer | store / raw | warm restore / raw | cold restore / raw | store MB/s | warm MB/s | cold MB/s "
        "| intact after SIGKILL | fsyncs before ack |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in res["peers"].items():
        d = res["durability"].get(name, {})
        kill = f"{d['survived_sigkill']} / {d['of']}" if d else "n/a"
        syncs = d.get("fsyncs", "n/a")
        lines.append(f"| {name} | {r['store_ratio']:.2f} | {r['warm_ratio']:.2f} | {r['cold_ratio']:.2f} | "
                     f"{r['store_mb_s']:,.0f} | {r['warm_mb_s']:,.0f} | {r['cold_mb_s']:,.0f} | {kill} | {syncs} |")
    lines += ["", "A peer with no fsync before it acknowledges keeps what a SIGKILL leaves (the page cache "
              "survives the process) but not what a power loss takes."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ckpts", type=int, default=32)
    ap.add_argument("--ckpt-mib", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--dir", default=None, help="scratch directory on the file system to measure")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--no-kill", action="store_true", help="skip the SIGKILL durability runs")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        name, root, n, mib = args.child
        child(name, root, int(n), int(mib))
        return 0
    if args.quick:
        args.ckpts, args.ckpt_mib, args.rounds = 4, 1, 1
    torch.set_num_threads(1)
    peers = args.peers.split(",")
    if "raw" not in peers:
        peers.insert(0, "raw")
    work = tempfile.mkdtemp(prefix="prefixstore-peers-", dir=args.dir)
    res: dict[str, Any] = {
        "quick": args.quick, "ckpts": args.ckpts, "ckpt_mib": args.ckpt_mib, "rounds": args.rounds,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "loadavg": " ".join(f"{x:.1f}" for x in os.getloadavg()), "fs": work,
    }
    try:
        data = checkpoints(args.ckpts, args.ckpt_mib)
        res["peers"] = bench(peers, data, args.rounds, work)
        res["durability"] = {} if args.no_kill else {
            p: durability(p, min(args.ckpts, 8), args.ckpt_mib, work) for p in peers}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["loadavg_end"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    os.makedirs(args.out, exist_ok=True)
    stem = "peers_quick" if args.quick else "peers"
    with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
        json.dump(res, f, indent=2, sort_keys=True)
    md = markdown(res)
    with open(os.path.join(args.out, f"{stem}.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
