"""``EngineConfig``: every option of ``Engine.open`` in one frozen, typed object,
validated once when it is built (each bad value raises ``InvalidArgumentError``
naming the option), and ``resolve_open``, the whole argument check of ``Engine.open``.

    cfg = EngineConfig(policy="lru", high_watermark=0.9, low_watermark=0.5)
    Engine.open(path, layout, capacity_bytes, config=cfg)
    Engine.open(path, layout, capacity_bytes, policy="lru")  # the same, as keywords
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from prefixstore.base.errors import InvalidArgumentError
from prefixstore.base.layout import Layout
from prefixstore.engine import identity
from prefixstore.engine.checks import callable_or_none, choice, flag, instance, integer, real
from prefixstore.gpu import tiers
from prefixstore.gpu.backings import BACKINGS
from prefixstore.gpu.remote import RemoteConfig, auth, registry
from prefixstore.statemachine.compaction import CompactionPolicy
from prefixstore.statemachine.cost import CostModel
from prefixstore.statemachine.policy import DEFAULT as DEFAULT_POLICY
from prefixstore.statemachine.policy import registered

if TYPE_CHECKING:
    from prefixstore.gpu.fileio import FaultHook, FileSystem
    from prefixstore.gpu.tier import RankIO


def _checked(check: Callable[..., Any], *args: Any, **kw: Any) -> Callable[[Any, attrs.Attribute, Any], None]:
    """An attrs validator running ``check(option_name, value, *args, **kw)``."""

    def validator(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        check(attribute.name, value, *args, **kw)

    return validator


def _registered_policy(argument: str, value: Any) -> None:
    """``value`` names a policy registered now (``statemachine/policy.py``'s REGISTRY)."""
    choice(argument, value, registered())


def check_executor(argument: str, value: Any) -> None:
    if isinstance(value, str) and not re.fullmatch(r"cpu|cuda(:\d+)?", value):
        raise InvalidArgumentError(argument, f"must be 'cpu', 'cuda', 'cuda:N' or an executor, got {value!r}")


def check_bandwidth(argument: str, value: Any) -> None:
    if value is None or value in ("measure", "remeasure"):
        return
    if isinstance(value, str):
        raise InvalidArgumentError(argument, f"must be a number, 'measure' or 'remeasure', got {value!r}")
    real(argument, value, lo=0.0, lo_open=True)


def check_ranks(argument: str, value: Any) -> None:
    if value is not None and (isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence)):
        raise InvalidArgumentError(argument, f"must be a sequence of rank executors or None, got {value!r}")


def check_compaction(argument: str, value: Any) -> None:
    if value is not None and not isinstance(value, (bool, CompactionPolicy)):
        raise InvalidArgumentError(argument, f"must be True, False, None or a CompactionPolicy, got {value!r}")


def check_remote(argument: str, value: Any) -> None:
    """``remote``: None or the URL of a registered remote tier (``gpu.remote.SCHEMES``)."""
    if value is not None:
        registry.parse(value)  # InvalidArgumentError("remote", ...) naming what is wrong, never a secret


def check_remote_options(inst: Any, _attribute: attrs.Attribute, value: RemoteConfig | None) -> None:
    """``remote_options`` that ``remote``'s backend can honour (it refuses, naming the option, one it cannot)."""
    if inst.remote is None:
        return
    try:
        registry.check(inst.remote, value)
    except InvalidArgumentError as exc:  # named as the option it came in: remote_options
        raise InvalidArgumentError("remote_options", str(exc)) from exc
    if value is not None:  # an unreadable or malformed key refuses the open before it creates anything
        auth.load(value.auth_key_env, value.auth_key_file)


def remote_options(value: Any) -> RemoteConfig | None:
    """``remote_options`` as a ``RemoteConfig``: one, a mapping of its fields, or None."""
    if value is None or isinstance(value, RemoteConfig):
        return value
    if not isinstance(value, Mapping):
        raise InvalidArgumentError("remote_options", f"must be a RemoteConfig or a dict, got {type(value).__name__}")
    known = {a.name for a in attrs.fields(RemoteConfig)}
    for name in value:
        if name not in known:
            raise InvalidArgumentError("remote_options", f"unknown option {name!r}; known: {', '.join(sorted(known))}")
    try:
        return RemoteConfig(**value)
    except InvalidArgumentError as exc:  # named as the option it came in: remote_options
        raise InvalidArgumentError("remote_options", str(exc)) from exc


def _low_below_high(inst: EngineConfig, _attribute: attrs.Attribute, low: float) -> None:
    if low > inst.high_watermark:
        raise InvalidArgumentError("low_watermark", f"must be <= high_watermark ({inst.high_watermark}), got {low}")


_FRACTION = _checked(real, lo=0.0, hi=1.0, lo_open=True)


@attrs.frozen(kw_only=True)
class EngineConfig:
    """The options of ``Engine.open`` (see its docstring for what each does).

    Built once and checked once: a bad value raises ``InvalidArgumentError`` naming
    the option. ``fs``, ``hook`` and ``registry`` are effect objects taken as given.
    """

    synchronous: str = attrs.field(default="FULL", validator=_checked(choice, ("FULL", "NORMAL"), fold=True))
    policy: str = attrs.field(default=DEFAULT_POLICY, validator=_checked(_registered_policy))
    cost: CostModel | None = attrs.field(default=None, validator=_checked(instance, CostModel))
    high_watermark: float = attrs.field(default=1.0, validator=_FRACTION)
    low_watermark: float = attrs.field(default=1.0, validator=[_FRACTION, _low_below_high])
    create: bool = attrs.field(default=True, validator=_checked(flag))
    fs: FileSystem | None = None
    hook: FaultHook | None = None
    ranks: Sequence[RankIO] | None = attrs.field(default=None, validator=_checked(check_ranks))
    registry: Any = None
    admission: Callable[..., bool] | None = attrs.field(default=None, validator=_checked(callable_or_none))
    inflight_wait_s: float = attrs.field(default=30.0, validator=_checked(real, lo=0.0))
    compaction: bool | CompactionPolicy | None = attrs.field(default=None, validator=_checked(check_compaction))
    backing: str = attrs.field(default=tiers.DEFAULT, validator=_checked(choice, BACKINGS))
    ram_bytes: int | None = attrs.field(default=None, validator=_checked(integer, minimum=1, none=True))
    executor: Any = attrs.field(default=None, validator=_checked(check_executor))
    bandwidth: float | str | None = attrs.field(default=None, validator=_checked(check_bandwidth))
    read_only_fallback: bool = attrs.field(default=True, validator=_checked(flag))
    remote: str | None = attrs.field(default=None, validator=_checked(check_remote), repr=False)
    remote_options: RemoteConfig | None = attrs.field(default=None, converter=remote_options,
                                                      validator=check_remote_options)
    identity: Mapping[str, str] | None = attrs.field(
        default=None, validator=_checked(identity.check_option), converter=identity.frozen)

    @classmethod
    def from_options(cls, **opts: Any) -> EngineConfig:
        """The config of these keyword options; an unknown one raises
        ``InvalidArgumentError`` naming it."""
        check_known(opts)
        return cls(**opts)

    def evolve(self, **changes: Any) -> EngineConfig:
        """A copy with ``changes`` applied, checked like a new config."""
        check_known(changes)
        return attrs.evolve(self, **changes)


OPTIONS: tuple[str, ...] = tuple(a.name for a in attrs.fields(EngineConfig))
"""The option names of ``Engine.open``, in declaration order."""


def check_known(opts: Mapping[str, Any]) -> None:
    """Raise ``InvalidArgumentError`` naming the first option that is not one."""
    for name in opts:
        if name not in OPTIONS:
            raise InvalidArgumentError(name, f"unknown option; known: {', '.join(sorted(OPTIONS))}")


def check_path(path: Any) -> str:
    """``path`` as a non-empty str (a str or ``os.PathLike``)."""
    try:
        root = os.fspath(path)
    except TypeError:
        root = None
    if not isinstance(root, str) or not root:
        raise InvalidArgumentError("path", f"must be a non-empty str or os.PathLike, got {path!r}")
    return root


def resolve_open(path: Any, layout: Any, capacity_bytes: Any, opts: Mapping[str, Any]) -> tuple[str, EngineConfig]:
    """Check every argument of ``Engine.open`` before anything is touched; returns the
    root as a str and the config. ``opts`` are the keyword options, or ``config=`` (an
    ``EngineConfig``) with any keyword options applied over it."""
    root = check_path(path)
    instance("layout", layout, Layout, none=False)
    opts = dict(opts)
    given = opts.pop("config", None)
    check_known(opts)
    integer("capacity_bytes", capacity_bytes, minimum=1)
    if given is None:
        return root, EngineConfig(**opts)
    instance("config", given, EngineConfig, none=False)
    return root, given.evolve(**opts) if opts else given
