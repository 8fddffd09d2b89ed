"""No import cycles between the project's modules (positronic/, steps/, mirror/, texts/).

The graph is built from the source with `ast`, nothing is imported. A node is a module
(a package is its __init__.py); an edge is an import statement that runs when the module is
imported: the module body, and the bodies of top-level `if`/`try`/`with`/`for` blocks and
classes. Imports under `if TYPE_CHECKING:` never count (they never run). Imports inside
functions run later, so they cannot make an import fail; the first test leaves them out and
must find no cycle at all. The second counts them too, since a circle through a deferred
import is still two modules that need each other, and allows only the circles listed in
KNOWN_DEFERRED_CYCLES (each to be removed from the list when it is gone).

`from pkg import name` is an edge to pkg.name when that is a module, else to pkg. Importing
a submodule also runs its package's __init__.py, but that implicit edge is left out: a package
that imports its own submodules would otherwise always be a cycle. An explicit import of the
package from one of its submodules is an edge, so `pkg/__init__ -> pkg.a -> pkg` is caught.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the source folders and the package names they install as (pyproject's package-dir)
SOURCES = {"positronic": "positronic", "steps": "positronic.steps", "mirror": "positronic.mirror",
           "texts": "positronic.texts"}


def modules(root: Path, sources: dict[str, str]) -> dict[str, tuple[Path, bool]]:
    """{dotted name: (file, is a package)} of every .py file under the source folders."""
    found = {}
    for folder, package in sources.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            found[".".join([package, *parts])] = (path, is_package)
    return found


def imports_run(tree: ast.Module, deferred: bool = False):
    """The Import/ImportFrom nodes that run when the module is imported (see the docstring);
    with `deferred`, those inside functions too. Never those under `if TYPE_CHECKING:`."""
    pending: list[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop(0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not deferred:
            continue
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in {getattr(node.test, "id", None),
                                                               getattr(node.test, "attr", None)}:
            pending.extend(node.orelse)
        else:  # blocks that run with their statement: if/try/with/for bodies, handlers, class bodies
            pending.extend(child for child in ast.iter_child_nodes(node)
                           if isinstance(child, (ast.stmt, ast.excepthandler, ast.match_case)))


def import_graph(root: Path = ROOT, sources: dict[str, str] = SOURCES, deferred: bool = False) -> dict[str, set[str]]:
    """{module: the project modules it imports at import time}. An import of a name under the
    project's packages that is no module of the sources fails (the graph would miss an edge)."""
    known = modules(root, sources)
    roots = {package.split(".")[0] for package in sources.values()}

    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in known.items():
        edges = graph.setdefault(name, set())
        for node in imports_run(ast.parse(path.read_text(encoding="utf-8"), str(path)), deferred):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    package = name.split(".") if is_package else name.split(".")[:-1]
                    package = package[:len(package) - (node.level - 1)]
                    base = ".".join(package + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
            for target in targets:
                if target in known:
                    edges.add(target)
                elif target.split(".")[0] in roots:
                    raise AssertionError(f"{path}:{node.lineno} imports {target}, not a module of {sorted(sources)}")
            edges.discard(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a list of modules, the first repeated at the end) per strongly connected
    component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [one_cycle(graph, component) for component in sorted(components)]


def one_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, by breadth-first search."""
    start, members = component[0], set(component)
    came_from = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & members):
                if target == start:
                    path = [node]
                    while came_from[path[-1]] is not None:
                        path.append(came_from[path[-1]])
                    return list(reversed(path)) + [start]
                if target not in came_from:
                    came_from[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # a strongly connected component always has one


def test_the_project_has_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50 and "positronic.brain.loop" in graph and "positronic.mirror.ledger" in graph
    assert "positronic.steps" in graph["positronic.brain.loop"] or any(
        target.startswith("positronic.steps") for target in graph["positronic.brain.loop"]), "steps/ is seen"
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in found)


# circles through imports inside functions that are still there (delete an entry when its circle is gone)
KNOWN_DEFERRED_CYCLES: list[list[str]] = []


def test_imports_inside_functions_add_no_cycle_but_the_known_ones():
    found = cycles(import_graph(deferred=True))
    new = [cycle for cycle in found if cycle not in KNOWN_DEFERRED_CYCLES]
    assert not new, "import cycles through imports inside functions:\n" + "\n".join(" -> ".join(c) for c in new)


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_planted_cycle_is_caught_and_deferred_or_type_only_imports_are_not(tmp_path):
    write(tmp_path, {
        "pkg/__init__.py": "from .front import entry\n",
        "pkg/front.py": "from . import back\n\ndef entry():\n    from .late import x  # deferred: no edge\n",
        "pkg/back.py": "import os\nfrom pkg.util import helper\n",
        "pkg/util.py": "try:\n    from .front import entry\nexcept ImportError:\n    entry = None\n",  # the cycle
        "pkg/late.py": "from .front import entry\n",
        "pkg/typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .typed_back import T\n",
        "pkg/typed_back.py": "from .typed import x\n",
        "pkg/sub/__init__.py": "from .a import a\n",
        "pkg/sub/a.py": "from .. import sub\n",  # a submodule importing its own package: a cycle too
        "other/b.py": "from pkg.sub.a import a\n",  # a second source folder installed as pkg.other
    })
    graph = import_graph(tmp_path, {"pkg": "pkg", "other": "pkg.other"})
    assert graph["pkg.front"] == {"pkg.back"} and graph["pkg.back"] == {"pkg.util"}
    assert graph["pkg.typed"] == set() and graph["pkg.other.b"] == {"pkg.sub.a"}
    assert cycles(graph) == [["pkg.back", "pkg.util", "pkg.front", "pkg.back"], ["pkg.sub", "pkg.sub.a", "pkg.sub"]]
    deferred = import_graph(tmp_path, {"pkg": "pkg", "other": "pkg.other"}, deferred=True)
    assert deferred["pkg.front"] == {"pkg.back", "pkg.late"} and deferred["pkg.typed"] == set()
    # the same tree without the two planted top-level imports: no cycle, but for the deferred one
    write(tmp_path, {"pkg/util.py": "helper = 1\n", "pkg/sub/a.py": "a = 1\n"})
    assert cycles(import_graph(tmp_path, {"pkg": "pkg", "other": "pkg.other"})) == []
    assert cycles(import_graph(tmp_path, {"pkg": "pkg", "other": "pkg.other"}, deferred=True)) == [
        ["pkg.front", "pkg.late", "pkg.front"]]


def test_an_import_of_a_project_module_that_is_not_there_fails_rather_than_drop_an_edge(tmp_path):
    write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "from pkg.gone import x\n"})
    with pytest.raises(AssertionError, match="imports pkg.gone"):
        import_graph(tmp_path, {"pkg": "pkg"})
