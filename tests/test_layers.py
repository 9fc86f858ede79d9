"""The package's layers read bottom to top (fxtron/README.md draws them).

Every `import` of fxtron in fxtron's sources, function-level ones included, is read with ast:
a module imports only its own layer or the ones below, the siblings (compiler and runtime) do
not import each other, and no set of modules imports itself
around a cycle. The checker is also run on a small made-up package that breaks each rule, so
a checker that finds nothing cannot pass for a layering that holds.
"""
from __future__ import annotations

import ast
import pathlib

import fxtron

# bottom first; a top-level module or package not named here belongs to the top layer
LAYERS = [
    ("core", {"errors", "mesh", "core", "config"}),
    ("ops", {"ops"}),
    ("passes, codegen", {"passes", "codegen"}),
    ("compiler, runtime", {"compiler", "runtime"}),
]
TOP = "api and tools"
SIBLINGS = [{"compiler", "runtime"}]


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_edges(root: pathlib.Path) -> dict[str, set[str]]:
    """module -> the fxtron modules it names in any import statement (module level or not)."""
    files = {_module_name(p, root): p for p in root.rglob("*.py")}
    pkg_name = root.name
    edges: dict[str, set[str]] = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names if a.name.split(".")[0] == pkg_name}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] != pkg_name:
                    continue
                for a in node.names:   # `from fxtron.ops import tp` names the module fxtron.ops.tp
                    sub = f"{target}.{a.name}"
                    out.add(sub if sub in files else target)
        edges[mod] = {_existing(t, files) for t in out} - {mod}
    return edges


def _existing(target: str, files) -> str:
    while target not in files and "." in target:
        target = target.rsplit(".", 1)[0]
    return target


def _group(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(group: str) -> int:
    return next((i for i, (_, groups) in enumerate(LAYERS) if group in groups), len(LAYERS))


def _layer_name(i: int) -> str:
    return LAYERS[i][0] if i < len(LAYERS) else TOP


def violations(edges: dict[str, set[str]]) -> list[str]:
    out = []
    for mod, targets in sorted(edges.items()):
        g = _group(mod)
        for t in sorted(targets):
            h = _group(t)
            if _layer(h) > _layer(g):
                out.append(f"{mod} (layer {_layer_name(_layer(g))}) imports {t} from the layer above "
                           f"({_layer_name(_layer(h))})")
            elif g != h and any({g, h} <= pair for pair in SIBLINGS):
                out.append(f"{mod} imports its sibling layer's {t}")
    return out + [f"import cycle: {' -> '.join(c)}" for c in cycles(edges)]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    found: list[list[str]] = []

    def visit(u: str, path: list[str]) -> None:
        state[u] = 1
        path.append(u)
        for v in sorted(edges.get(u, ())):
            if state.get(v) == 1:
                found.append(path[path.index(v):] + [v])
            elif v not in state:
                visit(v, path)
        path.pop()
        state[u] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [])
    return found


def test_fxtron_layers_hold():
    root = pathlib.Path(fxtron.__file__).parent
    edges = import_edges(root)
    assert len(edges) > 60 and edges["fxtron.runtime.program"], "the walk found too little of the package"
    bad = violations(edges)
    assert not bad, "\n".join(bad)


def test_runtime_needs_no_compiler():
    """The sharpest of the rules, spelled out: a reader learns the runtime from core and ops."""
    root = pathlib.Path(fxtron.__file__).parent
    for mod, targets in import_edges(root).items():
        if _group(mod) == "runtime":
            assert {_group(t) for t in targets} <= {"runtime", "core", "ops", "errors", "mesh", "config"}, (mod, targets)


def test_checker_finds_each_kind_of_violation(tmp_path):
    pkg = tmp_path / "fxtron"
    files = {
        "__init__.py": "from fxtron.api import go\n",
        "api.py": "from fxtron.runtime import program\n",
        "errors.py": "",
        "core/__init__.py": "",
        "core/meta.py": "def f():\n    from fxtron.passes import x   # upward, inside a function\n",
        "passes/__init__.py": "",
        "passes/x.py": "",
        "compiler/__init__.py": "",
        "compiler/x.py": "from ..runtime import build\n",            # sibling, relative
        "runtime/__init__.py": "",
        "runtime/program.py": "import fxtron.runtime.build\n",
        "runtime/build.py": "from fxtron.runtime import program\n",   # cycle
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    bad = violations(import_edges(pkg))
    assert any("fxtron.core.meta" in b and "fxtron.passes.x" in b and "layer above" in b for b in bad), bad
    assert any("fxtron.compiler.x imports its sibling" in b for b in bad), bad
    assert any(b.startswith("import cycle") and "fxtron.runtime.build" in b for b in bad), bad
    assert len(bad) == 3, bad
