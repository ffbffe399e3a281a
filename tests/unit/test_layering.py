"""The package's layering, read from the source: no import cycle anywhere (function-level
imports included: a lazy import only hides a cycle; ``if TYPE_CHECKING`` ones never run), and the client side loads no server
module (a user's tokenizer worker imports ``mmsched.client`` without the ranks' code)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import mmsched

ROOT = Path(mmsched.__file__).parent
SERVER = ("mmsched.transport", "mmsched.sessions", "mmsched.rank", "mmsched.batch", "mmsched.server",
          "mmsched.remote", "mmsched.consensus", "mmsched.group", "mmsched.lane", "mmsched.engine")


def modules() -> dict[str, Path]:
    out = {}
    for path in [*ROOT.rglob("*.py"), *ROOT.rglob("*.c")]:  # .c: an extension module (setup.py), a leaf
        parts = ["mmsched", *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The mmsched modules ``name`` imports, anywhere in its body, plus the packages above
    each one that importing it runs first (those outside ``name``'s own package)."""
    if path.suffix == ".c":
        return set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found, tree = set(), ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):  # imports for type checkers only never run
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            parent = t.rpartition(".")[0]
            while parent and not (name == parent or name.startswith(parent + ".")):
                found.add(parent)
                parent = parent.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def test_no_module_imports_itself_back():
    mods = modules()
    graph = {n: imports(n, p, set(mods)) for n, p in mods.items()}
    cycles, state = [], {}

    def visit(n, stack):
        state[n] = "open"
        for m in sorted(graph[n]):
            if state.get(m) == "open":
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m, stack + [m])
        state[n] = "done"

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_graph_sees_a_lazy_import():
    """The check above could fail: a function-level import is an edge like any other."""
    mods = modules()
    assert "mmsched.auth" in imports("mmsched.client", mods["mmsched.client"], set(mods))


def test_the_client_the_load_generator_and_the_worker_load_no_server_module():
    code = "import sys, mmsched.client, mmsched.loadgen, mmsched.worker.cli, mmsched.worker.app; print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            timeout=120).stdout.split()
    assert "mmsched.producers" in loaded
    assert [m for m in loaded if m.startswith(SERVER)] == []
