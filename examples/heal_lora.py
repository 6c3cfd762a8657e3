"""Heal a saved ghosted model with LoRA (PEFT) on the packaged calibration articles — next-token loss with
`ghosted heal`'s defaults, or distillation from a dense model with `--teacher` — then merge the adapters back
and save a ghosted model that still loads with trust_remote_code.

    python examples/heal_lora.py ghosted-smollm2 --output ghosted-smollm2-healed
    python examples/heal_lora.py ghosted-smollm2 --output ghosted-smollm2-distilled --teacher packaged
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import ghosted_hf
from ghosted_hf import assets
from ghosted_hf.pipelines.healing import DEFAULT_STEPS, HealOptions, heal, merge


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="Folder of a ghosted model.")
    parser.add_argument("--output", default="ghosted-healed")
    parser.add_argument("--max-steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--seq-len", type=int, default=HealOptions().seq_len)
    parser.add_argument("--teacher", help="Dense model folder to distill from ('packaged': the packaged SmolLM2-135M).")
    args = parser.parse_args(argv)

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    teacher = None
    if args.teacher:
        folder = assets.default_model_dir() if args.teacher == "packaged" else args.teacher
        teacher = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    healed = heal(model, tokenizer, assets.wikipedia_split("calibration"), teacher=teacher, max_steps=args.max_steps,
                  seq_len=args.seq_len)
    losses = healed.losses
    ghosted_hf.save_with_card(merge(healed), args.output, tokenizer)
    loss = "KL to the teacher" if teacher is not None else "next-token loss"
    print(f"{loss}: first step {losses[0]:.4f}, last step {losses[-1]:.4f}; saved to {args.output}")
    return losses


if __name__ == "__main__":
    main()
