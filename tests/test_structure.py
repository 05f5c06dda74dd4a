"""The tree keeps the shape the README describes: small modules, no import cycles."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("zeropp_jax", "pallas_kernels")
# Modules may grow a little past 400 lines before they are split; this is
# where a split is overdue.
MAX_MODULE_LINES = 430
MAX_CLASS_LINES = 250


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imports(path: pathlib.Path, name: str, modules: dict) -> set[str]:
    """Modules of ours that ``path`` imports (anywhere in the file, lazily too)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)
    return {m for m in found if m in modules and m != name}


def _package(name: str) -> str:
    """``zeropp_jax.step.trainer`` -> ``zeropp_jax.step``; top-level modules stay."""
    return ".".join(name.split(".")[:2])


def _assert_acyclic(graph: dict) -> None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_no_import_cycles_between_modules_or_packages():
    modules = _modules()
    graph = {name: _imports(path, name, modules) for name, path in modules.items()}
    # A package's __init__ re-exporting its own submodules is not a cycle.
    for name in graph:
        graph[name] = {m for m in graph[name] if not m.startswith(name + ".")}
    _assert_acyclic(graph)
    # Between packages (zeropp_jax.step, .wire, ..., pallas_kernels), too; the
    # top-level zeropp_jax/__init__.py re-exports the public API and is left out.
    packages: dict[str, set] = {}
    for name, targets in graph.items():
        if name == "zeropp_jax":
            continue
        here = _package(name)
        packages.setdefault(here, set()).update(
            _package(t) for t in targets if _package(t) != here and t != "zeropp_jax")
    for targets in list(packages.values()):
        for t in targets:
            packages.setdefault(t, set())
    _assert_acyclic(packages)


def test_kernels_package_imports_nothing_from_the_library():
    modules = _modules()
    for name, path in modules.items():
        if name.startswith("pallas_kernels"):
            ours = _imports(path, name, modules)
            assert not [m for m in ours if m.startswith("zeropp_jax")], (name, ours)


def test_modules_and_classes_stay_small():
    for name, path in _modules().items():
        text = path.read_text()
        lines = text.count("\n")
        assert lines <= MAX_MODULE_LINES, f"{path} has {lines} lines: split it"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1
                assert size <= MAX_CLASS_LINES, f"{name}.{node.name} has {size} lines"


def test_readme_layout_names_every_module():
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Layout"):]
    layout = layout[: layout.index("\n## ", 3)] if "\n## " in layout[3:] else layout
    for name, path in _modules().items():
        if path.name == "__init__.py":
            continue
        assert f"`{path.name}`" in layout or f"{path.relative_to(ROOT)}" in layout, (
            f"README's Layout section does not mention {path.relative_to(ROOT)}")
    for folder in re.findall(r"`((?:zeropp_jax|pallas_kernels)/[\w/]*)`", layout):
        assert (ROOT / folder).exists(), f"README's Layout names {folder}, which does not exist"


def test_importing_the_library_does_not_import_flax_nnx():
    """flax.nnx is imported by the NNX paths only: on jax 0.11.2 with flax <= 0.12.9
    it fails to import (google/flax#5596), which must not break the rest."""
    import subprocess
    import sys

    code = "import sys, zeropp_jax, zeropp_jax.cli.train; print('flax.nnx' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
