"""Under CI (PREFIXSTORE_CI=1, exported by .ci/run) a skip is a failure, except for
tests no CI machine can run (no CUDA device) and tests a person opts into; and the
Hypothesis profile is "ci". Checked in a separate pytest process over generated tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

SKIPS = textwrap.dedent('''
    import shutil
    import pytest

    def test_tool_missing():
        if shutil.which("no-such-tool-here") is None:
            pytest.skip("no-such-tool-here is not installed")

    @pytest.fixture
    def needs_root():
        pytest.skip("cannot mount a tmpfs here (needs root)")

    def test_in_a_fixture(needs_root):
        pass

    @pytest.mark.skipif(True, reason="needs a CUDA device")
    def test_cuda():
        pass

    @pytest.mark.skipif(True, reason="the whole trace takes minutes: PREFIXSTORE_FULL_REPLAY=1")
    def test_opt_in():
        pass

    @pytest.mark.xfail(reason="known")
    def test_expected_failure():
        assert False

    def test_passes():
        pass
''')

IMPORT_SKIP = textwrap.dedent('''
    import pytest
    pytest.importorskip("no_such_module_for_prefixstore_tests")

    def test_never_runs():
        pass
''')


def _pytest(tmp_path, ci: str | None, *files: str) -> dict[str, str]:
    """Run pytest on ``files`` (under tmp_path) with the CI hooks; outcome per test id."""
    env = {k: v for k, v in os.environ.items() if k != "PREFIXSTORE_CI"}
    if ci is not None:
        env["PREFIXSTORE_CI"] = ci
    env["PYTHONPATH"] = os.pathsep.join([HERE, REPO])
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "ci_mode", "-p", "no:cacheprovider", "-rA",
                        "-q", *files], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = {}
    for line in p.stdout.splitlines():
        m = re.match(r"(PASSED|FAILED|ERROR|XFAIL|SKIPPED) (?:\[\d+\] )?([\w./]+)(?:::(\w+))?", line)
        if m:
            key = m.group(3) or m.group(2)
            out[key] = m.group(1)
    return out | {"_stdout": p.stdout}


@pytest.fixture
def generated(tmp_path):
    (tmp_path / "test_skips.py").write_text(SKIPS)
    (tmp_path / "test_import_skip.py").write_text(IMPORT_SKIP)
    return tmp_path


def test_under_ci_a_skip_fails_but_cuda_and_opt_in_stay_skipped(generated):
    got = _pytest(generated, "1", "test_skips.py")
    assert {k: v for k, v in got.items() if k != "_stdout"} == {
        "test_tool_missing": "FAILED", "test_in_a_fixture": "ERROR", "test_passes": "PASSED",
        "test_expected_failure": "XFAIL", "test_skips.py": "SKIPPED",  # the two that stay skips
    }, got["_stdout"]
    assert "skipped under CI (PREFIXSTORE_CI=1)" in got["_stdout"]
    assert "no-such-tool-here is not installed" in got["_stdout"]
    assert re.search(r"2 skipped", got["_stdout"]), got["_stdout"]


def test_under_ci_a_module_level_importorskip_fails_collection(generated):
    got = _pytest(generated, "1", "test_import_skip.py")
    assert got.get("test_import_skip.py") == "ERROR", got["_stdout"]
    assert "no_such_module_for_prefixstore_tests" in got["_stdout"]


@pytest.mark.parametrize("ci", [None, "0"])
def test_outside_ci_skips_stay_skips(generated, ci):
    got = _pytest(generated, ci, "test_skips.py", "test_import_skip.py")
    assert "FAILED" not in got.values() and "ERROR" not in got.values(), got["_stdout"]
    assert re.search(r"1 passed, 5 skipped, 1 xfailed", got["_stdout"]), got["_stdout"]


@pytest.mark.parametrize(("ci", "profile", "examples"), [(None, "dev", 30), ("1", "ci", 60)])
def test_ci_selects_the_ci_hypothesis_profile(ci, profile, examples):
    env = {k: v for k, v in os.environ.items() if k not in ("PREFIXSTORE_CI", "PREFIXSTORE_HYPOTHESIS_PROFILE")}
    if ci is not None:
        env["PREFIXSTORE_CI"] = ci
    env["PYTHONPATH"] = os.pathsep.join([HERE, REPO])
    code = "import conftest, hypothesis; print(conftest.HYPOTHESIS_PROFILE, hypothesis.settings().max_examples)"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert p.stdout.split() == [profile, str(examples)], p.stderr[-2000:]
