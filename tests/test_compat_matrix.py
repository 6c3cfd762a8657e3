"""The remote code loads and runs on every pinned transformers version (see compat_matrix.py).

Builds cached venvs on first use (pip needs PyPI); set GHOSTED_SKIP_COMPAT=1 to skip where that is impossible.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import compat_venvs
import pytest
from compat_venvs import PINNED

SCRIPT = Path(__file__).with_name("compat_matrix.py")


def test_a_stamped_venv_is_reused_only_while_it_runs_torch_over_this_environment(tmp_path: Path) -> None:
    """A venv that imports transformers but not torch (built over another environment) is rebuilt, not reused."""
    root = tmp_path / "transformers-0.0"
    (root / "bin").mkdir(parents=True)
    python = root / "bin" / "python"
    # A wrapper, not a symlink: a symlinked venv interpreter outside its venv runs as the base interpreter (its
    # pyvenv.cfg is looked up beside the link), which need not have torch.
    python.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    inherits = compat_venvs.inherited_paths()
    assert any(Path(p, "torch").is_dir() for p in inherits), inherits  # torch comes from what runs the tests
    stamp = root / compat_venvs.STAMP
    import transformers

    stamp.write_text(json.dumps({"transformers": transformers.__version__, "inherits": inherits}))
    assert compat_venvs._stamped(root, transformers.__version__, inherits, log=lambda _: None)
    assert not compat_venvs._stamped(root, "0.0", inherits, log=lambda _: None)  # another transformers
    assert not compat_venvs._stamped(root, transformers.__version__, ["/elsewhere"], log=lambda _: None)
    python.unlink()
    python.write_text("#!/bin/sh\necho 'No module named torch' >&2\nexit 1\n")
    python.chmod(0o755)
    assert not compat_venvs._stamped(root, transformers.__version__, inherits, log=lambda _: None)
    stamp.write_text("[1, 2")
    assert not compat_venvs._stamped(root, transformers.__version__, inherits, log=lambda _: None)


@pytest.mark.compat
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
