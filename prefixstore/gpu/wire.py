"""Messages between the coordinator and one rank process, over torch.distributed.

Each coordinator/rank pair has its own two-member gloo process group (coordinator
rank 0, rank process rank 1), rendezvoused through a ``TCPStore`` under a key prefix
unique to that rank process's incarnation. A message is a 16-byte frame
(``b"PSR1"``, header length u32, payload length u64, little endian) followed, when
non-empty, by one body: the UTF-8 JSON header, then the payload bytes. Both travel
as uint8 tensors over point-to-point ``send`` / ``recv``; nothing is pickled.

Transport failures (a peer that died closes its sockets and gloo raises at once; a
deadline that passes closes the pair) surface as ``LinkError``. A link that raised
once is broken for good: the caller drops it and opens a new pair.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import re
import socket
import struct
import time
from typing import Any

import torch
import torch.distributed as dist

MAGIC = b"PSR1"
FRAME = struct.Struct("<4sIQ")
MAX_HEADER = 1 << 20
MAX_PAYLOAD = 1 << 40
IDLE_TIMEOUT = datetime.timedelta(days=365)
"""A rank process waits this long for its next request (gloo needs a finite timeout)."""


class LinkError(Exception):
    """The pair is broken: the peer died, a deadline passed, or a frame was malformed."""


def first_line(exc: BaseException) -> str:
    """An exception's message without the C++ stack torch appends to it."""
    text = str(exc).strip().splitlines()
    # gloo prefixes its source location: "[/.../pair.cc:553] Connection closed by peer"
    return re.sub(r"^\[[^\]]*\]\s*", "", text[0]) if text else type(exc).__name__


def store_client(host: str, port: int, timeout: float) -> dist.TCPStore:
    """A new client connection to the coordinator's TCPStore.

    Each pair rendezvous uses its own client: a TCPStore client serves one request at
    a time, so two rendezvous sharing one would wait on each other. The coordinator's
    port is probed with a plain socket first: a store client that cannot connect logs
    its C++ stack to stderr at every retry.
    """
    wait_listening(host, port, timeout)
    try:
        return dist.TCPStore(
            host, port, None, False, datetime.timedelta(seconds=timeout), wait_for_workers=False
        )
    except (RuntimeError, ValueError) as exc:
        raise LinkError(f"cannot reach the coordinator at {host}:{port}: {first_line(exc)}") from None


def wait_listening(host: str, port: int, timeout: float) -> None:
    """Return once ``host:port`` accepts a TCP connection; LinkError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(left, 5.0))):
                return
        except OSError as exc:
            if time.monotonic() + 0.2 >= deadline:
                raise LinkError(f"cannot reach the coordinator at {host}:{port} within "
                                f"{timeout:g} s: {exc.strerror or exc}") from None
        time.sleep(0.2)


def open_pair(
    host: str,
    port: int,
    prefix: str,
    rank: int,
    *,
    timeout: float,
    gloo_host: str | None = None,
    op_timeout: datetime.timedelta | None = None,
) -> Link:
    """Join the two-member gloo group under ``prefix`` as ``rank`` (0 or 1).

    Blocks until the peer joins too, at most ``timeout`` seconds. ``gloo_host`` is the
    address this side's gloo device listens on (None: gloo's default, which honours
    ``GLOO_SOCKET_IFNAME``). ``op_timeout`` is the group's default for waits without a
    deadline (a rank process idles on ``IDLE_TIMEOUT``).
    """
    store = store_client(host, port, timeout)
    opts = dist.ProcessGroupGloo._Options()
    dev = (
        dist.ProcessGroupGloo.create_device(hostname=gloo_host)
        if gloo_host
        else dist.ProcessGroupGloo.create_default_device()
    )
    opts._devices = [dev]
    opts._timeout = op_timeout or datetime.timedelta(seconds=timeout)
    try:
        pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, 2, opts)
    except RuntimeError as exc:
        raise LinkError(f"pair {prefix} did not form: {first_line(exc)}") from None
    return Link(pg, 1 - rank, store)


class Link:
    """One end of a pair: framed JSON header + payload messages to the peer."""

    def __init__(self, pg: Any, peer: int, store: Any = None) -> None:
        self.pg = pg
        self.peer = peer
        self._store = store  # keeps the rendezvous client alive with the group
        self.broken: str | None = None

    def send(self, header: dict[str, Any], payload: bytes | memoryview = b"", deadline: float | None = None) -> None:
        """Send one message; ``deadline`` is a ``time.monotonic()`` instant (None: none)."""
        head = json.dumps(header, separators=(",", ":")).encode()
        view = memoryview(payload).cast("B")
        if len(head) > MAX_HEADER or len(view) > MAX_PAYLOAD:
            raise ValueError("message too large")
        frame = bytearray(FRAME.pack(MAGIC, len(head), len(view)))
        self._xfer("send", torch.frombuffer(frame, dtype=torch.uint8), deadline)
        if head or view:
            body = bytearray(len(head) + len(view))
            body[: len(head)] = head
            body[len(head) :] = view
            self._xfer("send", torch.frombuffer(body, dtype=torch.uint8), deadline)

    def recv(self, deadline: float | None = None, seconds_per_byte: float = 0.0) -> tuple[dict[str, Any], bytes]:
        """Receive one message; the body's deadline grows by ``seconds_per_byte`` per byte."""
        frame = torch.empty(FRAME.size, dtype=torch.uint8)
        self._xfer("recv", frame, deadline)
        magic, hlen, plen = FRAME.unpack(frame.numpy().tobytes())
        if magic != MAGIC or hlen > MAX_HEADER or plen > MAX_PAYLOAD:
            self._break(f"malformed frame {bytes(frame.numpy()[:4])!r}")
        if hlen + plen == 0:
            self._break("empty message")
        body = torch.empty(hlen + plen, dtype=torch.uint8)
        if deadline is not None:
            deadline = max(deadline, time.monotonic()) + plen * seconds_per_byte
        self._xfer("recv", body, deadline)
        raw = body.numpy()
        try:
            header = json.loads(raw[:hlen].tobytes())
        except ValueError:
            self._break("header is not JSON")
        if not isinstance(header, dict):
            self._break("header is not a JSON object")
        return header, raw[hlen:].tobytes()

    def close(self) -> None:
        """Tear the pair down; the peer's pending and later operations fail at once."""
        if self.pg is not None:
            with contextlib.suppress(Exception):
                self.pg.abort()
            self.pg = None
        self.broken = self.broken or "closed"

    def _xfer(self, kind: str, tensor: torch.Tensor, deadline: float | None) -> None:
        if self.broken or self.pg is None:
            raise LinkError(f"link is broken: {self.broken}")
        try:
            work = self.pg.send([tensor], self.peer, 0) if kind == "send" else self.pg.recv([tensor], self.peer, 0)
            if deadline is None:
                done = work.wait()
            else:
                left = max(deadline - time.monotonic(), 0.001)
                done = work.wait(datetime.timedelta(seconds=left))
        except RuntimeError as exc:
            self._break(f"{kind} failed: {first_line(exc)}")
        if done is False:
            self._break(f"{kind} timed out")

    def _break(self, why: str):
        self.broken = why
        self.close()
        self.broken = why
        raise LinkError(why)
