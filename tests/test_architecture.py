"""The package's data flow is one-way: no module imports one above it (README, developer section)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "ghosted_hf"

# text -> statistics -> operators/selection -> model -> files -> orchestration -> CLI
LAYERS = {
    0: {"errors", "registry", "architectures", "hadamard", "network", "diskio", "hashing", "remote.configuration_ghosted",
        "remote.modeling_ghosted"},
    1: {"text", "data", "assets", "distributed", "checkpoint", "distillation", "provenance"},
    2: {"statistics.declarations", "statistics.plan", "statistics.store", "statistics.origin", "statistics.capture",
        "statistics.accumulate", "statistics.passes", "statistics.layerwise", "statistics.__init__"},
    3: {"operators", "selection", "subblocks"},
    4: {"surgery"},
    5: {"summary", "card", "hub", "loading", "evaluate", "files"},
    6: {"options", "recipe", "export", "llamacpp", "demo", "healing.__init__", "healing.options", "healing.callbacks",
        "healing.checkpoints", "healing.trainer", "healing.recipe"},
    7: {"cli.__init__", "cli.__main__", "cli.common", "cli.prune", "cli.stats", "cli.demo", "cli.evaluate", "cli.push",
        "cli.heal", "cli.export", "cli.inspect", "__init__"},
}
LEVEL = {module: level for level, modules in LAYERS.items() for module in modules}


def package_imports(path: Path) -> set[str]:
    prefix = "" if path.parent == PACKAGE else str(path.parent.relative_to(PACKAGE)).replace("/", ".") + "."
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = prefix if node.level == 1 else ""
            found |= {base + node.module} if node.module else {base + a.name for a in node.names}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found |= {n.removeprefix("ghosted_hf.") for n in names if n.startswith("ghosted_hf.")}
    return found


def test_every_module_has_a_layer() -> None:
    modules = {str(p.relative_to(PACKAGE).with_suffix("")).replace("/", ".") for p in PACKAGE.rglob("*.py")}
    assert modules - {"remote.__init__"} == set(LEVEL)


def test_no_module_imports_one_above_it() -> None:
    upward = []
    for path in PACKAGE.rglob("*.py"):
        module = str(path.relative_to(PACKAGE).with_suffix("")).replace("/", ".")
        for imported in package_imports(path):
            if module in LEVEL and LEVEL.get(imported, -1) > LEVEL[module]:
                upward.append(f"{module} (layer {LEVEL[module]}) imports {imported} (layer {LEVEL[imported]})")
    assert not upward, upward


def test_remote_code_imports_only_torch_transformers_and_the_standard_library() -> None:
    import sys

    for path in (PACKAGE / "remote").glob("*_ghosted.py"):
        tree = ast.parse(path.read_text())
        roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
        assert roots <= {"torch", "transformers", "__future__"} | set(sys.stdlib_module_names), (path.name, roots)


def test_the_linter_finds_nothing() -> None:
    """ruff with the project's rules (pyproject.toml): unused imports and undefined names fail like a test."""
    import subprocess
    import sys

    root = PACKAGE.parent
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "ghosted_hf", "tests", "benchmarks", "examples",
                           "docs"], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]
