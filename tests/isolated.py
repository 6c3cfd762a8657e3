"""Run Python in a fresh process where `import ghosted_hf` fails, as for a user who only has transformers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

BLOCK = "import sys\nsys.modules['ghosted_hf'] = None  # any import of ghosted_hf now raises ImportError\n"


def run_without_ghosted(code: str, cwd: Path, env: dict[str, str] | None = None, timeout: int = 300) -> str:
    script = cwd / "isolated_script.py"
    script.write_text(BLOCK + textwrap.dedent(code))
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(cwd / "hf_modules"), **(env or {})}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
    )
    if done.returncode != 0:
        raise AssertionError(f"isolated process failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.stdout
