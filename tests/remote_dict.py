"""A remote store backend kept in this process's memory, registered by a test: what a new
remote tier is (one module: its ``RemoteStore``, its URL and its ``Backend``; plus
``register(BACKEND)``), with nothing else of the package changed.

    dict://NAME      every tier of the process with the same NAME shares one dict
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import attrs

from prefixstore.base.errors import InvalidArgumentError
from prefixstore.gpu.remote import Backend, RemoteConfig
from prefixstore.gpu.remote.protocol import Faults, Refused

STORES: dict[str, dict[str, bytes]] = {}
_LOCK = threading.Lock()


@attrs.frozen
class DictURL:
    name: str

    def redacted(self) -> str:
        return f"dict://{self.name}"


def parse(url: str) -> DictURL:
    name = url.partition("://")[2]
    if not name.isidentifier():
        raise InvalidArgumentError("remote", "a dict:// URL names its dict: dict://NAME")
    return DictURL(name)


def check(config: RemoteConfig) -> None:
    if config.tls:
        raise InvalidArgumentError("tls", "a dict takes no TLS options")


class DictStore:
    faults = Faults()
    partial_writes = False

    def __init__(self, url: DictURL, config: RemoteConfig) -> None:
        with _LOCK:
            self.values = STORES.setdefault(url.name, {})

    def prepare(self, purpose: str) -> bool:
        return True

    def get_many(self, purpose: str, keys: list[str], limits: Sequence[int], seconds: float) -> list[Any]:
        with _LOCK:
            got = [self.values.get(k) for k in keys]
        return [v if v is None or len(v) <= n else Refused(f"longer than {n}") for v, n in zip(got, limits, strict=True)]

    def set_many(self, items: list[tuple[str, bytes]], *, replace: bool) -> None:
        with _LOCK:
            for k, v in items:
                if replace or k not in self.values:
                    self.values[k] = bytes(v)

    def touch(self, keys: list[str]) -> None:
        pass

    def delete_if(self, key: str, expected: bytes) -> int:
        with _LOCK:
            if key not in self.values:
                return 0
            if self.values[key] != expected:
                return -1
            del self.values[key]
            return 1

    def reply_bytes(self, limits: Sequence[int]) -> int:
        return sum(limits)

    def close(self, timeout: float) -> None:
        pass


BACKEND = Backend(name="dict", schemes=("dict",), url_type=DictURL, parse=parse, open=DictStore, check=check)
