"""The documentation: the README stays a front page whose links resolve, the command-line
reference is the one the parsers render, every page is in the site's navigation, and the
site builds with ``mkdocs build --strict``, which a broken link fails."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from prefixstore.cli import reference

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
MAX_README_LINES = 300
FIRST_COMMANDS = [
    "pip install torch==2.13.0 && pip install -e . && prefixstore replay "
    "../shared/traces/mooncake_conversation_trace.jsonl",
    "bash .ci/run",
]
LANDING: set[str] = set()
"""Pages the README links that another branch is writing. Once one exists, take it out of
here and put it in ``nav`` in mkdocs.yml (the tests below fail until both are done)."""
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _pages() -> set[str]:
    return {p.name for p in DOCS.glob("*.md")}


def _readme_links() -> set[str]:
    text = re.sub(r"```.*?```", "", README.read_text(), flags=re.S)
    return {link.split("#")[0] for link in LINK.findall(text) if "://" not in link and not link.startswith("#")}


def test_the_readme_is_a_front_page_whose_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    code = text.split("```sh\n", 1)[1].split("```", 1)[0].splitlines()
    assert code[:2] == FIRST_COMMANDS
    links = _readme_links()
    missing = {link for link in links if not (ROOT / link).exists()}
    assert missing <= LANDING, f"README links to nothing: {sorted(missing - LANDING)}"
    landed = {link for link in LANDING if (ROOT / link).exists()}
    assert not landed, f"{sorted(landed)} exist now: take them out of LANDING and add them to mkdocs.yml's nav"
    unlinked = {p for p in _pages() if f"docs/{p}" not in links and p != "index.md"}
    assert not unlinked, f"pages the README does not link: {sorted(unlinked)}"


def test_every_page_is_in_the_site_navigation():
    config = (ROOT / "mkdocs.yml").read_text()
    nav = set(re.findall(r"([\w.-]+\.md)\s*$", config.split("\nnav:", 1)[1], flags=re.M))
    assert nav == _pages(), {"not in nav": sorted(_pages() - nav), "no such page": sorted(nav - _pages())}


def test_the_command_line_reference_is_the_one_the_parsers_render():
    page = (DOCS / "cli-reference.md").read_text()
    assert page == reference.render(), (
        "docs/cli-reference.md is out of date: python -m prefixstore.cli.reference --write docs/cli-reference.md")
    for mod in reference.COMMANDS:  # every command, and every option of each
        section = page.split(f"\n## prefixstore {mod.NAME}\n", 1)[1].split("\n## ", 1)[0]
        parser = argparse.ArgumentParser(add_help=False)
        mod.add_arguments(parser)
        flags = [f for a in parser._actions if a.help != argparse.SUPPRESS for f in a.option_strings]
        assert flags and all(f"`{flag}" in section for flag in flags), (mod.NAME, flags)


def test_the_reference_check_command_fails_on_a_stale_page(tmp_path):
    stale = tmp_path / "cli-reference.md"
    stale.write_text(reference.render().replace("tokens per block", "tokens in a block"))
    assert reference.main(["--check", str(stale)]) == 1
    assert reference.main(["--write", str(stale)]) == 0
    assert reference.main(["--check", str(stale)]) == 0


def _build(root: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
                          cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
                    reason="mkdocs and mkdocs-material are the docs extra, which .ci/run installs")
def test_the_site_builds_strict_and_a_broken_link_or_anchor_fails_it(tmp_path):
    built = _build(ROOT, tmp_path / "site")
    assert built.returncode == 0, built.stdout + built.stderr
    assert (tmp_path / "site" / "cli-reference" / "index.html").is_file()
    for broken in ("[gone](no-such-page.md)", "[gone](concepts.md#no-such-heading)"):
        copy = tmp_path / "copy"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(DOCS, copy / "docs")
        shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
        with open(copy / "docs" / "index.md", "a") as f:
            f.write(f"\nSee {broken}.\n")
        failed = _build(copy, tmp_path / "site2")
        assert failed.returncode != 0, broken
        assert broken.split("(")[1].rstrip(")").split("#")[-1] in failed.stdout + failed.stderr


def test_ci_installs_the_docs_extra_and_builds_the_site_strict_before_the_tests():
    with open(ROOT / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert {d.split(">")[0] for d in extras["docs"]} == {"mkdocs", "mkdocs-material"}
    lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    install = next(ln for ln in lines if "pip install -q -e \".[" in ln)
    assert "docs" in install.split("[", 1)[1].split("]", 1)[0].split(",")
    build = next(i for i, ln in enumerate(lines) if "mkdocs build --strict" in ln and not ln.startswith("#"))
    assert " -q" not in lines[build]  # quiet, mkdocs does not count its warnings: --strict would pass them
    assert lines.index(install) < build < lines.index("$PY -m pytest -q")
