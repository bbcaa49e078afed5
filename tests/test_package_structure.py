"""The package's shape, kept by CI: one reader of the environment (envs.py), no module
importing another in a circle, no module over 600 lines, models/ independent of the CPU
backend, and bench/ independent of tests/."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "python" / "dflash_engine"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Package modules `name` imports at run time (at any depth of the file: lazy imports
    count too; annotations-only imports under `if TYPE_CHECKING:` do not)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            candidates = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        for c in candidates:
            while c and c not in modules:
                c = c.rpartition(".")[0]
            if c and c != name:
                found.add(c)
    return found


def test_no_import_cycles():
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    # A package's __init__ importing its own submodules is how packages expose them: not a cycle.
    for m in graph:
        graph[m] = {t for t in graph[m] if not t.startswith(m + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycle = stack[stack.index(t):] + [t]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_models_do_not_import_the_cpu_backend():
    modules = _modules()
    for m, p in modules.items():
        if m.startswith("dflash_engine.models"):
            bad = {t for t in _imports(m, p, modules) if t.startswith("dflash_engine.cpu")}
            assert not bad, f"{m} imports {bad}"


def test_one_reader_of_the_environment():
    readers = sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*.py")
                     if "os.environ" in p.read_text() or "os.getenv" in p.read_text())
    assert readers == ["envs.py"], readers


def test_no_module_over_600_lines():
    long = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long


def test_bench_does_not_import_tests():
    for path in (ROOT / "bench").glob("*.py"):
        text = path.read_text()
        assert '"tests"' not in text and "from tests" not in text and "import tests" not in text, path
