# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The EXL3 package's import graph: no cycle among its modules, and no import inside a
function but the few listed in LAZY_IMPORTS, each with its reason.

The package's files are parsed (ast), never imported, so no vLLM is needed. An edge is
a module-level import of another module of the package (imports under
`if TYPE_CHECKING:` never run, so they are none); a cycle among the edges fails. An
import statement inside a function fails unless LAZY_IMPORTS names it, and an entry
there that no function uses any more fails too, so the list stays the list of what is
really lazy.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = ROOT / "overlay/vllm/model_executor/layers/quantization/exl3"
PACKAGE = "vllm.model_executor.layers.quantization.exl3"

# (module, function, imported module) -> why the import waits for the call.
LAZY_IMPORTS = {
    ("__init__", "__getattr__", f"{PACKAGE}.config"): (
        "vLLM imports every quantization package to resolve a method name, and the "
        "checkpoint tools load this one without vLLM: the config, which imports "
        "vLLM's layers, loads only when asked for"
    ),
    (
        "moe_kernels",
        "_reconstructed_forward",
        "vllm.model_executor.layers.fused_moe",
    ): (
        "vLLM defines fused_experts only where Triton is installed; the reconstruct "
        "path runs only on CUDA, where it is"
    ),
}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, relative to the package ("moe_kernels")
    function: str | None  # the enclosing function, None at module level
    target: str  # the imported module, absolute
    line: int


def _targets(node: ast.Import | ast.ImportFrom, package: str, module: str) -> list[str]:
    """The absolute modules an import statement loads (for `from P import name`, the
    submodule P.name when P is the package itself, since that is what it loads)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        parts = package.split(".")
        # An __init__'s `.` is its own package; a module's `.` is its package too.
        base = ".".join(parts[: len(parts) - node.level + 1])
        source = f"{base}.{node.module}" if node.module else base
    else:
        source = node.module or ""
    if source == package:
        return [f"{package}.{alias.name}" for alias in node.names]
    return [source]


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def package_imports(package_dir: Path, package: str) -> list[Import]:
    """Every import statement of the package's modules, with where it stands."""
    found: list[Import] = []
    for path in sorted(package_dir.glob("*.py")):
        module = path.stem
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))

        def visit(node: ast.AST, function: str | None, module: str = module) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and _is_type_checking(child):
                    for other in child.orelse:
                        visit(other, function)
                    continue
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for target in _targets(child, package, module):
                        found.append(Import(module, function, target, child.lineno))
                    continue
                inner = (
                    child.name
                    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                    else function
                )
                visit(child, inner)

        visit(tree, None)
    return found


def local_name(target: str, package: str, modules: set[str]) -> str | None:
    """The package module `target` names (`format` for package.format), else None."""
    if target == package:
        return "__init__"
    prefix = package + "."
    if target.startswith(prefix):
        name = target[len(prefix) :].split(".")[0]
        return name if name in modules else None
    return None


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path that starts and ends on the same module, or
    None."""
    done: set[str] = set()

    def walk(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node) :] + [node]
        if node in done:
            return None
        for nxt in sorted(edges.get(node, ())):
            cycle = walk(nxt, path + [node])
            if cycle:
                return cycle
        done.add(node)
        return None

    for start in sorted(edges):
        cycle = walk(start, [])
        if cycle:
            return cycle
    return None


def graph_problems(
    package_dir: Path, package: str, lazy: dict[tuple[str, str, str], str]
) -> list[str]:
    """What breaks the rules (module docstring), one line each; [] when nothing."""
    imports = package_imports(package_dir, package)
    modules = {p.stem for p in package_dir.glob("*.py")}
    problems = []
    edges: dict[str, set[str]] = {}
    used = set()
    for imp in imports:
        local = local_name(imp.target, package, modules)
        if imp.function is None:
            if local is not None and local != imp.module:
                edges.setdefault(imp.module, set()).add(local)
            continue
        key = (imp.module, imp.function, imp.target)
        if key in lazy:
            used.add(key)
            continue
        what = "a package module" if local is not None else "a module"
        problems.append(
            f"{imp.module}.py:{imp.line}: {imp.function}() imports {imp.target}, "
            f"{what}, inside the function: import it at module level, or list it "
            "in LAZY_IMPORTS with the reason it must wait"
        )
    cycle = find_cycle(edges)
    if cycle:
        problems.append("import cycle: " + " -> ".join(f"{m}.py" for m in cycle))
    for key in sorted(set(lazy) - used):
        problems.append(f"LAZY_IMPORTS entry {key} matches no import any more")
    for key, reason in lazy.items():
        if not reason.strip():
            problems.append(f"LAZY_IMPORTS entry {key} gives no reason")
    return problems


def test_the_package_has_no_cycle_and_no_unexplained_lazy_import() -> None:
    assert PACKAGE_DIR.is_dir(), PACKAGE_DIR
    problems = graph_problems(PACKAGE_DIR, PACKAGE, LAZY_IMPORTS)
    assert not problems, "\n".join(problems)


def test_the_package_is_parsed_whole() -> None:
    """The walk sees the package's module-level edges (a check that can fail: the
    config reaches the kernels through the methods)."""
    imports = package_imports(PACKAGE_DIR, PACKAGE)
    top = {(i.module, i.target) for i in imports if i.function is None}
    assert ("config", f"{PACKAGE}.moe") in top
    assert ("moe", f"{PACKAGE}.moe_kernels") in top
    assert ("kernels", f"{PACKAGE}.plans") in top


def _write(root: Path, files: dict[str, str]) -> Path:
    package = root / "pkg"
    package.mkdir()
    for name, text in files.items():
        (package / name).write_text(text)
    return package


@pytest.mark.parametrize(
    "files,expected",
    [
        pytest.param(
            {
                "__init__.py": "",
                "a.py": "from .b import x\n",
                "b.py": "from . import a\n",
            },
            "import cycle: a.py -> b.py -> a.py",
            id="two-module-cycle",
        ),
        pytest.param(
            {
                "__init__.py": "",
                "a.py": "from pkg.b import x\n",
                "b.py": "import pkg.c\n",
                "c.py": "from .a import y\n",
            },
            "import cycle: a.py -> b.py -> c.py -> a.py",
            id="absolute-three-module-cycle",
        ),
        pytest.param(
            {"__init__.py": "", "a.py": "def f():\n    from .b import x\n", "b.py": ""},
            "a.py:2: f() imports pkg.b, a package module, inside the function",
            id="lazy-package-import",
        ),
        pytest.param(
            {
                "__init__.py": "",
                "a.py": "class C:\n    def m(self):\n        import json\n",
            },
            "a.py:3: m() imports json, a module, inside the function",
            id="lazy-import-without-reason",
        ),
    ],
)
def test_a_constructed_package_fails(tmp_path, files, expected) -> None:
    problems = graph_problems(_write(tmp_path, files), "pkg", {})
    assert any(p.startswith(expected) for p in problems), problems


def test_a_constructed_package_passes_with_its_reasons(tmp_path) -> None:
    """TYPE_CHECKING imports are no edges; a listed lazy import passes; a listed one
    that is gone fails."""
    files = {
        "__init__.py": "",
        "a.py": (
            "from typing import TYPE_CHECKING\n"
            "from .b import x\n"
            "if TYPE_CHECKING:\n"
            "    from .c import y\n"
            "def f():\n"
            "    import json\n"
        ),
        "b.py": "",
        "c.py": "from .a import z\n",
    }
    package = _write(tmp_path, files)
    lazy = {("a", "f", "json"): "a reason"}
    assert graph_problems(package, "pkg", lazy) == []
    stale = {**lazy, ("b", "g", "os"): "gone"}
    assert graph_problems(package, "pkg", stale) == [
        "LAZY_IMPORTS entry ('b', 'g', 'os') matches no import any more"
    ]
