"""The engine's side of bandwidth calibration: the measured value kept in the catalog meta
(key ``calibration``) and fed to the cost model. The probe itself is ``gpu/calibrate.py``."""

from __future__ import annotations

from typing import Any

import attrs

from prefixstore.gpu import calibrate

META_KEY = "calibration"


def resolve(eng: Any, bandwidth: Any) -> dict[str, Any] | None:
    """Apply the ``bandwidth`` option to ``eng``: returns the calibration used (None: the
    cost model's). A new measurement is stored in the catalog meta."""
    stored = eng.catalog.meta(META_KEY) if isinstance(bandwidth, str) else None
    got = calibrate.resolve(bandwidth, stored, executor=eng.executor, backing_kind=eng.tiers.backing.kind,
                            root=eng.root)
    if got.to_store is not None:
        with eng.catalog.txn("calibration") as c:
            eng.catalog.set_meta(c, META_KEY, got.to_store)
    if got.value is not None and eng.cost is not None:
        eng.cost = attrs.evolve(eng.cost, bandwidth_bytes_per_s=got.value["bytes_per_s"])
    return got.value
