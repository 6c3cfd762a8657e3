"""The package's data flow is one-way: no module imports one above it (README, developer section)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "ghosted_hf"

# text -> statistics -> operators/selection -> model -> files -> pipelines -> CLI; the packages are the stages
LAYERS = {
    0: {"errors", "architectures.__init__", "architectures.registry", "architectures.positions", "architectures.lookup",
        "utils.__init__", "utils.registry", "utils.hadamard", "utils.network", "utils.diskio",
        "utils.inputs", "utils.memory",
        "utils.hashing", "remote.format_ghosted", "remote.staging_ghosted", "remote.integrity_ghosted",
        "remote.configuration_ghosted", "remote.modeling_ghosted", "remote.cache_ghosted", "remote.modeling_decilm"},
    1: {"text.__init__", "text.documents", "text.tokens", "assets", "utils.distributed", "model.checkpoint",
        "model.provenance"},
    2: {"statistics.declarations", "statistics.plan", "statistics.store", "statistics.origin", "statistics.capture",
        "statistics.accumulate", "statistics.patch", "statistics.passes", "statistics.layerwise", "statistics.__init__"},
    3: {"fitting.__init__", "fitting.operators", "fitting.selection", "fitting.subblocks", "fitting.units"},
    4: {"model.__init__", "model.verify", "model.surgery", "model.folding"},
    5: {"io.__init__", "io.summary", "io.card", "io.hub", "model.loading", "evaluate", "io.files"},
    6: {"options", "pipelines.__init__", "pipelines.prune", "pipelines.export", "pipelines.gguf", "pipelines.decilm",
        "pipelines.demo",
        "pipelines.healing.__init__", "pipelines.healing.options", "pipelines.healing.callbacks",
        "pipelines.healing.checkpoints", "pipelines.healing.distillation", "pipelines.healing.local",
        "pipelines.healing.trainer",
        "pipelines.healing.recipe"},
    7: {"cli.__init__", "cli.__main__", "cli.common", "cli.prune", "cli.stats", "cli.demo", "cli.evaluate", "cli.push",
        "cli.heal", "cli.export", "cli.inspect", "__init__"},
}
LEVEL = {module: level for level, modules in LAYERS.items() for module in modules}


def package_imports(path: Path) -> set[str]:
    """The package modules `path` imports (a name imported from a package counts as its submodule when it is one)."""
    package = list(path.parent.relative_to(PACKAGE).parts)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ghosted_hf"):
            base = node.module.split(".")[1:]
        else:
            if isinstance(node, ast.Import):
                found |= {a.name.removeprefix("ghosted_hf.") for a in node.names if a.name.startswith("ghosted_hf.")}
            continue
        for alias in node.names:  # a submodule imported by name, else a name of the module (or package) itself
            candidates = [".".join(base + [alias.name]), ".".join(base + [alias.name, "__init__"]), ".".join(base),
                          ".".join(base + ["__init__"])]
            found.add(next((c for c in candidates if c in LEVEL), candidates[2]))
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


def test_every_subpackage_is_installed() -> None:
    """pyproject lists the packages a (non-editable) install copies: a subpackage missing there is missing for users."""
    import tomllib

    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"ghosted_hf." + ".".join(p.parent.relative_to(PACKAGE).parts) if p.parent != PACKAGE else "ghosted_hf"
             for p in PACKAGE.rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)
