"""The simplicity budget (DESIGN.md), checked: no import cycles between modules or packages, at most
seven modules at the top level, no library file over 450 lines, no function over 60 lines or with
more than 8 positional parameters, no jitted entry point with more than 6 parameters, the library
outside cli/ and tools/ under 7,600 lines, imports inside functions only where listed, and
`import jaxspec` free of the tooling."""

import ast
import subprocess
import sys
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


def package_of(module: str) -> str:
    """`jaxspec.engine.step` -> `jaxspec.engine`; a top-level module is its own package."""
    return ".".join(module.split(".")[:2])


def test_no_import_cycles_between_packages():
    packages = {}
    for name, edges in import_graph().items():
        packages.setdefault(package_of(name), set()).update(
            package_of(e) for e in edges if package_of(e) not in (package_of(name), "jaxspec"))
    assert find_cycle(packages) is None, " -> ".join(find_cycle(packages))


def test_the_policy_imports_nothing_of_the_engine_drafters_or_models():
    graph = import_graph()
    for name in ("jaxspec.policy", "jaxspec.policy.cost", "jaxspec.policy.goodput"):
        bad = {m for m in graph[name]
               if m.startswith(("jaxspec.engine", "jaxspec.parallel", "jaxspec.drafting", "jaxspec.models"))}
        assert not bad, (name, bad)


def functions():
    """(file, function node) for every function in the library."""
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path.relative_to(PACKAGE.parent), node


def test_files_and_functions_are_short():
    long_files = [p.name for p in PACKAGE.rglob("*.py") if p.read_text().count("\n") > 450]
    long_functions = [f"{p}:{f.name}" for p, f in functions() if f.end_lineno - f.lineno + 1 > 60]
    assert not long_files and not long_functions, (long_files, long_functions)


def positional(f) -> list[str]:
    return [a.arg for a in f.args.posonlyargs + f.args.args if a.arg not in ("self", "cls")]


def test_no_function_takes_more_than_8_positional_parameters():
    many = [f"{p}:{f.name}={len(positional(f))}" for p, f in functions() if len(positional(f)) > 8]
    assert not many, many


def jitted(tree) -> set[str]:
    """Names of the functions a module compiles: decorated with `jax.jit` (also through
    `functools.partial`), or passed to it (`jax.jit(f)`, `partial(jax.jit, ...)(f)`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if any("jit" in ast.unparse(d) for d in node.decorator_list):
                names.add(node.name)
        elif isinstance(node, ast.Call) and "jit" in ast.unparse(node.func):
            names.update(a.id for a in node.args if isinstance(a, ast.Name))
    return names


def test_the_jit_finder_finds_decorated_and_wrapped_functions():
    tree = ast.parse("@functools.partial(jax.jit, static_argnames=('a',))\ndef f(a, b): pass\n"
                     "def g(x): pass\nh = jax.jit(g)\ni = functools.partial(jax.jit, static_argnums=0)(g)\n"
                     "def k(x): pass\n")
    assert jitted(tree) == {"f", "g"}


def test_every_jitted_entry_point_takes_at_most_6_parameters():
    wide = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        names = jitted(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name in names:
                count = len(positional(node)) + len(node.args.kwonlyargs)
                if count > 6:
                    wide.append(f"{path.name}:{node.name}={count}")
    assert not wide, wide


def test_the_library_outside_the_command_line_and_tools_stays_under_7600_lines():
    core = [p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] not in ("cli", "tools")]
    lines = sum(len(p.read_text().splitlines()) for p in core)
    assert lines <= 7600, lines


def test_at_most_seven_modules_at_the_top_level():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 7, top


def test_no_jaxspec_module_is_imported_inside_a_function():
    """The graph has no cycles, so no import needs to wait for a call (imports inside functions
    remain only for heavy or optional third-party packages: torch, transformers, orbax, gguf)."""
    late = []
    for path, f in functions():
        for node in ast.walk(f):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            late += [f"{path}:{f.name}:{n}" for n in names if n.startswith("jaxspec")]
    assert not late, late


def test_import_jaxspec_loads_no_tooling():
    code = ("import sys, jaxspec; print(sorted(m for m in sys.modules "
            "if m.startswith(('jaxspec.tools', 'jaxspec.cli', 'matplotlib', 'torch'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
