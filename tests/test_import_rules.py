"""The "may import" table (docs/architecture.md §3.1), enforced: imports are read with `ast` (no
module is imported), so a forbidden import fails here before it can blur a folder's role.

    folder               may import (of ours)                        third-party rule
    ipc/                 nothing                                     never torch
    engine_core/         ipc; engine_core/advice (observers, in the  never torch (nor triton)
                         daemon alone)
    engine_core/advice/  ipc, engine_core (config, scheduler,        never torch (nor triton)
                         request, preemption log, CPU threads,
                         the observer interface)
    workers/             ipc, kernels                                -
    kernels/             ipc (its paths module alone)                -
    frontend/            ipc, engine_core (config and launching),    never torch at module level
                         engine_core/advice

A subfolder with a row of its own (`engine_core/advice/`) is a folder of its own here: its
modules are held to its row, and its parent's row says what the parent may take of it.

Imports inside the package are relative (`from ..ipc.messages import X`), so tools that read
the tree without an install follow them; they are resolved here to `tidal.` names the same way
Python does. A module named in a string is held to the table too: a launch (`[sys.executable,
"-m", "tidal.workers.proc"]`), a lazy export (`"tidal.frontend.llm"`), a CLI table entry
(`"tidal.frontend.server.serve"`). Starting a process is not importing its code, so
`MAY_LAUNCH` lists the few child processes a folder starts across the table.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("ipc", "engine_core", "engine_core/advice", "workers", "kernels", "frontend")

MAY_IMPORT = {
    "ipc": set(),
    "engine_core": {"ipc", "engine_core/advice"},
    "engine_core/advice": {"ipc", "engine_core"},
    "workers": {"ipc", "kernels"},
    "kernels": {"ipc"},
    "frontend": {"ipc", "engine_core", "engine_core/advice"},
}
ONLY = {
    # (folder, folder it imports): the modules of it that it may import, where not all
    ("frontend", "engine_core"): {
        # "config and launching only": the flags, the config, the daemon that a frontend
        # starts, and launching it
        "args", "config", "daemon", "model_files",
        "launcher",  # launching: a private engine core (or -dp router) for a frontend
        "supervisor",  # launching: the restart rule every supervisor of a child applies
    },
    # the step loop offers observers one interface (core.py's EngineObserver); the daemon
    # builds the advisory wing's once (WIRED_BY below)
    ("engine_core", "engine_core/advice"): {"observers"},
    # the advisory wing prices steps and replays the scheduler: the engine core's config, its
    # scheduler and requests (the simulator runs them), the preemption log (where advice is
    # quoted), the CPU threads a worker gets (a cost model's key, a profile's child) and the
    # observer interface of the step loop (core.py)
    ("engine_core/advice", "engine_core"): {
        "config", "core", "cpu_threads", "preemption_log", "request", "scheduler",
    },
    # the cache folder's rule (ipc/paths.py, standard library only), written once: the C
    # kernels' builds live there; kernels/ imports nothing else of ours
    ("kernels", "ipc"): {"paths"},
}
WIRED_BY = {
    # (folder, folder it imports): the one module of the folder that may import it
    ("engine_core", "engine_core/advice"): "engine_core/daemon.py",
}
KNOWN_EXCEPTIONS = {
    # `tidal bench chaos` finds worker processes by their command line to kill them
    ("frontend/bench/chaos.py", "tidal.workers.proc"),
}
MAY_LAUNCH = {
    # the engine core starts one worker process per rank, and the GGUF converter, by name
    "engine_core": {"tidal.workers.proc", "tidal.workers.gguf"},
    # `tidal tune profile` times worker steps in a child process that builds the Worker
    "engine_core/advice": {"tidal.workers.step_profile"},
}
NEVER = {
    "engine_core": {"torch", "triton"},
    "engine_core/advice": {"torch", "triton"},
    "ipc": {"torch", "triton"},
}


def _modules(folder: str) -> list[Path]:
    """The folder's modules, less those of a subfolder with a row of its own."""
    inner = [ROOT / f for f in FOLDERS if f.startswith(folder + "/")]
    return sorted(path for path in (ROOT / folder).rglob("*.py")
                  if not any(path.is_relative_to(sub) for sub in inner))


def _folder_of(name: str) -> tuple[str, str | None] | None:
    """(folder of the table, the module's first name inside it) of a `tidal.` module, the
    deepest folder that holds it; None for a module not of ours (or `tidal` itself)."""
    parts = name.split(".")
    if parts[0] != "tidal" or len(parts) < 2:
        return None
    for depth in range(len(parts) - 1, 0, -1):
        folder = "/".join(parts[1:depth + 1])
        if folder in FOLDERS:
            return folder, (parts[depth + 1] if len(parts) > depth + 1 else None)
    return None


def _package(path: Path) -> list[str]:
    """The `tidal.` package a file of the tree belongs to, as its parts."""
    parts = list(path.relative_to(ROOT).parts[:-1])
    return ["tidal", *parts]


def _absolute(node: ast.ImportFrom, path: Path) -> list[str]:
    """The modules an ImportFrom names, relative levels resolved as Python does (`from . import
    x` may import the submodule x, so both the package and package.x are returned)."""
    if node.level == 0:
        return [node.module] if node.module else []
    base = _package(path)[:len(_package(path)) - (node.level - 1)]
    module = ".".join(base + ([node.module] if node.module else []))
    return [module] + [f"{module}.{alias.name}" for alias in node.names
                       if _module_file(f"{module}.{alias.name}") is not None]


def _module_file(name: str) -> Path | None:
    """The file of tidal module `name` in the tree, or None."""
    parts = name.split(".")
    if parts[0] != "tidal" or len(parts) < 2:
        return None
    base = ROOT.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


_MODULE_STRING = re.compile(r"tidal(\.\w+)+(:\w+)?")


def _named_in_strings(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) for each string constant that names a tidal module of the tree (a launch
    `-m` argument, a lazy export, a CLI table entry), logger names aside."""
    loggers = {id(arg) for node in ast.walk(tree) if isinstance(node, ast.Call)
               and getattr(node.func, "attr", getattr(node.func, "id", "")) == "getLogger"
               for arg in node.args}
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and id(node) not in loggers and _MODULE_STRING.fullmatch(node.value)):
            module = node.value.split(":")[0]
            if _module_file(module) is not None:
                found.append((node.lineno, module))
    return found


@functools.lru_cache(maxsize=None)
def _parsed(path: Path) -> ast.Module:
    """The file's syntax tree, parsed once per test run (the rules below read every module of
    the package several times)."""
    return ast.parse(path.read_text(), str(path))


def _imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, imported module, at module level) for every import in the file, and for every
    module it names in a string (never at module level: nothing is imported then)."""
    tree = _parsed(path)
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = _absolute(node, path)
        else:
            continue
        found += [(node.lineno, name, id(node) in top_level) for name in names]
    return found + [(line, name, False) for line, name in _named_in_strings(tree)]


def _violations(folder: str) -> list[str]:
    bad = []
    for path in _modules(folder):
        where = path.relative_to(ROOT)
        for line, name, top in _imports(path):
            if (str(where), name) in KNOWN_EXCEPTIONS or name in MAY_LAUNCH.get(folder, ()):
                continue
            if name.split(".")[0] in NEVER.get(folder, ()):
                bad.append(f"{where}:{line} imports {name}")
            elif folder == "frontend" and name.split(".")[0] == "torch" and top:
                bad.append(f"{where}:{line} imports torch at module level")
            found = _folder_of(name)
            if found is None or found[0] == folder:
                continue
            target, module = found
            if target not in MAY_IMPORT[folder]:
                bad.append(f"{where}:{line} imports {name} ({folder}/ may import "
                           f"{sorted(MAY_IMPORT[folder]) or 'nothing of ours'})")
            elif (folder, target) in ONLY and module not in ONLY[folder, target]:
                bad.append(f"{where}:{line} imports {name} ({folder}/ takes only "
                           f"{sorted(ONLY[folder, target])} of {target}/)")
            elif WIRED_BY.get((folder, target), str(where)) != str(where):
                bad.append(f"{where}:{line} imports {name} (only "
                           f"{WIRED_BY[folder, target]} takes {target}/)")
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
        "engine_core/bad.py:2 imports tidal.workers.worker (engine_core/ may import "
        "['engine_core/advice', 'ipc'])",
    ]


def test_relative_imports_and_launch_strings_are_held_to_the_table(tmp_path, monkeypatch):
    (tmp_path / "engine_core").mkdir()
    (tmp_path / "frontend").mkdir()
    (tmp_path / "frontend" / "cli.py").write_text("")
    (tmp_path / "engine_core" / "bad.py").write_text(
        "import logging, sys\n"
        "from ..frontend import cli\n"
        "logger = logging.getLogger('tidal.frontend.cli')\n"
        "cmd = [sys.executable, '-m', 'tidal.frontend.cli']\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert _violations("engine_core") == [
        "engine_core/bad.py:2 imports tidal.frontend (engine_core/ may import "
        "['engine_core/advice', 'ipc'])",
        "engine_core/bad.py:2 imports tidal.frontend.cli (engine_core/ may import "
        "['engine_core/advice', 'ipc'])",
        "engine_core/bad.py:4 imports tidal.frontend.cli (engine_core/ may import "
        "['engine_core/advice', 'ipc'])",
    ]


def test_no_module_of_the_package_imports_tidal_by_its_installed_name():
    """Inside the package every import of ours is relative, so an editor or a static checker
    reading the tree (no install) resolves it."""
    absolute = [f"{path.relative_to(ROOT)}:{line}" for folder in FOLDERS
                for path in _modules(folder) for line, name, _ in _imports(path)
                if name.split(".")[0] == "tidal" and _is_absolute_import(path, line)]
    assert absolute == []


def _is_absolute_import(path: Path, line: int) -> bool:
    return line in _absolute_import_lines(path)


@functools.lru_cache(maxsize=None)
def _absolute_import_lines(path: Path) -> frozenset[int]:
    """The lines of the file's absolute imports (`import x`, `from x import y`), found in one
    walk of its tree (walking it again for each import cost seconds)."""
    return frozenset(node.lineno for node in ast.walk(_parsed(path)) if isinstance(
        node, ast.Import) or (isinstance(node, ast.ImportFrom) and node.level == 0))


def test_kernels_take_only_the_cache_folder_of_ipc(tmp_path, monkeypatch):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "ipc").mkdir()
    for name in ("paths", "messages"):
        (tmp_path / "ipc" / f"{name}.py").write_text("")
    (tmp_path / "kernels" / "native.py").write_text(
        "from ..ipc.paths import cache_dir\nfrom ..ipc.messages import BatchPlan\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert _violations("kernels") == [
        "kernels/native.py:2 imports tidal.ipc.messages (kernels/ takes only ['paths'] of "
        "ipc/)",
    ]
