"""The remote code loads and runs on every pinned transformers version (see compat_matrix.py).

Builds cached venvs on first use (pip needs PyPI); set GHOSTED_SKIP_COMPAT=1 to skip where that is impossible.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from compat_venvs import PINNED

SCRIPT = Path(__file__).with_name("compat_matrix.py")
pytestmark = pytest.mark.compat


@pytest.mark.skipif(os.environ.get("GHOSTED_SKIP_COMPAT") == "1",
                    reason="GHOSTED_SKIP_COMPAT=1: transformers compatibility matrix skipped")
def test_remote_code_on_every_pinned_transformers(tmp_path: Path) -> None:
    table = tmp_path / "matrix.md"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--versions", *PINNED, "--table", str(table)],
        capture_output=True, text=True, timeout=3600,
    )
    report = table.read_text() if table.exists() else done.stdout[-5000:]
    assert done.returncode == 0, f"compatibility matrix failed:\n{report}\n{done.stderr[-3000:]}"
    rows = [line for line in report.splitlines() if line.startswith("| ") and "transformers" not in line]
    assert [row.split(" | ")[0].removeprefix("| ") for row in rows] == list(PINNED)
    assert "✗" not in report
