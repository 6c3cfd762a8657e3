"""The GPU benchmark script runs end to end (on CPU, at a tiny shape) and writes its results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.slow
def test_gpu_script_smoke_on_cpu(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--shape", "tiny", "--device", "cpu",
                           "--sequences", "8", "--seq-len", "32", "--num-layers", "2", "--repeats", "1",
                           "--new-tokens", "3", "--heal-steps", "3", "--output", str(tmp_path / "gpu")],
                          capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "gpu.json").read_text())
    assert results["calibration"]["tokens"] == 256 and results["calibration"]["tokens_per_second"] > 0
    assert set(results["ratios"]) == {"prefill", "decode"} and len(results["removed"]) == 2
    assert results["healing"]["tokens_per_second"] > 0 and results["healing"]["batch_size"] == 4
    assert "| calibration tokens/s |" in (tmp_path / "gpu.md").read_text()
