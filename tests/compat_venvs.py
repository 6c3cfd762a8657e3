"""Cached virtualenvs, one per pinned transformers version, for the remote-code compatibility matrix.

Each venv is made with ``--system-site-packages`` (torch comes from the system) and gets
``transformers==X`` installed into it, pip resolving tokenizers / huggingface_hub / safetensors for that
version. A venv counts as built only once its stamp file exists; the stamp is written last, after checking
inside the venv that ``transformers.__version__`` is X. A half-built venv is wiped and rebuilt.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

PINNED = ("4.57.6", "5.0.0", "5.10.4", "5.20.0", "5.24.0")
STAMP = "ghosted-compat.json"


def default_cache() -> Path:
    return Path(os.environ.get("GHOSTED_COMPAT_CACHE") or Path.home() / ".cache" / "ghosted_hf" / "compat")


def _venv_python(root: Path) -> Path:
    return root / "bin" / "python"


def _installed_version(python: Path | str) -> str:
    done = subprocess.run(
        [str(python), "-c", "import transformers; print(transformers.__version__)"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONNOUSERSITE": "1"},
    )
    if done.returncode != 0:
        raise RuntimeError(f"cannot import transformers with {python}: {done.stderr.strip().splitlines()[-1:]}")
    return done.stdout.strip()


def ensure_venv(version: str, cache: Path, log=print) -> Path:
    """Python executable of a venv holding transformers==`version` (built once, then reused)."""
    root = cache / f"transformers-{version}"
    stamp = root / STAMP
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".transformers-{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two runs never build the same venv at once
        if stamp.exists():
            return _venv_python(root)
        if root.exists():
            shutil.rmtree(root)  # no stamp: an interrupted build
        log(f"[compat] building venv for transformers {version} in {root}")
        venv.EnvBuilder(system_site_packages=True, with_pip=True, symlinks=True).create(root)
        python = _venv_python(root)
        done = subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", f"transformers=={version}"],
            capture_output=True, text=True, timeout=1800,
        )
        if done.returncode != 0:
            raise RuntimeError(f"pip install transformers=={version} failed:\n{done.stdout}\n{done.stderr}")
        found = _installed_version(python)
        if found != version:
            raise RuntimeError(f"venv {root} imports transformers {found}, expected {version}")
        freeze = subprocess.run([str(python), "-m", "pip", "freeze", "--local"], capture_output=True, text=True)
        stamp.write_text(json.dumps({"transformers": version, "freeze": freeze.stdout.split()}, indent=1))
        return python


def python_for(version: str, cache: Path, log=print) -> Path:
    """The current interpreter when it already has transformers==`version`, else a cached venv's."""
    # Read from the installed metadata, not by importing transformers: this runs in worker threads while the
    # main thread imports transformers, and two threads importing it at once can see it half-initialised.
    try:
        if importlib.metadata.version("transformers") == version:
            return Path(sys.executable)
    except importlib.metadata.PackageNotFoundError:
        pass
    return ensure_venv(version, cache, log)


if __name__ == "__main__":
    import argparse
    from concurrent.futures import ThreadPoolExecutor

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--versions", nargs="+", default=list(PINNED))
    parser.add_argument("--cache", type=Path, default=default_cache())
    args = parser.parse_args()
    with ThreadPoolExecutor(3) as pool:
        for version, python in zip(args.versions, pool.map(lambda v: python_for(v, args.cache), args.versions)):
            print(version, python)
