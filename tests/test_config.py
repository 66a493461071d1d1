"""``EngineConfig`` (the options of ``Engine.open``) and the Params objects of
``store`` / ``lookup``: each bad value raises ``InvalidArgumentError`` naming it when
the object is built; defaults are the documented ones; both are frozen; a call made
with a Params object does exactly what the same call made with arguments does."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from conftest import BT, make_layout, seg_tensors, snap_tensors, tokens_for

from prefixstore.base import errors as E
from prefixstore.base.keys import Prefix
from prefixstore.engine import params
from prefixstore.engine.api import Engine
from prefixstore.engine.config import OPTIONS, EngineConfig, resolve_open
from prefixstore.engine.params import LookupParams, StoreParams
from prefixstore.gpu.remote import RemoteConfig
from prefixstore.statemachine.compaction import CompactionPolicy
from prefixstore.statemachine.cost import CostModel

CAP = 16 << 20
L = make_layout(ranks=2)
A = tokens_for(1, 4)
PA = Prefix.from_tokens(A, BT)
SEGS, SNAP = seg_tensors(L, A), snap_tensors(L, A)

DOCUMENTED_DEFAULTS: dict[str, Any] = {
    "synchronous": "FULL", "policy": "prefixstore", "cost": None, "high_watermark": 1.0,
    "low_watermark": 1.0, "create": True, "fs": None, "hook": None, "ranks": None,
    "registry": None, "admission": None, "inflight_wait_s": 30.0, "compaction": None,
    "backing": "disk", "ram_bytes": None, "executor": None, "bandwidth": None,
    "read_only_fallback": True, "remote": None, "remote_options": None, "identity": None,
}

NAN = math.nan
BAD_OPTIONS: list[tuple[str, dict[str, Any]]] = [
    ("synchronous", {"synchronous": "OFF"}),
    ("synchronous", {"synchronous": 2}),
    ("synchronous", {"synchronous": None}),
    ("policy", {"policy": "bogus"}),
    ("policy", {"policy": None}),
    ("cost", {"cost": "cheap"}),
    ("cost", {"cost": CompactionPolicy()}),
    ("high_watermark", {"high_watermark": 1.5}),
    ("high_watermark", {"high_watermark": 0}),
    ("high_watermark", {"high_watermark": NAN}),
    ("high_watermark", {"high_watermark": "0.5"}),
    ("low_watermark", {"low_watermark": 0}),
    ("low_watermark", {"low_watermark": -0.5}),
    ("low_watermark", {"low_watermark": True}),
    ("low_watermark", {"low_watermark": 0.9, "high_watermark": 0.5}),
    ("create", {"create": "no"}),
    ("create", {"create": 1}),
    ("ranks", {"ranks": "01"}),
    ("ranks", {"ranks": {0: None}}),
    ("ranks", {"ranks": 2}),
    ("admission", {"admission": 5}),
    ("inflight_wait_s", {"inflight_wait_s": -1}),
    ("inflight_wait_s", {"inflight_wait_s": NAN}),
    ("inflight_wait_s", {"inflight_wait_s": math.inf}),
    ("inflight_wait_s", {"inflight_wait_s": "1"}),
    ("compaction", {"compaction": "yes"}),
    ("compaction", {"compaction": 1}),
    ("backing", {"backing": "tape"}),
    ("backing", {"backing": None}),
    ("ram_bytes", {"ram_bytes": -5}),
    ("ram_bytes", {"ram_bytes": 0}),
    ("ram_bytes", {"ram_bytes": "x"}),
    ("ram_bytes", {"ram_bytes": 1.5}),
    ("executor", {"executor": "tpu"}),
    ("executor", {"executor": "cuda:x"}),
    ("bandwidth", {"bandwidth": -1}),
    ("bandwidth", {"bandwidth": 0}),
    ("bandwidth", {"bandwidth": NAN}),
    ("bandwidth", {"bandwidth": "fast"}),
    ("read_only_fallback", {"read_only_fallback": "yes"}),
    ("read_only_fallback", {"read_only_fallback": None}),
    ("remote", {"remote": "http://127.0.0.1:6379"}),
    ("remote", {"remote": 6379}),
    ("remote", {"remote": "redis://127.0.0.1:notaport/0"}),
    ("remote_options", {"remote_options": 5}),
    ("remote_options", {"remote_options": {"bogus": 1}}),
    ("remote_options", {"remote_options": {"lookup_timeout": -1}}),
    ("identity", {"identity": "llama"}),
    ("identity", {"identity": {"model": 1}}),
]
CHECKED = {a for a, _ in BAD_OPTIONS}
TAKEN_AS_GIVEN = {"fs", "hook", "registry"}  # effect objects: any object is accepted

GOOD_OPTIONS: list[dict[str, Any]] = [
    {"synchronous": "NORMAL"}, {"synchronous": "normal"}, {"synchronous": "FULL"},
    {"policy": "leaf-lru"}, {"policy": "lru"}, {"cost": CostModel()},
    {"high_watermark": 0.9, "low_watermark": 0.5}, {"high_watermark": 1}, {"create": False},
    {"ranks": []}, {"ranks": ()}, {"admission": lambda *a: True}, {"inflight_wait_s": 0},
    {"compaction": True}, {"compaction": False}, {"compaction": CompactionPolicy()},
    {"backing": "memory"}, {"backing": "composite", "ram_bytes": 1 << 20},
    {"executor": "cpu"}, {"executor": "cuda"}, {"executor": "cuda:1"}, {"executor": object()},
    {"bandwidth": 1e9}, {"bandwidth": 5}, {"bandwidth": "measure"}, {"bandwidth": "remeasure"},
    {"read_only_fallback": False}, {"remote": "redis://127.0.0.1:6379/0"},
    {"remote": "redis+cluster://127.0.0.1:7000,127.0.0.1:7001", "remote_options": RemoteConfig(lookup_timeout=0.1)},
    {"fs": object(), "hook": object(), "registry": object()},
]


def _ids(cases):
    return [f"{a}={list(k.values())[-1]!r}" for a, k in cases]


def test_every_option_has_a_check_or_is_an_effect_object():
    assert set(OPTIONS) == CHECKED | TAKEN_AS_GIVEN and not CHECKED & TAKEN_AS_GIVEN


def test_defaults_are_the_documented_ones():
    assert attrs.asdict(EngineConfig(), recurse=False) == DOCUMENTED_DEFAULTS
    assert EngineConfig.from_options() == EngineConfig()
    assert list(OPTIONS) == list(DOCUMENTED_DEFAULTS)


@pytest.mark.parametrize(("argument", "kw"), BAD_OPTIONS, ids=_ids(BAD_OPTIONS))
def test_bad_option_is_refused_naming_it(argument, kw):
    for build in (lambda: EngineConfig(**kw), lambda: EngineConfig.from_options(**kw),
                  lambda: EngineConfig().evolve(**kw), lambda: resolve_open("/nonexistent/x", L, CAP, kw)):
        with pytest.raises(E.InvalidArgumentError) as err:
            build()
        assert err.value.argument == argument, err.value
        assert str(err.value).startswith(f"{argument}: ")


@pytest.mark.parametrize("kw", GOOD_OPTIONS, ids=[repr(sorted(k)) for k in GOOD_OPTIONS])
def test_good_option_is_kept_as_given(kw):
    cfg = EngineConfig.from_options(**kw)
    for name, value in kw.items():
        assert getattr(cfg, name) is value
    assert resolve_open("/x", L, CAP, kw) == ("/x", cfg)


def test_unknown_option_is_refused_naming_it():
    known = ", ".join(sorted(OPTIONS))
    for build in (lambda: EngineConfig.from_options(no_such_option=1),
                  lambda: EngineConfig().evolve(no_such_option=1),
                  lambda: resolve_open("/x", L, CAP, {"policy": "lru", "no_such_option": 1}),
                  lambda: resolve_open("/x", L, CAP, {"config": EngineConfig(), "no_such_option": 1})):
        with pytest.raises(E.InvalidArgumentError) as err:
            build()
        assert err.value.argument == "no_such_option"
        assert str(err.value) == f"no_such_option: unknown option; known: {known}"
    with pytest.raises(TypeError):
        EngineConfig(no_such_option=1)  # the class itself: an ordinary keyword error
    with pytest.raises(TypeError):
        EngineConfig("FULL")  # options are keywords only


def test_evolve_checks_the_result_and_leaves_the_original():
    cfg = EngineConfig(high_watermark=0.5, low_watermark=0.25)
    moved = cfg.evolve(policy="lru", low_watermark=0.5)
    assert (moved.policy, moved.low_watermark, moved.high_watermark) == ("lru", 0.5, 0.5)
    assert (cfg.policy, cfg.low_watermark) == ("prefixstore", 0.25)
    with pytest.raises(E.InvalidArgumentError) as err:
        cfg.evolve(low_watermark=0.75)  # above the kept high watermark
    assert err.value.argument == "low_watermark" and "high_watermark (0.5)" in str(err.value)
    assert cfg.evolve() == cfg


def test_config_and_params_are_frozen():
    cfg = EngineConfig()
    sp, lp = StoreParams(PA, SEGS, SNAP), LookupParams(PA)
    for obj, name in ((cfg, "policy"), (sp, "tokens_from"), (lp, "gpu_blocks")):
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            setattr(obj, name, 1)
    assert cfg.policy == "prefixstore" and sp.tokens_from == 0 and lp.gpu_blocks == 0


OPEN_ARGS: list[tuple[str, tuple[Any, Any, Any], dict[str, Any]]] = [
    ("path", (5, L, CAP), {}),
    ("path", (None, L, CAP), {}),
    ("path", ("", L, CAP), {}),
    ("layout", ("/x", "bfloat16", CAP), {}),
    ("capacity_bytes", ("/x", L, "abc"), {}),
    ("capacity_bytes", ("/x", L, 0), {}),
    ("capacity_bytes", ("/x", L, NAN), {}),
    ("capacity_bytes", ("/x", L, True), {}),
    ("config", ("/x", L, CAP), {"config": {"policy": "lru"}}),
    ("policy", ("/x", L, CAP), {"config": EngineConfig(), "policy": "bogus"}),
]


@pytest.mark.parametrize(("argument", "args", "opts"), OPEN_ARGS, ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(OPEN_ARGS)])
def test_resolve_open_refuses_bad_arguments(argument, args, opts):
    with pytest.raises(E.InvalidArgumentError) as err:
        resolve_open(*args, opts)
    assert err.value.argument == argument, err.value


def test_resolve_open_takes_a_config_and_options_over_it():
    cfg = EngineConfig(policy="lru", high_watermark=0.8, low_watermark=0.4)
    assert resolve_open(Path("/x"), L, CAP, {}) == ("/x", EngineConfig())
    assert resolve_open("/x", L, CAP, {"config": cfg}) == ("/x", cfg)
    assert resolve_open("/x", L, CAP, {"config": cfg})[1] is cfg
    assert resolve_open("/x", L, CAP, {"config": None, "policy": "lru"})[1] == EngineConfig(policy="lru")
    root, over = resolve_open("/x", L, CAP, {"config": cfg, "low_watermark": 0.8})
    assert over == cfg.evolve(low_watermark=0.8) and cfg.low_watermark == 0.4
    opts = {"config": cfg, "policy": "leaf-lru"}
    resolve_open("/x", L, CAP, opts)
    assert opts == {"config": cfg, "policy": "leaf-lru"}  # the caller's mapping is not changed


# ---------------------------------------------------------------------- Params

BAD_PARAMS: list[tuple[str, Any]] = [
    ("prefix", lambda: StoreParams(A, SEGS, SNAP)),
    ("prefix", lambda: StoreParams(None, SEGS, SNAP)),
    ("prefix", lambda: StoreParams(PA[:0], SEGS, SNAP)),
    ("segments", lambda: StoreParams(PA, 5, SNAP)),
    ("segments", lambda: StoreParams(PA, "kv", SNAP)),
    ("segments", lambda: StoreParams(PA, None, SNAP)),
    ("tokens_from", lambda: StoreParams(PA, SEGS, SNAP, tokens_from="0")),
    ("tokens_from", lambda: StoreParams(PA, SEGS, SNAP, tokens_from=-4)),
    ("tokens_from", lambda: StoreParams(PA, SEGS, SNAP, tokens_from=1.0)),
    ("valid", lambda: StoreParams(PA, SEGS, SNAP, valid=5)),
    ("prefix", lambda: params.store_arguments("store", StoreParams(PA, SEGS, SNAP), SEGS, None, 0, None)),
    ("prefix", lambda: params.store_arguments("store", StoreParams(PA, SEGS, SNAP), None, None, BT, None)),
    ("prefix", lambda: LookupParams(A)),
    ("gpu_blocks", lambda: LookupParams(PA, gpu_blocks=-1)),
    ("gpu_blocks", lambda: LookupParams(PA, gpu_blocks=1.0)),
    ("gpu_blocks", lambda: LookupParams(PA, gpu_blocks=len(PA) + 1)),
    ("total_tokens", lambda: LookupParams(PA, total_tokens="x")),
    ("total_tokens", lambda: LookupParams(PA, total_tokens=-5)),
    ("total_tokens", lambda: LookupParams(PA, total_tokens=NAN)),
    ("prefix", lambda: params.alone("lookup", LookupParams(PA), 1, None)),
]


@pytest.mark.parametrize(("argument", "build"), BAD_PARAMS, ids=[f"{a}-{i}" for i, (a, _) in enumerate(BAD_PARAMS)])
def test_bad_params_field_is_refused_naming_it(argument, build):
    with pytest.raises(E.InvalidArgumentError) as err:
        build()
    assert err.value.argument == argument, err.value
    assert str(err.value).startswith(f"{argument}: ")


def test_params_from_call_arguments():
    valid = lambda: True  # noqa: E731
    args = (PA, SEGS, None, BT, valid)
    assert params.store_arguments("store", *args) == args  # plain arguments pass through
    given = StoreParams(PA, SEGS, SNAP, tokens_from=BT, valid=valid)
    assert params.store_arguments("store", given, None, None, 0, None) == (PA, SEGS, SNAP, BT, valid)
    params.alone("lookup", LookupParams(PA, 2), 0, None)  # nothing else given: accepted


def test_calls_refuse_a_params_with_other_arguments_and_unknown_ones(tmp_path):
    with Engine.open(tmp_path / "c", L, CAP) as eng:
        for call in (eng.store, eng.store_async):
            with pytest.raises(E.InvalidArgumentError, match="given alone"):
                call(StoreParams(PA, SEGS, SNAP), SEGS)
            with pytest.raises(TypeError):
                call(PA, SEGS, SNAP, bogus=1)
        with pytest.raises(E.InvalidArgumentError, match="given alone"):
            eng.lookup(LookupParams(PA), gpu_blocks=1)
        with pytest.raises(TypeError):
            eng.lookup(PA, 1)
        with pytest.raises(TypeError):
            eng.lookup()
        assert not eng.catalog.journal() and eng.audit().ok


# ---------------------------------------------------------------------- on a real engine


def _rows(eng) -> tuple:
    return tuple(tuple(r[1:]) for r in eng.catalog.query("SELECT * FROM nodes ORDER BY 1"))


def test_params_calls_equal_argument_calls(tmp_path):
    B, C = A + tokens_for(2, 2), tokens_for(3, 3)
    PB, PC = Prefix.from_tokens(B, BT), Prefix.from_tokens(C, BT)
    tail = [{k: v[len(A):] for k, v in d.items()} for d in seg_tensors(L, B)]
    with Engine.open(tmp_path / "args", L, CAP) as ea, Engine.open(tmp_path / "params", L, CAP) as ep:
        ra = [ea.store(PA, SEGS, SNAP),
              ea.store(PB, tail, snap_tensors(L, B), tokens_from=len(A)),
              ea.store(PA, SEGS, SNAP),
              ea.store_async(PC, seg_tensors(L, C), snap_tensors(L, C)).result()]
        rp = [ep.store(StoreParams(PA, SEGS, SNAP)),
              ep.store(StoreParams(PB, tail, snap_tensors(L, B), tokens_from=len(A))),
              ep.store(StoreParams(PA, SEGS, SNAP)),
              ep.store_async(StoreParams(PC, seg_tensors(L, C), snap_tensors(L, C))).result()]
        assert [r.status for r in ra] == ["stored", "stored", "duplicate", "stored"]
        assert rp == ra
        assert _rows(ep) == _rows(ea)
        for eng in (ea, ep):
            for prefix, kw in ((PA, {}), (PB, {"gpu_blocks": 2}), (PB, {"total_tokens": 10 * BT}),
                               (PB[:3], {}), (PC, {"gpu_blocks": 3}), (Prefix.from_tokens(tokens_for(9, 2), BT), {})):
                by_args, by_params = eng.lookup(prefix, **kw), eng.lookup(LookupParams(prefix, **kw))
                assert by_params == by_args
            m = eng.lookup(LookupParams(PB, gpu_blocks=2))
            assert m.hit and m.gpu_blocks == 2 and m.blocks == len(PB)
            r = eng.restore(m)
            assert r is not None and torch.equal(r.segments[1]["v"], seg_tensors(L, B)[1]["v"][2 * BT:])


def test_engine_checks_what_params_cannot(tmp_path):
    """The layout's checks (block size, tensor shapes) still run on a Params call."""
    with Engine.open(tmp_path / "c", L, CAP) as eng:
        with pytest.raises(E.BlockSizeMismatchError):
            eng.lookup(LookupParams(Prefix.from_tokens(A, 2 * BT)))
        with pytest.raises(E.ShapeError):
            eng.store(StoreParams(PA, SEGS, None))
        with pytest.raises(E.InvalidArgumentError) as err:
            eng.store(StoreParams(PA, SEGS, SNAP, tokens_from=len(A)))
        assert err.value.argument == "tokens_from"
        assert eng.catalog.query("SELECT count(*) FROM nodes")[0][0] == 0


def test_open_with_a_config_equals_open_with_options(tmp_path):
    cfg = EngineConfig(policy="lru", high_watermark=0.9, low_watermark=0.5, inflight_wait_s=0)
    with Engine.open(tmp_path / "cfg", L, CAP, config=cfg) as ec, \
            Engine.open(tmp_path / "kw", L, CAP, policy="lru", high_watermark=0.9, low_watermark=0.5,
                        inflight_wait_s=0) as ek:
        for eng in (ec, ek):
            assert (eng.policy_name, eng.high_watermark, eng.low_watermark, eng.inflight_wait_s) == ("lru", 0.9, 0.5, 0)
            assert eng.store(StoreParams(PA, SEGS, SNAP)).status == "stored"
    with Engine.open(tmp_path / "cfg", L, CAP, config=cfg, create=False) as eng:
        assert eng.lookup(PA).hit
    with pytest.raises(E.NotACacheError):  # the config's create=False is the engine's
        Engine.open(tmp_path / "new", L, CAP, config=cfg.evolve(create=False))
    assert not (tmp_path / "new").exists()
