"""The vLLM connector's ``kv_connector_extra_config``, and the Layout of a vLLM KV cache.

Both halves of the connector (the scheduler's and each worker's) parse the same extra
config with ``ConnectorOptions.parse`` and derive the same ``Layout`` from vLLM's
``KVCacheConfig`` with ``kv_layout``, so they agree on every byte without talking.
Neither imports vLLM: they read the fields of the objects vLLM hands the connector.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Mapping
from typing import Any

import attrs

from prefixstore.base.errors import InvalidInputError, LayoutError
from prefixstore.base.keys import DIGEST_SIZE
from prefixstore.base.layout import Layout, TensorSpec, dtype_name
from prefixstore.statemachine.cost import CostModel

DEFAULT_CAPACITY = 64 << 30
DEFAULT_STAGING_BYTES = 4 << 30
SHM = "/dev/shm"

KEYS = frozenset({
    "dir", "capacity_bytes", "backing", "ram_bytes", "policy", "synchronous", "cost", "retention",
    "checkpoint_blocks", "namespace", "staging_dir", "staging_bytes", "load_timeout_s", "compaction",
    "remote", "remote_options",
})
"""Every key ``kv_connector_extra_config`` may hold (docs/vllm.md explains each)."""


class UnknownConfigKeysError(InvalidInputError):
    """A configuration holds keys an adapter does not know (``.keys``)."""

    def __init__(self, keys: list[str], known: frozenset[str] = KEYS,
                 where: str = "kv_connector_extra_config") -> None:
        self.keys = keys
        super().__init__(f"{where}: unknown keys {keys}; known: {sorted(known)}")


@attrs.frozen
class ConnectorOptions:
    """The parsed extra config (see ``KEYS`` and docs/vllm.md)."""

    dir: str
    capacity_bytes: int = DEFAULT_CAPACITY
    engine: Mapping[str, Any] = attrs.field(factory=dict)
    """Options passed to ``Engine.open`` as they are (backing, policy, cost, remote, ...)."""
    retention: bool = False
    checkpoint_blocks: int = 0
    namespace: str = ""
    staging_dir: str = ""
    staging_bytes: int = DEFAULT_STAGING_BYTES
    load_timeout_s: float = 30.0

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None, model: str) -> ConnectorOptions:
        """Check every key; a bad one is an InvalidInputError naming it. ``model`` is the
        default namespace (vLLM's model name or path)."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - KEYS)
        if unknown:
            raise UnknownConfigKeysError(unknown)
        root = extra.get("dir")
        if not isinstance(root, str) or not root:
            raise InvalidInputError(f"kv_connector_extra_config['dir'] must be a directory path, got {root!r}")
        engine: dict[str, Any] = {"synchronous": _choice(extra, "synchronous", ("FULL", "NORMAL"), "FULL")}
        for key in ("backing", "policy"):
            if key in extra:
                engine[key] = _text(extra, key)
        if extra.get("ram_bytes") is not None:
            engine["ram_bytes"] = _integer(extra, "ram_bytes", 0, minimum=1)
        if extra.get("cost") is not None:
            engine["cost"] = _cost(extra["cost"])
        if "compaction" in extra:
            engine["compaction"] = _flag(extra, "compaction", False)
        if extra.get("remote") is not None:
            engine["remote"] = _text(extra, "remote")
            if extra.get("remote_options") is not None:
                if not isinstance(extra["remote_options"], Mapping):
                    raise InvalidInputError("kv_connector_extra_config['remote_options'] must be a mapping")
                engine["remote_options"] = dict(extra["remote_options"])
        namespace = extra.get("namespace", model)
        if not isinstance(namespace, str):
            raise InvalidInputError(f"kv_connector_extra_config['namespace'] must be a string, got {namespace!r}")
        timeout = extra.get("load_timeout_s", 30.0)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise InvalidInputError(f"kv_connector_extra_config['load_timeout_s'] must be a positive number, "
                                    f"got {timeout!r}")
        staging = extra.get("staging_dir") or os.path.join(SHM if os.path.isdir(SHM) else "/tmp", "prefixstore-vllm")
        if not isinstance(staging, str):
            raise InvalidInputError(f"kv_connector_extra_config['staging_dir'] must be a path, got {staging!r}")
        return cls(
            dir=root, capacity_bytes=_integer(extra, "capacity_bytes", DEFAULT_CAPACITY, minimum=1),
            engine=engine, retention=_flag(extra, "retention", False),
            checkpoint_blocks=_integer(extra, "checkpoint_blocks", 0, minimum=0),
            namespace=namespace, staging_dir=staging,
            staging_bytes=_integer(extra, "staging_bytes", DEFAULT_STAGING_BYTES, minimum=1),
            load_timeout_s=float(timeout),
        )

    @property
    def staging_root(self) -> str:
        """This cache's staging folder: one per cache directory, shared by its scheduler
        and workers (the engine's directory lock makes the scheduler its only owner)."""
        tag = hashlib.blake2b(os.path.realpath(self.dir).encode(), digest_size=8).hexdigest()
        return os.path.join(self.staging_dir, tag)

    def digest(self, block_hash: bytes) -> bytes:
        """The prefixstore block digest of one of vLLM's chained block hashes: the hash
        folded with the namespace, so caches of two models never share a key."""
        return hashlib.blake2b(bytes(block_hash), digest_size=DIGEST_SIZE, key=_namespace_key(self.namespace)).digest()


@functools.lru_cache(maxsize=8)
def _namespace_key(namespace: str) -> bytes:
    return hashlib.blake2b(namespace.encode(), digest_size=32).digest()


def kv_layout(kv_cache_config: Any, tp_size: int) -> Layout:
    """The Layout of one vLLM KV cache: one segment tensor per attention layer, named as
    vLLM names the layer, per token ``(heads, content)`` in the cache dtype (content = K
    and V side by side, as vLLM's ``[blocks, heads, block_size, content]`` views hold them),
    one rank per tensor-parallel worker. Anything else is refused with a LayoutError."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) != 1:
        kinds = [f"{type(g.kv_cache_spec).__name__} ({len(g.layer_names)} layers)" for g in groups]
        raise LayoutError(f"the prefixstore connector handles one full-attention KV cache group, got "
                          f"{len(groups)}: {kinds}; hybrid models (Mamba, sliding-window groups) are not handled")
    group = groups[0]
    specs = getattr(group.kv_cache_spec, "kv_cache_specs", None) or dict.fromkeys(group.layer_names,
                                                                                group.kv_cache_spec)
    segments = [TensorSpec(name, *_row(name, specs[name])) for name in group.layer_names]
    return Layout(segments=segments, block_tokens=int(group.kv_cache_spec.block_size), ranks=tp_size)


def _row(layer: str, spec: Any) -> tuple[str, tuple[int, int]]:
    """(dtype, (heads, content)) of one layer's token row; LayoutError for a spec this
    connector cannot read token by token."""
    kind = type(spec).__name__
    full = any(c.__name__ == "FullAttentionSpec" for c in type(spec).__mro__)
    if not full or kind == "SinkFullAttentionSpec":
        raise LayoutError(f"layer {layer!r} has a {kind} KV cache: the prefixstore connector stores full-attention "
                          f"KV only (hybrid Mamba and sliding-window groups are refused; with "
                          f"--disable-hybrid-kv-cache-manager vLLM keeps sliding-window layers as full attention)")
    packed = (getattr(spec, "state_content_bytes", None) is not None or getattr(spec, "tokens_per_state", 1) != 1
              or int(getattr(spec, "kv_quant_mode", 0) or 0) != 0)
    if packed:
        raise LayoutError(f"layer {layer!r}: a packed or quantized {kind} page (not one dense row per token) is "
                          f"not handled")
    return dtype_name(spec.dtype), (int(spec.num_heads), int(spec.head_size) + int(spec.head_size_v))


def _integer(extra: Mapping[str, Any], key: str, default: int, *, minimum: int) -> int:
    v = extra.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise InvalidInputError(f"kv_connector_extra_config[{key!r}] must be an integer >= {minimum}, got {v!r}")
    return v


def _flag(extra: Mapping[str, Any], key: str, default: bool) -> bool:
    v = extra.get(key, default)
    if not isinstance(v, bool):
        raise InvalidInputError(f"kv_connector_extra_config[{key!r}] must be true or false, got {v!r}")
    return v


def _text(extra: Mapping[str, Any], key: str) -> str:
    v = extra.get(key)
    if not isinstance(v, str) or not v:
        raise InvalidInputError(f"kv_connector_extra_config[{key!r}] must be a non-empty string, got {v!r}")
    return v


def _choice(extra: Mapping[str, Any], key: str, allowed: tuple[str, ...], default: str) -> str:
    v = extra.get(key, default)
    if v not in allowed:
        raise InvalidInputError(f"kv_connector_extra_config[{key!r}] must be one of {list(allowed)}, got {v!r}")
    return v


def _cost(value: Any) -> CostModel:
    if not isinstance(value, Mapping):
        raise InvalidInputError("kv_connector_extra_config['cost'] must be a mapping of CostModel fields")
    try:
        return CostModel(**value)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"kv_connector_extra_config['cost']: {exc}") from exc


def model_identity(vllm_config: Any, namespace: str, tp: int) -> dict[str, str]:
    """What the cache's rows mean (``Engine.open(identity=...)``): the model, its revision
    and a fingerprint of its config, the dtypes, the tensor-parallel size, the block size
    and hash, the key namespace. A directory another model or setup wrote is refused."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    hf = getattr(model, "hf_config", None)
    text = hf.to_json_string(use_diff=False) if hasattr(hf, "to_json_string") else repr(hf)
    return {
        "adapter": "vllm",
        "model": str(model.model),
        "revision": str(getattr(model, "revision", None) or ""),
        "config": hashlib.sha256(text.encode()).hexdigest(),
        "dtype": str(model.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(cache.cache_dtype),
        "tp": str(tp),
        "block_size": str(cache.block_size),
        "hash": str(cache.prefix_caching_hash_algo),
        "namespace": namespace,
    }
