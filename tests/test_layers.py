"""The package's imports point one way (docs/layout.md). Every module under src/waferscale is parsed with `ast`;
every import is an edge (module level and inside functions, `import x`, `from x import y`, relative imports,
`if TYPE_CHECKING:` blocks too), and every edge against the rules below fails the test, all listed at once.
Imports under `if __name__ == "__main__":` are the program's when the file runs as a script, so they follow the
rule of a `__main__` module (which may import the command line).

The rules are data: docs/layout.md states the same table.
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "waferscale"

# Layers, bottom to top: what each part of the package may import from the rest of it (besides itself).
# `waferscale` is the package's own __init__ (the version); `plots` is waferscale/plots.py.
_BOTTOM = {"errors", "util"}
_L1 = _BOTTOM | {"fabric", "models", "data", "sparse"}
MAY_IMPORT: dict[str, set[str]] = {
    "errors": set(),
    "util": {"errors"},
    "fabric": _BOTTOM,  # numpy only (THIRD_PARTY below); cost*.py never load sim.py (MODULE_RULES)
    "models": _BOTTOM,  # models and data never import each other
    "data": _BOTTOM,
    "sparse": _BOTTOM,  # masks and algorithms, pure torch: below everything that applies them
    # sparse: a params file's section, read by capture; data: span corruption's lengths (a T5 target's tokens)
    "compiler": _BOTTOM | {"fabric", "models", "sparse", "data"},
    "runtime": _L1 | {"compiler"},  # never pytorch, params, zoo, serve, cli
    "pytorch": _L1 | {"compiler", "runtime"},  # the cstorch API
    "params": _BOTTOM | {"models", "data", "sparse", "runtime"},  # the params YAML; read only by zoo and cli
    "zoo": _L1 | {"compiler", "runtime", "pytorch", "params", "plots"},  # the Model Zoo runner (`wsc run`)
    "serve": _L1 | {"compiler", "runtime"},  # not pytorch, not zoo
    "plots": _BOTTOM,  # pictures; imported only by cli and zoo
    # the job service: zoo checks a run at submit, serve's error envelope, runtime's source.py names a deployment
    "appliance": _BOTTOM | {"zoo", "serve", "runtime"},
    "cli": _L1 | {"compiler", "runtime", "pytorch", "params", "zoo", "serve", "plots", "appliance", "waferscale"},
    "__main__": {"cli"},
    "waferscale": set(),
}

# Third-party imports allowed per part (None: any). Standard-library modules are always allowed.
THIRD_PARTY: dict[str, set[str] | None] = {"fabric": {"numpy"}, "errors": set()}

# (importer module, imported module): never, not even through other modules at import time.
MODULE_RULES: list[tuple[str, str, str]] = [
    ("waferscale.fabric.cost", "waferscale.fabric.sim",
     "the fast cost model must not load the event simulation that judges it"),
    ("waferscale.fabric.cost_matmul", "waferscale.fabric.sim",
     "the fast cost model must not load the event simulation that judges it"),
    ("waferscale.fabric.cost_collectives", "waferscale.fabric.sim",
     "the fast cost model must not load the event simulation that judges it"),
]


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _exists(module: str) -> bool:
    base = SRC.joinpath(*module.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _edges(path: Path) -> list[tuple[int, str, bool, bool]]:
    """(line, imported module, at import time, as a script) for every import in the file; `from pkg import name`
    names the submodule when `name` is one. At import time: not inside a function body nor an
    `if TYPE_CHECKING:`; as a script: under `if __name__ == "__main__":`."""
    module = _module_name(path)
    package = module if _is_package(path) else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    lazy: set[int] = set()
    script: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            lazy.update(id(n) for n in ast.walk(node) if n is not node)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):  # for type checkers only
            lazy.update(id(n) for stmt in node.body for n in ast.walk(stmt))
        elif isinstance(node, ast.If) and ast.unparse(node.test).replace("'", '"') == '__name__ == "__main__"':
            inner = {id(n) for stmt in node.body for n in ast.walk(stmt)}
            lazy |= inner
            script |= inner
    out: list[tuple[int, str, bool, bool]] = []
    for node in ast.walk(tree):
        eager, as_main = id(node) not in lazy, id(node) in script
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, eager, as_main) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.append((node.lineno, sub if target.startswith("waferscale") and _exists(sub) else target, eager,
                            as_main))
    return out


def _part(module: str) -> str:
    """'waferscale.runtime.optim' -> 'runtime'; 'waferscale.plots' -> 'plots'; 'waferscale' -> 'waferscale'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "waferscale"


@functools.cache
def _graph() -> dict[str, list[tuple[int, str, bool, bool]]]:
    return {_module_name(p): _edges(p) for p in sorted(PKG.rglob("*.py"))}


def _where(module: str, line: int) -> str:
    base = SRC.joinpath(*module.split("."))
    path = base / "__init__.py" if (base / "__init__.py").is_file() else base.with_suffix(".py")
    return f"{path.relative_to(SRC.parent)}:{line}"


def test_every_part_has_a_rule() -> None:
    parts = {_part(m) for m in _graph()}
    missing = sorted(parts - MAY_IMPORT.keys())
    assert not missing, f"parts with no layer rule (add them to MAY_IMPORT and docs/layout.md): {missing}"


def test_imports_point_one_way() -> None:
    bad = []
    for module, edges in _graph().items():
        for line, target, _, as_main in edges:
            part = "__main__" if as_main else _part(module)
            allowed = MAY_IMPORT.get(part, set())
            if target == "waferscale" or target.startswith("waferscale."):
                other = _part(target)
                if other != part and other not in allowed:
                    bad.append(f"{_where(module, line)} -> {target}  ({part} may not import {other})")
    assert not bad, "imports against the layer order:\n" + "\n".join(dict.fromkeys(bad))


def test_third_party_imports() -> None:
    bad = []
    stdlib = sys.stdlib_module_names
    for module, edges in _graph().items():
        allowed = THIRD_PARTY.get(_part(module))
        if allowed is None:
            continue
        for line, target, _, _ in edges:
            top = target.split(".")[0]
            if top and top != "waferscale" and top not in stdlib and top not in allowed:
                bad.append(f"{_where(module, line)} -> {target}  ({_part(module)} may use only "
                           f"{sorted(allowed) or 'the standard library'})")
    assert not bad, "third-party imports against the rules:\n" + "\n".join(dict.fromkeys(bad))


def _loads(graph: dict[str, list[tuple[int, str, bool, bool]]], start: str) -> dict[str, list[str]]:
    """Modules importing `start` loads (import-time edges, packages' __init__ included), each with the chain."""
    chains = {start: [start]}
    todo = [start]
    while todo:
        m = todo.pop()
        for _, target, eager, _ in graph.get(m, []):
            if not eager or not target.startswith("waferscale"):
                continue
            parts = target.split(".")
            for i in range(2, len(parts) + 1):  # importing a.b.c runs a.b's __init__ first
                t = ".".join(parts[:i])
                if t in graph and t not in chains:
                    chains[t] = chains[m] + [t]
                    todo.append(t)
    return chains


@pytest.mark.parametrize("importer, imported, why", MODULE_RULES)
def test_module_rules(importer: str, imported: str, why: str) -> None:
    graph = _graph()
    direct = [f"{_where(importer, line)} -> {t}" for line, t, _, _ in graph.get(importer, [])
              if t == imported or t.startswith(imported + ".")]
    assert not direct, f"{importer} imports {imported} ({why}):\n" + "\n".join(direct)
    chain = _loads(graph, importer).get(imported)
    assert chain is None, f"importing {importer} loads {imported} ({why}): " + " -> ".join(chain)


def test_the_parser_sees_every_kind_of_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Module level, inside functions, `import x`, `from x import y` (submodule or name), relative imports,
    type-checking blocks (edges, not loaded at import time) and a script's `__main__` block."""
    for rel in ("waferscale/__init__.py", "waferscale/runtime/__init__.py", "waferscale/runtime/optim.py",
                "waferscale/pytorch/__init__.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    f = tmp_path / "waferscale/runtime/engine.py"
    f.write_text("from typing import TYPE_CHECKING\nimport numpy as np\nfrom . import optim\nfrom .. import pytorch\n"
                 "from waferscale.runtime import optim, build\nif TYPE_CHECKING:\n    import waferscale.zoo\n"
                 "def f():\n    from waferscale.params import load_params\n"
                 "if __name__ == '__main__':\n    from waferscale.cli.main import main\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path)
    assert sorted(_edges(f)) == [(1, "typing", True, False), (2, "numpy", True, False),
                                 (3, "waferscale.runtime.optim", True, False), (4, "waferscale.pytorch", True, False),
                                 (5, "waferscale.runtime", True, False), (5, "waferscale.runtime.optim", True, False),
                                 (7, "waferscale.zoo", False, False), (9, "waferscale.params", False, False),
                                 (11, "waferscale.cli.main", False, True)]


def test_no_private_name_is_imported_from_another_module() -> None:
    """A leading underscore means "this module's own": `from waferscale.x import _name` across modules is refused
    (make the name public where another module needs it). Modules imported under a private alias
    (`from waferscale.pytorch import amp as _amp`) are fine: the module itself is public."""
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        module = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("waferscale"):
                for alias in node.names:
                    private = alias.name.startswith("_") and not alias.name.startswith("__")
                    if private and not _exists(f"{node.module}.{alias.name}") and node.module != module:
                        bad.append(f"{_where(module, node.lineno)}: from {node.module} import {alias.name}")
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def _type_only_lines(path: Path) -> set[int]:
    """The lines of imports under `if TYPE_CHECKING:` (for type checkers only: never executed)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.lineno for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for stmt in node.body for n in ast.walk(stmt) if isinstance(n, (ast.Import, ast.ImportFrom))}


def test_no_two_modules_import_each_other() -> None:
    """A seam is one-way: no two modules of the package import each other, at import time or inside a function (a
    callback they need goes in as an argument; type annotations alone do not count)."""
    modules = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}
    uses = {}
    for m, p in modules.items():
        type_only = _type_only_lines(p)
        uses[m] = {t for line, t, _, as_main in _graph()[m]
                   if t in modules and t != m and not as_main and line not in type_only}
    pairs = sorted({tuple(sorted((a, b))) for a in uses for b in uses[a] if a in uses[b]})
    # a package's __init__ re-exports its modules, which may import siblings through it: not a seam
    pairs = [(a, b) for a, b in pairs if not (_is_package(modules[a]) and b.startswith(a + "."))]
    assert not pairs, "modules that import each other:\n" + "\n".join(f"{a} <-> {b}" for a, b in pairs)
