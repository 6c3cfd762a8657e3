"""A ghosted model served by mlx-lm from a Nemotron-NAS (DeciLM) export (issue #52): SmolLM2-135M-Instruct with 8/30
layers removed (`normed`) and with sub-blocks replaced at 25% of the decoder's parameters, exported with `ghosted
export-decilm --tensor-names mlx-lm` and run by mlx-lm on the CPU beside transformers: perplexity on the same
held-out windows, greedy tokens, KV-cache bytes per token; and whether llama.cpp's unmodified converter takes the
`nemotron` export.

    pip install -e .[test]      # mlx-lm and mlx-cpu (Linux x86-64)
    python benchmarks/decilm.py [--llama-cpp PATH/TO/llama.cpp] > benchmarks/results/decilm.md

Both engines in float32 on the packaged model's fp32 weights; perplexity over --windows non-overlapping 512-token
windows of the held-out Wikipedia articles (mlx-lm takes no attention mask: whole windows only); greedy: 32 new tokens
after the first 32 tokens of the first window. The sub-blocks are the ones the ghost-aware criterion chose at 25%
(benchmarks/results/subblocks.md), replaced here without choosing them again.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from common import held_out_windows, packaged_model

from ghosted_hf import assets, ghost_prune
from ghosted_hf.pipelines.decilm import export_decilm

SUBBLOCKS_25 = ("5.attention, 6.attention, 7.attention, 8.attention, 12.attention, 12.mlp, 13.mlp, 14.attention, "
                "14.mlp, 15.attention, 15.mlp, 16.mlp, 17.attention, 17.mlp, 18.mlp, 19.mlp, 20.attention, "
                "21.attention, 24.attention, 26.attention, 27.attention, 28.attention, 29.attention").split(", ")


def transformers_figures(model, windows: list[torch.Tensor], prompt: torch.Tensor) -> tuple[float, list[int]]:
    nll = count = 0
    with torch.no_grad():
        for ids in windows:
            logits = model(ids[None]).logits[0].log_softmax(-1)
            nll -= float(logits[:-1].gather(1, ids[1:, None]).sum())
            count += len(ids) - 1
        tokens = model.generate(input_ids=prompt[None], max_new_tokens=32, do_sample=False)[0, len(prompt):]
    return math.exp(nll / count), tokens.tolist()


def mlx_figures(folder: Path, windows: list[torch.Tensor], prompt: torch.Tensor) -> tuple[float, list[int], float]:
    """(perplexity, greedy tokens, KV-cache bytes per token) in mlx-lm."""
    import mlx.core as mx
    from mlx_lm import load

    model, _ = load(str(folder), tokenizer_config={"trust_remote_code": True})
    nll = count = 0
    for ids in windows:
        logits = np.array(model(mx.array(ids.numpy()[None])).astype(mx.float32))[0]
        logits = torch.from_numpy(logits).log_softmax(-1)
        nll -= float(logits[:-1].gather(1, ids[1:, None]).sum())
        count += len(ids) - 1
    cache = model.make_cache()
    logits = model(mx.array(prompt.numpy()[None]), cache=cache)
    # (each layer's buffer grows 256 tokens at a time: its bytes over the tokens it has room for)
    kv = sum(c.nbytes / c.keys.shape[2] for c in cache if c.keys is not None)
    tokens = []
    for _ in range(32):
        token = int(mx.argmax(logits[0, -1]).item())
        tokens.append(token)
        logits = model(mx.array([[token]]), cache=cache)
    return math.exp(nll / count), tokens, kv


def converter_verdict(llama_cpp: Path | None, folder: Path) -> str:
    if llama_cpp is None:
        return "not run (no --llama-cpp)"
    done = subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(folder), "--outfile",
                           str(folder / "model.gguf"), "--outtype", "f32"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")})
    return "converted" if done.returncode == 0 else "refused: " + done.stderr.strip().splitlines()[-1][:160]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--llama-cpp", type=Path, default=None)
    parser.add_argument("--work", type=Path, default=Path("benchmark-cache/decilm"))
    args = parser.parse_args()
    tokenizer, load = packaged_model()
    windows = [row for batch in held_out_windows(tokenizer, args.windows).batches for row in batch["input_ids"]]
    prompt = windows[0][:32]
    calibration = assets.wikipedia_split("calibration")
    print("| model | transformers ppl | mlx-lm ppl | gap | greedy tokens equal | mlx KV bytes/token | llama.cpp "
          "converter (`nemotron` names) |\n|---|---|---|---|---|---|---|")
    models = {"8/30 layers, normed": dict(operator="normed", num_layers=8),
              "sub-blocks at 25%": dict(unit="subblock", criterion="manual", subblocks=SUBBLOCKS_25)}
    for name, options in models.items():
        ghosted = ghost_prune(load(), tokenizer, calibration, **options)
        ppl, tokens = transformers_figures(ghosted, windows, prompt)
        folder = args.work / name.split()[0].replace("/", "-")
        export_decilm(ghosted, tokenizer, folder / "mlx", tensor_names="mlx-lm")
        export_decilm(ghosted, tokenizer, folder / "nemotron")
        mlx_ppl, mlx_tokens, kv = mlx_figures(folder / "mlx", windows, prompt)
        print(f"| {name} | {ppl:.3f} | {mlx_ppl:.3f} | {100 * (mlx_ppl / ppl - 1):+.3f}% | "
              f"{tokens == mlx_tokens} | {kv:.0f} | {converter_verdict(args.llama_cpp, folder / 'nemotron')} |",
              flush=True)


if __name__ == "__main__":
    main()
