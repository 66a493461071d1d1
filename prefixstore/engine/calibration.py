"""The engine's side of bandwidth calibration: the measured value kept in the catalog meta
(key ``calibration``) and fed to the cost model. The probe itself is ``gpu/calibrate.py``."""

from __future__ import annotations

from typing import Any

import attrs

from prefixstore.engine.catalog import Catalog
from prefixstore.engine.settings import Settings
from prefixstore.gpu import calibrate

META_KEY = "calibration"


def resolve(catalog: Catalog, executor: Any, backing_kind: str, root: str, settings: Settings,
            bandwidth: Any) -> dict[str, Any] | None:
    """Apply the ``bandwidth`` option: returns the calibration used (None: the cost
    model's), and sets the measured bandwidth in ``settings.cost``. A new measurement
    is stored in the catalog meta."""
    stored = catalog.meta(META_KEY) if isinstance(bandwidth, str) else None
    got = calibrate.resolve(bandwidth, stored, executor=executor, backing_kind=backing_kind, root=root)
    if got.to_store is not None:
        with catalog.txn("calibration") as c:
            catalog.set_meta(c, META_KEY, got.to_store)
    if got.value is not None and settings.cost is not None:
        settings.cost = attrs.evolve(settings.cost, bandwidth_bytes_per_s=got.value["bytes_per_s"])
    return got.value
