"""The package's own import graph, read from the source (no module is imported): cycles, layering, private names.

Used by ``tests/cli/test_architecture.py`` (no cycle; the core packages import no tooling) and by
``scripts/architecture_report.py`` (the figures of docs/architecture.md).

An import counts when it is executed at module level or inside a function: both tie the modules together. Imports
under ``if TYPE_CHECKING:`` do not (they never run).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

#: the packages a training run is made of, and the tooling around them that they must not import
CORE_PACKAGES = ("schedulers", "models", "rewards", "trainer")
TOOLING_PACKAGES = ("benchmarking", "gpu_check", "toy", "testing", "plan", "evaluate")

__all__ = ["CORE_PACKAGES", "TOOLING_PACKAGES", "ImportGraph", "read_import_graph"]


@dataclass
class ImportGraph:
    """``edges[a]``: the package modules module ``a`` imports; ``private[a]``: (module, name) pairs of private names
    (a leading underscore) that ``a`` imports from another module of the package."""

    root: Path
    edges: dict[str, set[str]] = field(default_factory=dict)
    private: dict[str, set[tuple[str, str]]] = field(default_factory=dict)

    def cycles(self) -> list[list[str]]:
        """The strongly connected components of more than one module (each a circle of imports), sorted."""
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        on_stack: set[str] = set()
        found: list[list[str]] = []
        counter = [0]

        def visit(node: str) -> None:  # Tarjan's algorithm, iterative over the successors of one node at a time
            work = [(node, iter(sorted(self.edges.get(node, ()))))]
            index[node] = low[node] = counter[0]
            counter[0] += 1
            stack.append(node)
            on_stack.add(node)
            while work:
                current, successors = work[-1]
                advanced = False
                for nxt in successors:
                    if nxt not in index:
                        index[nxt] = low[nxt] = counter[0]
                        counter[0] += 1
                        stack.append(nxt)
                        on_stack.add(nxt)
                        work.append((nxt, iter(sorted(self.edges.get(nxt, ())))))
                        advanced = True
                        break
                    if nxt in on_stack:
                        low[current] = min(low[current], index[nxt])
                if advanced:
                    continue
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[current])
                if low[current] == index[current]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == current:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))

        for node in sorted(self.edges):
            if node not in index:
                visit(node)
        return sorted(found)

    def layer_violations(self, core=CORE_PACKAGES, tooling=TOOLING_PACKAGES) -> list[tuple[str, str]]:
        """(importer, imported) pairs where a module of a core package imports a module of a tooling package."""
        bad = []
        for module, targets in sorted(self.edges.items()):
            if _package(module) in core:
                bad += [(module, t) for t in sorted(targets) if _package(t) in tooling]
        return bad

    def private_imports(self) -> list[tuple[str, str, str]]:
        """(importer, module, name): private names imported across modules of the package."""
        return sorted((a, m, n) for a, pairs in self.private.items() for m, n in pairs)


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _module_name(root: Path, path: Path) -> str:
    relative = path.relative_to(root.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _resolve(importer: str, is_package: bool, level: int, module: str | None) -> str:
    if level == 0:
        return module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([module] if module else []))


class _Collector(ast.NodeVisitor):
    def __init__(self):
        self.imports: list[tuple[int, str | None, list[str]]] = []  # (level, module, names)

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else None
        if name == "TYPE_CHECKING":
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.imports.append((0, alias.name, []))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.imports.append((node.level, node.module, [a.name for a in node.names]))

    def visit_Call(self, node: ast.Call) -> None:
        """``importlib.import_module("flowgrpo.x")`` with a literal absolute name is an import too."""
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if name == "import_module" and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and not node.args[0].value.startswith("."):
            self.imports.append((0, node.args[0].value, []))
        self.generic_visit(node)


def read_import_graph(package_dir: str | Path) -> ImportGraph:
    """The import graph of the package at ``package_dir`` (e.g. ``src/flowgrpo``)."""
    root = Path(package_dir).resolve()
    name = root.name
    files = {_module_name(root, p): p for p in sorted(root.rglob("*.py"))}
    graph = ImportGraph(root=root, edges={m: set() for m in files})
    for module, path in files.items():
        collector = _Collector()
        collector.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        is_package = path.name == "__init__.py"
        for level, target, names in collector.imports:
            full = _resolve(module, is_package, level, target)
            if not (full == name or full.startswith(name + ".")):
                continue
            for imported in names or [None]:
                candidate = f"{full}.{imported}" if imported else full
                if candidate in files:  # `from package import module`
                    dest = candidate
                else:
                    dest = full
                    while dest and dest not in files:
                        dest = dest.rpartition(".")[0]
                    if imported and imported.startswith("_") and not imported.startswith("__") and dest != module:
                        graph.private.setdefault(module, set()).add((dest, imported))
                if dest and dest != module:
                    graph.edges[module].add(dest)
    return graph
