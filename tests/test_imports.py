"""rewardax's modules import each other without a circle.

The graph is read from the source (ast), not from a running interpreter: every `import` counts,
including those inside functions, since a lazy import only hides a circle until the day the
function runs first. A package's own `__init__` is not an edge from its submodules (Python imports
parents first by design); what an `__init__` imports is.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _module_names() -> dict[str, Path]:
    names = {}
    for path in (SRC / "rewardax").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _imported(node: ast.AST, package: str) -> list[str]:
    """Dotted names an import statement reaches: `from a.b import c` gives `a.b.c` (resolved to a
    module or to `a.b` by the caller)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parent = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*parent, base] if base else parent)
        return [f"{base}.{alias.name}" for alias in node.names]
    return []


def import_graph() -> dict[str, set[str]]:
    """rewardax module -> the rewardax modules it imports (anywhere in its source)."""
    modules = _module_names()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            for target in _imported(node, package):
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_finder_sees_a_circle_through_a_lazy_import():
    # The check itself: hf -> reward at the top, reward -> hf inside a method (the old layout).
    graph = {"m.hf": {"m.reward"}, "m.reward": {"m.hf"}, "m.config": set()}
    assert find_cycle(graph) == ["m.hf", "m.reward", "m.hf"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    tree = ast.parse("def save(self):\n    from rewardax.models.hf import save_pretrained\n")
    (lazy,) = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert _imported(lazy, "rewardax.models") == ["rewardax.models.hf.save_pretrained"]


def test_the_models_package_has_no_import_circle():
    graph = import_graph()
    assert {"rewardax.models.hf", "rewardax.models.reward"} <= set(graph)
    models = {n: {m for m in e if m.startswith("rewardax.models")} for n, e in graph.items()}
    models = {n: e for n, e in models.items() if n.startswith("rewardax.models")}
    assert find_cycle(models) is None, " -> ".join(find_cycle(models))
    # The writer does not need the model class; the model class uses the writer.
    assert "rewardax.models.reward" not in graph["rewardax.models.hf"]
    assert "rewardax.models.hf" in graph["rewardax.models.reward"]


def test_rewardax_has_no_import_circle():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_importing_rewardax_starts_no_jax_backend():
    """`import rewardax` (and its CLI module) must not start a JAX backend: rewardax.hostmem and
    jax.distributed.initialize only apply before the first computation."""
    import subprocess
    import sys

    code = (
        "from jax._src import xla_bridge\n"
        "import rewardax, rewardax.cli, rewardax.serve\n"
        "print(xla_bridge.backends_are_initialized())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"JAX_PLATFORMS": "cpu", "PATH": ""},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
