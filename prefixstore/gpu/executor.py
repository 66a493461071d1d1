"""Executors: the device side of a store and a restore, behind one interface.

A store *stages* a checkpoint: each tensor is copied from the device straight into its
place in a host buffer laid out as the shard file (``shards.plan_shard``), so the file
is later written from that buffer with no further copy. The copy is asynchronous; its
``Copy`` handle says when the device tensors may be released. A restore *uploads*
tensor views of a host buffer (a file read into a staging buffer, or a RAM-tier
buffer) into device tensors it allocated once for the whole request.

- ``CpuExecutor``: the "device" is the CPU (tests, no GPU). Copies run inline.
- ``CudaExecutor``: pinned staging buffers, a dedicated device-to-host stream and a
  dedicated host-to-device stream, with events: a store's copies are enqueued on the
  D2H stream after the caller's stream (so they see its writes); a restore's copies
  are enqueued on the H2D stream and the caller's stream waits on them.

Both keep ``CopyStats``: bytes moved device->host, host->device, read from a tier into
host memory, and *host->host* copies, the ones a zero-copy path must not make (tests
assert they stay zero). ``StagingPool`` recycles host buffers by size class.
``ForegroundGate`` gives restores priority: background copy work (a store's staging
after the caller asked for it in the background, checksums of the commit worker)
waits, bounded, while a restore is running.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import attrs
import numpy as np
import torch

from prefixstore.gpu import shards

# ------------------------------------------------------------------------------ counters


class CopyStats:
    """Bytes and counts of every copy an executor (and the paths around it) made."""

    FIELDS = ("d2h_bytes", "h2d_bytes", "host_copy_bytes", "tier_read_bytes", "d2h_copies",
              "h2d_copies", "host_copies", "gate_waits")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._v: dict[str, float] = dict.fromkeys(self.FIELDS, 0)
        self._v["gate_wait_s"] = 0.0

    def add(self, **kv: float) -> None:
        with self._lock:
            for k, v in kv.items():
                self._v[k] = self._v.get(k, 0) + v

    def host_copy(self, nbytes: int) -> None:
        """Record a host->host copy of ``nbytes`` tensor bytes."""
        if nbytes:
            self.add(host_copy_bytes=nbytes, host_copies=1)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._v)

    def __getitem__(self, key: str) -> float:
        with self._lock:
            return self._v[key]


# ------------------------------------------------------------------------------ copies


class Copy:
    """Completion of asynchronous copies, with the interface of ``threading.Event``."""

    def __init__(self, events: list[Any] | None = None) -> None:
        self._events = events or []

    def is_set(self) -> bool:
        return all(e.query() for e in self._events)

    def wait(self, timeout: float | None = None) -> bool:
        if timeout is None:
            for e in self._events:
                e.synchronize()
            return True
        deadline = time.monotonic() + timeout
        while not self.is_set():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.0002)
        return True

    def __add__(self, other: Copy) -> Copy:
        return Copy(self._events + other._events)


DONE = Copy()


# ------------------------------------------------------------------------------ buffers


class Buffer:
    """A host buffer from a ``StagingPool``: ``view()`` is its first ``nbytes`` bytes.

    Reference counted: the owner holds one reference; readers (a restore reading a
    RAM-tier buffer) ``retain`` one while they copy from it. The buffer returns to its
    pool when the last reference is released, and is reused only after the copies
    recorded with ``release(after=...)`` have completed.
    """

    __slots__ = ("tensor", "nbytes", "klass", "_pool", "_refs", "_fence", "_lock", "parsed", "_np", "__weakref__")

    def __init__(self, tensor: torch.Tensor, nbytes: int, klass: int, pool: StagingPool | None) -> None:
        self.tensor = tensor
        self.nbytes = nbytes
        self.klass = klass
        self._pool = pool
        self._refs = 1
        self._fence: Copy | None = None
        self._lock = threading.Lock()
        self.parsed: Any = None  # a restore's validated views of these bytes, with their key
        self._np: Any = None

    def array(self) -> np.ndarray:
        """The whole buffer as a numpy uint8 array (made once: restores slice it)."""
        if self._np is None:
            self._np = self.tensor.numpy()
        return self._np

    def view(self) -> torch.Tensor:
        """The buffer's bytes as a 1-D uint8 tensor (no copy)."""
        return self.tensor[: self.nbytes]

    def mv(self) -> memoryview:
        """The buffer's bytes as a writable memoryview (no copy)."""
        return shards.buffer_view(self.view())

    def retain(self) -> Buffer:
        with self._lock:
            if self._refs <= 0:
                raise RuntimeError("buffer retained after its last release")
            self._refs += 1
        return self

    def release(self, after: Copy | None = None) -> None:
        """Drop one reference; ``after``: copies still reading the buffer."""
        with self._lock:
            if self._refs <= 0:
                raise RuntimeError("buffer released more times than it was retained")
            self._refs -= 1
            if after is not None and after is not DONE:
                self._fence = after if self._fence is None else self._fence + after
            last = self._refs == 0
        if last and self._pool is not None:
            self._pool._give_back(self)

    def detach(self) -> None:
        """Take the buffer out of its pool: it is freed when no tensor views it any more."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool._forget(self)

    @property
    def refs(self) -> int:
        return self._refs


def size_class(nbytes: int, pow2: bool = False) -> int:
    """The capacity a buffer of ``nbytes`` is allocated with (reused within a class)."""
    n = max(int(nbytes), 4096)
    p = 1 << (n - 1).bit_length()
    if pow2 or n <= 65536:
        return p if pow2 else -(-n // 4096) * 4096
    step = p // 8
    return -(-n // step) * step


class StagingPool:
    """Host buffers recycled by size class; at most ``keep_bytes`` of them kept free."""

    def __init__(self, alloc: Callable[[int], torch.Tensor], keep_bytes: int, *, pow2: bool = False) -> None:
        self._alloc = alloc
        self.keep_bytes = int(keep_bytes)
        self.pow2 = pow2
        self._lock = threading.Lock()
        self._free: dict[int, list[Buffer]] = defaultdict(list)
        self.free_bytes = 0
        self.outstanding_bytes = 0
        self.allocs = 0
        self.reuses = 0
        self.dropped = 0
        self.detached = 0

    def acquire(self, nbytes: int) -> Buffer:
        """A buffer of exactly ``nbytes`` usable bytes (a free one of its class if any)."""
        klass = size_class(nbytes, self.pow2)
        with self._lock:
            free = self._free.get(klass)
            buf = free.pop() if free else None
            if buf is not None:
                self.free_bytes -= klass
                self.reuses += 1
            else:
                self.allocs += 1
            self.outstanding_bytes += klass
        if buf is None:
            buf = Buffer(self._alloc(klass), nbytes, klass, self)
        else:
            if buf._fence is not None:
                buf._fence.wait()  # an upload may still read it
                buf._fence = None
            buf.nbytes, buf._refs, buf.parsed = nbytes, 1, None
        return buf

    def _give_back(self, buf: Buffer) -> None:
        with self._lock:
            self.outstanding_bytes -= buf.klass
            if self.free_bytes + buf.klass <= self.keep_bytes:
                self._free[buf.klass].append(buf)
                self.free_bytes += buf.klass
                return
            self.dropped += 1
        buf._pool = None  # freed with its last reference

    def _forget(self, buf: Buffer) -> None:
        with self._lock:
            self.outstanding_bytes -= buf.klass
            self.detached += 1

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"allocs": self.allocs, "reuses": self.reuses, "free_bytes": self.free_bytes,
                    "outstanding_bytes": self.outstanding_bytes, "dropped": self.dropped,
                    "detached": self.detached, "keep_bytes": self.keep_bytes}


# ------------------------------------------------------------------------------ priority


class ForegroundGate:
    """Restores run in the foreground; background copy work yields to them (bounded)."""

    def __init__(self, max_wait_s: float = 0.05) -> None:
        self.max_wait_s = max_wait_s
        self._cv = threading.Condition()
        self._active = 0

    def foreground(self) -> ForegroundGate:
        """Context: a restore is running (background copies yield until it ends). The
        gate is its own context manager (cheaper than a generator on the request path)."""
        return self

    def __enter__(self) -> None:
        with self._cv:
            self._active += 1

    def __exit__(self, *exc: Any) -> None:
        with self._cv:
            self._active -= 1
            if not self._active:
                self._cv.notify_all()

    @property
    def active(self) -> int:
        return self._active

    def yield_(self, stats: CopyStats | None = None) -> float:
        """Wait while a restore runs, at most ``max_wait_s``; returns seconds waited."""
        if not self._active:
            return 0.0
        t0 = time.perf_counter()
        with self._cv:
            self._cv.wait_for(lambda: not self._active, timeout=self.max_wait_s)
        waited = time.perf_counter() - t0
        if stats is not None:
            stats.add(gate_waits=1, gate_wait_s=waited)
        return waited


# ------------------------------------------------------------------------------ interface


class Executor(Protocol):
    """What the engine needs from the device side."""

    device: torch.device
    pool: StagingPool
    stats: CopyStats
    gate: ForegroundGate

    host_outputs: bool
    """True when a restore's output tensors are host memory a file can be read into."""

    def alloc_host(self, nbytes: int) -> torch.Tensor: ...
    def stage(self, plan: shards.ShardPlan, tensors: Mapping[str, torch.Tensor], *,
              background: bool = False) -> Staged: ...
    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...
    def begin_uploads(self) -> None: ...
    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...
    def flat(self, dst: torch.Tensor) -> Any: ...
    def source(self, buf: Buffer) -> Any: ...
    def upload_bytes(self, dst: Any, dst_off: int, src: Any, src_off: int, nbytes: int) -> None: ...
    def upload_batch(self, ops: Sequence[tuple[Any, int, Any, int, int]]) -> None: ...
    def record(self) -> Copy: ...
    def finish_uploads(self) -> None: ...
    def describe(self) -> str: ...


@attrs.define(eq=False)
class Staged:
    """One rank's shard staged in a host buffer: the file's exact bytes once ``copy`` is done.

    The stager holds one reference to ``buffer`` (a RAM tier that keeps the buffer as
    its copy takes its own). ``checksum`` is over exactly the bytes that get written.
    """

    plan: shards.ShardPlan
    buffer: Buffer
    copy: Copy
    checksum_: str | None = None
    released: bool = False

    @property
    def size(self) -> int:
        return self.plan.size

    def checksum(self, gate: ForegroundGate | None = None, stats: CopyStats | None = None,
                 chunk: int = 2 << 20) -> str:
        """The xxh3-128 of the staged file (waits for the copy; yields to restores if ``gate``)."""
        if self.checksum_ is None:
            self.copy.wait()
            mv = self.buffer.mv()
            if gate is None or len(mv) <= chunk:
                self.checksum_ = shards.checksum(mv)
            else:
                import xxhash

                h = xxhash.xxh3_128()
                for off in range(0, len(mv), chunk):
                    gate.yield_(stats)
                    h.update(mv[off : off + chunk])
                self.checksum_ = h.hexdigest()
        return self.checksum_

    def tensors(self) -> dict[str, torch.Tensor]:
        """Host views of the staged tensors (``seg.*`` / ``snap.*`` names)."""
        self.copy.wait()
        return shards.views(self.plan, self.buffer.view())

    def release(self) -> None:
        """Drop the stager's reference (idempotent): the buffer returns to the pool
        unless a tier still holds it."""
        if not self.released:
            self.released = True
            self.buffer.release()

    def detach(self) -> None:
        """Take the buffer out of the pool: views of it outlive this store (a queued
        retry holds them); freed with the last of them."""
        if not self.released:
            self.released = True
            self.buffer.detach()


def _chunks(dst: torch.Tensor, src: torch.Tensor, chunk_bytes: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(dst, src)`` split along dim 0 into pieces of about ``chunk_bytes``."""
    row = max(1, dst[0].numel() * dst.element_size()) if dst.dim() and dst.shape[0] else 1
    if dst.dim() == 0 or dst.shape[0] <= 1 or dst.numel() * dst.element_size() <= chunk_bytes:
        yield dst, src
        return
    step = max(1, chunk_bytes // row)
    for i in range(0, dst.shape[0], step):
        yield dst[i : i + step], src[i : i + step]


def host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy between CPU tensors: one single-threaded ``memcpy`` (numpy releases the GIL)
    when both are contiguous and alike, ``torch.copy_`` otherwise.

    torch's copy splits a large copy across its intra-op threads, whose barrier spins;
    on a busy host (the model's own threads, other processes) that costs far more than
    the copy. A data mover should not take the compute threads anyway.
    """
    if (src.device.type == "cpu" and dst.dtype == src.dtype and dst.shape == src.shape
            and dst.is_contiguous() and src.is_contiguous() and dst.numel()):
        np.copyto(dst.reshape(-1).view(torch.uint8).numpy(), src.reshape(-1).view(torch.uint8).numpy())
    else:
        dst.copy_(src)


def _write_header(plan: shards.ShardPlan, buf: Buffer) -> None:
    # The header is a few hundred bytes of JSON, not tensor data.
    buf.mv()[: plan.data_start] = plan.header


# ------------------------------------------------------------------------------ CPU


class CpuExecutor:
    """The CPU as the device: staging and uploads are plain (inline) copies.

    Device tensors given to it (an engine opened without ``executor='cuda'``) are
    copied synchronously, as ``tensor.to('cpu')`` would. Its outputs are host memory:
    a restore reads shards straight into them (``host_outputs``)."""

    host_outputs = True

    def __init__(self, *, keep_bytes: int = 256 << 20, chunk_bytes: int = 2 << 20,
                 gate: ForegroundGate | None = None) -> None:
        self.device = torch.device("cpu")
        self.stats = CopyStats()
        self.gate = gate or ForegroundGate()
        self.chunk_bytes = chunk_bytes
        self.pool = StagingPool(self.alloc_host, keep_bytes)

    def describe(self) -> str:
        return "cpu"

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def stage(self, plan: shards.ShardPlan, tensors: Mapping[str, torch.Tensor], *,
              background: bool = False) -> Staged:
        buf = self.pool.acquire(plan.size)
        try:
            _write_header(plan, buf)
            dsts = shards.views(plan, buf.view())
            moved = 0
            for name, dst in dsts.items():
                src = tensors[name]
                # In the background, in pieces that yield to restores between them.
                for d, s in _chunks(dst, src, self.chunk_bytes) if background else [(dst, src)]:
                    if background:
                        self.gate.yield_(self.stats)
                    host_copy(d, s)
                moved += dst.numel() * dst.element_size()
            self.stats.add(d2h_bytes=moved, d2h_copies=len(dsts))
        except BaseException:
            buf.release()
            raise
        return Staged(plan, buf, DONE)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def begin_uploads(self) -> None:
        """Nothing to order on the CPU."""

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        host_copy(dst, src)
        self.stats.add(h2d_bytes=dst.numel() * dst.element_size(), h2d_copies=1)

    def flat(self, dst: torch.Tensor) -> np.ndarray:
        """A byte view of a contiguous output tensor, for ``upload_bytes`` (flattened by
        numpy: a torch reshape costs more than the rest of the view)."""
        return (dst if dst.dim() else dst.reshape(1)).view(torch.uint8).numpy().reshape(-1)

    def source(self, buf: Buffer) -> np.ndarray:
        return buf.array()

    def upload_bytes(self, dst: np.ndarray, dst_off: int, src: np.ndarray, src_off: int, nbytes: int) -> None:
        """Copy ``nbytes`` from ``src`` (``source``) into ``dst`` (``flat``): one memcpy.
        The caller counts the bytes (``stats``), once per restore."""
        np.copyto(dst[dst_off : dst_off + nbytes], src[src_off : src_off + nbytes])

    def upload_batch(self, ops: Sequence[tuple[np.ndarray, int, np.ndarray, int, int]]) -> None:
        """``upload_bytes`` for each ``(dst, dst_off, src, src_off, nbytes)``, in order."""
        up = self.upload_bytes
        for op in ops:
            up(*op)

    def record(self) -> Copy:
        return DONE

    def finish_uploads(self) -> None:
        """Uploads are complete when ``upload`` returns."""


# ------------------------------------------------------------------------------ CUDA


class CudaExecutor:
    """A CUDA device: pinned staging pool, one D2H and one H2D copy stream, events.

    Stores: ``stage`` makes the D2H stream wait for the caller's current stream, then
    enqueues one ``copy_(non_blocking=True)`` per tensor (in pieces of ``chunk_bytes``
    when the copy runs in the background, yielding to restores between pieces) into
    the pinned buffer and records an event; the returned ``Staged.copy`` completes
    when the device tensors may be released. Restores: ``begin_uploads`` orders the
    H2D stream after the caller's stream (the output tensors were allocated there),
    ``upload`` enqueues copies on the H2D stream, ``record`` returns an event after
    them (a staging buffer is reused only after it), and ``finish_uploads`` makes
    the caller's stream wait for the H2D stream, so the caller sees the data without
    a host synchronisation.

    ``pin``: ``"torch"`` allocates pinned buffers with torch's caching host allocator
    (which rounds every allocation up to a power of two, so the pool's size classes
    are powers of two: a 2 GiB shard plus its header takes 4 GiB); ``"register"``
    allocates ordinary memory in the pool's finer classes and page-locks it with
    ``cudaHostRegister`` (unregistered when the buffer is freed).
    """

    host_outputs = False

    def __init__(self, device: str | torch.device | None = None, *, keep_bytes: int = 4 << 30,
                 chunk_bytes: int = 16 << 20, gate: ForegroundGate | None = None,
                 pin: str = "torch") -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaExecutor needs a CUDA device")
        self.device = torch.device(device if device is not None else "cuda")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.stats = CopyStats()
        self.gate = gate or ForegroundGate()
        self.chunk_bytes = chunk_bytes
        self.d2h = torch.cuda.Stream(self.device)
        self.h2d = torch.cuda.Stream(self.device)
        if pin not in ("torch", "register"):
            raise ValueError(f"pin must be 'torch' or 'register', got {pin!r}")
        if pin == "register" and not hasattr(torch.cuda.cudart(), "cudaHostRegister"):
            pin = "torch"
        self.pin = pin
        self.pool = StagingPool(self.alloc_host, keep_bytes, pow2=pin == "torch")

    def describe(self) -> str:
        return f"cuda:{torch.cuda.get_device_name(self.device)}"

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        if self.pin == "torch":
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        t = torch.empty(nbytes, dtype=torch.uint8)
        rt = torch.cuda.cudart()
        err = rt.cudaHostRegister(t.data_ptr(), nbytes, 0)
        if int(getattr(err, "value", err)) != 0:
            raise RuntimeError(f"cudaHostRegister failed: {err}")
        weakref.finalize(t, rt.cudaHostUnregister, t.data_ptr())
        return t

    def stage(self, plan: shards.ShardPlan, tensors: Mapping[str, torch.Tensor], *,
              background: bool = False) -> Staged:
        buf = self.pool.acquire(plan.size)
        try:
            _write_header(plan, buf)
            dsts = shards.views(plan, buf.view())
            caller = torch.cuda.current_stream(self.device)
            self.d2h.wait_stream(caller)
            d2h = host = 0
            with torch.cuda.stream(self.d2h):
                for name, dst in dsts.items():
                    src = tensors[name]
                    n = dst.numel() * dst.element_size()
                    if src.device.type == "cuda":
                        pieces = _chunks(dst, src, self.chunk_bytes) if background else [(dst, src)]
                        for d, s in pieces:
                            if background:
                                self.gate.yield_(self.stats)
                            d.copy_(s, non_blocking=True)
                        src.record_stream(self.d2h)
                        d2h += n
                    else:  # a host tensor given to a CUDA executor: a host copy
                        host_copy(dst, src)
                        host += n
                ev = torch.cuda.Event()
                ev.record(self.d2h)
            self.stats.add(d2h_bytes=d2h, d2h_copies=len(dsts))
            self.stats.host_copy(host)
        except BaseException:
            buf.release()
            raise
        copy = Copy([ev])
        buf._fence = copy
        return Staged(plan, buf, copy)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def begin_uploads(self) -> None:
        self.h2d.wait_stream(torch.cuda.current_stream(self.device))

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.h2d):
            dst.copy_(src, non_blocking=True)
        self.stats.add(h2d_bytes=dst.numel() * dst.element_size(), h2d_copies=1)

    def flat(self, dst: torch.Tensor) -> torch.Tensor:
        return dst.reshape(-1).view(torch.uint8)

    def source(self, buf: Buffer) -> torch.Tensor:
        return buf.tensor

    def upload_bytes(self, dst: torch.Tensor, dst_off: int, src: torch.Tensor, src_off: int, nbytes: int) -> None:
        """One H2D copy of ``nbytes`` on the H2D stream (the caller counts the bytes)."""
        self.upload_batch([(dst, dst_off, src, src_off, nbytes)])

    def upload_batch(self, ops: Sequence[tuple[torch.Tensor, int, torch.Tensor, int, int]]) -> None:
        """``upload_bytes`` for each op, in order, under one H2D stream context."""
        with torch.cuda.stream(self.h2d):
            for dst, dst_off, src, src_off, nbytes in ops:
                dst[dst_off : dst_off + nbytes].copy_(src[src_off : src_off + nbytes], non_blocking=True)

    def record(self) -> Copy:
        ev = torch.cuda.Event()
        ev.record(self.h2d)
        return Copy([ev])

    def finish_uploads(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.h2d)


def make_executor(spec: str | Executor | None) -> Executor:
    """``None``/'cpu' -> CpuExecutor, 'cuda'/'cuda:N' -> CudaExecutor, or an executor as is."""
    if spec is None or spec == "cpu":
        return CpuExecutor()
    if isinstance(spec, str):
        if spec.startswith("cuda"):
            return CudaExecutor(spec)
        raise ValueError(f"unknown executor {spec!r} (cpu, cuda, cuda:N)")
    return spec
