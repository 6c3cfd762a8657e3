"""Load a ghosted model by folder or Hub repo id with plain transformers and generate with pipeline().
ghosted_hf is not needed here: the model's code comes with its files (trust_remote_code=True).

    python examples/load_and_generate.py ghosted-smollm2 --prompt "The history of the city began"
"""

from __future__ import annotations

import argparse

from transformers import pipeline


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="Folder or Hub repo id of a ghosted model.")
    parser.add_argument("--prompt", default="The history of the city began")
    parser.add_argument("--max-new-tokens", type=int, default=30)
    parser.add_argument("--revision", default=None, help="Pin the weights and remote code to this commit/branch.")
    args = parser.parse_args(argv)

    generator = pipeline("text-generation", model=args.model, trust_remote_code=True, revision=args.revision)
    text = generator(args.prompt, max_new_tokens=args.max_new_tokens, do_sample=False)[0]["generated_text"]
    print(text)
    return text


if __name__ == "__main__":
    main()
