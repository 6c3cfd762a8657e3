"""Cached virtualenvs, one per pinned transformers version, for the remote-code compatibility matrix.

Each venv sees the site-packages of the interpreter that runs the matrix (a ``.pth`` file naming them, after
the venv's own), so torch comes from the running environment, whether that is a system interpreter or a
virtual environment (``--system-site-packages`` would give the base interpreter's packages instead, which a venv
does not share). ``transformers==X`` is installed into it, pip resolving tokenizers / huggingface_hub /
safetensors for that version. A venv counts as built only once its stamp file exists; the stamp is written
last, after the venv imports torch and transformers X and runs a tiny model. A stamped venv is checked the same
way before each use and rebuilt when the check fails or it inherits from another environment.
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


# Imports what the child needs and runs one model: a venv that imports transformers but not torch is broken.
_CHECK = """
import sys
sys.modules["kernels"] = None  # hidden as compat_child hides it (see there)
import torch, transformers
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1)
assert torch.isfinite(LlamaForCausalLM(config)(torch.tensor([[1, 2, 3]])).logits).all()
print(transformers.__version__)
"""


def inherited_paths() -> list[str]:
    """The running interpreter's site-packages folders, which every pinned venv sees after its own."""
    return [p for p in dict.fromkeys(sys.path) if p and Path(p).name in ("site-packages", "dist-packages")
            and Path(p).is_dir()]


def _working_version(python: Path | str) -> str | None:
    """transformers version of a venv that imports torch and runs a tiny model, else None."""
    try:
        done = subprocess.run([str(python), "-c", _CHECK], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONNOUSERSITE": "1"})
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else None


def _stamped(root: Path, version: str, inherits: list[str], log) -> bool:
    """Whether `root` is a finished venv for `version` over this environment that still works."""
    try:
        stamp = json.loads((root / STAMP).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(stamp, dict) or stamp.get("inherits") != inherits:
        log(f"[compat] {root} was built over another environment: rebuilding")
        return False
    if _working_version(_venv_python(root)) != version:
        log(f"[compat] {root} no longer imports torch and transformers {version}: rebuilding")
        return False
    return True


def ensure_venv(version: str, cache: Path, log=print) -> Path:
    """Python executable of a venv holding transformers==`version` (built once, then reused)."""
    root = cache / f"transformers-{version}"
    stamp = root / STAMP
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".transformers-{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two runs never build the same venv at once
        inherits = inherited_paths()
        if _stamped(root, version, inherits, log):
            return _venv_python(root)
        if root.exists():
            shutil.rmtree(root)  # no stamp (an interrupted build), another environment, or broken
        log(f"[compat] building venv for transformers {version} in {root}")
        venv.EnvBuilder(system_site_packages=False, with_pip=True, symlinks=True).create(root)
        python = _venv_python(root)
        site_packages = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                       capture_output=True, text=True, check=True).stdout.strip()
        (Path(site_packages) / "ghosted-compat-inherit.pth").write_text("".join(f"{p}\n" for p in inherits))
        done = subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", f"transformers=={version}"],
            capture_output=True, text=True, timeout=1800,
        )
        if done.returncode != 0:
            raise RuntimeError(f"pip install transformers=={version} failed:\n{done.stdout}\n{done.stderr}")
        found = _working_version(python)
        if found != version:
            raise RuntimeError(f"venv {root} does not run torch with transformers {version} (found {found})")
        freeze = subprocess.run([str(python), "-m", "pip", "freeze", "--local"], capture_output=True, text=True)
        stamp.write_text(json.dumps({"transformers": version, "inherits": inherits, "freeze": freeze.stdout.split()},
                                    indent=1))
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
