"""Under CI (``PREFIXSTORE_CI=1``, exported by ``.ci/run``) a skipped test is a failed
one: CI installs every package and tool the suite needs, so a skip there means a
broken install, not a missing option. The only skips that stay skips are those no CI
machine can satisfy (no CUDA device) and tests a person opts into with an environment
variable (``PREFIXSTORE_...=1`` in the reason). ``tests/conftest.py`` installs the
hooks below; they act on skips from anywhere (``pytest.importorskip`` at module level,
``pytest.skip`` in a test or fixture, ``skipif`` marks).
"""

from __future__ import annotations

import os
import re

import pytest

CI = os.environ.get("PREFIXSTORE_CI") == "1"
STAYS_SKIPPED = re.compile(r"CUDA|\bPREFIXSTORE_[A-Z_]+=1\b")
"""Skip reasons that stay skips under CI: no CUDA device here; tests a person opts into."""


def skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    """The reason of a skipped report (pytest keeps it as (path, line, 'Skipped: why'))."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def fail_skip_under_ci(report: pytest.CollectReport | pytest.TestReport, ci: bool = CI) -> None:
    """Turn a skipped ``report`` into a failed one under CI, unless its reason stays a skip."""
    if not ci or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = skip_reason(report)
    if STAYS_SKIPPED.search(reason):
        return
    report.outcome = "failed"
    report.longrepr = (f"skipped under CI (PREFIXSTORE_CI=1), where everything the suite needs is "
                       f"installed: {reason}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    fail_skip_under_ci(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    outcome = yield
    fail_skip_under_ci(outcome.get_result())
