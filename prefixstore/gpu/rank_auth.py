"""The shared token of a coordinator and its rank servers, and the handshake that checks it.

The TCPStore and the gloo pairs are unauthenticated: anyone who reaches the
coordinator's store can register as a rank, or join a rank's pair as its coordinator.
So every new pair starts with a mutual challenge over the pair itself, before any
request is served or any shard sent:

1. coordinator -> rank: ``{"op": "hello", "nonce": Nc}``
2. rank -> coordinator: ``{"nonce": Ns, "mac": HMAC(token, "rank|Nc|Ns|R|K")}``
3. coordinator -> rank: ``{"op": "proof", "mac": HMAC(token, "coordinator|Nc|Ns|R|K")}``
4. rank -> coordinator: ``{"ok": true, "directory": ..., "pid": ..., "host": ...}``

(HMAC-SHA256, fresh 128-bit nonces on each side, ``R`` the rank, ``K`` the
incarnation; the role in each MAC stops a reflected answer.) A side that gets anything
else closes the pair: the coordinator refuses that incarnation (``EACCES``), the rank
server registers again. So a stranger gets no shard and no directory name, and makes
no rank apply an effect; what it can still do is disrupt the rendezvous (write keys of
the store), which fails connections but changes no file: keep the store's port behind
a firewall (see docs/multi-host.md). Without a token on either side the key is empty:
the handshake still runs, so a side with a token refuses one without.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from typing import Any

from prefixstore.base.errors import InvalidArgumentError, RankAuthError
from prefixstore.gpu.wire import Link, LinkError

TOKEN_ENV = "PREFIXSTORE_RANK_TOKEN"
"""The environment variable read when no token file or variable is named."""
MIN_TOKEN_BYTES = 16


def load_token(file: str | None = None, env: str | None = None) -> bytes | None:
    """The token from ``file`` (its contents, stripped), else from the variable ``env``,
    else from ``$PREFIXSTORE_RANK_TOKEN``; None when none is set. A token shorter than
    16 bytes is refused (InvalidArgumentError)."""
    if file is not None:
        try:
            with open(file, "rb") as f:
                raw = f.read().strip()
        except OSError as exc:
            raise InvalidArgumentError("token file", f"cannot read {file}: {exc.strerror or exc}") from None
    elif env is not None:
        if env not in os.environ:
            raise InvalidArgumentError("token env", f"the variable {env} is not set")
        raw = os.environ[env].strip().encode()
    else:
        raw = os.environ.get(TOKEN_ENV, "").strip().encode()
        if not raw:
            return None
    if len(raw) < MIN_TOKEN_BYTES:
        raise InvalidArgumentError("token", f"a rank token needs at least {MIN_TOKEN_BYTES} bytes, got {len(raw)}")
    return raw


def mac(token: bytes | None, role: str, *parts: Any) -> str:
    return hmac.new(token or b"", "|".join([role, *map(str, parts)]).encode(), hashlib.sha256).hexdigest()


def directory_tag(token: bytes | None, directory: str) -> str:
    """What a registration says of the rank's directory: its MAC, not its name."""
    return mac(token, "directory", directory)


def _expect(got: Any, want: str, who: str) -> None:
    if not isinstance(got, str) or not hmac.compare_digest(got, want):
        raise RankAuthError(f"{who} did not prove the shared token")


def coordinator_handshake(link: Link, token: bytes | None, rank: int, incarnation: int,
                          timeout: float) -> dict[str, Any]:
    """Run the coordinator's side on a new pair; the rank's account (directory, pid, host).

    Raises RankAuthError (the peer is not a rank server holding the token) or LinkError.
    """
    deadline = time.monotonic() + timeout
    nc = secrets.token_hex(16)
    link.send({"op": "hello", "nonce": nc}, b"", deadline)
    reply, _ = link.recv(deadline)
    ns = reply.get("nonce")
    if not isinstance(ns, str) or len(ns) != 32:
        raise RankAuthError(f"rank {rank} incarnation {incarnation} did not answer the challenge")
    _expect(reply.get("mac"), mac(token, "rank", nc, ns, rank, incarnation), f"rank {rank} incarnation {incarnation}")
    link.send({"op": "proof", "mac": mac(token, "coordinator", nc, ns, rank, incarnation)}, b"", deadline)
    info, _ = link.recv(deadline)
    if not info.get("ok"):
        raise RankAuthError(f"rank {rank} incarnation {incarnation} refused the coordinator: {info.get('strerror')}")
    return info


def rank_handshake(link: Link, token: bytes | None, rank: int, incarnation: int, timeout: float,
                   account: dict[str, Any]) -> None:
    """Run the rank server's side on a new pair: ``account`` goes only to a peer that
    proved the token. Raises RankAuthError or LinkError (the caller closes the pair)."""
    deadline = time.monotonic() + timeout
    hello, _ = link.recv(deadline)
    nc = hello.get("nonce")
    if hello.get("op") != "hello" or not isinstance(nc, str) or len(nc) != 32:
        raise RankAuthError("the peer sent a request before the handshake")
    ns = secrets.token_hex(16)
    link.send({"nonce": ns, "mac": mac(token, "rank", nc, ns, rank, incarnation)}, b"", deadline)
    proof, _ = link.recv(deadline)
    if proof.get("op") != "proof":
        raise RankAuthError("the peer sent a request before the handshake")
    try:
        _expect(proof.get("mac"), mac(token, "coordinator", nc, ns, rank, incarnation), "the coordinator")
    except RankAuthError as exc:
        link.send({"ok": False, "strerror": str(exc)}, b"", deadline)
        raise
    link.send({"ok": True, **account}, b"", deadline)


__all__ = ["TOKEN_ENV", "LinkError", "coordinator_handshake", "directory_tag", "load_token", "mac", "rank_handshake"]
