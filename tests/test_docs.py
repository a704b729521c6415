"""The docs that the code is held to: docs/flags.md is what `tools/gen_flags.py` writes from
the real parsers, docs/architecture.md's may-import table is the one
`tests/test_import_rules.py` enforces, and every "§x.y" cited in the code is a section of
docs/architecture.md."""

from __future__ import annotations

import difflib
import importlib.util
import re
from pathlib import Path

import pytest
import test_import_rules

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def _gen_flags():
    spec = importlib.util.spec_from_file_location("gen_flags", ROOT / "tools" / "gen_flags.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flags_doc_is_generated_from_the_parsers():
    gen = _gen_flags()
    current = gen.OUTPUT.read_text() if gen.OUTPUT.exists() else ""
    expected = gen.render()
    if current != expected:
        diff = difflib.unified_diff(current.splitlines(), expected.splitlines(),
                                    "docs/flags.md", "the parsers", lineterm="", n=0)
        pytest.fail(f"docs/flags.md is stale (a flag, its default or its help changed): "
                    f"regenerate it with `{gen.COMMAND}` and commit it with the change\n"
                    + "\n".join(list(diff)[:20]), pytrace=False)


def test_flags_doc_has_the_flags_the_hand_kept_table_lacked():
    text = (ROOT / "docs" / "flags.md").read_text()
    for flag in ("--seed", "--served-model-name", "--tokenizer", "--api-server-count",
                 "--listen", "--max-num-seqs"):
        assert f"`{flag}`" in text


def _may_import_table() -> dict[str, set[str]]:
    """folder -> folders it may import, from the table in docs/architecture.md whose header
    has a "may import" column."""
    table: dict[str, set[str]] = {}
    column = None
    for line in ARCHITECTURE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") \
            else None
        if cells is None:
            column = None
            continue
        if "may import (of ours)" in cells:
            column = cells.index("may import (of ours)")
            continue
        if column is None or set(cells[0]) <= set("-: "):
            continue
        folder = re.fullmatch(r"`([\w/]+)/`", cells[0])  # a subfolder's row: `a/b/`
        if folder and folder.group(1) in test_import_rules.MAY_IMPORT:
            table[folder.group(1)] = set(re.findall(r"`([\w/]+)`", cells[column]))
    return table


def test_architecture_may_import_table_is_the_enforced_one():
    assert _may_import_table() == test_import_rules.MAY_IMPORT, (
        "docs/architecture.md's may-import table and tests/test_import_rules.py's MAY_IMPORT "
        "disagree: change both in the same commit")


_CITATION = re.compile(r"§(\d+(?:\.\d+)?)")
_HEADING = re.compile(r"^#{2,4} (\d+(?:\.\d+)?)[. ]", re.MULTILINE)
_ITEM = re.compile(r"\*\*(\d+\.\d+)\*\*")


def test_section_citations_in_the_code_exist_in_architecture_md():
    text = ARCHITECTURE.read_text()
    sections = set(_HEADING.findall(text)) | set(_ITEM.findall(text))
    missing = []
    for folder in (*test_import_rules.FOLDERS, "tests", "tools", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                for cited in _CITATION.findall(line):
                    if cited not in sections:
                        missing.append(f"{path.relative_to(ROOT)}:{number} cites §{cited}")
    assert missing == [], "sections cited in the code but not in docs/architecture.md"


def test_ci_runs_the_readme_test_command():
    """.ci/run runs the suite exactly as README.md's "Test it" tells a reader to: one command,
    written in both places, changed in both in the same commit."""
    readme = (ROOT / "README.md").read_text()
    (command,) = re.findall(r"^pip install .*&& (python -m pytest .*)$", readme, re.MULTILINE)
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip().startswith("python -m pytest")]
    assert ci == [command], f".ci/run runs {ci}, README.md says {command!r}"
