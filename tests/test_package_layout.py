"""The package's architecture, read from its source: at most five faces at the package root, rooms
whose imports go one way (ops -> model -> checkpoints -> megatron -> train), no import cycle
(function-level imports counted), ``__all__`` in every module naming what it defines, and every
``glm5_dsa_plugin`` import of the scripts and tests resolving to a module and a name that exist."""

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "glm5_dsa_plugin"
ROOMS = ("ops", "model", "checkpoints", "megatron", "train")  # each may import only those before it


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The package modules ``name`` imports anywhere in its source. ``from pkg import sub`` counts as
    an import of ``pkg.sub`` only (the package's ``__init__`` runs first, but a package importing its
    own children is not a cycle); ``from pkg import name`` of a non-module counts as ``pkg``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in MODULES)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            subs = {f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in MODULES}
            out |= subs
            if len(subs) < len(node.names) and source in MODULES:
                out.add(source)
    out.discard(name)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _children(package: str) -> set[str]:
    return {m.rsplit(".", 1)[1] for m in MODULES if m.startswith(package + ".") and m.count(".") == package.count(".") + 1}


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ROOMS else None


def test_at_most_five_modules_at_the_package_root():
    faces = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(faces) <= 5, faces


def test_rooms_import_one_way():
    upward = [(a, b) for a, targets in GRAPH.items() for b in targets
              if _room(a) and (_room(b) is None and b != "glm5_dsa_plugin"
                               or _room(b) and ROOMS.index(_room(b)) > ROOMS.index(_room(a)))]
    assert not upward, upward


def test_ops_knows_nothing_of_megatron():
    third_party = []
    for name, path in MODULES.items():
        if _room(name) != "ops":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            third_party += [(name, n) for n in names if n.split(".")[0] in ("megatron", "transformer_engine")]
    assert not third_party, third_party


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    assert not _cycles(GRAPH)


def test_the_cycle_check_finds_a_cycle():
    graph = dict(GRAPH)
    graph["glm5_dsa_plugin.ops.contract"] = GRAPH["glm5_dsa_plugin.ops.contract"] | {"glm5_dsa_plugin.ops.op"}
    assert any("glm5_dsa_plugin.ops.contract" in c for c in _cycles(graph))


def _defined(path: Path) -> set[str]:
    """Names bound at a module's top level (definitions, assignments, imports)."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                out |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.If, ast.Try)):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.FunctionDef, ast.ClassDef)):
                    out.add(sub.name)
                elif isinstance(sub, (ast.Import, ast.ImportFrom)):
                    out |= {(a.asname or a.name).split(".")[0] for a in sub.names}
                elif isinstance(sub, ast.Assign):
                    out |= {n.id for t in sub.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return out


def _all_of(path: Path) -> list[str] | None:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return ast.literal_eval(node.value)
    return None


@pytest.mark.parametrize("name", sorted(n for n, p in MODULES.items() if p.name != "__main__.py"))
def test_every_module_states_its_public_names(name):
    path = MODULES[name]
    names = _all_of(path)
    assert names is not None, f"{path.relative_to(ROOT)} has no __all__"
    missing = [n for n in names if n not in _defined(path) | _children(name)]
    assert not missing, f"{path.relative_to(ROOT)}: __all__ names {missing}, which it does not define"
    assert len(set(names)) == len(names), f"{path.relative_to(ROOT)}: __all__ repeats a name"


def _package_imports(path: Path):
    """(line, module, [names]) of each ``glm5_dsa_plugin`` import in a script or test."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("glm5_dsa_plugin"):
            yield node.lineno, node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("glm5_dsa_plugin"):
                    yield node.lineno, a.name, []


CLIENTS = sorted([*ROOT.glob("scripts/*.py"), *ROOT.glob("tests/**/*.py")])


@pytest.mark.parametrize("path", CLIENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_client_imports_resolve(path):
    """A moved or renamed module fails here, not when a GPU benchmark is finally run."""
    bad = []
    for line, module, names in _package_imports(path):
        if module not in MODULES:
            bad.append(f"line {line}: no module {module}")
            continue
        known = _defined(MODULES[module]) | _children(module)
        bad += [f"line {line}: {module} has no {n}" for n in names if n not in known]
    assert not bad, f"{path.relative_to(ROOT)}: " + "; ".join(bad)


@pytest.mark.parametrize("module, names", [
    ("glm5_dsa_plugin.spec", ["get_glm5_dsa_spec", "glm5_dsa_layer_spec", "get_glm5_dsa_mtp_spec",
                              "glm5_dsa_hybrid_stack_spec"]),
    ("glm5_dsa_plugin.bridge", ["register_bridge", "GLM5DSAPluginBridge"]),
    ("glm5_dsa_plugin.megatron_lm", ["main"]),
    ("glm5_dsa_plugin.__main__", ["main"]),
    ("glm5_dsa_plugin.ops", ["sparse_mla"]),
])
def test_public_names_import(module, names):
    mod = importlib.import_module(module)
    assert all(callable(getattr(mod, n)) for n in names)
