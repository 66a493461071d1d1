"""The remote tier: checkpoints shared by many engines through Redis (or Redis Cluster)."""

from prefixstore.gpu.remote.config import RemoteConfig
from prefixstore.gpu.remote.manifest import BlobRef, Manifest
from prefixstore.gpu.remote.redis_tier import RemoteHit, RemoteTier
from prefixstore.gpu.remote.stats import RemoteCollector
from prefixstore.gpu.remote.urls import RemoteURL, parse

__all__ = [
    "BlobRef", "Manifest", "RemoteCollector", "RemoteConfig", "RemoteHit", "RemoteTier",
    "RemoteURL", "parse",
]
