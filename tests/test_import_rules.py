"""DESIGN.md's "may import" table, enforced: every module's imports are read with `ast` (no
module is imported), so a forbidden import fails here before it can blur a folder's role.

    folder        may import (of ours)                       third-party rule
    ipc/          nothing                                    -
    engine_core/  ipc                                        never torch (nor triton)
    workers/      ipc, kernels                               -
    kernels/      nothing                                    -
    frontend/     ipc, engine_core (config and launching)    never torch at module level
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("ipc", "engine_core", "workers", "kernels", "frontend")

MAY_IMPORT = {
    "ipc": set(),
    "engine_core": {"ipc"},
    "workers": {"ipc", "kernels"},
    "kernels": set(),
    "frontend": {"ipc", "engine_core"},
}
FRONTEND_ENGINE_CORE = {
    # "config and launching only": the flags, the config, the daemon that a frontend
    # starts, and the pieces the offline tools (`tidal tune`) reuse by design
    "args", "config", "daemon", "model_files", "step_cost", "cpu_threads",
    "restart_budget",  # launching: the restart limit every supervisor of a core applies
    "scheduler", "request", "block_pool",  # tidal tune's simulator runs the real scheduler
}
KNOWN_EXCEPTIONS = {
    # `tidal tune profile`'s measuring child process builds a Worker inside a function; it
    # belongs in workers/ (noted on issue 14), listed here so nothing else joins it
    ("frontend/tune/profile.py", "tidal.workers.worker"),
}
NEVER = {
    "engine_core": {"torch", "triton"},
    "ipc": {"torch", "triton"},
}


def _modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, imported module, at module level) for every import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [(node.lineno, name, id(node) in top_level) for name in names]
    return found


def _violations(folder: str) -> list[str]:
    bad = []
    for path in _modules(folder):
        where = path.relative_to(ROOT)
        for line, name, top in _imports(path):
            if (str(where), name) in KNOWN_EXCEPTIONS:
                continue
            parts = name.split(".")
            if parts[0] in NEVER.get(folder, ()):
                bad.append(f"{where}:{line} imports {name}")
            elif folder == "frontend" and parts[0] == "torch" and top:
                bad.append(f"{where}:{line} imports torch at module level")
            if parts[0] != "tidal" or len(parts) < 2 or parts[1] == folder:
                continue
            if parts[1] not in MAY_IMPORT[folder]:
                bad.append(f"{where}:{line} imports {name} ({folder}/ may import "
                           f"{sorted(MAY_IMPORT[folder]) or 'nothing of ours'})")
            elif (folder == "frontend" and parts[1] == "engine_core"
                  and (len(parts) < 3 or parts[2] not in FRONTEND_ENGINE_CORE)):
                bad.append(f"{where}:{line} imports {name} (frontend/ takes only "
                           "engine_core's config and launching)")
    return bad


@pytest.mark.parametrize("folder", FOLDERS)
def test_folder_imports_only_what_design_allows(folder):
    assert _modules(folder), f"no modules found under {folder}/"
    assert _violations(folder) == []


def test_the_rule_catches_a_forbidden_import(tmp_path, monkeypatch):
    (tmp_path / "engine_core").mkdir()
    (tmp_path / "engine_core" / "bad.py").write_text(
        "import torch\nfrom tidal.workers.worker import Worker\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert _violations("engine_core") == [
        "engine_core/bad.py:1 imports torch",
        "engine_core/bad.py:2 imports tidal.workers.worker (engine_core/ may import ['ipc'])",
    ]
