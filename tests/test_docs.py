"""The docs say what the code does: the generated reference is current, links resolve, the README stays a
front page, and removed levers are gone from the options."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_generated_reference_equals_the_dataclasses_and_the_parser() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "docs" / "reference" / "generate.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_reference_lists_every_option() -> None:
    from ghosted_hf import ExportOptions, HealOptions, PruneOptions
    from ghosted_hf.options import option_fields

    page = (ROOT / "docs" / "reference" / "options.md").read_text()
    for cls in (PruneOptions, ExportOptions, HealOptions):
        for f in option_fields(cls):
            assert f"| `{f.name}`" in page, (cls.__name__, f.name)
    assert "| `learning_rate` (formerly `lr`) |" in page


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
        if "://" not in target and not target.startswith("mailto:"):
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to missing {target}"


def test_readme_is_a_front_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert "python -m pytest -q" in readme and "pip install torch==2.13.0" in readme


@pytest.mark.parametrize("flag", ["--lookahead", "--norm-operator", "--weighting", "--skip-first-tokens",
                                  "--calibration-format", "--max-blocks", "--verify-candidates"])
def test_removed_levers_are_not_flags(flag: str, capsys: pytest.CaptureFixture) -> None:
    from ghosted_hf.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["prune", "--dry-run", flag, "1"])
    assert exited.value.code == 2 and f"unrecognized arguments: {flag}" in capsys.readouterr().err


def test_removed_kinds_and_heal_options_are_gone() -> None:
    from ghosted_hf import OPERATOR_KINDS, HealOptions

    assert not {"ghost-affine", "folded-cq"} & set(OPERATOR_KINDS)
    assert not {"scope", "train_norms", "lr_ratio"} & set(HealOptions.__dataclass_fields__)


@pytest.mark.real_model
def test_the_readme_python_quickstart_runs_offline_as_written(tmp_path: Path) -> None:
    """The first Python block of the README, executed as a user would paste it, offline, in an empty folder."""
    import os

    readme = (ROOT / "README.md").read_text()
    code = readme.split("## Python quickstart")[1].split("```python\n")[1].split("```")[0]
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "my-ghosted-model" / "model.safetensors").is_file() and "'removed': [" in done.stdout


def test_the_benchmarks_index_names_every_script_and_results_file() -> None:
    """benchmarks/README.md is the map of benchmarks/: a script or results file it does not name is lost."""
    import fnmatch

    index = (ROOT / "benchmarks" / "README.md").read_text()
    named = set(re.findall(r"`([\w*]+\.(?:py|md|json))`", index))
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py")}
    results = {p.name for p in (ROOT / "benchmarks" / "results").iterdir()}
    assert scripts <= named, scripts - named
    unnamed = {r for r in results if not any(fnmatch.fnmatch(r, n) for n in named) and f"results/{r}" not in index}
    assert not unnamed, unnamed


def test_every_benchmark_script_imports(monkeypatch) -> None:
    """Benchmarks run by hand, so nothing else would notice one importing a name the package no longer has: each
    script is imported (what runs before its main)."""
    import importlib

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    scripts = sorted(ROOT.glob("benchmarks/*.py"))
    assert len(scripts) > 10
    for script in scripts:
        importlib.import_module(script.stem)
