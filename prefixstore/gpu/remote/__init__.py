"""The remote tier: checkpoints shared by many engines through a remote store.

The tier's logic is one class (``tier.RemoteTier``) over any registered backend
(``protocol.RemoteStore``, found by URL scheme in ``registry``). Registered here: Redis
and Redis Cluster (``redis_store``: ``redis://``, ``rediss://``, ``redis+cluster://``,
``rediss+cluster://``) and Mooncake Store (``mooncake_store``: ``mooncake://``).
"""

from prefixstore.gpu.remote import mooncake_store, redis_store, registry
from prefixstore.gpu.remote.config import RemoteConfig
from prefixstore.gpu.remote.manifest import BlobRef, Manifest
from prefixstore.gpu.remote.protocol import Backend, RemoteStore
from prefixstore.gpu.remote.registry import SCHEMES, check, parse, register, unregister
from prefixstore.gpu.remote.stats import RemoteCollector
from prefixstore.gpu.remote.tier import RemoteHit, RemoteTier
from prefixstore.gpu.remote.urls import RemoteURL

registry.register(redis_store.BACKEND)
registry.register(mooncake_store.BACKEND)

__all__ = [
    "SCHEMES", "Backend", "BlobRef", "Manifest", "RemoteCollector", "RemoteConfig", "RemoteHit",
    "RemoteStore", "RemoteTier", "RemoteURL", "check", "parse", "register", "unregister",
]
