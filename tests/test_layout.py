"""The house rules a reader relies on: no import circle between the package's modules, no module over 450 lines, and
the layers importing only downwards (suffix needs no torch; the verifier, router and drafters never import the
runtime or its faces)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> import name (setup.py maps the root folders into the hybridspec namespace)
PACKAGES = {"hybridspec": "hybridspec", "suffix": "hybridspec.suffix", "speculators": "hybridspec.speculators",
            "router": "hybridspec.router", "verifier": "hybridspec.verifier", "agent_traces": "hybridspec.agent_traces"}
MAX_LINES = 450
UPPER = ("hybridspec.runtime", "hybridspec.serve", "hybridspec.vllm_plugin", "hybridspec.tools", "hybridspec.cli")


def modules() -> dict[str, Path]:
    found = {}
    for folder, name in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in (".py", ".pyx", ".pxi", ".h") or "__pycache__" in path.parts:
                continue
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join((name, *parts))] = path
    return found


def imports(path: Path, module: str, known: set[str]) -> set[str]:
    """The package's modules `path` imports, at any level of the file (TYPE_CHECKING blocks included)."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return {n for n in names if n in known and n != module}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    found = modules()
    known = {m for m, p in found.items() if p.suffix == ".py"}
    return {m: imports(p, m, known) for m, p in found.items() if p.suffix == ".py"}


def test_no_module_outside_tests_and_benchmarks_is_over_450_lines():
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in modules().values()}
    long = {path: n for path, n in lines.items() if n > MAX_LINES}
    assert not long, f"split these by what they do: {long}"


def test_no_import_circle(graph):
    """A module that imports another (at any level of the file, TYPE_CHECKING included) is never imported back,
    directly or through others; a package's __init__ re-exporting its own modules is not a circle."""
    def own(module: str, other: str) -> bool:
        return other.startswith(module + ".")  # a package importing from its own modules

    edges = {m: {o for o in targets if not own(m, o)} for m, targets in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for o in sorted(edges.get(m, ())):
            if state.get(o) == 1:
                return stack[stack.index(o):] + [o]
            if o not in state and (circle := visit(o)):
                return circle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (circle := visit(m)):
            pytest.fail(" -> ".join(circle))


def test_layers_import_only_downwards(graph):
    lower = ("hybridspec.suffix", "hybridspec.verifier", "hybridspec.router", "hybridspec.speculators",
             "hybridspec.model", "hybridspec.proposal", "hybridspec.errors")
    wrong = {m: sorted(o for o in targets if o.startswith(UPPER))
             for m, targets in graph.items() if m.startswith(lower)}
    assert not {m: o for m, o in wrong.items() if o}, wrong
    suffix_imports = {o for m, targets in graph.items() if m.startswith("hybridspec.suffix") for o in targets}
    assert suffix_imports <= {"hybridspec.proposal", "hybridspec.suffix"} | {
        m for m in graph if m.startswith("hybridspec.suffix")}, suffix_imports
