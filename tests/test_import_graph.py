"""No import circles among the Python files of sd-scripts/ and kohya_gui/ (issue 24), counting imports inside
functions too (a circle made lazy is still a circle); the bottom layer imports nothing above it."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def modules() -> dict[str, Path]:
    """module name -> file: sd-scripts/ is on sys.path (library.*, networks.*, the scripts), kohya_gui is a package."""
    found = {}
    for folder, top in ((ROOT / "sd-scripts", ROOT / "sd-scripts"), (ROOT / "kohya_gui", ROOT)):
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(top).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `name` imports anywhere in its file (a package's own __init__ counts for `from p import`
    only when p is what is named)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            names.update(f"{base}.{a.name}" for a in node.names)  # a submodule, or a name in `base`
    out = set()
    for n in names:
        while n and n not in known:
            n = n.rpartition(".")[0]
        if n and n != name:
            out.add(n)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(name, path, known) for name, path in known.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for start in g:
        if start in index:
            continue
        work = [(start, iter(sorted(g[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, edges = work[-1]
            for w in edges:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(g[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_graph_sees_imports_inside_functions_and_relative_ones():
    g = graph()
    assert "library.errors" in g["library.network_trainer"]
    assert "kohya_gui.runner" in g["kohya_gui.trainer_check"]  # `from .runner import run_env`
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles():
    g = graph()
    found = cycles(g)
    described = ["; ".join(f"{m} -> {', '.join(sorted(set(c) & g[m]))}" for m in c) for c in found]
    assert not found, "import circles:\n" + "\n".join(described)


def test_the_bottom_layer_imports_nothing_above_it():
    g = graph()
    assert g["library.errors"] == set()
    assert g["library.files"] <= {"library", "library.errors"}
