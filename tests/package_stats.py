"""Size and documentation of the package: lines per module, the longest functions, and the public names
without a docstring. Run it by hand (`python tests/package_stats.py [PACKAGE_DIR]`, e.g. on an older
checkout to compare); tests/test_package_stats.py keeps the numbers from regressing."""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "ghosted_hf"
MAX_FUNCTION_LINES = 60


@dataclass
class Function:
    name: str  # module:qualified name
    lines: int


def modules(package: Path = PACKAGE) -> list[Path]:
    return sorted(package.rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.with_suffix("").parts
    return ".".join(parts[parts.index("ghosted_hf") + 1:])


def functions(path: Path) -> list[Function]:
    """Every function and method, with its length in lines (decorators and docstring included)."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append(Function(f"{module_name(path)}:{prefix}{child.name}", child.end_lineno - child.lineno + 1))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(path.read_text()), "")
    return found


def public_names(path: Path) -> list[tuple[str, str, bool]]:
    """(kind, module:name, has a docstring) of every module-level public function and class."""
    names = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            names.append((kind, f"{module_name(path)}:{node.name}", ast.get_docstring(node) is not None))
    return names


def report(package: Path = PACKAGE) -> dict:
    lines = {module_name(p): len(p.read_text().splitlines()) for p in modules(package)}
    every = [f for p in modules(package) for f in functions(p)]
    public = [n for p in modules(package) for n in public_names(p)]
    return {"lines": lines, "total_lines": sum(lines.values()),
            "longest": sorted(every, key=lambda f: -f.lines)[:10],
            "over_limit": [f for f in every if f.lines > MAX_FUNCTION_LINES],
            "public": public, "undocumented": [name for _, name, documented in public if not documented]}


def main() -> None:
    r = report(Path(sys.argv[1]) if len(sys.argv) > 1 else PACKAGE)
    print(f"package lines: {r['total_lines']} in {len(r['lines'])} modules")
    for name, count in sorted(r["lines"].items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {count:5d}  {name}")
    print(f"longest functions (limit {MAX_FUNCTION_LINES} lines):")
    for f in r["longest"]:
        print(f"  {f.lines:5d}  {f.name}")
    for kind in ("function", "class"):
        names = [n for n in r["public"] if n[0] == kind]
        print(f"public {kind}s with a docstring: {sum(n[2] for n in names)} of {len(names)}")
    for name in r["undocumented"]:
        print(f"  undocumented: {name}")


if __name__ == "__main__":
    main()
