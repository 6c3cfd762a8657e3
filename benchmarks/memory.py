"""Peak memory and time of the user-facing commands (issue #54): each command of the list run in its own process under
`/usr/bin/time -v`, its peak resident memory and wall time read from it. `--tree DIR` runs them on another checkout
of the package (a `git worktree` of an older commit: the "before" column), by PYTHONPATH.

    python benchmarks/memory.py > benchmarks/results/memory.md
    python benchmarks/memory.py --tree /tmp/before --commands eval-gemma heal-gemma --ghosted DIR
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GHOSTED = [sys.executable, "-m", "ghosted_hf.cli"]


def commands(scratch: Path, ghosted: Path | None) -> dict[str, list[str]]:
    """name -> command; the healing rows heal `ghosted` (None: the Gemma demo's output, so `demo-gemma` runs first)."""
    from ghosted_hf import assets

    ghosted = ghosted or scratch / "gemma"
    heal = [*GHOSTED, "heal", str(ghosted), "--max-steps", "8", "--seq-len", "512", "--batch-size", "4", "--overwrite"]
    return {
        "demo-smollm2": [*GHOSTED, "demo", "--output", str(scratch / "smollm2")],
        "demo-gemma": [*GHOSTED, "demo", "--model", "gemma3-270m", "--output", str(scratch / "gemma")],
        "eval-gemma": [*GHOSTED, "eval", str(assets.packaged_model_dir("gemma3-270m")), "--seq-len", "2048",
                       "--windows", "16"],
        "heal-gemma": [*heal, "--output", str(scratch / "healed")],
        "heal-gemma-teacher": [*heal, "--teacher", "base", "--output", str(scratch / "distilled")],
    }


def measured(command: list[str], tree: Path) -> tuple[float | None, float | None, int]:
    """(peak resident memory in GB, wall seconds, exit status) of `command` run under /usr/bin/time -v."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(["/usr/bin/time", "-v", *command], capture_output=True, text=True, env=env, cwd=tree)
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", done.stderr)
    seconds = None
    if wall:
        parts = [float(p) for p in wall.group(1).split(":")]
        seconds = sum(p * 60 ** i for i, p in enumerate(reversed(parts)))
    return (int(peak.group(1)) / 1e6 if peak else None), seconds, done.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=ROOT, help="The checkout whose ghosted_hf runs.")
    parser.add_argument("--commands", nargs="+", default=None, help="Only these rows (names as in the table).")
    parser.add_argument("--ghosted", type=Path, default=None, help="The ghosted Gemma 3 folder the healing rows heal.")
    parser.add_argument("--scratch", type=Path, default=None,
                        help="Where the commands write (kept; None: a temporary folder, removed).")
    args = parser.parse_args()
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="ghosted-memory-"))
    try:
        rows = commands(scratch, args.ghosted)
        chosen = args.commands or list(rows)
        print(f"Tree {args.tree}; `/usr/bin/time -v` per command, {os.cpu_count()} cores.\n")
        print("| command | peak RSS (GB) | wall (s) | exit |")
        print("|---|---|---|---|")
        for name in chosen:
            peak, seconds, status = measured(rows[name], args.tree)
            shown = " ".join(rows[name][2:]).replace(str(scratch), "$SCRATCH")
            print(f"| `ghosted {shown.removeprefix('ghosted_hf.cli ')}` | {peak:.2f} | {seconds:.0f} | {status} |",
                  flush=True)
    finally:
        if args.scratch is None:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
