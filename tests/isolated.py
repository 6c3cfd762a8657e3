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


def assert_loads_with_same_logits(model_id: str | Path, model, inputs: dict | list[dict], cwd: Path,
                                  env: dict[str, str] | None = None, trust_remote_code: bool = True, atol: float = 0.0,
                                  auto_class: str = "AutoModelForCausalLM") -> str:
    """Load `model_id` with `auto_class` in a process without ghosted_hf and check its logits on `inputs` (one
    batch, or several: a multimodal model's text batch and image prompt) against `model`'s (bit-identical by
    default). Returns what the process printed: 'LOADED <module> <class> <layers>'."""
    return assert_all_load_with_same_logits([(model_id, model, inputs)], cwd, env, trust_remote_code, atol, auto_class)


def assert_all_load_with_same_logits(cases: list[tuple[str | Path, object, dict | list[dict]]], cwd: Path,
                                     env: dict[str, str] | None = None, trust_remote_code: bool = True,
                                     atol: float = 0.0, auto_class: str = "AutoModelForCausalLM") -> str:
    """`assert_loads_with_same_logits` for several (folder, model, inputs) at once, in one fresh process (one start
    of Python, torch and transformers for all). Prints one 'LOADED ...' line per folder, in order."""
    import torch
    from safetensors.torch import save_file

    counts = []
    for k, (_, model, inputs) in enumerate(cases):
        batches = [inputs] if isinstance(inputs, dict) else list(inputs)
        for i, one in enumerate(batches):
            with torch.no_grad():
                expected = model(**one).logits
            save_file({"expected": expected, **one}, cwd / f"io{k}-{i}.safetensors")
        counts.append(len(batches))
    remote = ", trust_remote_code=True" if trust_remote_code else ""
    folders = [str(folder) for folder, _, _ in cases]
    return run_without_ghosted(
        f"""
        import torch
        from safetensors.torch import load_file
        from transformers import {auto_class}
        for k, (folder, count) in enumerate(zip({folders!r}, {counts!r})):
            model = {auto_class}.from_pretrained(folder{remote})
            for i in range(count):
                io = load_file(f"io{{k}}-{{i}}.safetensors")
                expected = io.pop("expected")
                with torch.no_grad():
                    got = model(**io).logits
                torch.testing.assert_close(got, expected, rtol=0, atol={atol}, msg=lambda m: f"{{folder}}: {{m}}")
            print("LOADED", type(model).__module__, type(model).__name__, model.config.get_text_config().num_hidden_layers)
        """,
        cwd,
        env,
    )
