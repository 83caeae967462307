"""The simplicity budget, checked: no import cycles in `jaxspec/`, no library file over 450 lines,
no function over 80 lines."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "jaxspec"


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the jaxspec modules it imports (at any depth of the file: a function-level import
    is a dependency too). `from jaxspec.a import b` names module `jaxspec.a.b` where that is one."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name.startswith("jaxspec")}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxspec"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    edges.add(sub if sub in modules else node.module)
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def find_cycle(graph):
    """A cycle as a list of modules, or None (depth-first search)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles_in_the_library():
    graph = import_graph()
    assert "jaxspec.engine.decoder" in graph and graph["jaxspec.engine.decoder"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_policy_and_cost_import_nothing_of_the_engine_parallel_or_drafters():
    graph = import_graph()
    for name in ("jaxspec.policy", "jaxspec.policy.cost", "jaxspec.policy.goodput"):
        bad = {m for m in graph[name] if m.startswith(("jaxspec.engine", "jaxspec.parallel", "jaxspec.drafting", "jaxspec.models"))}
        assert not bad, (name, bad)


def test_no_library_file_over_450_lines_and_no_function_over_80():
    long_files, long_functions = [], []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if text.count("\n") > 450:
            long_files.append(path.name)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80:
                long_functions.append(f"{path.name}:{node.name}")
    assert not long_files and not long_functions, (long_files, long_functions)
