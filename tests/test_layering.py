"""The house: every import points down. No import cycle between the package's modules, no imports
inside functions, no `TYPE_CHECKING` imports of the package's own modules, and the core imports
neither generation nor relevance."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "transformer_bridge"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports() -> tuple[dict[str, set[str]], list[str]]:
    graph: dict[str, set[str]] = {}
    problems: list[str] = []
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        tree = ast.parse(path.read_text())
        deps: set[str] = set()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            targets = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [_resolve(name, path.name == "__init__.py", node)]
            )
            if isinstance(node, ast.ImportFrom):
                base = targets[0]
                targets += [f"{base}.{a.name}" for a in node.names]
                if node.module is None:  # `from . import x` depends on x, not on the package
                    targets = targets[1:]
            for target in targets:
                if target in modules and target != name:
                    deps.add(target)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.ImportFrom) and inner.level > 0:
                        problems.append(f"{name}: call-time import in {node.name}()")
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.ImportFrom) and inner.level > 0:
                        problems.append(f"{name}: TYPE_CHECKING import of the package's own modules")
        graph[name] = deps
    return graph, problems


def test_no_import_cycles_and_no_hidden_imports():
    graph, problems = _imports()
    assert not problems, problems
    # Parent packages import their submodules (``__init__`` re-exports); a cycle is a loop through
    # modules that are not each other's package.
    edges = {
        m: {d for d in deps if not d.startswith(m + ".") and not m.startswith(d + ".")} for m, deps in graph.items()
    }
    seen: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        seen[m] = 1
        stack.append(m)
        for d in edges.get(m, ()):
            if seen.get(d) == 1:
                raise AssertionError(f"import cycle: {' -> '.join([*stack[stack.index(d) :], d])}")
            if d not in seen:
                visit(d)
        stack.pop()
        seen[m] = 2

    for module in edges:
        if module not in seen:
            visit(module)


def test_core_imports_neither_generation_nor_relevance():
    graph, _ = _imports()
    upward = {"transformer_bridge.generation", "transformer_bridge.relevance", "transformer_bridge.bridge"}

    def reach(m: str, acc: set[str]) -> set[str]:
        for d in graph.get(m, ()):
            if d not in acc:
                acc.add(d)
                reach(d, acc)
        return acc

    reached = reach("transformer_bridge.core", set())
    assert not {r for r in reached if any(r == u or r.startswith(u + ".") for u in upward)}
