"""An import-linter contract type of the architecture rules (pyproject.toml, ``[tool.importlinter]``): no module
imports itself back through a circle.

import-linter's own ``acyclic_siblings`` refuses circles between packages (a package's children, their descendants
squashed into them); this contract refuses circles between modules, at any depth: module A imports B (at module level
or inside a function; ``if TYPE_CHECKING:`` imports excluded by the session option) and B reaches A again through the
modules it imports. It is registered with ``contract_types`` and runs with the other contracts::

    PYTHONPATH=tests lint-imports          # from the repository root (flowgrpo installed); or the test,
                                           # tests/cli/test_architecture.py

    [[tool.importlinter.contracts]]
    type = "acyclic_modules"
    containers = ["flowgrpo"]              # every module under these packages
"""

from __future__ import annotations

import grimp
from importlinter import Contract, ContractCheck, fields, output

__all__ = ["AcyclicModulesContract", "module_circles"]


def module_circles(graph: grimp.ImportGraph, package: str) -> list[list[str]]:
    """The circles of imports among the modules of ``package``: each a sorted list of the modules that import one
    another in a circle (a strongly connected component of more than one module), the list sorted.

    An import A -> B lies on a circle exactly when B reaches A again; joining the two ends of every such import gives
    the components."""
    modules = {package, *graph.find_descendants(package)}
    parent = {module: module for module in modules}

    def root(module: str) -> str:
        while parent[module] != module:
            parent[module] = parent[parent[module]]
            module = parent[module]
        return module

    for importer in sorted(modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & modules):
            if imported != importer and graph.chain_exists(importer=imported, imported=importer):
                parent[root(importer)] = root(imported)
    components: dict[str, list[str]] = {}
    for module in modules:
        components.setdefault(root(module), []).append(module)
    return sorted(sorted(members) for members in components.values() if len(members) > 1)


class AcyclicModulesContract(Contract):
    """No circle of imports among the modules of ``containers`` (see the module docstring)."""

    type_name = "acyclic_modules"

    containers = fields.ListField(subfield=fields.StringField())

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        circles = []
        for container in self.containers:  # type: ignore[attr-defined]
            for circle in module_circles(graph, container):
                chain = graph.find_shortest_chain(importer=circle[1], imported=circle[0])
                back = graph.find_shortest_chain(importer=circle[0], imported=circle[1])
                circles.append({"modules": circle, "example": list(back or ()) + list(chain or ())[1:]})
        return ContractCheck(kept=not circles, warnings=[], metadata={"circles": circles})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for circle in check.metadata["circles"]:
            output.print_error(f"Circle of {len(circle['modules'])} modules: {', '.join(circle['modules'])}")
            output.print_error("  e.g. " + " -> ".join(circle["example"]), bold=False)
            output.new_line()
        output.print("Fold what both sides need into a module that imports neither (an import inside a function counts "
                     "too: it ties the modules together when it runs).")
