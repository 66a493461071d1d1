"""The package as installed: pytest and hypothesis are extras, not runtime
dependencies; the library and every command but the test machinery import without
them; py.typed ships; a command or example whose extra is missing says in one line
which extra to install."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs a snippet in a fresh interpreter in which the named top-level packages cannot be
# imported (as when they are not installed).
_WITHOUT = """
import sys
BLOCKED = set(sys.argv[1].split(","))

class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Missing())
sys.argv = sys.argv[2:]
exec(compile(sys.argv[0], "<snippet>", "exec"))
"""


def _without(blocked: str, code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-c", _WITHOUT, blocked, code, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_pytest_and_hypothesis_are_extras_and_py_typed_ships():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    deps = {d.split(">")[0].split("=")[0].strip() for d in project["project"]["dependencies"]}
    assert not deps & {"pytest", "hypothesis"}, deps
    extras = project["project"]["optional-dependencies"]
    assert any(d.startswith("hypothesis") for d in extras["fuzz"])
    assert {d.split(">")[0] for d in extras["test"]} >= {"pytest", "hypothesis"}
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["prefixstore"]
    assert os.path.isfile(os.path.join(REPO, "prefixstore", "py.typed"))
    with open(os.path.join(REPO, ".ci", "run")) as f:
        installs = [ln for ln in f if "pip install -q -e" in ln]
    assert any("test" in ln for ln in installs), installs


def test_library_and_commands_need_neither_pytest_nor_hypothesis(tmp_path):
    code = """
import importlib, pkgutil, sys
import prefixstore
skip = {"prefixstore.fuzz.stateful", "prefixstore.adapters.hf",
        "prefixstore.adapters.vllm", "prefixstore.adapters.lmcache"}  # vllm imports torch._dynamo, which probes for hypothesis
for m in pkgutil.walk_packages(prefixstore.__path__, "prefixstore."):
    if m.name not in skip:
        importlib.import_module(m.name)
from prefixstore.cli import main
rc = main(["demo", sys.argv[1]]) or main(["audit", sys.argv[1]]) or main(["fuzz", "--steps", "40", "--quiet"])
assert not {"pytest", "hypothesis"} & set(sys.modules), "imported"
print("RC", rc)
"""
    p = _without("pytest,hypothesis", code, str(tmp_path / "c"))
    assert p.returncode == 0 and "RC 0" in p.stdout, p.stdout[-1500:] + p.stderr[-3000:]


def test_stateful_machines_without_hypothesis_name_the_extra():
    p = _without("hypothesis", "import prefixstore.fuzz.stateful")
    assert p.returncode == 1
    assert "ImportError: prefixstore.fuzz.stateful needs hypothesis: pip install 'prefixstore[fuzz]'" in p.stderr


def test_replay_plots_without_matplotlib_names_the_extra(tmp_path):
    code = "import sys; from prefixstore.cli import main; sys.exit(main(sys.argv[1:]))"
    trace = os.path.join(REPO, "..", "shared", "traces", "mooncake_conversation_trace.jsonl")
    p = _without("matplotlib", code, "replay", trace, "--limit", "5", "--plots", str(tmp_path / "p"))
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [
        "replay: --plots needs matplotlib: install the plots extra (pip install 'prefixstore[plots]')"]


def test_chat_example_without_transformers_names_the_extra():
    code = "import runpy; runpy.run_path('examples/chat.py', run_name='__main__')"
    p = _without("transformers", code)
    assert p.returncode == 1
    assert p.stderr.strip().splitlines() == [
        "examples/chat.py needs transformers: pip install 'prefixstore[transformers]'"]


def test_the_command_line_is_the_top_level_cli_module():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert scripts == {"prefixstore": "prefixstore.cli:main"}
    env = {**os.environ, "PYTHONPATH": REPO}
    p = subprocess.run([sys.executable, "-m", "prefixstore.cli", "--help"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    for command in ("demo", "audit", "catalog", "rank-server", "replay", "fuzz", "soak", "fiu"):
        assert command in p.stdout, command


def test_import_linter_is_a_test_extra_and_ci_runs_the_layers_contract():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    for extra in ("test", "dev"):
        assert any(d.startswith("import-linter") for d in project["project"]["optional-dependencies"][extra])
    contract, = project["tool"]["importlinter"]["contracts"]
    assert contract["type"] == "layers" and contract["layers"][0] == "prefixstore.cli"
    assert contract["layers"][-1] == "prefixstore.base"
    with open(os.path.join(REPO, ".ci", "run")) as f:
        lines = [ln.strip() for ln in f]
    assert "lint-imports" in lines and lines.index("lint-imports") < lines.index("$PY -m pytest -q")


# Every package that only an extra installs; a plain `pip install -e .` has none of them.
_EXTRAS_ONLY = "redis,mooncake,transformers,matplotlib,sglang,vllm,lmcache,pytest,hypothesis,importlinter,ruff"
# Modules that exist to use an extra, and say which one when it is missing.
_NEEDS_AN_EXTRA = {"prefixstore.fuzz.stateful", "prefixstore.adapters.hf", "prefixstore.adapters.hf_tiny",
                   "prefixstore.adapters.hf_walk", "prefixstore.adapters.sglang", "prefixstore.adapters.vllm",
                   "prefixstore.adapters.lmcache"}


def test_a_plain_install_imports_everything_else_and_runs_the_first_command(tmp_path):
    code = f"""
import importlib, pkgutil, sys
import prefixstore
for m in pkgutil.walk_packages(prefixstore.__path__, "prefixstore."):
    if m.name not in {sorted(_NEEDS_AN_EXTRA)!r}:
        importlib.import_module(m.name)
from prefixstore.cli import main
rc = main(["replay", sys.argv[1], "--limit", "40"])
print("RC", rc)
"""
    trace = os.path.join(REPO, "..", "shared", "traces", "mooncake_conversation_trace.jsonl")
    p = _without(_EXTRAS_ONLY, code, trace)
    assert p.returncode == 0 and "RC 0" in p.stdout, p.stdout[-1500:] + p.stderr[-3000:]
    assert "hit ratio" in p.stdout.lower()


def test_a_remote_tier_without_redis_names_the_extra_in_one_line(tmp_path):
    code = "import sys; from prefixstore.cli import main; sys.exit(main(sys.argv[1:]))"
    trace = os.path.join(REPO, "..", "shared", "traces", "mooncake_conversation_trace.jsonl")
    p = _without("redis", code, "replay", trace, "--limit", "5", "--remote", "redis://127.0.0.1:1")
    assert p.returncode == 2, p.stdout[-1500:] + p.stderr[-3000:]
    assert p.stderr.strip().splitlines() == [
        "prefixstore replay: the Redis remote tier needs redis-py: pip install 'prefixstore[remote]'"]
    api = """
import tempfile
from prefixstore import Layout, TensorSpec
from prefixstore.base.errors import MissingExtraError
from prefixstore.engine.api import Engine
layout = Layout(segments=[TensorSpec("k", "float32", (2,))], block_tokens=4, ranks=1)
try:
    Engine.open(tempfile.mkdtemp(), layout, 1 << 20, remote="redis://127.0.0.1:1")
except MissingExtraError as exc:
    print("MISSING", exc)
"""
    p = _without("redis", api)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == "MISSING the Redis remote tier needs redis-py: pip install 'prefixstore[remote]'"
