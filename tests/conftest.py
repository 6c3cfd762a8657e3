"""Shared test setup: helpers live in tiny.py (models, text), isolated.py (processes without ghosted_hf)
and fake_hub.py (a local Hub). Under CI (CI=true), which installs every optional wheel, a skipped test
fails the run: nothing that should run may silently not run."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

_skipped: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped:
        _skipped.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("CI") == "true" and _skipped and exitstatus == 0:
        print(f"\nCI: {len(_skipped)} test(s) were skipped, but CI installs everything they need: {_skipped}",
              file=sys.stderr)
        session.exitstatus = 1
