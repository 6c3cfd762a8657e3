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
                           "--sequences", "8", "16", "--seq-len", "32", "--num-layers", "2", "--repeats", "1",
                           "--prefill-len", "48", "--new-tokens", "3", "--batch-sizes", "1", "2", "--heal-steps", "3",
                           "--output", str(tmp_path / "gpu")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "gpu.json").read_text())
    assert [p["tokens"] for p in results["calibration"]["passes"]] == [8 * 32, 16 * 32]
    assert results["calibration"]["grams"] + results["calibration"]["pairs"] >= 2
    assert len(results["fit"]["removed"]) == 2 and results["fit"]["tokens"] == 16 * 32
    assert set(results["inference"]["batches"]) == {"1", "2"}
    for batch in results["inference"]["batches"].values():
        assert set(batch["ms"]) == {"dense", "plainly pruned", "ghosted"}
        assert set(batch["ghosted / plainly pruned"]) == {"prefill", "decode"}
    assert results["healing"]["batch_size"] == 4 and results["healing"]["seconds_per_step"] is not None
    table = (tmp_path / "gpu.md").read_text()
    assert "| statistics pass |" in table and "| 2 | ghosted / plainly pruned |" in table
