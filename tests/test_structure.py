"""The layout's rules, kept by tests (no GPU, a few seconds).

- Layers talk downwards only: the runtime knows no HTTP (no import of ``spaceserve.server``),
  the server asks the engine, never the kernels (no ``spaceserve.kernels``), and nothing in the
  package (spaceserve/, autotune/) imports the repo-level ``bench/`` scripts. Every import
  statement counts, at module level or inside a function, absolute or relative, and so does a
  module path written as a string (``importlib.import_module("bench.x")``, a command table).
- No import cycle between modules of the package, counting function-level imports too.
- No .py file over 400 lines under spaceserve/, autotune/ or bench/.
- The wheel installs exactly the top-level packages ``spaceserve`` and ``autotune``.
- Rooms, not halls: no package folder holds more than 12 modules (``__init__`` and
  ``__main__`` not counted), except the folders listed in `FOLDERS_ALLOWED`, which may not grow.
- Inside ``spaceserve.runtime`` the longest import chain is at most 10 edges long.
- Settings are leaves: ``runtime/modes.py``, ``runtime/engine/setting.py`` (how a field
  declares its flag) and ``spaceserve/checks.py`` import nothing of the package;
  ``EngineConfig``'s module imports only leaves (`CONFIG_IMPORTS`) and no torch; the lists of
  names settings take (MODES, TEMPORAL_MODES, PLACEMENTS, ...) are assigned only in
  ``runtime/modes.py``.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("spaceserve", "autotune")
MAX_LINES = 400

TOO_LONG_ALLOWED: set[str] = set()
MAX_MODULES = 12
# Folders still to be cut into rooms (module count today; they may shrink, never grow).
FOLDERS_ALLOWED: dict[str, int] = {}
MAX_RUNTIME_DEPTH = 10
LEAVES = ("spaceserve.runtime.modes", "spaceserve.checks", "spaceserve.runtime.engine.setting")
CONFIG_MODULE = "spaceserve.runtime.engine.config"
CONFIG_IMPORTS = {"spaceserve.checks", "spaceserve.runtime.modes", "spaceserve.runtime.policy.slo",
                  "spaceserve.runtime.core.memory", "spaceserve.runtime.engine.setting"}
SETTING_NAMES = {"MODES", "TEMPORAL_MODES", "COLOCATED_MODES", "PLACEMENTS", "PARTITIONS",
                 "DRIVERS", "OBJECTIVES", "SIS_ACTIONS", "ENCODER_POLICIES"}
CYCLES_ALLOWED: list[set[str]] = []
# (importer prefix, imported prefix, rule)
FORBIDDEN = [
    ("spaceserve.runtime", "spaceserve.server", "the runtime knows no HTTP"),
    ("spaceserve.server", "spaceserve.kernels", "the server asks the engine, not the kernels"),
    ("spaceserve", "bench", "the package never imports repo-level bench/"),
    ("autotune", "bench", "the package never imports repo-level bench/"),
]
DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules(root: Path = ROOT) -> dict[str, Path]:
    """{dotted module name: file} of every module under the package roots."""
    return {module_name(p, root): p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))}


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _dynamic_import(call: ast.Call) -> bool:
    """``importlib.import_module("a.b")`` / ``__import__("a.b")`` with a literal name."""
    fn = call.func
    name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) \
        else None
    return name in ("import_module", "__import__") and bool(call.args) and \
        isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str)


def imports_of(path: Path, name: str, known: set[str]) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import in the file, wherever it sits; ``from X import
    y`` counts as X.y when that is a module, else as X. Imports by name count too:
    ``importlib.import_module`` / ``__import__`` of a literal, and any string that is the dotted
    path of a repo-level ``bench.`` module (a command table naming one)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                yield (sub if sub in known else target), node.lineno
        elif isinstance(node, ast.Call) and _dynamic_import(node):
            yield node.args[0].value.split(":")[0], node.lineno
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value.split(":")[0]  # "module:function" references
            if DOTTED.fullmatch(text) and text.startswith("bench."):
                yield text, node.lineno


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """{module: {imported module: first line}} over the package, every import counted."""
    mods = package_modules(root)
    known = set(mods)
    graph: dict[str, dict[str, int]] = {}
    for name, path in mods.items():
        edges: dict[str, int] = {}
        for target, line in imports_of(path, name, known):
            if target != name:
                edges.setdefault(target, line)
        graph[name] = edges
    return graph


def planted(pkg: Path, files: dict[str, str]) -> tuple[dict[str, Path], dict[str, dict[str, int]]]:
    """Write `files` under the planted package `pkg`; its (modules, import graph)."""
    for rel, text in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    mods = {module_name(p, pkg.parent): p for p in pkg.rglob("*.py")}
    known = set(mods)
    return mods, {n: {t: line for t, line in imports_of(p, n, known) if t != n}
                  for n, p in mods.items()}


def layer_violations(graph: dict[str, dict[str, int]], modules: dict[str, Path]) -> list[str]:
    out = []
    for src, edges in graph.items():
        for dst, line in edges.items():
            for low, high, rule in FORBIDDEN:
                if _within(src, low) and _within(dst, high) and not _within(dst, src) \
                        and not (high == "bench" and _within(dst, low)):
                    where = modules[src].relative_to(ROOT)
                    out.append(f"{where}:{line}: {src} imports {dst} ({rule})")
    return out


def cycles(graph: dict[str, dict[str, int]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan), internal edges only."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_layers_talk_downwards_only() -> None:
    mods = package_modules()
    graph = import_graph()
    # the walk saw the package
    assert len(graph) > 50 and "spaceserve.runtime.engine.engine" in graph
    bad = layer_violations(graph, mods)
    assert not bad, "\n".join(bad)


def test_no_import_cycles() -> None:
    found = [c for c in cycles(import_graph()) if c not in CYCLES_ALLOWED]
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(sorted(c)) for c in found)


def test_the_checks_see_function_level_relative_and_string_imports(tmp_path: Path) -> None:
    """Each rule fires on a planted package that breaks it (so the checks above can fail)."""
    pkg = tmp_path / "spaceserve"
    files = {
        "__init__.py": "",
        "runtime/__init__.py": "",
        "runtime/a.py": "def f():\n    from ..server import b\n    return b\n",
        "runtime/c.py": "from . import d\n",
        "runtime/d.py": "def g():\n    from .c import x\n",
        "server/__init__.py": "",
        "server/b.py": "import spaceserve.kernels.budget\n",
        "kernels/__init__.py": "",
        "kernels/budget.py": "COMMANDS = {'demo': ('bench.kernels', 'help')}\n",
        "kernels/aot.py": "import importlib\nm = importlib.import_module('spaceserve.runtime.e')\n",
        "runtime/e.py": "import spaceserve.kernels.aot\n",
    }
    mods, graph = planted(pkg, files)
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        bad = layer_violations(graph, mods)
    finally:
        ROOT = saved
    assert any("runtime.a imports spaceserve.server.b" in b for b in bad), bad
    assert any("server.b imports spaceserve.kernels.budget" in b for b in bad), bad
    assert any("imports bench.kernels" in b for b in bad), bad
    assert sorted(map(sorted, cycles(graph))) == [
        ["spaceserve.kernels.aot", "spaceserve.runtime.e"],
        ["spaceserve.runtime.c", "spaceserve.runtime.d"]]


def test_no_file_over_400_lines() -> None:
    long = {}
    for top in (*PACKAGES, "bench"):
        for p in sorted((ROOT / top).rglob("*.py")):
            n = len(p.read_text().splitlines())
            if n > MAX_LINES:
                long[str(p.relative_to(ROOT))] = n
    unexpected = {p: n for p, n in long.items() if p not in TOO_LONG_ALLOWED}
    assert not unexpected, f"files over {MAX_LINES} lines (split them at a real seam): " \
        f"{unexpected}"


def test_wheel_installs_only_spaceserve_and_autotune(tmp_path: Path) -> None:
    """Build the wheel (setuptools, no network) from a copy of the tree; its top-level names."""
    pytest.importorskip("setuptools", reason="the wheel is built with setuptools")
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "__pycache__", "*.egg-info", "build", "dist", "runs", ".*_cache",
        "results", ".benchmarks"))
    out = tmp_path / "wheel"
    proc = subprocess.run(
        [sys.executable, "-c", "import sys, setuptools.build_meta as b; "
         "print(b.build_wheel(sys.argv[1]))", str(out)],
        cwd=src, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"spaceserve", "autotune"}, sorted(top)
    assert "spaceserve/runtime/inputs/__init__.py" in names  # subpackages are found


def oversized_folders(root: Path = ROOT) -> dict[str, int]:
    """{folder: module count} of the package folders over `MAX_MODULES` modules."""
    out = {}
    for pkg in PACKAGES:
        for init in sorted((root / pkg).rglob("__init__.py")):
            mods = [p for p in init.parent.glob("*.py")
                    if p.name not in ("__init__.py", "__main__.py")]
            if len(mods) > MAX_MODULES:
                out[str(init.parent.relative_to(root))] = len(mods)
    return out


def longest_chain(graph: dict[str, dict[str, int]], prefix: str) -> list[str]:
    """The longest import chain (modules, first importer first) among modules under `prefix`;
    the graph must be acyclic there (`test_no_import_cycles`)."""
    inner = {m: [d for d in e if _within(d, prefix) and d in graph and d != m]
             for m, e in graph.items() if _within(m, prefix)}
    best: dict[str, list[str]] = {}

    def chain(m: str) -> list[str]:
        if m not in best:
            best[m] = [m] + max((chain(d) for d in inner[m]), key=len, default=[])
        return best[m]

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    return max((chain(m) for m in inner), key=len, default=[])


def settings_violations(graph: dict[str, dict[str, int]], modules: dict[str, Path]) -> list[str]:
    """Leaves that import the package, a config importing more than leaves, and setting-name
    lists assigned outside runtime/modes.py."""
    out = []
    for leaf in LEAVES:
        bad = [d for d in graph.get(leaf, {}) if _within(d, "spaceserve")]
        if bad:
            out.append(f"{leaf} is a leaf but imports {bad}")
    extra = {d for d in graph.get(CONFIG_MODULE, {}) if _within(d, "spaceserve")} - CONFIG_IMPORTS
    if extra:
        out.append(f"{CONFIG_MODULE} imports {sorted(extra)}, more than the leaves it may")
    for name, path in modules.items():
        if name == "spaceserve.runtime.modes":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) and node.value else []
            for t in targets:
                if isinstance(t, ast.Name) and t.id in SETTING_NAMES and node.col_offset == 0:
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {t.id} is assigned "
                               "outside runtime/modes.py")
    return out


def test_no_folder_over_12_modules() -> None:
    found = oversized_folders()
    grown = {f: n for f, n in found.items() if n > FOLDERS_ALLOWED.get(f, MAX_MODULES)}
    assert not grown, f"folders over {MAX_MODULES} modules (cut them into rooms): {grown}"


def test_runtime_import_chain_is_at_most_10_deep() -> None:
    chain = longest_chain(import_graph(), "spaceserve.runtime")
    assert len(chain) > 5, chain  # the walk saw the runtime
    assert len(chain) - 1 <= MAX_RUNTIME_DEPTH, " -> ".join(chain)


def test_settings_are_leaves() -> None:
    bad = settings_violations(import_graph(), package_modules())
    assert not bad, "\n".join(bad)
    code = ("import sys, spaceserve.runtime.engine.config as c; c.EngineConfig(); "
            "sys.exit('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, "importing EngineConfig imports torch\n" + proc.stderr[-2000:]


def test_the_room_rules_fire_on_planted_breaks(tmp_path: Path) -> None:
    """Each new rule fires on a planted package that breaks it."""
    pkg = tmp_path / "spaceserve"
    files = {"__init__.py": "", "checks.py": "import spaceserve.runtime.modes\n",
             "runtime/__init__.py": "", "runtime/modes.py": "MODES = ('a',)\n",
             "runtime/engine/__init__.py": "",
             "runtime/engine/config.py": "import spaceserve.runtime.x0\nTEMPORAL_MODES = ()\n"}
    files.update({f"runtime/x{i}.py": f"import spaceserve.runtime.x{i + 1}\n" for i in range(12)})
    files["runtime/x12.py"] = ""
    mods, graph = planted(pkg, files)
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert oversized_folders(tmp_path) == {"spaceserve/runtime": 14}
        assert len(longest_chain(graph, "spaceserve.runtime")) - 1 == 13
        bad = settings_violations(graph, mods)
    finally:
        ROOT = saved
    assert any("spaceserve.checks is a leaf" in b for b in bad), bad
    assert any("imports ['spaceserve.runtime.x0']" in b for b in bad), bad
    assert any("TEMPORAL_MODES is assigned outside" in b for b in bad), bad
